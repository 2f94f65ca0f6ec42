"""``octavo bench serve`` against the real ``octavo serve`` on 127.0.0.1 (the tiny Llama)."""

from __future__ import annotations

import json

import pytest
from octavo.cli.main import main

from tests.entrypoints.openai.conftest import API_KEY, SERVED_NAME, free_port, wait_idle


def bench(capsys, *flags: str) -> tuple[int, dict | None, str]:
    """Run ``octavo bench serve FLAGS``; return the exit code, its JSON line and stderr."""
    code = main(["bench", "serve", "--disable-tqdm", *flags])
    captured = capsys.readouterr()
    lines = [line for line in captured.out.splitlines() if line.startswith("{")]
    return code, (json.loads(lines[-1]) if lines else None), captured.err


@pytest.fixture
def api_key(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)


def test_counts_are_exact_and_metrics_consistent(server, tiny_model, api_key, capsys):
    code, result, err = bench(
        capsys, "--base-url", server.url, "--model", SERVED_NAME, "--tokenizer", str(tiny_model),
        "--num-prompts", "24", "--input-len", "20", "--output-len", "9", "--ignore-eos",
        "--prefix-len", "4", "--goodput", "ttft:60000", "tpot:60000", "e2el:60000",
        "--metric-percentiles", "50,90,99")
    assert code == 0, err
    assert result["completed"] == 24 and result["failed"] == 0
    assert result["total_input_tokens"] == 24 * (20 + 4)
    assert result["total_output_tokens"] == 24 * 9
    # Every request met the generous SLOs: goodput is the request throughput.
    assert result["request_goodput"] == pytest.approx(result["request_throughput"], rel=1e-3)
    # The JSON's duration is rounded to 0.1 ms: a run of ~40 ms carries up to ~0.13 % of it.
    rounding = 0.5e-4 / result["duration"]
    assert result["output_throughput"] == pytest.approx(24 * 9 / result["duration"],
                                                        rel=1e-3 + rounding)
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert 0 <= result[f"p50_{name}_ms"] <= result[f"p90_{name}_ms"] <= result[f"p99_{name}_ms"]
        assert result[f"p50_{name}_ms"] == result[f"median_{name}_ms"]
    for name in ("ttft", "tpot", "e2el"):
        assert result[f"p50_{name}_ms"] > 0
    # Chunks that came in one socket read share its arrival stamp, so a gap can be exactly 0
    # (a busy 2-core machine merges many reads: CI once saw a median ITL of 0). Their sum
    # cannot: the last chunk came after the first in every request of more than one read.
    assert result["mean_itl_ms"] > 0
    assert result["mean_e2el_ms"] >= result["mean_ttft_ms"]
    assert result["p99_e2el_ms"] >= result["p99_ttft_ms"]
    assert result["max_output_tokens_per_s"] > 0
    # All at once (--request-rate inf, no limit): every request in flight together.
    assert result["max_concurrent_requests"] == 24
    # One chunk per token at most (a server that lags merges steps into fewer).
    assert 24 <= result["total_chunks"] <= 24 * 9
    # The client's own CPU over the run: some, never more than one core's worth.
    assert result["client_processes"] == 1 and result["client_cpu_s"] > 0
    assert 0 < result["client_busiest_cpu_fraction"] <= 1.05
    m = wait_idle(server)
    assert m["octavo:kv_cache_usage_perc"] == 0


def test_max_concurrency_and_rate(server, tiny_model, api_key, capsys):
    code, result, err = bench(
        capsys, "--base-url", server.url, "--model", SERVED_NAME, "--tokenizer", str(tiny_model),
        "--num-prompts", "16", "--input-len", "8", "--output-len", "6", "--ignore-eos",
        "--max-concurrency", "3", "--request-rate", "200", "--burstiness", "0.5")
    assert code == 0, err
    assert result["completed"] == 16 and result["total_output_tokens"] == 16 * 6
    assert result["max_concurrent_requests"] == 3
    assert result["request_rate"] == 200.0 and result["max_concurrency"] == 3


def test_several_client_processes_send_every_request_once(server, tiny_model, api_key, capsys):
    """Requests dealt to 3 client processes: the same counts as one process, the concurrency
    cap shared between them, and the prompts the same token ids (the server's counters)."""
    before = wait_idle(server)
    code, result, err = bench(
        capsys, "--base-url", server.url, "--model", SERVED_NAME, "--tokenizer", str(tiny_model),
        "--num-prompts", "13", "--input-len", "10", "--output-len", "5", "--ignore-eos",
        "--num-client-processes", "3", "--max-concurrency", "7")
    assert code == 0, err
    assert "3 client processes" in err
    assert result["completed"] == 13 and result["failed"] == 0
    assert result["total_input_tokens"] == 13 * 10 and result["total_output_tokens"] == 13 * 5
    assert 3 <= result["max_concurrent_requests"] <= 7
    assert result["client_processes"] == 3 and result["client_cpu_s"] > 0
    assert 0 < result["client_busiest_cpu_fraction"] <= 1.05
    assert result["output_throughput"] == pytest.approx(
        13 * 5 / result["duration"], rel=1e-3 + 0.5e-4 / result["duration"])  # 0.1 ms rounding
    after = wait_idle(server)
    assert (after["octavo:prompt_tokens_total"] - before["octavo:prompt_tokens_total"]
            == 13 * 10 + 10)  # and the test request's prompt
    code, _, err = bench(capsys, "--base-url", server.url, "--model", SERVED_NAME,
                         "--tokenizer", str(tiny_model), "--num-prompts", "2",
                         "--num-client-processes", "4", "--max-concurrency", "2")
    assert code != 0 and "--max-concurrency 2 is less than --num-client-processes 4" in err


def test_the_model_defaults_to_the_servers_first(server, tiny_model, api_key, capsys):
    # The server lists "tiny" first; the tokenizer comes from the folder.
    code, result, err = bench(capsys, "--base-url", server.url, "--tokenizer", str(tiny_model),
                              "--num-prompts", "2", "--input-len", "4", "--output-len", "2",
                              "--ignore-eos", "--save-result", "--result-dir", "/tmp",
                              "--result-filename", f"octavo-bench-serve-{free_port()}.json")
    assert code == 0, err
    assert result["model"] == SERVED_NAME
    path = err.strip().splitlines()[-1].removeprefix("result written to ")
    with open(path) as f:
        assert json.load(f) == result


def test_unreachable_server_is_one_line_and_non_zero(tiny_model, capsys):
    code, result, err = bench(capsys, "--port", str(free_port()), "--model", "m", "--tokenizer",
                              str(tiny_model), "--num-prompts", "2")
    assert code == 1 and result is None
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("octavo bench: error: cannot reach a server at http://127.0.0.1:")


def test_wrong_model_name_is_one_line_and_non_zero(server, tiny_model, api_key, capsys):
    code, result, err = bench(capsys, "--base-url", server.url, "--model", "nope",
                              "--tokenizer", str(tiny_model), "--num-prompts", "2")
    assert code == 1 and result is None
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "the server refused model 'nope'" in lines[0] and "--model" in lines[0]


def test_missing_api_key_is_named(server, tiny_model, monkeypatch, capsys):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    code, _, err = bench(capsys, "--base-url", server.url, "--model", SERVED_NAME,
                         "--tokenizer", str(tiny_model), "--num-prompts", "2")
    assert code == 1 and "OPENAI_API_KEY" in err.strip().splitlines()[-1]
