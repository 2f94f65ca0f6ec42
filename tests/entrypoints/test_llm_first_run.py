"""``octavo.LLM`` on a first run: a ``max_tokens`` cut to fit ``max_model_len`` is said once per
call, and the CPU KV cache has a fixed size (flag, ``OCTAVO_CPU_KVCACHE_SPACE``, 4 GiB)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from octavo import LLM, SamplingParams

from tests.cli.test_cli import octavo_cmd

GiB = 2**30


@pytest.fixture
def octavo_logs(monkeypatch, caplog):
    """caplog that sees the ``octavo`` tree (``configure_logging`` stops propagation)."""
    from octavo.logger import configure_logging

    configure_logging()  # first, so the engine's own call does not undo what follows
    monkeypatch.setattr(logging.getLogger("octavo"), "propagate", True)
    caplog.set_level(logging.INFO, logger="octavo")
    return caplog


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and "max_tokens lowered" in r.getMessage()]


def test_max_tokens_cut_to_fit_is_said_once_per_call(tiny_llama: Path, octavo_logs) -> None:
    llm = LLM(str(tiny_llama), device="cpu", max_model_len=48, num_gpu_blocks_override=64)
    prompts = ["Hello world", "Once upon a time there was", "The capital of France is"]
    too_long = SamplingParams(temperature=0, max_tokens=1000)
    outputs = llm.generate(prompts, too_long, use_tqdm=False)
    for output in outputs:  # still cut to fit, as before
        assert len(output.prompt_token_ids) + len(output.outputs[0].token_ids) <= 48
    [message] = _warnings(octavo_logs)
    assert message.startswith("max_tokens lowered to fit max_model_len=48 for 3 of 3 prompt(s) "
                              "(asked 1000, lowered to as little as ")
    octavo_logs.clear()
    fits = [SamplingParams(max_tokens=4), too_long, SamplingParams(max_tokens=2)]
    llm.generate(prompts, fits, use_tqdm=False)
    [message] = _warnings(octavo_logs)
    assert "for 1 of 3 prompt(s)" in message
    octavo_logs.clear()
    llm.generate(prompts, SamplingParams(max_tokens=4), use_tqdm=False)
    llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=4), use_tqdm=False)
    assert _warnings(octavo_logs) == []
    llm.chat([[{"role": "user", "content": "hi"}]] * 2, too_long, use_tqdm=False)
    assert len(_warnings(octavo_logs)) == 1


def _kv_bytes(llm: LLM) -> int:
    worker = llm.llm_engine.engine_core.executor.worker
    return llm.llm_engine.num_blocks * worker.kv_cache_bytes_per_block()


def test_cpu_kv_cache_size_is_fixed_by_flag_env_or_default(tiny_llama: Path, monkeypatch,
                                                           octavo_logs) -> None:
    monkeypatch.delenv("OCTAVO_CPU_KVCACHE_SPACE", raising=False)
    # max_num_seqs x max_model_len tokens would fill far more than these sizes: no cap.
    common = {"device": "cpu", "max_num_seqs": 256}

    def expected(gib: float, llm: LLM) -> int:
        per_block = llm.llm_engine.engine_core.executor.worker.kv_cache_bytes_per_block()
        return int(gib * GiB) // per_block * per_block

    llm = LLM(str(tiny_llama), cpu_kv_cache_space=0.01, **common)
    assert _kv_bytes(llm) == expected(0.01, llm)
    monkeypatch.setenv("OCTAVO_CPU_KVCACHE_SPACE", "0.02")
    llm = LLM(str(tiny_llama), **common)
    assert _kv_bytes(llm) == expected(0.02, llm)
    assert any(r.getMessage().startswith("CPU KV cache: 0.02 GiB (OCTAVO_CPU_KVCACHE_SPACE 0.02 GiB")
               for r in octavo_logs.records)
    monkeypatch.delenv("OCTAVO_CPU_KVCACHE_SPACE")
    llm = LLM(str(tiny_llama), **common)  # the tiny model can use at most 64 MiB: capped
    assert any("default 4 GiB; capped at" in r.getMessage() for r in octavo_logs.records)


def test_cpu_kv_cache_space_on_the_command_line(tiny_llama: Path) -> None:
    done = octavo_cmd("generate", "hi", "--model", str(tiny_llama), "--device", "cpu",
                      "--max-tokens", "2", "--cpu-kv-cache-space", "0.01", "--json")
    assert done.returncode == 0, done.stderr
    too_big = octavo_cmd("generate", "hi", "--model", str(tiny_llama), "--device", "cpu",
                         "--cpu-kv-cache-space", "100000")
    assert too_big.returncode == 1
    assert "the CPU KV cache was asked for 100000 GiB (cpu_kv_cache_space)" in too_big.stderr
