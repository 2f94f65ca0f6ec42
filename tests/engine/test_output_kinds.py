"""``OutputProcessor`` output kinds: DELTA pieces add up to the CUMULATIVE result; FINAL_ONLY once."""

from __future__ import annotations

from pathlib import Path

import pytest
from octavo.engine.output_processor import OutputProcessor, RequestOutputKind
from octavo.engine.processor import Processor
from octavo.messages import EngineCoreOutput
from octavo.sampling_params import SamplingParams

TEXT = "Caf\u00e9 cr\u00e8me! Hello world! hello World? HELLO, world; 12345"


@pytest.fixture(scope="module")
def tokenizer(tiny_llama: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama)


def run(tokenizer, kind: RequestOutputKind, params: SamplingParams, stream_interval: int = 1):
    """Feed TEXT's tokens one per step to every completion; return outputs and stopped ids."""
    class _Config:  # what Processor reads of a ModelConfig
        vocab_size = 384
        max_model_len = 512
        max_logprobs = 20
        max_n = 128

    processor = Processor(_Config(), tokenizer, {2})
    processed = processor.process("r", "Hello", params)
    op = OutputProcessor(tokenizer, stream_interval=stream_interval)
    op.add_request("r", processed, kind)
    ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    outputs, stopped = [], []
    for step, token_id in enumerate(ids):
        last = step == len(ids) - 1
        core_outputs = [
            EngineCoreOutput(request_id=r.request_id, new_token_ids=[token_id],
                             finish_reason="length" if last else None)
            for r in processed.core_requests
        ]
        result = op.process_outputs(core_outputs)
        outputs.extend(result.request_outputs)
        stopped.extend(result.stopped_req_ids)
    assert not op.has_unfinished_requests()
    return outputs, stopped


@pytest.mark.parametrize("stop", [None, ["World?"], ["\u00e8me", "HELLO"]])
def test_deltas_join_to_the_cumulative_text(tokenizer, stop) -> None:
    params = SamplingParams(n=2, max_tokens=100, stop=stop)
    full, full_stopped = run(tokenizer, RequestOutputKind.CUMULATIVE, params)
    final = full[-1]
    deltas, stopped = run(tokenizer, RequestOutputKind.DELTA, params)
    assert stopped == full_stopped
    for completion in final.outputs:
        pieces = [c for out in deltas for c in out.outputs if c.index == completion.index]
        assert "".join(c.text for c in pieces) == completion.text
        assert [t for c in pieces for t in c.token_ids] == completion.token_ids
        assert [c.finish_reason for c in pieces][-1] == completion.finish_reason
        assert all(c.finish_reason is None for c in pieces[:-1])
    assert deltas[-1].finished and not any(o.finished for o in deltas[:-1])


@pytest.mark.parametrize("stop", [None, ["World?"]])
def test_a_stream_interval_sends_the_first_token_then_every_interval(tokenizer, stop) -> None:
    """--stream-interval 4: each completion's first token at once, then deltas of 4 tokens,
    the finish with what is left; text, tokens and logprobs still join up."""
    params = SamplingParams(n=2, max_tokens=100, stop=stop, logprobs=1)
    final = run(tokenizer, RequestOutputKind.CUMULATIVE, params)[0][-1]
    deltas, _ = run(tokenizer, RequestOutputKind.DELTA, params, stream_interval=4)
    every_step, _ = run(tokenizer, RequestOutputKind.DELTA, params)
    assert len(deltas) < len(every_step) / 2
    for completion in final.outputs:
        pieces = [c for out in deltas for c in out.outputs if c.index == completion.index]
        assert "".join(c.text for c in pieces) == completion.text
        assert [t for c in pieces for t in c.token_ids] == completion.token_ids
        assert [p for c in pieces for p in c.logprobs] == completion.logprobs
        sizes = [len(c.token_ids) for c in pieces]
        assert sizes[0] == 1 and all(size == 4 for size in sizes[1:-1]) and sizes[-1] <= 4
        assert pieces[-1].finish_reason == completion.finish_reason
    assert deltas[-1].finished


def test_a_stream_interval_must_be_positive(tokenizer) -> None:
    with pytest.raises(ValueError, match="stream_interval"):
        OutputProcessor(tokenizer, stream_interval=0)


def test_final_only_gives_one_output(tokenizer) -> None:
    params = SamplingParams(max_tokens=100, stop=["World?"])
    outputs, _ = run(tokenizer, RequestOutputKind.FINAL_ONLY, params)
    cumulative, _ = run(tokenizer, RequestOutputKind.CUMULATIVE, params)
    assert len(outputs) == 1 and outputs[0].finished
    assert outputs[0].outputs[0].text == cumulative[-1].outputs[0].text
