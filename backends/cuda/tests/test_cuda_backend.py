"""The CUDA backend end to end on an NVIDIA GPU (run through the device tool; skipped in CI).

HF match in float32 (exact token ids) and bfloat16 (logprob tolerance), and the engine's
equivalence invariants (prefix caching, chunked prefill, preemption, batch size) on the GPU.
"""

from __future__ import annotations

import pytest
import torch
from octavo import LLM, SamplingParams

from tests.helpers.tiny import make_tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or getattr(torch.version, "hip", None) is not None,
        reason="needs an NVIDIA GPU and a CUDA build of torch",
    ),
]

PROMPTS = [
    "The capital of France is",
    "Once upon a time there was",
    "def add(a, b):\n    return",
    "Hello world! hello World? HELLO, world; 12345 67890 Caf\u00e9 cr\u00e8me",
]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model_dir(request, tmp_path_factory):
    # Real head dims: 64 (llama: 256 hidden / 4 heads) and 128 (qwen3 explicit head_dim).
    folder = tmp_path_factory.mktemp(request.param)
    overrides = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
                 "num_key_value_heads": 2}
    if request.param == "qwen3":
        overrides["head_dim"] = 128
    return make_tiny_model(folder, request.param, **overrides)


def _greedy(max_tokens=24, **kwargs):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def _token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def _free_all(llm):
    engine = llm.llm_engine
    return engine.num_free_blocks == engine.num_blocks and not engine.has_unfinished_requests()


def test_fp32_matches_hf_greedy(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    llm = LLM(str(model_dir), device="cuda", dtype="float32", num_gpu_blocks_override=256)
    outputs = llm.generate(PROMPTS, _greedy(), use_tqdm=False)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda()
    for prompt, output in zip(PROMPTS, outputs):
        ids = tokenizer(prompt, return_tensors="pt").input_ids.cuda()
        ref = hf.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False)
        ours, theirs = output.outputs[0].token_ids, ref[0, ids.shape[1]:].tolist()
        # HF's min_new_tokens masks EOS while ignore_eos lets Octavo emit it: compare the
        # tokens before Octavo's first EOS.
        if 2 in ours:
            cut = ours.index(2)
            assert ours[:cut] == theirs[:cut]
        else:
            assert ours == theirs
    assert _free_all(llm)


def test_bf16_logprobs_close_to_hf(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    llm = LLM(str(model_dir), device="cuda", dtype="bfloat16", num_gpu_blocks_override=256)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0, logprobs=0)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda()
    for prompt, output in zip(PROMPTS, outputs):
        ids = tokenizer(prompt, return_tensors="pt").input_ids.cuda()
        logits = hf(ids).logits[0].float()
        ref = torch.log_softmax(logits, dim=-1)
        # prompt logprobs: position i predicts token i + 1
        for pos, position in enumerate(output.prompt_logprobs[1:]):
            token = ids[0, pos + 1].item()
            assert abs(position[token].logprob - ref[pos, token].item()) < 0.08
        first = output.outputs[0].token_ids[0]
        assert abs(output.outputs[0].logprobs[0][first].logprob - ref[-1, first].item()) < 0.08


@pytest.mark.parametrize("arch", ["qwen2", "llama"])  # qwen2: a qkv bias
def test_bf16_batch_of_one_decode_close_to_hf(arch, tmp_path):
    """Batch-1 decode steps in bfloat16, where dense layers run the one-row GEMV
    (``octavo.kernels.dense``) on GPUs with PDL: each generated token's logprob against HF's
    on the same sequence (teacher-forced), as the prefill logprobs above."""
    from octavo.kernels.dense import uses_one_row_kernel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = make_tiny_model(tmp_path / arch, arch, hidden_size=256, intermediate_size=512,
                                num_attention_heads=4, num_key_value_heads=2)
    one_row = torch.zeros(1, 256, device="cuda", dtype=torch.bfloat16)
    weight = torch.zeros(512, 256, device="cuda", dtype=torch.bfloat16)
    assert uses_one_row_kernel(one_row, weight, None) == (
        torch.cuda.get_device_capability()[0] >= 9)
    llm = LLM(str(model_dir), device="cuda", dtype="bfloat16", num_gpu_blocks_override=256)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda()
    for prompt in PROMPTS[:2]:
        output = llm.generate(prompt, _greedy(16, logprobs=0), use_tqdm=False)[0].outputs[0]
        ids = tokenizer(prompt, return_tensors="pt").input_ids.cuda()
        sequence = torch.cat([ids, torch.tensor([output.token_ids], device="cuda")], dim=1)
        ref = torch.log_softmax(hf(sequence).logits[0].float(), dim=-1)
        for step, (token, logprobs) in enumerate(zip(output.token_ids, output.logprobs)):
            expected = ref[ids.shape[1] - 1 + step, token].item()
            assert abs(logprobs[token].logprob - expected) < 0.08, (prompt, step)
    assert _free_all(llm)


@pytest.fixture(scope="module")
def reference(model_dir):
    llm = LLM(str(model_dir), device="cuda", dtype="float32", num_gpu_blocks_override=512,
              enable_prefix_caching=False)
    prompts = [p * 3 for p in PROMPTS] * 4
    expected = _token_ids(llm.generate(prompts, _greedy(32), use_tqdm=False))
    return prompts, expected


@pytest.mark.parametrize(
    "options",
    [
        {"enable_prefix_caching": True},
        {"max_num_batched_tokens": 16},
        {"enable_chunked_prefill": False},
        {"block_size": 8},
        {"block_size": 32},
        {"num_gpu_blocks_override": 24, "block_size": 8},
        {"enforce_eager": True},
        {"async_scheduling": False},
        {"async_scheduling": False, "enforce_eager": True},
    ],
    ids=["prefix-cache", "chunked-16", "no-chunking", "block-8", "block-32", "preemption",
         "eager-no-cuda-graphs", "one-step-at-a-time", "one-step-at-a-time-eager"],
)
def test_equivalence(model_dir, reference, options):
    prompts, expected = reference
    options = {"num_gpu_blocks_override": 512, **options}
    llm = LLM(str(model_dir), device="cuda", dtype="float32", **options)
    first = _token_ids(llm.generate(prompts, _greedy(32), use_tqdm=False))
    second = _token_ids(llm.generate(prompts, _greedy(32), use_tqdm=False))  # warm prefix cache
    assert first == expected
    assert second == expected
    if options.get("num_gpu_blocks_override") == 24:
        assert llm.llm_engine.stats().num_preemptions > 0
    assert _free_all(llm)


@pytest.mark.parametrize(
    "options",
    [{}, {"num_gpu_blocks_override": 24, "block_size": 8, "max_num_batched_tokens": 32}],
    ids=["roomy", "preempting"],
)
def test_async_scheduling_matches_one_step_at_a_time(model_dir, options):
    """Every sampler path (greedy, seeded, penalties, logprobs, stop ids, n) gives the same
    outputs with the next step launched before the last one's tokens are read (the CUDA
    default) as one step at a time; float32, so only the last bits of logprobs may move."""
    from tests.engine.test_async_scheduling import PROMPTS as ASYNC_PROMPTS
    from tests.engine.test_async_scheduling import same, sampling_kinds, summary

    options = {"num_gpu_blocks_override": 512, **options}
    sync = LLM(str(model_dir), device="cuda", dtype="float32", async_scheduling=False, **options)
    pipelined = LLM(str(model_dir), device="cuda", dtype="float32", **options)
    assert pipelined.llm_engine.engine_core.async_scheduling  # the CUDA backend's default
    prompts = [{"prompt_token_ids": p} for p in ASYNC_PROMPTS]
    eos_like = sync.generate(prompts[:1], _greedy(8), use_tqdm=False)[0].outputs[0].token_ids[4]
    for name, params in sampling_kinds(eos_like).items():
        want = summary(sync.generate(prompts, params, use_tqdm=False))
        got = summary(pipelined.generate(prompts, params, use_tqdm=False))
        assert same(got, want), name
        assert _free_all(pipelined)
    if options["num_gpu_blocks_override"] == 24:
        assert pipelined.llm_engine.stats().num_preemptions > 0


def test_cuda_graphs_are_captured_and_used(model_dir):
    llm = LLM(str(model_dir), device="cuda", dtype="bfloat16", num_gpu_blocks_override=256,
              max_num_seqs=8)
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    assert runner.graph_runner is not None
    assert runner.graph_runner.sizes == [1, 2, 4, 8]
    replays = []
    original = runner.graph_runner.run
    runner.graph_runner.run = lambda *a: replays.append(1) or original(*a)
    graph_out = _token_ids(llm.generate(PROMPTS, _greedy(16), use_tqdm=False))
    assert len(replays) >= 15  # every decode step of the batch replayed a graph
    eager = LLM(str(model_dir), device="cuda", dtype="bfloat16", num_gpu_blocks_override=256,
                max_num_seqs=8, enforce_eager=True)
    assert eager.llm_engine.engine_core.executor.worker.model_runner.graph_runner is None
    eager_out = _token_ids(eager.generate(PROMPTS, _greedy(16), use_tqdm=False))
    same = sum(a == b for x, y in zip(graph_out, eager_out) for a, b in zip(x, y))
    assert same >= 0.9 * sum(len(x) for x in eager_out)  # bf16: padding may flip a rare tie


def test_batch_of_one_equals_batch(model_dir, reference):
    prompts, expected = reference
    llm = LLM(str(model_dir), device="cuda", dtype="float32", num_gpu_blocks_override=512)
    one_by_one = [_token_ids(llm.generate(p, _greedy(32), use_tqdm=False))[0] for p in prompts[:4]]
    assert one_by_one == expected[:4]


@pytest.mark.parametrize("options", [{}, {"num_gpu_blocks_override": 24, "block_size": 8}],
                         ids=["roomy", "preempting"])
def test_mp_executor_equals_in_process_in_bfloat16(model_dir, options):
    """The tensor-parallel code path at TP=1: a worker process (the mp executor) with CUDA
    graphs and async scheduling on, in bfloat16, gives the in-process engine's tokens and
    logprobs."""
    prompts = [p * 3 for p in PROMPTS] * 4
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=2)
    results = {}
    for backend in ("uni", "mp"):
        llm = LLM(str(model_dir), device="cuda", dtype="bfloat16",
                  distributed_executor_backend=backend, **{"num_gpu_blocks_override": 512,
                                                          **options})
        assert llm.llm_engine.engine_core.async_scheduling
        assert not llm.llm_engine.config.model_config.enforce_eager  # CUDA graphs on
        outs = llm.generate(prompts, params, use_tqdm=False)
        results[backend] = [(list(o.outputs[0].token_ids),
                             [p[t].logprob for t, p in zip(o.outputs[0].token_ids,
                                                            o.outputs[0].logprobs)])
                            for o in outs]
        assert _free_all(llm)
        llm.llm_engine.shutdown()
    for (ids, logprobs), (ref_ids, ref_logprobs) in zip(results["mp"], results["uni"]):
        assert ids == ref_ids
        assert logprobs == pytest.approx(ref_logprobs, abs=1e-3)
