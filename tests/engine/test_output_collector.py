"""``RequestOutputCollector``: deltas that pile up merge into one that joins up the same."""

from __future__ import annotations

import asyncio

from octavo.engine.output_collector import RequestOutputCollector
from octavo.outputs import CompletionOutput, Logprob, RequestOutput


def delta(texts: dict[int, str], tokens: dict[int, list[int]], finished: bool = False,
          finish: str | None = None, prompt_logprobs=None, logprobs: bool = False) -> RequestOutput:
    return RequestOutput(
        request_id="r", prompt=None, prompt_token_ids=[1, 2], prompt_logprobs=prompt_logprobs,
        outputs=[CompletionOutput(index=i, text=texts[i], token_ids=tokens[i],
                                  logprobs=[{t: Logprob(-1.0)} for t in tokens[i]] if logprobs else None,
                                  finish_reason=finish if finished else None)
                 for i in sorted(texts)],
        finished=finished)


def test_deltas_merge_in_order_and_keep_the_newest_finish_state():
    c = RequestOutputCollector(merge_deltas=True)
    c.put(delta({0: "a"}, {0: [5]}, prompt_logprobs=[None], logprobs=True))
    c.put(delta({1: "x"}, {1: [9]}, logprobs=True))  # only choice 1 moved this step
    c.put(delta({0: "b", 1: "y"}, {0: [6], 1: [10]}, finished=True, finish="length", logprobs=True))
    out = c.get_nowait()
    assert [o.index for o in out.outputs] == [0, 1]
    assert [o.text for o in out.outputs] == ["ab", "xy"]
    assert [o.token_ids for o in out.outputs] == [[5, 6], [9, 10]]
    assert [list(p) for p in out.outputs[0].logprobs] == [[5], [6]]
    assert out.finished and out.outputs[1].finish_reason == "length"
    assert out.prompt_logprobs == [None]  # the first delta's, kept
    assert c.get_nowait() is None


def test_one_choice_deltas_merge_in_place_and_leave_the_newer_ones_alone():
    """n = 1 (the fast path): the pending delta grows; the merged-in deltas keep their lists."""
    c = RequestOutputCollector(merge_deltas=True)
    first = delta({0: "a"}, {0: [5]}, prompt_logprobs=[None], logprobs=True)
    later = [delta({0: "b"}, {0: [6]}, logprobs=True),
             delta({0: "c"}, {0: [7]}, finished=True, finish="stop", logprobs=True)]
    c.put(first)
    for output in later:
        c.put(output)
    out = c.get_nowait()
    assert out is first
    assert out.outputs[0].text == "abc" and out.outputs[0].token_ids == [5, 6, 7]
    assert [list(p) for p in out.outputs[0].logprobs] == [[5], [6], [7]]
    assert out.finished and out.outputs[0].finish_reason == "stop"
    assert out.prompt_logprobs == [None]
    assert [o.outputs[0].token_ids for o in later] == [[6], [7]]
    assert [len(o.outputs[0].logprobs) for o in later] == [1, 1]


def test_snapshots_replace_and_errors_end_the_stream():
    c = RequestOutputCollector(merge_deltas=False)
    c.put(delta({0: "a"}, {0: [5]}))
    c.put(delta({0: "ab"}, {0: [5, 6]}))
    assert c.get_nowait().outputs[0].text == "ab"
    error = ValueError("refused")
    c.put(delta({0: "a"}, {0: [5]}))
    c.put(error)
    c.put(delta({0: "abc"}, {0: [5, 6, 7]}))  # after an error: dropped
    assert c.get_nowait() is error and c.get_nowait() is None


def test_get_waits_for_a_put():
    async def main():
        c = RequestOutputCollector(merge_deltas=True)
        waiter = asyncio.ensure_future(c.get())
        await asyncio.sleep(0)
        assert not waiter.done()
        c.put(delta({0: "a"}, {0: [5]}))
        c.put(delta({0: "b"}, {0: [6]}))
        return await waiter

    assert asyncio.run(main()).outputs[0].text == "ab"
