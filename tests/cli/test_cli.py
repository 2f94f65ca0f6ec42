"""The ``octavo`` command line: a few real subprocesses (the console script), the rest through
``octavo.cli.main.main(argv)`` in process, which is what the script runs."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys

import pytest
from octavo.cli.main import build_parser, main

SUBCOMMANDS = [["generate"], ["backends"], ["bench", "throughput"], ["bench", "latency"]]


def octavo_cmd(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    """Run the installed ``octavo`` script (or ``python -m octavo.cli.main``) with ``args``."""
    script = shutil.which("octavo")
    command = [script] if script else [sys.executable, "-m", "octavo.cli.main"]
    env = {**os.environ, "OCTAVO_LOG_LEVEL": "WARNING"}
    return subprocess.run([*command, *args], capture_output=True, text=True, env=env,
                          input=stdin, timeout=300, check=False)


def last_json_line(text: str) -> dict:
    return json.loads([line for line in text.splitlines() if line.startswith("{")][-1])


def one_line_error(text: str, command: str) -> str:
    """The single ``octavo COMMAND: error: ...`` line of stderr (and no traceback)."""
    assert "Traceback" not in text, text
    lines = [line for line in text.splitlines() if line.startswith(f"octavo {command}: error:")]
    assert len(lines) == 1, text
    return lines[0]


# ---- subprocesses ------------------------------------------------------------------------------


def test_backends_json_lists_cpu_available():
    done = octavo_cmd("backends", "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    rows = {row["name"]: row for row in data["backends"]}
    assert rows["cpu"]["available"] is True and rows["cpu"]["package"] == "octavo-backend-cpu"
    assert data["default"] in {name for name, row in rows.items() if row["available"]}
    priorities = [row["priority"] for row in data["backends"]]
    assert priorities == sorted(priorities, reverse=True)


def test_generate_prints_text_and_exits_0(tiny_llama):
    done = octavo_cmd("generate", "The capital of France is", "--model", str(tiny_llama),
                      "--max-tokens", "5", "--device", "cpu")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("The capital of France is")
    assert len(done.stdout.strip()) > len("The capital of France is")
    assert "finish_reason=length, 5 tokens" in done.stderr


def test_bad_input_in_a_real_process_is_one_line_and_exit_1(tmp_path):
    done = octavo_cmd("generate", "hi", "--model", str(tmp_path / "missing"))
    assert done.returncode == 1
    line = one_line_error(done.stderr, "generate")
    assert "does not exist" in line and "missing" in line


def test_bench_throughput_against_hf(tiny_llama):
    done = octavo_cmd("bench", "throughput", "--model", str(tiny_llama), "--device", "cpu",
                      "--num-prompts", "4", "--input-len", "8:16", "--output-len", "4:8",
                      "--num-gpu-blocks-override", "64", "--compare-hf")
    assert done.returncode == 0, done.stderr
    result = last_json_line(done.stdout)
    assert result["bench"] == "throughput" and result["backend"] == "cpu"
    assert result["num_requests"] == 4
    assert 4 * 4 <= result["output_tokens"] <= 4 * 8  # EOS ignored: lengths as drawn
    assert 4 * 8 <= result["prompt_tokens"] <= 4 * 16
    assert result["output_tokens_per_s"] > 0
    assert result["hf_output_tokens_per_s"] > 0
    assert result["speedup_vs_hf"] == pytest.approx(
        result["output_tokens_per_s"] / result["hf_output_tokens_per_s"], rel=0.01)
    assert "octavo / HF" in done.stdout
    # Said up front, and progress shown in each long phase (HF's decoding steps included).
    assert "workload: 4 requests" in done.stderr and "then the same on HF" in done.stderr
    assert "HF transformers: loading the model, then generating; expect roughly" in done.stderr
    assert "Processed prompts" in done.stderr and "HF generate (1 batch(es))" in done.stderr


def test_bench_throughput_async_engine_matches_the_workload(tiny_llama):
    done = octavo_cmd("bench", "throughput", "--model", str(tiny_llama), "--device", "cpu",
                      "--num-prompts", "6", "--input-len", "8:16", "--output-len", "4:8",
                      "--num-gpu-blocks-override", "64", "--async-engine")
    assert done.returncode == 0, done.stderr
    result = last_json_line(done.stdout)
    assert result["engine"] == "async" and result["backend"] == "cpu"
    offline = octavo_cmd("bench", "throughput", "--model", str(tiny_llama), "--device", "cpu",
                         "--num-prompts", "6", "--input-len", "8:16", "--output-len", "4:8",
                         "--num-gpu-blocks-override", "64")
    assert offline.returncode == 0, offline.stderr
    expected = last_json_line(offline.stdout)
    assert expected["engine"] == "offline"
    # Same seed, same workload: every requested token is generated by both engines.
    for key in ("num_requests", "prompt_tokens", "output_tokens"):
        assert result[key] == expected[key], key
    assert result["output_tokens_per_s"] > 0
    # The engine thread's CPU over the run only: the baseline is the stats the engine core
    # sent when ready, not zeros (its start-up's CPU counted in the run: 14.9 s of CPU in a
    # 2.6 s run on the H100 before)
    assert 0 < result["engine_thread_cpu_s"] <= result["elapsed_s"] + 0.5


@pytest.mark.parametrize("engine", [[], ["--async-engine"]])
def test_bench_throughput_structured_json(tiny_llama, engine):
    done = octavo_cmd("bench", "throughput", "--model", str(tiny_llama), "--device", "cpu",
                      "--num-prompts", "12", "--input-len", "8:16", "--output-len", "8:24",
                      "--num-gpu-blocks-override", "64", "--structured", "json", *engine)
    assert done.returncode == 0, done.stderr
    result = last_json_line(done.stdout)
    assert result["structured"] == "json" and result["num_requests"] == 12
    assert 12 <= result["output_tokens"] <= 12 * 24
    assert result["unconstrained_output_tokens_per_s"] > 0
    assert result["structured_vs_unconstrained"] == pytest.approx(
        result["output_tokens_per_s"] / result["unconstrained_output_tokens_per_s"], rel=0.01)
    assert "json / unconstrained" in done.stdout
    # Every constrained request samples under a mask at least once; the waits are timed.
    assert result["grammar_steps"] >= 1
    assert result["grammar_wait_s"] > 0 and result["grammar_work_s"] > 0
    assert "the engine thread waited" in done.stdout
    # Where each run's engine-thread time went (SchedulerStats' engine_*).
    for prefix in ("", "unconstrained_"):
        assert result[f"{prefix}engine_steps"] >= 8
        assert result[f"{prefix}engine_result_wait_s"] > 0
        assert result[f"{prefix}engine_schedule_s"] > 0
        # The engine thread's CPU over the run: some, and no more than the run's wall time
        # (plus the moments between the run and the stats taken before it); its involuntary
        # switches a count.
        elapsed = result["elapsed_s" if not prefix else "unconstrained_elapsed_s"]
        assert 0 < result[f"{prefix}engine_thread_cpu_s"] <= elapsed + 0.5
        assert result[f"{prefix}engine_thread_involuntary_switches"] >= 0
        # What the machine's CPUs did over the run (Linux's /proc/stat).
        assert result[f"{prefix}machine_busy_cpu_s"] > 0
        assert result[f"{prefix}machine_steal_cpu_s"] >= 0
    assert "the engine thread scheduled" in done.stdout and "unconstrained run," in done.stdout
    assert "was taken off it" in done.stdout and "stolen by the hypervisor" in done.stdout
    # Each timed run started from an empty prefix cache (through the engine core's utility
    # call with --async-engine).
    assert "prefix cache could not be emptied" not in done.stderr


def test_bench_structured_refuses_compare_hf(tiny_llama):
    done = octavo_cmd("bench", "throughput", "--model", str(tiny_llama), "--structured", "json",
                      "--compare-hf")
    assert done.returncode == 2 and "drop --compare-hf" in done.stderr


# ---- in process --------------------------------------------------------------------------------


@pytest.mark.parametrize("argv", SUBCOMMANDS, ids=" ".join)
def test_help_of_each_subcommand_lists_its_options(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main([*argv, "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    assert f"octavo {' '.join(argv)}" in text
    parser = build_parser()
    for name in argv:  # walk down to the subcommand's own parser
        parser = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"
                      ).choices[name]
    options = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    assert options and all(option in text for option in options)
    expected = {"generate": "--max-tokens", "backends": "--json", "throughput": "--compare-hf",
                "latency": "--num-iters"}[argv[-1]]
    assert expected in text


def test_no_command_prints_help_and_exits_2(capsys):
    assert main([]) == 2
    out = capsys.readouterr().out
    assert all(command in out for command in ("generate", "backends", "bench"))


@pytest.mark.parametrize("args,message", [
    (["--max-tokens", "0"], "max_tokens must be >= 1, got 0"),
    (["--device", "nosuch"], "Backend 'nosuch' is not installed"),
    (["--temperature", "-1"], "temperature"),
])
def test_bad_input_is_one_clear_line(tiny_llama, capsys, args, message):
    assert main(["generate", "hi", "--model", str(tiny_llama), *args]) == 1
    line = one_line_error(capsys.readouterr().err, "generate")
    assert message in line
    if "nosuch" in args:
        assert "'cpu'" in line  # names what is installed


def test_bad_range_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as info:
        main(["bench", "throughput", "--input-len", "0:3"])
    assert info.value.code == 2
    assert "expected MIN:MAX with 1 <= MIN <= MAX" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["bench", "throughput", "--num-prompts", "0"],
    ["bench", "latency", "--num-iters", "0"],
    ["bench", "latency", "--output-len", "-3"],
])
def test_bench_counts_must_be_positive(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert "expected a positive integer" in capsys.readouterr().err


def test_generate_reads_prompts_from_stdin_as_json(tiny_llama, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello world\n\nOnce upon a time\n"))
    code = main(["generate", "--model", str(tiny_llama), "--max-tokens", "3", "--json",
                 "--num-gpu-blocks-override", "32", "--n", "2", "--temperature", "0.8",
                 "--sampling-seed", "7"])
    assert code == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [row["prompt"] for row in rows] == ["Hello world", "Once upon a time"]
    for row in rows:
        assert len(row["completions"]) == 2
        assert all(len(c["token_ids"]) == 3 and c["finish_reason"] == "length"
                   for c in row["completions"])


def test_generate_without_prompts_on_a_terminal_fails_fast(tiny_llama, capsys, monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stdin", Terminal(""))
    assert main(["generate", "--model", str(tiny_llama)]) == 1
    assert "no prompt given" in one_line_error(capsys.readouterr().err, "generate")


def test_bench_latency(tiny_llama, capsys):
    code = main(["bench", "latency", "--model", str(tiny_llama), "--input-len", "8",
                 "--output-len", "4", "--num-iters", "2", "--num-iters-warmup", "1",
                 "--num-gpu-blocks-override", "32", "--device", "cpu"])
    assert code == 0
    result = last_json_line(capsys.readouterr().out)
    assert result["bench"] == "latency" and result["backend"] == "cpu"
    assert (result["input_len"], result["output_len"]) == (8, 4)
    assert result["mean_latency_s"] > 0 and result["mean_ttft_s"] > 0
    assert result["ms_per_output_token"] >= 0


def test_bench_latency_with_speculative_decoding(tiny_llama, capsys):
    code = main(["bench", "latency", "--model", str(tiny_llama), "--input-len", "8",
                 "--output-len", "48", "--num-iters", "2", "--num-iters-warmup", "1",
                 "--num-gpu-blocks-override", "32", "--device", "cpu", "--speculative-config",
                 '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, '
                 '"prompt_lookup_max": 2}'])
    assert code == 0
    out = capsys.readouterr().out
    result = last_json_line(out)
    assert result["speculative_config"] == {"method": "ngram", "k": 3}
    assert 0 < result["draft_acceptance_rate"] <= 1
    assert result["mean_acceptance_length"] > 1
    assert "speculative decoding: mean acceptance length" in out


def test_bench_latency_compare_llama_cpp_needs_a_gguf_model(tiny_llama, capsys):
    code = main(["bench", "latency", "--model", str(tiny_llama), "--input-len", "8",
                 "--output-len", "4", "--num-iters", "1", "--num-gpu-blocks-override", "32",
                 "--device", "cpu", "--compare-llama-cpp"])
    assert code == 1
    # (the engine's log lines go to a handler made for an earlier test's captured stream, so
    # only the error line itself is looked for)
    assert "octavo bench: error: --compare-llama-cpp needs a GGUF model" in capsys.readouterr().err


def test_backends_text_marks_the_default(capsys):
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    assert any(line.startswith("cpu") and "available" in line for line in out.splitlines())
    assert "<- default" in out
