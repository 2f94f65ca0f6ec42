"""Multi-LoRA throughput: W1 (256 requests, prompts and outputs of 100-1024 tokens, seed 0)
through ``LLM.generate`` without adapters, then with 4 adapters assigned round-robin (every step
mixes them), output tokens per second of each.

    python benchmarks/gpu/bench_lora.py --model /tmp/qwen2.5-0.5b-random
    python benchmarks/gpu/bench_lora.py --model /tmp/llama3-8b-config --load-format dummy

The adapters are random PEFT-format folders (rank 16 on every q/k/v/o/gate/up/down projection,
written from the model's config: no ``peft`` needed) in ``--adapter-dir``. Both runs use the
same engine (``--enable-lora --max-loras 4``), so the no-adapter run also shows what enabling
LoRA costs when no request uses one. Decode steps replay CUDA graphs in both runs (those with
adapters stage their rows into the LoRA graph inputs); prefill steps run eagerly.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def write_adapter(folder: Path, hf_config, rank: int, seed: int) -> Path:
    """A random LoRA of every adaptable projection, in PEFT's file format."""
    from octavo.lora.peft import SUPPORTED_MODULES, expected_shapes
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(hf_config.num_hidden_layers):
        for module, (fan_in, fan_out) in expected_shapes(hf_config).items():
            part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            name = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{name}.lora_A.weight"] = (
                torch.randn(rank, fan_in, generator=gen) / fan_in ** 0.5).to(torch.bfloat16)
            tensors[f"{name}.lora_B.weight"] = (
                torch.randn(fan_out, rank, generator=gen) * 0.01).to(torch.bfloat16)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
        "target_modules": list(SUPPORTED_MODULES), "bias": "none"}))
    return folder


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--num-adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--adapter-dir", default="/tmp/octavo-lora-adapters")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    args = parser.parse_args()

    from octavo import LLM, LoRARequest
    from octavo.cli.bench import _throughput_params, make_workload
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(args.model)
    adapters = [LoRARequest(f"adapter{i}", i + 1, str(write_adapter(
        Path(args.adapter_dir) / f"r{args.rank}-{i}", hf_config, args.rank, seed=i)))
        for i in range(args.num_adapters)]
    llm = LLM(args.model, dtype="bfloat16", load_format=args.load_format,
              max_num_seqs=args.max_num_seqs, enable_lora=True, max_loras=args.num_adapters,
              max_lora_rank=args.rank)
    vocab = min(len(llm.get_tokenizer()), hf_config.vocab_size)
    workload = make_workload(args.num_prompts, (100, 1024), (100, 1024), vocab, seed=0)
    params = _throughput_params(workload.output_lens, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in workload.prompts]
    # Warm-up (kernels compiled, graphs captured) with and without adapters, untimed.
    warm = min(8, len(prompts))
    llm.generate(prompts[:warm], params[:warm], use_tqdm=False,
                 lora_request=[adapters[i % len(adapters)] for i in range(warm)])
    llm.llm_engine.engine_core.scheduler.kv_cache_manager.reset_prefix_cache()
    results = {}
    for label, loras in [("no adapter", None),
                         (f"{len(adapters)} adapters round-robin",
                          [adapters[i % len(adapters)] for i in range(len(prompts))])]:
        llm.llm_engine.engine_core.scheduler.kv_cache_manager.reset_prefix_cache()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        elapsed = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        results[label] = tokens / elapsed
        print(f"{label:<28} {tokens:,} output tokens in {elapsed:.1f} s: "
              f"{tokens / elapsed:,.0f} output tok/s", flush=True)
    base, lora = results["no adapter"], list(results.values())[1]
    print(f"with adapters: {lora / base:.2f}x the no-adapter throughput", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
