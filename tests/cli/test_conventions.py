"""Command-line conventions a first run meets: Ctrl-C and closed pipes end quietly, unknown
and abbreviated flags are reported with the command's own usage, every flag has help and shows
its default, ``python -m octavo.entrypoints.openai.api_server`` is ``octavo serve``, and the
vLLM flags users type by habit are taken or refused with a line saying why.

Signals and pipes are tested on real processes: Ctrl-C is typed into a pseudo-terminal (the
terminal sends SIGINT to the program, as for a user), and stdout is a pipe closed by its reader.
"""

from __future__ import annotations

import argparse
import json
import os
import pty
import select
import signal
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from octavo.cli.main import build_parser, main

from tests.cli.test_cli import octavo_cmd, one_line_error
from tests.test_docs import cli_commands

OCTAVO = [shutil.which("octavo")] if shutil.which("octavo") else [sys.executable, "-m",
                                                                   "octavo.cli.main"]


def run_in_terminal(argv: list[str], interrupt_after: bytes, delay_s: float,
                    timeout_s: float = 300) -> tuple[int, str]:
    """Run ``argv`` on a pseudo-terminal; once ``interrupt_after`` has been printed and
    ``delay_s`` more seconds have passed, type Ctrl-C. Return (exit status, all output)."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: the pty is its controlling terminal, as in a shell
        # As an interactive shell does: Ctrl-C's SIGINT at its default, even when this test
        # run was started in the background (a non-interactive shell's `&` ignores SIGINT).
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.execvpe(argv[0], argv, {**os.environ, "OCTAVO_LOG_LEVEL": "INFO"})
    output, typed_at, deadline = b"", None, time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if typed_at is None and interrupt_after in output:
                typed_at = time.monotonic() + delay_s
            if typed_at is not None and time.monotonic() >= typed_at:
                os.write(fd, b"\x03")  # Ctrl-C: the terminal sends SIGINT to the program
                typed_at = float("inf")
            ready, _, _ = select.select([fd], [], [], 0.05)
            if ready:
                try:
                    data = os.read(fd, 65536)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not data:
                    break
                output += data
    finally:
        if time.monotonic() >= deadline:
            os.kill(pid, signal.SIGKILL)  # never wait forever on a program that ignored Ctrl-C
        _, status = os.waitpid(pid, 0)
        os.close(fd)
    return os.waitstatus_to_exitcode(status), output.decode(errors="replace")


# ---- Ctrl-C and pipes --------------------------------------------------------------------------


def test_ctrl_c_during_generate_prints_what_is_done_then_one_line(tiny_llama):
    # Enough work that an idle machine is still generating 1 s after start-up (48 prompts
    # were sometimes all done by then).
    prompts = [f"Prompt number {i}" for i in range(192)]
    status, output = run_in_terminal(
        [*OCTAVO, "generate", *prompts, "--model", str(tiny_llama), "--device", "cpu",
         "--max-tokens", "480", "--n", "4"],
        interrupt_after=b"engine ready", delay_s=1.0)
    assert status == 130, output
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output
    lines = output.replace("^C", "").splitlines()  # the terminal echoes Ctrl-C as ^C
    assert lines[-1].strip() == "interrupted", output[-2000:]
    # What was generated before Ctrl-C is printed: prompts with their (cut short) completions.
    assert any(line.startswith("Prompt number") for line in lines), output[-2000:]
    assert "finish_reason=abort" in output


def test_ctrl_c_in_a_benchmark_is_one_line(tiny_llama):
    status, output = run_in_terminal(
        [*OCTAVO, "bench", "latency", "--model", str(tiny_llama), "--device", "cpu",
         "--num-iters", "100000", "--output-len", "64", "--input-len", "8"],
        interrupt_after=b"engine ready", delay_s=0.5)
    assert status == 130, output
    assert "Traceback" not in output, output
    assert output.replace("^C", "").strip().splitlines()[-1].strip() == "interrupted", output[-2000:]


def test_stdout_closed_by_its_reader_ends_quietly():
    # The reader is gone before anything is written: every write fails (EPIPE).
    read_end, write_end = os.pipe()
    os.close(read_end)
    done = subprocess.run([*OCTAVO, "backends"], stdout=write_end, stderr=subprocess.PIPE,
                          text=True, timeout=300, check=False)
    os.close(write_end)
    assert done.returncode == 141, done.stderr
    assert done.stderr == "", done.stderr


def test_backends_piped_into_head():
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OCTAVO_LOG_LEVEL": "WARNING"}
    command = " ".join([*map(str, OCTAVO), "backends", "|", "head", "-3"])
    done = subprocess.run(["sh", "-c", command], capture_output=True, text=True, env=env,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.splitlines()) == 3
    assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr, done.stderr


# ---- parsing -----------------------------------------------------------------------------------


@pytest.mark.parametrize("command,flags", [
    ("generate", ["hi", "--bogus"]),
    ("bench throughput", ["--bogus", "1"]),
    ("serve", ["--bogus"]),
    ("backends", ["--bogus"]),
    # Abbreviations are not taken for the flag they start (--max-tokens, --temperature, ...).
    ("generate", ["hi", "--max-token", "5"]),
    ("generate", ["hi", "--temp", "0.5"]),
    ("bench latency", ["--num-iter", "2"]),
    ("serve", ["--max-model", "128"]),
])
def test_unknown_or_abbreviated_flag_shows_the_commands_usage(command, flags, capsys):
    with pytest.raises(SystemExit) as info:
        main([*command.split(), *flags])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: octavo {command} "), err
    unknown = next(flag for flag in flags if flag.startswith("--"))
    assert f"octavo {command}: error: unrecognized arguments: {unknown}" in err, err


def _value_options(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if action.option_strings and action.option_strings[0] not in ("-h", "--help"):
            yield action


@pytest.mark.parametrize("command", sorted(cli_commands()))
def test_every_flag_has_help_and_shows_its_default(command, capsys):
    parser = cli_commands()[command]
    with pytest.raises(SystemExit):
        main([*command.split(), "--help"])
    text = " ".join(capsys.readouterr().out.split())  # unwrap the lines
    for action in _value_options(parser):
        flag = action.option_strings[0]
        assert action.help and action.help.strip(), f"{command} {flag} has no help"
        default = action.default
        if default is None or isinstance(default, bool) or default is argparse.SUPPRESS:
            continue
        shown = ":".join(map(str, default)) if isinstance(default, tuple) else str(default)
        assert f"(default: {shown})" in text or "default" in action.help, \
            f"{command} {flag}: default {shown} not shown"


def test_bench_throughput_help_is_plain_text(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "throughput", "--help"])
    out = capsys.readouterr().out
    assert "``" not in out and ":func:" not in out
    assert "progress bar" in out and "--compare-hf" in out


def test_api_server_module_is_octavo_serve(tmp_path):
    module = [sys.executable, "-m", "octavo.entrypoints.openai.api_server"]
    helped = subprocess.run([*module, "--help"], capture_output=True, text=True, timeout=300,
                            check=False)
    assert helped.returncode == 0 and helped.stdout.startswith("usage: octavo serve"), helped
    assert "--served-model-name" in helped.stdout
    bad_flag = subprocess.run([*module, "--bogus"], capture_output=True, text=True, timeout=300,
                              check=False)
    assert bad_flag.returncode == 2 and "unrecognized arguments: --bogus" in bad_flag.stderr
    missing = subprocess.run([*module, str(tmp_path / "missing")], capture_output=True,
                             text=True, timeout=300, check=False)
    assert missing.returncode == 1
    assert "does not exist" in one_line_error(missing.stderr, "serve")


# ---- vLLM flags typed by habit -----------------------------------------------------------------


@pytest.mark.parametrize("flags,field,value", [
    (["--seed", "7"], "seed", 7),
    (["--max-num-batched-tokens", "512"], "max_num_batched_tokens", 512),
    (["--gpu-memory-utilization", "0.5"], "gpu_memory_utilization", 0.5),
    (["--enforce-eager"], "enforce_eager", True),
    (["--trust-remote-code"], "trust_remote_code", True),
    (["--tokenizer", "./tok"], "tokenizer", "./tok"),
    (["--dtype", "half"], "dtype", "half"),
    (["--disable-log-requests"], None, None),
    (["--generation-config", "vllm"], "generation_config", "vllm"),
    (["--generation-config", "auto"], "generation_config", "auto"),
    (["--swap-space", "2"], "swap_space", 2.0),
    (["--preemption-mode", "swap"], "preemption_mode", "swap"),
    (["--scheduling-policy", "priority"], "scheduling_policy", "priority"),
])
def test_vllm_flags_with_the_same_meaning_are_accepted(flags, field, value):
    for command in (["generate", "hi"], ["serve"], ["bench", "throughput"]):
        args = build_parser().parse_args([*command, *flags])
        if field is not None:
            assert getattr(args, field) == value


def test_generation_config_defaults_to_auto_and_refuses_a_missing_folder(tiny_llama, tmp_path,
                                                                         capsys):
    assert build_parser().parse_args(["serve"]).generation_config == "auto"
    code = main(["generate", "hi", "--model", str(tiny_llama), "--device", "cpu",
                 "--generation-config", str(tmp_path / "nowhere")])
    assert code == 1
    err = capsys.readouterr().err
    assert "octavo generate: error: --generation-config" in err and "folder" in err


def test_dtype_half_runs_in_float16(tiny_llama):
    done = octavo_cmd("generate", "Hello", "--model", str(tiny_llama), "--device", "cpu",
                      "--dtype", "half", "--max-tokens", "3", "--json",
                      "--num-gpu-blocks-override", "16")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["completions"][0]["finish_reason"] in ("length", "stop")


def _tokenizer_folder(tiny_llama: Path, tmp_path: Path) -> Path:
    """A copy of the tiny model's tokenizer with its own chat template."""
    folder = tmp_path / "other-tokenizer"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_llama / name, folder)
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}[[{{ m['content'] }}]]{% endfor %}")
    return folder


def test_tokenizer_folder_replaces_the_models(tiny_llama, tmp_path):
    import octavo

    folder = _tokenizer_folder(tiny_llama, tmp_path)
    llm = octavo.LLM(str(tiny_llama), device="cpu", tokenizer=str(folder),
                     num_gpu_blocks_override=16)
    assert llm.get_tokenizer().chat_template.startswith("{% for m in messages %}[[")
    out = llm.chat([{"role": "user", "content": "hi"}],
                   octavo.SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert out.prompt == "[[hi]]"
    done = octavo_cmd("generate", "hi", "--chat", "--model", str(tiny_llama), "--device", "cpu",
                      "--tokenizer", str(folder), "--max-tokens", "2")
    assert done.returncode == 0, done.stderr
    missing = octavo_cmd("generate", "hi", "--model", str(tiny_llama),
                         "--tokenizer", str(tmp_path / "nope"))
    assert missing.returncode == 1
    assert "neither a local folder" in one_line_error(missing.stderr, "generate")


def test_trust_remote_code_lets_a_custom_config_class_load(tiny_llama, tmp_path):
    model = tmp_path / "custom"
    shutil.copytree(tiny_llama, model)
    (model / "configuration_custom.py").write_text(
        "from transformers import LlamaConfig\n\n\n"
        "class CustomLlamaConfig(LlamaConfig):\n"
        "    model_type = 'octavo_test_custom_llama'\n")
    config = json.loads((model / "config.json").read_text())
    config["model_type"] = "octavo_test_custom_llama"
    config["auto_map"] = {"AutoConfig": "configuration_custom.CustomLlamaConfig"}
    (model / "config.json").write_text(json.dumps(config))
    common = ["generate", "hi", "--model", str(model), "--device", "cpu", "--max-tokens", "2",
              "--num-gpu-blocks-override", "16"]
    refused = octavo_cmd(*common)
    assert refused.returncode == 1
    assert "trust_remote_code" in one_line_error(refused.stderr, "generate")
    trusted = octavo_cmd(*common, "--trust-remote-code")
    assert trusted.returncode == 0, trusted.stderr
