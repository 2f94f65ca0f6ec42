"""``StructuredOutputManager``: compile off the caller's thread, masks per step, matchers
advanced by sampled tokens, nothing kept after a request ends; the same through
``GrammarProcess`` (the manager in a process of its own), and what that process leaves behind
(nothing) and does when it dies."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
from octavo.messages.shared_masks import SharedMasks
from octavo.sampling_params import StructuredOutputsParams
from octavo.structured_output.manager import StructuredOutputManager
from octavo.structured_output.process import GrammarProcess

from tests.helpers.engine import grammar_process, grammar_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama)


VOCAB = 400  # wider than the tokenizer's 384 tokens, as padded embeddings are


@pytest.fixture(params=["thread", "thread-shared", "process"])
def manager(request, tokenizer, tiny_llama):
    if request.param == "thread":
        m = StructuredOutputManager(lambda: grammar_tokenizer(tokenizer), VOCAB)
    elif request.param == "thread-shared":  # the masks filled into shared buffers in turn
        m = StructuredOutputManager(lambda: grammar_tokenizer(tokenizer), VOCAB,
                                    shared_masks=SharedMasks.create(64, VOCAB))
    else:
        m = grammar_process(tiny_llama, VOCAB, max_rows=64)
    yield m
    m.shutdown()


def compile_all(manager: StructuredOutputManager | GrammarProcess,
                requests: dict[str, StructuredOutputsParams]):
    for request_id, params in requests.items():
        manager.submit(request_id, params)
    ready = []
    deadline = time.monotonic() + 60
    while len(ready) < len(requests) and time.monotonic() < deadline:
        manager.wait(1.0)
        ready += manager.take_ready()
    assert sorted(r.request_id for r in ready) == sorted(requests)
    assert all(r.error is None for r in ready)


def allowed(manager: StructuredOutputManager | GrammarProcess, request_id: str) -> set[int]:
    bitmask = manager.bitmask([request_id])
    words = np.frombuffer(bitmask.data, dtype="<u4").reshape(1, bitmask.num_words)[0]
    return {w * 32 + b for w, word in enumerate(words) for b in range(32) if word >> b & 1}


def walk(manager, tokenizer, request_id: str, text: str) -> None:
    """Feed ``text`` token by token, checking each token is in the mask first."""
    for token in tokenizer.encode(text, add_special_tokens=False):
        assert token in allowed(manager, request_id), tokenizer.decode([token])
        assert manager.accept(request_id, [token]) is None


def test_a_regex_walk_ends_with_eos_only(manager, tokenizer) -> None:
    compile_all(manager, {"r": StructuredOutputsParams(regex=r"\d{3}-\d{2}")})
    assert manager.is_constrained("r")
    walk(manager, tokenizer, "r", "123-45")
    assert allowed(manager, "r") == {tokenizer.eos_token_id}


def test_a_refused_token_is_an_error(manager, tokenizer) -> None:
    compile_all(manager, {"c": StructuredOutputsParams(choice=["yes", "no"])})
    letter_z = tokenizer.encode("z", add_special_tokens=False)[0]
    assert letter_z not in allowed(manager, "c")
    assert manager.accept("c", [letter_z]) is not None


def test_masks_of_several_requests_in_one_call(manager, tokenizer) -> None:
    compile_all(manager, {
        "digits": StructuredOutputsParams(regex=r"[0-9]+"),
        "json": StructuredOutputsParams(json={"type": "object"}, disable_any_whitespace=True),
    })
    bitmask = manager.bitmask(["digits", "json", "gone"])
    rows = np.frombuffer(bitmask.data, dtype="<u4").reshape(3, bitmask.num_words)
    assert bitmask.num_words == (400 + 31) // 32
    digit_ids = {tokenizer.convert_tokens_to_ids(d) for d in "0123456789"}
    first = {w * 32 + b for w, word in enumerate(rows[0]) for b in range(32) if word >> b & 1}
    assert digit_ids <= first and all(tokenizer.decode([t]).isdigit() for t in first)
    brace = tokenizer.convert_tokens_to_ids("{")
    assert rows[1][brace // 32] >> (brace % 32) & 1
    assert (rows[2] == 0xFFFFFFFF).all()  # no matcher (finished meanwhile): unconstrained
    # Tokens past the tokenizer's vocabulary are never allowed.
    assert not any(rows[0][t // 32] >> (t % 32) & 1 for t in range(len(tokenizer), 400))


def test_json_walk_and_cache_hits(manager, tokenizer) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    compile_all(manager, {"one": StructuredOutputsParams(json=schema)})
    start = time.perf_counter()
    compile_all(manager, {"two": StructuredOutputsParams(json=json.dumps(schema))})
    assert time.perf_counter() - start < 5
    walk(manager, tokenizer, "one", '{"a": 12}')
    # "two" is a copy of the cached matcher, not the same one: it still expects "{".
    assert tokenizer.convert_tokens_to_ids("{") in allowed(manager, "two")


def test_nothing_is_kept_after_remove(manager) -> None:
    compile_all(manager, {"a": StructuredOutputsParams(regex="a+"),
                          "b": StructuredOutputsParams(regex="b+")})
    manager.submit("c", StructuredOutputsParams(regex="c+"))
    for request_id in ("a", "b", "c"):
        manager.remove(request_id)
    assert manager.num_active == 0
    assert not manager.is_constrained("a")


@pytest.mark.parametrize("rows", [3, 40])
def test_accept_step_advances_every_row_and_names_the_refused(manager, tokenizer, rows) -> None:
    requests = {f"d{i}": StructuredOutputsParams(regex=r"[0-9]{2}") for i in range(rows)}
    compile_all(manager, requests)
    one, letter_z = (tokenizer.encode(t, add_special_tokens=False)[0] for t in ("1", "z"))
    sampled = {request_id: [one] for request_id in requests}
    sampled["d0"] = [letter_z]  # refused by its grammar
    sampled["gone"] = [one]  # no matcher (finished meanwhile): skipped
    errors = manager.accept_step(sampled)
    assert list(errors) == ["d0"] and errors["d0"]
    for request_id in list(requests)[1:]:
        # One digit in: a second digit may follow, nothing else; the grammar ends after it.
        assert allowed(manager, request_id) == {
            tokenizer.convert_tokens_to_ids(d) for d in "0123456789"}
    assert manager.accept_step({request_id: [one] for request_id in list(requests)[1:]}) == {}
    assert all(allowed(manager, r) == {tokenizer.eos_token_id} for r in list(requests)[1:])


def test_an_async_step_reports_how_long_its_grammar_work_took(manager, tokenizer) -> None:
    """``AcceptedStep.work_s``: the accept and the fill, timed where they ran (the grammar
    thread or the grammar process), no longer than the caller waited from the call on."""
    requests = {f"d{i}": StructuredOutputsParams(regex=r"[0-9]{2}") for i in range(8)}
    compile_all(manager, requests)
    one = tokenizer.encode("1", add_special_tokens=False)[0]
    start = time.perf_counter()
    done = manager.accept_and_bitmask_async(list(requests), [[one]] * len(requests),
                                          list(requests)).result()
    waited = time.perf_counter() - start
    assert done.errors == {} and 0 < done.work_s <= waited


def test_the_grammar_threads_parallel_accept_equals_the_loop(tokenizer, monkeypatch) -> None:
    """The grammar thread's accept (llguidance's consume_token_par, GIL released) and the
    one-after-the-other loop leave every matcher in the same state and name the same refused
    rows: a refused token, a matcher whose grammar already ended (skipped), several tokens in
    one row (the loop), a request without a matcher."""
    one, two, letter_z = (tokenizer.encode(t, add_special_tokens=False)[0] for t in "12z")
    results = {}
    for mode in ("parallel", "loop"):
        monkeypatch.setenv("OCTAVO_GRAMMAR_ACCEPT", mode)
        m = StructuredOutputManager(lambda: grammar_tokenizer(tokenizer), 400)
        try:
            requests = {f"d{i}": StructuredOutputsParams(regex=r"[0-9]{2}") for i in range(40)}
            compile_all(m, requests)
            assert m.accept_step({"d1": [one, two]}) == {}  # d1's grammar has ended
            sampled = {request_id: [one] for request_id in requests}
            sampled["d0"] = [letter_z]  # refused
            sampled["d2"] = [one, two]  # two tokens: the loop, in either mode
            sampled["gone"] = [one]  # no matcher: skipped
            done = m.accept_and_bitmask_async(list(sampled), list(sampled.values()),
                                              list(requests)).result()
            masks = allowed_rows_of(done.bitmask)
            results[mode] = (sorted(done.errors), masks)
        finally:
            m.shutdown()
    assert results["parallel"] == results["loop"]
    errors, masks = results["parallel"]
    assert errors == ["d0"]
    digits = {tokenizer.convert_tokens_to_ids(d) for d in "0123456789"}
    assert masks[1] == masks[2] == {tokenizer.eos_token_id}
    assert all(mask == digits for mask in masks[3:])


def allowed_rows_of(bitmask) -> list[set[int]]:
    words = np.frombuffer(bitmask.data, dtype="<u4").reshape(-1, bitmask.num_words)
    return [{w * 32 + b for w, word in enumerate(row) for b in range(32) if word >> b & 1}
            for row in words]


@pytest.mark.parametrize("name, value", [("OCTAVO_GRAMMAR_ACCEPT", "threads"),
                                         ("OCTAVO_GRAMMAR_SWITCH_INTERVAL_US", "-5"),
                                         ("OCTAVO_GRAMMAR_SWITCH_INTERVAL_US", "fast"),
                                         ("OCTAVO_GRAMMAR_PROCESS", "yes"),
                                         ("OCTAVO_GRAMMAR_SPIN_US", "-1"),
                                         ("OCTAVO_GRAMMAR_SPIN_US", "busy"),
                                         ("OCTAVO_GRAMMAR_THREADS", "0"),
                                         ("OCTAVO_GRAMMAR_THREADS", "2.5")])
def test_a_bad_grammar_setting_says_what_it_takes(monkeypatch, name, value) -> None:
    from octavo import envs

    read = {"OCTAVO_GRAMMAR_ACCEPT": envs.grammar_accept,
            "OCTAVO_GRAMMAR_SWITCH_INTERVAL_US": envs.grammar_switch_interval_s,
            "OCTAVO_GRAMMAR_PROCESS": envs.grammar_process,
            "OCTAVO_GRAMMAR_SPIN_US": envs.grammar_spin_s,
            "OCTAVO_GRAMMAR_THREADS": envs.grammar_threads}[name]
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        read()


def test_the_mask_pool_takes_its_size_from_the_environment(monkeypatch, tokenizer) -> None:
    """``OCTAVO_GRAMMAR_THREADS`` sizes llguidance's pool; unset, half the cores (1 to 8)."""
    from octavo import envs

    monkeypatch.delenv("OCTAVO_GRAMMAR_THREADS", raising=False)
    assert envs.grammar_threads() == max(1, min(8, (os.cpu_count() or 2) // 2))
    monkeypatch.setenv("OCTAVO_GRAMMAR_THREADS", "3")
    manager = StructuredOutputManager(lambda: grammar_tokenizer(tokenizer), VOCAB)
    try:
        assert manager._num_threads == 3
        compile_all(manager, {"r": StructuredOutputsParams(regex="ab")})
        mask = allowed(manager, "r")
        first, = tokenizer.encode("a", add_special_tokens=False)
        second, = tokenizer.encode("b", add_special_tokens=False)
        assert first in mask and second not in mask
    finally:
        manager.shutdown()


@pytest.mark.parametrize("value, async_scheduling, expected", [
    ("auto", True, "GrammarProcess"), ("auto", False, "StructuredOutputManager"),
    ("0", True, "StructuredOutputManager"), ("1", False, "GrammarProcess")])
def test_where_the_grammars_run(tiny_llama, monkeypatch, value, async_scheduling,
                                expected) -> None:
    from octavo.engine.arg_utils import EngineArgs
    from octavo.engine_core.core import make_structured_outputs

    monkeypatch.setenv("OCTAVO_GRAMMAR_PROCESS", value)
    config = EngineArgs(model=str(tiny_llama), device="cpu",
                        async_scheduling=async_scheduling).create_engine_config()
    structured = make_structured_outputs(config)
    try:
        assert type(structured).__name__ == expected
    finally:
        structured.shutdown()


def test_llguidance_writes_every_word_of_a_row(tokenizer) -> None:
    """The manager fills masks into a zeroed buffer without setting the rows to "allow
    everything" first: that holds only if the fill writes each row whole, whatever was there
    (here: rows of all ones, and rows of zeros, give the same masks)."""
    import llguidance
    import llguidance.hf
    import llguidance.numpy

    llg_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=400,
                                                 eos_token=tokenizer.eos_token_id)
    grammars = [llguidance.LLMatcher.grammar_from_regex(r"[0-9]{2}"),
                llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}')]
    matchers = [llguidance.LLMatcher(llg_tokenizer, g) for g in grammars]
    executor = llguidance.LLExecutor(num_threads=2)
    words = (400 + 31) // 32
    filled = []
    for start in (-1, 0):
        rows = np.full((len(matchers), words), start, dtype=np.int32)
        llguidance.numpy.fill_next_token_bitmask_par(
            executor, [(m, i) for i, m in enumerate(matchers)], rows)
        filled.append(rows)
    assert np.array_equal(filled[0], filled[1])
    assert not (filled[1] == -1).all(axis=1).any()  # the masks constrain something


# ---- the grammar process ----------------------------------------------------------------------


def test_a_grammar_that_does_not_compile_is_reported(manager) -> None:
    manager.submit("bad", StructuredOutputsParams(regex="(unclosed"))
    deadline = time.monotonic() + 60
    ready = []
    while not ready and time.monotonic() < deadline:
        manager.wait(1.0)
        ready = manager.take_ready()
    assert [r.request_id for r in ready] == ["bad"] and ready[0].error
    assert not manager.is_constrained("bad") and manager.num_active == 0


def test_the_grammar_process_leaves_nothing_behind(tiny_llama) -> None:
    import os

    process = grammar_process(tiny_llama, VOCAB, max_rows=4)
    assert process._process is None  # started by the first constraint, not before
    compile_all(process, {"a": StructuredOutputsParams(regex="a+")})
    child = process._process
    assert child.poll() is None
    # The shared masks have no name while both processes use them: none can be left behind.
    assert not [name for name in os.listdir("/dev/shm") if name.startswith("octavo-grammar")]
    pending = process.accept_and_bitmask_async(["a"], [[5]], ["a"])
    pending.result()
    process.remove("a")
    process.shutdown()
    assert child.poll() == 0
    process.shutdown()  # idempotent


def test_warm_up_starts_the_grammar_process_before_any_constraint(tiny_llama) -> None:
    process = grammar_process(tiny_llama, VOCAB, max_rows=4)
    try:
        process.warm_up()
        process.warm_up()  # idempotent: one process
        process._started()
        child = process._process
        assert child is not None and child.poll() is None
        # The tokenizer came as data: the child loads neither the model config nor
        # transformers, so torch (which transformers imports) is not in it either.
        maps = Path(f"/proc/{child.pid}/maps").read_text()
        assert "libtorch" not in maps
        compile_all(process, {"a": StructuredOutputsParams(regex="a+")})
        assert process._process is child
    finally:
        process.shutdown()
    assert child.poll() == 0


@pytest.mark.parametrize("where", ["thread", "process"])
def test_a_tokenizer_that_cannot_load_fails_each_constraint_only(where) -> None:
    def loader():
        raise ValueError("no tokenizer.json here")

    manager = (StructuredOutputManager(loader, VOCAB) if where == "thread"
               else GrammarProcess(loader, VOCAB, max_rows=4))
    try:
        manager.warm_up()
        for request_id in ("a", "b"):  # each constraint says why; nothing raises
            manager.submit(request_id, StructuredOutputsParams(regex="a+"))
        ready = []
        deadline = time.monotonic() + 30
        while len(ready) < 2 and time.monotonic() < deadline:
            manager.wait(1.0)
            ready += manager.take_ready()
        assert sorted(r.request_id for r in ready) == ["a", "b"]
        assert all("no tokenizer.json here" in r.error for r in ready)
        assert manager.num_active == 0
    finally:
        manager.shutdown()


def test_one_step_in_flight_at_a_time(tiny_llama) -> None:
    process = grammar_process(tiny_llama, VOCAB, max_rows=2)
    try:
        compile_all(process, {"a": StructuredOutputsParams(regex="a+")})
        with pytest.raises(ValueError, match="3 mask rows"):
            process.bitmask(["a", "b", "c"])
        pending = process.accept_and_bitmask_async([], [], ["a"])
        with pytest.raises(RuntimeError, match="still in flight"):
            process.bitmask(["a"])
        assert pending.result().bitmask.req_ids == ["a"]
    finally:
        process.shutdown()


def test_a_dead_grammar_process_is_a_clear_error(tiny_llama) -> None:
    process = grammar_process(tiny_llama, VOCAB, max_rows=4)
    try:
        compile_all(process, {"a": StructuredOutputsParams(regex="a+")})
        process._process.kill()
        process._process.wait()
        with pytest.raises(RuntimeError, match="grammar process exited"):
            process.bitmask(["a"])
    finally:
        process.shutdown()


def test_a_hung_grammar_process_is_a_clear_error(tiny_llama, monkeypatch) -> None:
    import signal

    from octavo.structured_output import process as process_module

    process = grammar_process(tiny_llama, VOCAB, max_rows=4)
    try:
        compile_all(process, {"a": StructuredOutputsParams(regex="a+")})
        monkeypatch.setattr(process_module, "_STEP_TIMEOUT_S", 0.5)
        process._process.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(RuntimeError, match="did not answer a step within"):
                process.bitmask(["a"])
        finally:
            process._process.send_signal(signal.SIGCONT)
    finally:
        process.shutdown()


def test_the_threads_masks_take_the_shared_buffers_in_turn(tokenizer) -> None:
    """With ``SharedMasks`` each step's rows go into the next of its two buffers (named by the
    bitmask, so worker processes read them in place), the same rows as in new memory; a step
    of more rows than the buffers hold gets new memory."""
    shared = StructuredOutputManager(lambda: grammar_tokenizer(tokenizer), VOCAB,
                                     shared_masks=SharedMasks.create(2, VOCAB))
    plain = StructuredOutputManager(lambda: grammar_tokenizer(tokenizer), VOCAB)
    try:
        requests = {"d": StructuredOutputsParams(regex=r"[0-9]+"),
                    "c": StructuredOutputsParams(choice=["yes", "no"])}
        compile_all(shared, requests)
        compile_all(plain, requests)
        first, second = shared.bitmask(["d", "c"]), shared.bitmask(["c"])
        assert (first.shared_buffer, second.shared_buffer) == (0, 1)
        assert bytes(first.data) == bytes(plain.bitmask(["d", "c"]).data)
        third = shared.accept_and_bitmask_async([], [], ["d"]).result().bitmask
        assert third.shared_buffer == 0
        assert allowed_rows_of(third) == allowed_rows_of(plain.bitmask(["d"]))
        assert bytes(second.data) == bytes(plain.bitmask(["c"]).data)  # not overwritten
        wide = shared.bitmask(["d", "c", "gone"])
        assert wide.shared_buffer is None and len(wide.data) == 3 * wide.num_words * 4
    finally:
        shared.shutdown()
        plain.shutdown()


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="CPU affinity is Linux's")
def test_grammar_cpus_pin_the_grammar_process_and_a_bad_list_fails_at_once(tiny_llama,
                                                                           monkeypatch) -> None:
    """``OCTAVO_GRAMMAR_CPUS``: the child and the threads it starts run on those CPUs; a list
    that does not parse fails in the engine core, before any child starts."""
    cpu = min(os.sched_getaffinity(0))
    monkeypatch.setenv("OCTAVO_GRAMMAR_CPUS", str(cpu))
    process = grammar_process(tiny_llama, VOCAB, max_rows=4)
    try:
        compile_all(process, {"a": StructuredOutputsParams(regex="a+")})  # pool threads up
        child = process._process
        assert child is not None
        threads = os.listdir(f"/proc/{child.pid}/task")
        assert len(threads) > 1
        assert all(os.sched_getaffinity(int(tid)) == {cpu} for tid in threads)
    finally:
        process.shutdown()
    monkeypatch.setenv("OCTAVO_GRAMMAR_CPUS", "3-1")
    with pytest.raises(ValueError, match="OCTAVO_GRAMMAR_CPUS must be a CPU list"):
        grammar_process(tiny_llama, VOCAB, max_rows=4)


@pytest.mark.parametrize("raw,cpus", [("", None), ("3", {3}), ("8-11", {8, 9, 10, 11}),
                                      (" 2,4,6-7 ", {2, 4, 6, 7})])
def test_grammar_cpus_lists(raw, cpus, monkeypatch) -> None:
    from octavo import envs

    monkeypatch.setenv("OCTAVO_GRAMMAR_CPUS", raw)
    assert envs.grammar_cpus() == cpus


@pytest.mark.parametrize("raw", ["a", "3-", "-1", "4-2", "1,,2"])
def test_grammar_cpus_refuses_what_is_not_a_cpu_list(raw, monkeypatch) -> None:
    from octavo import envs

    monkeypatch.setenv("OCTAVO_GRAMMAR_CPUS", raw)
    with pytest.raises(ValueError, match="OCTAVO_GRAMMAR_CPUS must be a CPU list"):
        envs.grammar_cpus()
