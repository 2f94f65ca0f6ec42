"""Split models give what one device gives: greedy tokens equal and logprobs within float32
rounding, for tensor parallelism (2 ranks) and pipeline parallelism (2 stages) on the CPU
(gloo), one worker process per rank.

Each split engine runs with prefix caching, chunked prefill under an 8-token budget and a KV
pool small enough to force preemption, all at once; the reference is one rank with none of
that (a roomy pool, whole prompts). Qwen2 runs with 2 KV heads at TP=2 (one per rank) and with
1 KV head (replicated on both ranks).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest
from octavo import SamplingParams

from tests.helpers.engine import (
    assert_close_logprobs,
    assert_no_leaks,
    make_llm,
    prompts_of_lengths,
)
from tests.helpers.tiny import VOCAB_SIZE, make_tiny_model

NUM_TOKENS = 12
NUM_LOGPROBS = 2
# Prompts of 6..40 tokens; the last three share a 24-token prefix with the fifth.
_BASE = prompts_of_lengths([6, 13, 21, 33, 40], seed=7)
PROMPTS = _BASE + [_BASE[4][:24] + tail for tail in prompts_of_lengths([3, 9, 5], seed=8)]
PARAMS = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True,
                        logprobs=NUM_LOGPROBS)
# What forces preemption, chunking and prefix hits in the split engines.
STRESS = dict(enable_prefix_caching=True, max_num_batched_tokens=8, num_gpu_blocks_override=14,
              block_size=4)

MODELS = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "qwen2-1kv": ("qwen2", {"num_key_value_heads": 1}),
    "qwen3": ("qwen3", {}),
    "mistral": ("mistral", {}),
    # Mixtures of experts: every expert's intermediate dim split over the ranks; Qwen2-MoE's
    # shared expert summed with the routed ones before the one all-reduce. (Mixtral differs
    # only in checkpoint names: tests/distributed/test_sharded_loading.py.)
    "qwen2_moe": ("qwen2_moe", {}),
    "qwen3_moe": ("qwen3_moe", {}),
    # Fused qkv_proj / gate_up_proj checkpoint tensors sliced per rank; partial longrope.
    "phi3": ("phi3", {}),
    # Sandwich norms, q/k norms, local/global layers with their own rope, windows that bind.
    "gemma3": ("gemma3", {}),
}


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    folders: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in folders:
            arch, overrides = MODELS[name]
            folders[name] = make_tiny_model(tmp_path_factory.mktemp(name), arch, **overrides)
        return folders[name]

    return get


def run(llm) -> list[tuple[list[int], list[float]]]:
    """(token ids, chosen-token logprobs) of every prompt."""
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    results = []
    for out in outputs:
        completion = out.outputs[0]
        chosen = [position[token].logprob
                  for token, position in zip(completion.token_ids, completion.logprobs)]
        results.append((list(completion.token_ids), chosen))
    return results


@cache
def reference(folder: Path) -> tuple[tuple[list[int], list[float]], ...]:
    llm = make_llm(folder, device="cpu")
    try:
        return tuple(run(llm))
    finally:
        llm.llm_engine.shutdown()


def assert_same(got, expected) -> None:
    for (ids, logprobs), (ref_ids, ref_logprobs) in zip(got, expected, strict=True):
        assert ids == ref_ids
        assert logprobs == pytest.approx(ref_logprobs, abs=2e-4)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_tensor_parallel_2_equals_one_device(model_folder, name):
    folder = model_folder(name)
    llm = make_llm(folder, device="cpu", tensor_parallel_size=2, **STRESS)
    try:
        assert llm.llm_engine.config.parallel_config.distributed_executor_backend == "mp"
        assert_same(run(llm), reference(folder))
        assert llm.llm_engine.stats().num_preemptions > 0
        assert llm.llm_engine.stats().prefix_cache_hits > 0
        assert_no_leaks(llm)
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma3"])
def test_pipeline_parallel_2_equals_one_device(model_folder, name):
    folder = model_folder(name)
    llm = make_llm(folder, device="cpu", pipeline_parallel_size=2, **STRESS)
    try:
        assert llm.llm_engine.engine_core.max_in_flight == 2  # a batch per stage
        assert_same(run(llm), reference(folder))
        assert llm.llm_engine.stats().num_preemptions > 0
        assert_no_leaks(llm)
    finally:
        llm.llm_engine.shutdown()


def test_tensor_parallel_with_async_scheduling(model_folder):
    folder = model_folder("llama")
    llm = make_llm(folder, device="cpu", tensor_parallel_size=2, async_scheduling=True,
                   **STRESS)
    try:
        assert llm.llm_engine.engine_core.async_scheduling
        assert_same(run(llm), reference(folder))
        assert_no_leaks(llm)
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("parallel", [{"tensor_parallel_size": 2, "async_scheduling": True},
                                      {"pipeline_parallel_size": 2}], ids=["tp2-async", "pp2"])
def test_structured_outputs_when_split(model_folder, parallel):
    """Grammar masks reach every rank (with async scheduling, in a deferred sample message):
    constrained greedy outputs equal one device's. With pipeline stages no sampling is
    deferred (a request waits for its token in flight), so none is prepared ahead."""
    from octavo import StructuredOutputsParams

    folder = model_folder("llama")
    params = [SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=constraint)
              for constraint in (StructuredOutputsParams(regex=r"[a-z]{3}-\d{2,3}"),
                                 StructuredOutputsParams(choice=["alpha", "beta", "gamma"]))]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:2]]

    def texts(llm) -> list[str]:
        return [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]

    one = make_llm(folder, device="cpu")
    want = texts(one)
    one.llm_engine.shutdown()
    llm = make_llm(folder, device="cpu", **parallel)
    try:
        executor = llm.llm_engine.engine_core.executor
        launch, deferred = executor.execute_model_async, []

        def spy(scheduler_output):
            deferred.append(scheduler_output.sampling_deferred)
            return launch(scheduler_output)

        executor.execute_model_async = spy
        sent = bitmasks_sent(llm)
        assert texts(llm) == want
        assert want[1] in ("alpha", "beta", "gamma")
        pipelined = "pipeline_parallel_size" in parallel
        assert executor.prepares_ahead == (not pipelined)
        assert any(deferred) == (not pipelined)
        # The masks reach the ranks by reference (the grammar process's buffers with async
        # scheduling, the engine core's own without), never in the messages.
        assert_sent_by_reference(sent)
        assert_no_leaks(llm)
    finally:
        llm.llm_engine.shutdown()


def mixed_requests():
    """Constrained and free requests side by side: greedy, seeded sampling with n = 2, logprobs
    and prompt logprobs."""
    from octavo import StructuredOutputsParams

    regex = StructuredOutputsParams(regex=r"[a-z]{3}-\d{2,3}")
    choice = StructuredOutputsParams(choice=["alpha", "beta", "gamma"])
    return [SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=regex, logprobs=2),
            SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=choice,
                           prompt_logprobs=1),
            SamplingParams(temperature=1.0, seed=3, max_tokens=9, ignore_eos=True, n=2),
            SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=1)]


def launches_ahead(llm) -> list[bool]:
    """Spy on the executor: for each step launched, whether a step launched before it with its
    sampling deferred was still waiting for ``sample_tokens`` (the step was prepared ahead)."""
    executor = llm.llm_engine.engine_core.executor
    launch, sample = executor.execute_model_async, executor.sample_tokens
    waiting = [0]
    ahead: list[bool] = []

    def spy_launch(scheduler_output):
        ahead.append(waiting[0] > 0)
        waiting[0] += scheduler_output.sampling_deferred
        return launch(scheduler_output)

    def spy_sample(bitmask):
        waiting[0] -= 1
        return sample(bitmask)

    executor.execute_model_async, executor.sample_tokens = spy_launch, spy_sample
    return ahead


def bitmasks_sent(llm) -> list:
    """Spy on the multiprocess executor's messages: every grammar bitmask it sends to the
    ranks, as sent."""
    executor = llm.llm_engine.engine_core.executor
    send = executor._send
    sent: list = []

    def spy(message):
        bitmask = getattr(message, "grammar_bitmask", None)
        if bitmask is None and hasattr(message, "scheduler_output"):
            bitmask = message.scheduler_output.grammar_bitmask
        if bitmask is not None:
            sent.append(bitmask)
        return send(message)

    executor._send = spy
    return sent


def assert_sent_by_reference(sent: list) -> None:
    """Bitmasks were sent (``bitmasks_sent``), each as a buffer of the shared masks with no
    rows in the message."""
    assert sent and all(b.shared_buffer in (0, 1) and len(b.data) == 0 for b in sent)


def outputs_of(llm, params) -> list:
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:len(params)]]
    return [([c.token_ids for c in o.outputs], [c.logprobs for c in o.outputs], o.prompt_logprobs)
            for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("prepare_ahead, spin_us", [("1", "0"), ("0", "0"), ("1", "3000")])
def test_structured_outputs_when_split_with_the_next_step_prepared_ahead(
        model_folder, monkeypatch, prepare_ahead, spin_us):
    """With two ranks in worker processes under async scheduling, the next step is sent to the
    ranks (and prepared there) before the sampling of the step before it, which waits for the
    grammar masks; each rank finishes that step only after its sample message. Under
    preemption and prompt chunks the outputs are one device's; with
    ``OCTAVO_PREPARE_AHEAD=0`` no step goes ahead; with ``OCTAVO_WORKER_SPIN_US`` the ranks
    and the engine core poll their sockets between messages. The masks, filled by the grammar
    process in shared memory, reach the ranks by reference (the ranks map the same buffers)."""
    monkeypatch.setenv("OCTAVO_WORKER_SPIN_US", spin_us)
    folder = model_folder("llama")
    params = mixed_requests()
    one = make_llm(folder, device="cpu")
    want = outputs_of(one, params)
    one.llm_engine.shutdown()
    monkeypatch.setenv("OCTAVO_PREPARE_AHEAD", prepare_ahead)
    llm = make_llm(folder, device="cpu", tensor_parallel_size=2, async_scheduling=True,
                   **STRESS)
    try:
        assert llm.llm_engine.engine_core.executor.prepares_ahead
        ahead = launches_ahead(llm)
        sent = bitmasks_sent(llm)
        got = outputs_of(llm, params)
        assert [ids for ids, _, _ in got] == [ids for ids, _, _ in want]
        for (_, logprobs, prompt_logprobs), (_, want_logprobs, want_prompt) in zip(got, want):
            assert_close_logprobs(logprobs, want_logprobs)
            assert_close_logprobs([prompt_logprobs], [want_prompt])
        assert any(ahead) == (prepare_ahead == "1")
        assert_sent_by_reference(sent)
        assert llm.llm_engine.stats().num_preemptions > 0
        assert_no_leaks(llm)
    finally:
        llm.llm_engine.shutdown()


def test_tensor_parallel_with_speculative_decoding(model_folder):
    """ngram drafts verified on two ranks (each runs the rejection sampler on its own copy of
    the logits) under the same stress: the one-device tokens, drafts accepted."""
    folder = model_folder("llama")
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 2}
    llm = make_llm(folder, device="cpu", tensor_parallel_size=2, speculative_config=spec,
                   **STRESS)
    try:
        assert_same(run(llm), reference(folder))
        stats = llm.llm_engine.stats()
        assert stats.spec_decode_num_accepted_tokens > 0 and stats.num_preemptions > 0
        assert_no_leaks(llm)
    finally:
        llm.llm_engine.shutdown()


def test_tensor_parallel_with_a_draft_model(model_folder, tmp_path):
    """A draft model (replicated whole on both ranks, its KV in the same blocks) under the
    same stress: the one-device tokens and logprobs; the target as its own draft accepts
    every draft."""
    folder = model_folder("llama")
    spec = {"method": "draft_model", "model": str(folder), "num_speculative_tokens": 3}
    llm = make_llm(folder, device="cpu", tensor_parallel_size=2, speculative_config=spec,
                   **STRESS)
    try:
        assert_same(run(llm), reference(folder))
        stats = llm.llm_engine.stats()
        assert stats.num_preemptions > 0 and stats.spec_decode_num_draft_tokens > 0
        assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens
        assert_no_leaks(llm)
    finally:
        llm.llm_engine.shutdown()


def test_tensor_parallel_with_an_eagle_head(model_folder, tmp_path):
    """An EAGLE-1 head (replicated on both ranks; the target's embedding and LM head it
    shares are split over them) under the same stress: the one-device tokens."""
    from octavo.testing.eagle_heads import make_tiny_eagle_head

    folder = model_folder("llama")
    head = make_tiny_eagle_head(tmp_path / "head", folder, seed=4)
    spec = {"method": "eagle", "model": str(head), "num_speculative_tokens": 3}
    llm = make_llm(folder, device="cpu", tensor_parallel_size=2, speculative_config=spec,
                   **STRESS)
    try:
        assert_same(run(llm), reference(folder))
        stats = llm.llm_engine.stats()
        assert stats.num_preemptions > 0 and stats.spec_decode_num_draft_tokens > 0
        assert_no_leaks(llm)
    finally:
        llm.llm_engine.shutdown()


def test_tensor_parallel_with_an_eagle3_head(tmp_path):
    """An EAGLE-3 head (replicated on both ranks, its own LM head whole; the target's
    embedding it shares is split over them) reading the target's aux hidden states, which
    each rank has whole after the row-parallel reduce: the exact head for a target that
    repeats its token has every draft accepted, and the tokens are the one-device ones."""
    from octavo.testing.eagle_heads import (
        default_draft_token_ids,
        make_exact_eagle3_head,
        make_repeating_target,
    )

    folder = make_repeating_target(tmp_path / "target", seed=2)
    head = make_exact_eagle3_head(tmp_path / "head", folder)
    draftable = set(default_draft_token_ids(VOCAB_SIZE))
    assert all(p[-1] in draftable for p in PROMPTS), "each output token must be draftable"
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}
    llm = make_llm(folder, device="cpu", tensor_parallel_size=2, speculative_config=spec,
                   **STRESS)
    try:
        assert_same(run(llm), reference(folder))
        stats = llm.llm_engine.stats()
        assert stats.num_preemptions > 0 and stats.spec_decode_num_draft_tokens > 0
        assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens
        assert_no_leaks(llm)
    finally:
        llm.llm_engine.shutdown()
