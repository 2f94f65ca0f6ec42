"""Each rank builds and loads only its part of the model: its slices of every split weight,
read from the checkpoint as slices (no rank reads a whole split weight), or random values of
the right shapes with load_format="dummy". Built without process groups: only forwards need
them."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from octavo.attention.reference import ReferenceAttentionBackend
from octavo.distributed.parallel_state import ParallelRanks, ParallelState
from octavo.engine.arg_utils import EngineArgs
from octavo.model_executor import model_loader
from octavo.model_executor.loader import safetensors_loader
from octavo.plugins import get_plugin_manager

from tests.helpers.engine import greedy, make_llm


def build(folder, rank: int = 0, tp: int = 1, pp: int = 1, **args):
    config = EngineArgs(model=str(folder), device="cpu", dtype="float32", **args)
    model_config = config.create_engine_config().model_config
    parallel = ParallelState(ParallelRanks(rank, tp, pp))
    return model_config, model_loader.build_model(
        model_config, ReferenceAttentionBackend(), torch.device("cpu"), get_plugin_manager(),
        parallel)


def test_each_rank_loads_its_slices_and_nothing_whole(tiny_llama, monkeypatch):
    whole_reads = []
    real_load = safetensors_loader.SafetensorsSlice.load

    def counting_load(self):
        whole_reads.append(tuple(self.shape))
        return real_load(self)

    monkeypatch.setattr(safetensors_loader.SafetensorsSlice, "load", counting_load)
    model_config, full = build(tiny_llama)
    full.load_weights(model_loader.iterate_weights(model_config))  # eager, whole tensors
    ranks = []
    for rank in range(2):
        model_config, model = build(tiny_llama, rank=rank, tp=2)
        model.load_weights(model_loader.iterate_weights(model_config, lazy=True))
        ranks.append(dict(model.named_parameters()))
    # Only replicated parameters (norms) are read whole.
    assert whole_reads and all(len(shape) == 1 for shape in whole_reads), whole_reads
    full_params = dict(full.named_parameters())
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    # rank r holds q heads 2r..2r+1 and KV head r (4 heads, 2 KV heads, head_dim 16).
    for rank, params in enumerate(ranks):
        q, k, v = params[qkv].split([32, 16, 16])
        fq, fk, fv = full_params[qkv].split([64, 32, 32])
        assert torch.equal(q, fq[rank * 32:(rank + 1) * 32])
        assert torch.equal(k, fk[rank * 16:(rank + 1) * 16])
        assert torch.equal(v, fv[rank * 16:(rank + 1) * 16])
    down = "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(torch.cat([ranks[0][down], ranks[1][down]], dim=1), full_params[down])
    embed = "model.embed_tokens.weight"
    assert torch.equal(torch.cat([ranks[0][embed], ranks[1][embed]])[: full_params[embed].shape[0]],
                       full_params[embed])
    norm = "model.norm.weight"
    assert torch.equal(ranks[0][norm], full_params[norm]) and torch.equal(ranks[1][norm],
                                                                          full_params[norm])
    per_rank = sum(p.numel() for p in ranks[0].values())
    assert per_rank < 0.6 * sum(p.numel() for p in full_params.values())


def test_pipeline_stages_build_only_their_layers(tiny_llama):
    _, first = build(tiny_llama, rank=0, pp=2)
    _, last = build(tiny_llama, rank=1, pp=2)
    assert list(first.model.layers) == ["0"] and list(last.model.layers) == ["1"]
    assert first.model.embed_tokens is not None and first.lm_head is None
    assert last.model.embed_tokens is None and last.model.norm is not None
    assert last.lm_head is not None


@pytest.fixture
def config_only(tiny_llama, tmp_path):
    """The tiny model's config and tokenizer, without its weights."""
    folder = tmp_path / "shape-only"
    shutil.copytree(tiny_llama, folder)
    for weights in folder.glob("*.safetensors"):
        weights.unlink()
    assert json.loads((folder / "config.json").read_text())["num_hidden_layers"] == 2
    return folder


def test_dummy_weights_need_no_checkpoint(config_only):
    with pytest.raises(FileNotFoundError, match="no safetensors weights"):
        make_llm(config_only, device="cpu")
    _, model = build(config_only, rank=1, tp=2, load_format="dummy")
    model_loader.fill_dummy_weights(model)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    llm = make_llm(config_only, device="cpu", load_format="dummy", tensor_parallel_size=2)
    try:
        out = llm.generate("Hello", greedy(6), use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) == 6
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_each_rank_loads_its_slice_of_every_expert(tiny_model_factory, arch):
    """Every rank holds every expert, cut along the intermediate dim: gate and up rows, down
    columns (and the shared expert likewise); the router is whole on each rank."""
    folder = tiny_model_factory(arch)
    model_config, full = build(folder)
    full.load_weights(model_loader.iterate_weights(model_config))
    full_params = dict(full.named_parameters())
    ranks = []
    for rank in range(2):
        model_config, model = build(folder, rank=rank, tp=2)
        model.load_weights(model_loader.iterate_weights(model_config, lazy=True))
        ranks.append(dict(model.named_parameters()))
    w13, w2 = "model.layers.1.mlp.experts.w13_weight", "model.layers.1.mlp.experts.w2_weight"
    full_gate, full_up = full_params[w13].chunk(2, dim=1)  # [E, I, H] each
    local = full_gate.shape[1] // 2
    for rank, params in enumerate(ranks):
        gate, up = params[w13].chunk(2, dim=1)
        assert torch.equal(gate, full_gate[:, rank * local:(rank + 1) * local])
        assert torch.equal(up, full_up[:, rank * local:(rank + 1) * local])
        assert torch.equal(params["model.layers.1.mlp.gate.weight"],
                           full_params["model.layers.1.mlp.gate.weight"])
    assert torch.equal(torch.cat([ranks[0][w2], ranks[1][w2]], dim=2), full_params[w2])
    if arch == "qwen2_moe":
        down = "model.layers.0.mlp.shared_expert.down_proj.weight"
        assert torch.equal(torch.cat([ranks[0][down], ranks[1][down]], dim=1), full_params[down])
