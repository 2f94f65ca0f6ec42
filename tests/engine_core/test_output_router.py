"""``OutputRouter``: each request's outputs go back to the front end that sent it."""

from __future__ import annotations

import pytest
from octavo.engine_core.output_router import OutputRouter
from octavo.messages.engine_core import EngineCoreOutput, EngineCoreRequest
from octavo.sampling_params import SamplingParams


def request(request_id: str, client_index: int) -> EngineCoreRequest:
    return EngineCoreRequest(request_id=request_id, prompt_token_ids=[1, 2],
                             sampling_params=SamplingParams(max_tokens=2),
                             client_index=client_index)


def output(request_id: str, finish_reason: str | None = None) -> EngineCoreOutput:
    return EngineCoreOutput(request_id=request_id, new_token_ids=[7],
                            finish_reason=finish_reason)


def test_one_client_remembers_nothing() -> None:
    router = OutputRouter(1)
    router.add(request("a", 0))
    outputs = [output("a"), output("b")]
    assert router.split(outputs) == [outputs]
    assert len(router) == 0 and router.client_of("anything") == 0


def test_outputs_split_per_client_in_step_order_and_finished_are_forgotten() -> None:
    router = OutputRouter(3)
    for request_id, client in (("a", 0), ("b", 2), ("c", 2), ("d", 1)):
        router.add(request(request_id, client))
    split = router.split([output("c"), output("a", "length"), output("b"), output("d", "stop")])
    assert [[o.request_id for o in outputs] for outputs in split] == [["a"], ["d"], ["c", "b"]]
    assert len(router) == 2  # a and d finished
    assert router.client_of("a") is None and router.client_of("b") == 2
    router.forget(["b", "c", "unknown"])  # aborted or stopped by their front end
    assert len(router) == 0
    assert router.split([output("b")]) == [[], [], []]  # an output nobody waits for is dropped


def test_bad_index_or_duplicate_id_is_refused_and_changes_nothing() -> None:
    router = OutputRouter(2)
    with pytest.raises(ValueError, match="client_index 2 is out of range"):
        router.add(request("a", 2))
    router.add(request("a", 1))
    with pytest.raises(ValueError, match="already in use"):
        router.add(request("a", 0))
    assert router.client_of("a") == 1
