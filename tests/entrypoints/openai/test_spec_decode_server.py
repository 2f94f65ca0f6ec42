"""``octavo serve --speculative-config``: a real server with ngram speculation answers the
openai client with the offline engine's greedy text (streamed or not), exports vLLM's
``spec_decode_*`` metrics, and refuses a bad config with a one-line error."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.entrypoints.openai.conftest import (
    API_KEY,
    SERVED_NAME,
    ServerProcess,
    greedy_kwargs,
    metrics,
    wait_idle,
)
from tests.helpers.engine import greedy, make_llm

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3}
PROMPTS = ["one two three one two three one two three one two",
           "Hello world! hello World? HELLO, world; Hello world! hello",
           "The capital of France is Paris. The capital of"]


@pytest.fixture(scope="module")
def spec_server(tiny_model: Path):
    # --async-scheduling is asked for: speculation turns it off (one step at a time).
    srv = ServerProcess(tiny_model, "--speculative-config", json.dumps(SPEC), "--async-scheduling")
    try:
        yield srv
    finally:
        assert srv.stop() == 0


def test_greedy_text_streamed_or_not_and_metrics(spec_server, tiny_model: Path) -> None:
    import openai

    offline = make_llm(tiny_model)
    expected = [o.outputs[0].text for o in offline.generate(
        PROMPTS, greedy(24), use_tqdm=False)]
    before = wait_idle(spec_server)
    with openai.OpenAI(base_url=f"{spec_server.url}/v1", api_key=API_KEY, max_retries=0,
                       timeout=120) as client:
        for prompt, text in zip(PROMPTS, expected):
            kwargs = greedy_kwargs(24)
            resp = client.completions.create(model=SERVED_NAME, prompt=prompt, **kwargs)
            assert resp.choices[0].text == text
            assert resp.usage.completion_tokens == 24
            chunks = client.completions.create(model=SERVED_NAME, prompt=prompt, stream=True,
                                               **kwargs)
            assert "".join(c.choices[0].text for c in chunks if c.choices) == text
        batch = client.completions.create(model=SERVED_NAME, prompt=PROMPTS, **greedy_kwargs(24))
        assert [c.text for c in sorted(batch.choices, key=lambda c: c.index)] == expected
    after = wait_idle(spec_server)
    accepted = (after["octavo:spec_decode_num_accepted_tokens_total"]
                - before.get("octavo:spec_decode_num_accepted_tokens_total", 0.0))
    drafted = (after["octavo:spec_decode_num_draft_tokens_total"]
               - before.get("octavo:spec_decode_num_draft_tokens_total", 0.0))
    assert after["octavo:spec_decode_num_drafts_total"] > 0
    assert 0 < accepted <= drafted
    per_pos = [v for k, v in after.items()
               if k.startswith("octavo:spec_decode_num_accepted_tokens_per_pos_total{")]
    assert per_pos and sum(per_pos) == after["octavo:spec_decode_num_accepted_tokens_total"]
    assert 'position="0"' in "".join(metrics(spec_server))
    log = spec_server.read_log()
    assert "speculative decoding: async scheduling is off" in log
    assert "speculative decoding: ngram, up to 3 draft tokens per step" in log


def test_bad_config_is_refused_with_one_line(tiny_model: Path) -> None:
    """(Every bad value is checked in tests/spec_decode/test_config.py; here the CLI path.)"""
    config, message = ('{"method": "medusa", "num_speculative_tokens": 2}',
                       "method 'medusa' is not supported yet")
    proc = subprocess.run(
        [sys.executable, "-m", "octavo.cli.main", "serve", str(tiny_model), "--dtype", "float32",
         "--port", "0", "--speculative-config", config],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert message in proc.stderr + proc.stdout
    assert "Traceback" not in proc.stderr
