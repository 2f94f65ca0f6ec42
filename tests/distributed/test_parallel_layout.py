"""How a model is split: ranks, stages, shards, KV-head replication, and the configurations
refused before anything loads (pure functions; no process group)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch
from octavo.distributed.parallel_state import ParallelRanks, ParallelState
from octavo.model_executor.layers.linear import local_kv_heads, qkv_parallel
from octavo.model_executor.loader.safetensors_loader import iterate_safetensors_weights
from octavo.model_executor.models.llama import stage_layers


def state(rank: int, tp: int = 1, pp: int = 1) -> ParallelState:
    return ParallelState(ParallelRanks(rank, tp, pp))


def test_ranks_form_a_grid_of_stages_by_tensor_parallel_ranks():
    grid = [ParallelRanks(r, tp_size=2, pp_size=3) for r in range(6)]
    assert [(r.pp_rank, r.tp_rank) for r in grid] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0),
                                                       (2, 1)]
    assert [r.rank for r in grid if r.is_output_rank] == [4]
    assert grid[3].tp_group_ranks() == [2, 3] and grid[3].pp_group_ranks() == [1, 3, 5]
    with pytest.raises(ValueError, match="outside a world of 6"):
        ParallelRanks(6, 2, 3)


def test_layers_split_evenly_over_stages():
    ranges = [stage_layers(10, state(r, pp=4)) for r in range(4)]
    assert [list(r) for r in ranges] == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    with pytest.raises(ValueError, match="3 layers cannot be split into 4"):
        stage_layers(3, state(0, pp=4))


@pytest.mark.parametrize("num_kv_heads, tp, heads_per_rank, first_head", [
    (8, 2, 4, [0, 4]),   # split
    (2, 4, 1, [0, 0, 1, 1]),  # fewer KV heads than ranks: each replicated twice
    (1, 2, 1, [0, 0]),   # multi-query: on every rank
])
def test_kv_heads_split_or_replicate(num_kv_heads, tp, heads_per_rank, first_head):
    assert local_kv_heads(num_kv_heads, tp) == heads_per_rank
    head_dim = 16
    for rank in range(tp):
        layer = qkv_parallel(64, head_dim, 8, num_kv_heads, False, state(rank, tp=tp))
        q, k, v = layer.shards
        assert (q.start, q.size) == (rank * 8 // tp * head_dim, 8 // tp * head_dim)
        assert k.start == v.start == first_head[rank] * head_dim
        assert k.size == heads_per_rank * head_dim
        assert tuple(layer.weight.shape) == (q.size + 2 * k.size, 64)


def test_a_kv_head_count_that_does_not_split_is_refused_at_start_up():
    from types import SimpleNamespace

    from octavo.distributed.checks import check_parallel_config

    config = SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=4, pipeline_parallel_size=1,
                                        distributed_executor_backend="mp", world_size=4),
        model_config=SimpleNamespace(num_heads=12, num_kv_heads=6, num_layers=2))
    with pytest.raises(ValueError, match="6 KV heads: --tensor-parallel-size 4 must divide them"):
        check_parallel_config(config, "cpu")


def test_a_kv_head_count_that_does_not_split_is_refused():
    with pytest.raises(ValueError, match=r"tensor_parallel_size.* \(3\) is not divisible by 2"):
        local_kv_heads(2, 3)
    with pytest.raises(ValueError, match=r"number of KV heads \(6\) is not divisible by 4"):
        local_kv_heads(6, 4)


def test_lazy_safetensors_read_only_the_asked_slice(tiny_llama):
    lazy = dict(iterate_safetensors_weights(tiny_llama, lazy=True))
    eager = dict(iterate_safetensors_weights(tiny_llama))
    name = "model.layers.0.mlp.down_proj.weight"
    # The lazy view is read inside the iteration in real loading; the handle is closed after.
    for got_name, tensor in iterate_safetensors_weights(tiny_llama, lazy=True):
        if got_name == name:
            assert tensor.shape == tuple(eager[name].shape)
            assert torch.equal(tensor.narrow(1, 32, 32), eager[name][:, 32:64])
            assert torch.equal(tensor.load(), eager[name])
    assert set(lazy) == set(eager)


@pytest.mark.parametrize("flags, message", [
    (["--tensor-parallel-size", "3"], "4 attention heads, which do not split over "
                                      "--tensor-parallel-size 3"),
    (["-tp", "8"], "4 attention heads, which do not split over --tensor-parallel-size 8"),
    (["-pp", "3"], "2 layers, fewer than --pipeline-parallel-size 3"),
    (["--distributed-executor-backend", "uni", "-tp", "2"], "the uni executor runs one rank"),
])
def test_bad_splits_are_one_line_before_loading(tiny_llama, flags, message):
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "octavo.cli.main", "generate", "Hi", "--model", str(tiny_llama),
         "--device", "cpu", *flags], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    last = [line for line in done.stderr.splitlines() if line.strip()][-1]
    assert last.startswith("octavo generate: error: ") and message in last, last
    assert "weights:" not in done.stderr  # nothing was loaded
    assert time.monotonic() - started < 60


def test_an_unreachable_ray_cluster_is_one_line(tiny_llama):
    import os

    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "octavo.cli.main", "generate", "Hi", "--model", str(tiny_llama),
         "--device", "cpu", "-tp", "2", "--distributed-executor-backend", "ray"],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "RAY_ADDRESS": "127.0.0.1:1"})
    assert done.returncode == 1, done.stderr
    last = [line for line in done.stderr.splitlines() if line.strip()][-1]
    assert last.startswith("octavo generate: error: cannot reach a Ray cluster at '127.0.0.1:1'")
    assert "ray start --head" in last and time.monotonic() - started < 60
