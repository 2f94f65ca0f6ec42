"""The Triton wrappers of the eager step check their inputs with one cheap expression per call
and build the detailed ``ValueError`` only when it fails: every wrong input still fails with
its message (never the ``AssertionError`` that says the two checks disagree), and the
host-side helpers that replace Triton's constexpr functions compute what Triton's do."""

from __future__ import annotations

import pytest
import torch
import triton

from octavo.kernels.triton.activation import silu_and_mul
from octavo.kernels.triton.cache_write import (
    KERNELS_INTERPRETED,
    cdiv,
    check_attention_inputs,
    interpreting,
    next_power_of_2,
    write_kv_cache,
)
from octavo.kernels.triton.rmsnorm import emulate_bf16_rounding, fused_add_rms_norm, rms_norm
from octavo.kernels.triton.rotary import apply_rotary
from tests.kernels.conftest import DEVICE, HAS_CUDA

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, TOKENS = 32, 4, 2, 16, 5


def _t(*shape, dtype=torch.float32, device=DEVICE):
    return torch.zeros(*shape, dtype=dtype, device=device)


def _strided_last(*shape):
    """A tensor of ``shape`` whose last dimension has stride 2."""
    return _t(*shape[:-1], 2 * shape[-1])[..., ::2]


x, w = _t(TOKENS, HIDDEN), _t(HIDDEN)
NORM_CASES = [
    ("weight shape", lambda: rms_norm(x, _t(HIDDEN - 1), 1e-6)),
    ("weight is on meta", lambda: rms_norm(x, _t(HIDDEN, device="meta"), 1e-6)),
    ("x needs a contiguous", lambda: rms_norm(_strided_last(TOKENS, HIDDEN), w, 1e-6)),
    ("weight needs a contiguous", lambda: rms_norm(x, _strided_last(HIDDEN), 1e-6)),
    ("residual shape", lambda: fused_add_rms_norm(x, _t(TOKENS + 1, HIDDEN), w, 1e-6)),
    ("residual is on meta", lambda: fused_add_rms_norm(x, _t(TOKENS, HIDDEN, device="meta"), w,
                                                      1e-6)),
    ("residual needs a contiguous", lambda: fused_add_rms_norm(
        x, _strided_last(TOKENS, HIDDEN), w, 1e-6)),
]

q, k = _t(TOKENS, HEADS, HEAD_DIM), _t(TOKENS, KV_HEADS, HEAD_DIM)
pos, cos_sin = _t(TOKENS, dtype=torch.int64), _t(64, HEAD_DIM)
ROTARY_CASES = [
    ("query shape", lambda: apply_rotary(pos, q[0], k, cos_sin)),
    ("key shape .* != \\[5, num_kv_heads, 16\\]", lambda: apply_rotary(pos, q, k[:4], cos_sin)),
    ("key shape .*, 16\\]$", lambda: apply_rotary(pos, q, _t(TOKENS, KV_HEADS, 8), cos_sin)),
    ("key shape", lambda: apply_rotary(pos, q, k[0], cos_sin)),
    ("positions shape", lambda: apply_rotary(pos[:4], q, k, cos_sin)),
    ("cos_sin_cache shape", lambda: apply_rotary(pos, q, k, _t(64, 8))),
    ("cos_sin_cache shape .* \\[max_positions", lambda: apply_rotary(pos, q, k, _t(64))),
    ("head_dim must be even", lambda: apply_rotary(
        pos, _t(TOKENS, HEADS, 5), _t(TOKENS, KV_HEADS, 5), _t(64, 5))),
    ("positions is on meta", lambda: apply_rotary(pos.to("meta"), q, k, cos_sin)),
    ("key is on meta", lambda: apply_rotary(pos, q, k.to("meta"), cos_sin)),
    ("cos_sin_cache is on meta", lambda: apply_rotary(pos, q, k, cos_sin.to("meta"))),
    ("query needs a contiguous", lambda: apply_rotary(
        pos, _strided_last(TOKENS, HEADS, HEAD_DIM), k, cos_sin)),
    ("key needs a contiguous", lambda: apply_rotary(
        pos, q, _strided_last(TOKENS, KV_HEADS, HEAD_DIM), cos_sin)),
    ("cos_sin_cache needs a contiguous", lambda: apply_rotary(
        pos, q, k, _strided_last(64, HEAD_DIM))),
]

ACTIVATION_CASES = [
    ("even last dimension", lambda: silu_and_mul(_t(TOKENS, 7))),
    ("even last dimension", lambda: silu_and_mul(torch.tensor(1.0, device=DEVICE))),
    ("x needs a contiguous", lambda: silu_and_mul(_strided_last(TOKENS, 8))),
]

cache = _t(2, 4, 4, KV_HEADS, HEAD_DIM)
slots = _t(TOKENS, dtype=torch.int64)
WRITE_CASES = [
    ("value shape", lambda: write_kv_cache(k, k[:4], cache, slots)),
    ("kv_cache shape", lambda: write_kv_cache(k, k, cache[0], slots)),
    ("kv_cache shape", lambda: write_kv_cache(k, k, _t(3, 4, 4, KV_HEADS, HEAD_DIM), slots)),
    ("kv_cache shape", lambda: write_kv_cache(k, k, _t(2, 4, 4, KV_HEADS + 1, HEAD_DIM), slots)),
    ("slot_mapping shape", lambda: write_kv_cache(k, k, cache, slots[:4])),
    ("key needs a contiguous", lambda: write_kv_cache(
        _strided_last(TOKENS, KV_HEADS, HEAD_DIM), k, cache, slots)),
    ("value needs a contiguous", lambda: write_kv_cache(
        k, _strided_last(TOKENS, KV_HEADS, HEAD_DIM), cache, slots)),
    ("kv_cache needs a contiguous", lambda: write_kv_cache(
        k, k, _strided_last(2, 4, 4, KV_HEADS, HEAD_DIM), slots)),
]

tables, lens, starts = _t(2, 3, dtype=torch.int32), _t(2, dtype=torch.int32), _t(
    3, dtype=torch.int32)
ATTENTION_CASES = [
    ("kv_cache shape", lambda: check_attention_inputs(q, cache[0], tables, lens, starts)),
    ("kv_cache shape", lambda: check_attention_inputs(
        q, _t(2, 4, 4, KV_HEADS, 8), tables, lens, starts)),
    ("multiple of num_kv_heads", lambda: check_attention_inputs(
        q, _t(2, 4, 4, 3, HEAD_DIM), tables, lens, starts)),
    ("block_tables shape", lambda: check_attention_inputs(q, cache, tables[0], lens, starts)),
    ("block_tables shape", lambda: check_attention_inputs(q, cache, tables[:1], lens, starts)),
    ("query_start_loc shape", lambda: check_attention_inputs(q, cache, tables, lens, starts[:2])),
    ("query_start_loc shape", lambda: check_attention_inputs(
        q, cache, tables, lens, starts.view(1, 3))),
    ("query needs a contiguous", lambda: check_attention_inputs(
        _strided_last(TOKENS, HEADS, HEAD_DIM), cache, tables, lens, starts)),
    ("kv_cache needs a contiguous", lambda: check_attention_inputs(
        q, _strided_last(2, 4, 4, KV_HEADS, HEAD_DIM), tables, lens, starts)),
    ("block_tables needs a contiguous", lambda: check_attention_inputs(
        q, cache, _strided_last(2, 3), lens, starts)),
]

# (wrapper, the message expected, the call)
ALL_CASES = [(group, match, call) for group, cases in (
    ("rmsnorm", NORM_CASES), ("rotary", ROTARY_CASES), ("activation", ACTIVATION_CASES),
    ("write_kv_cache", WRITE_CASES), ("attention", ATTENTION_CASES)) for match, call in cases]


@pytest.mark.parametrize(("group", "match", "call"), ALL_CASES,
                         ids=[f"{group}-{i}" for i, (group, _, _) in enumerate(ALL_CASES)])
def test_wrong_inputs_fail_with_their_message(group: str, match: str, call) -> None:
    with pytest.raises(ValueError, match=match):
        call()


def test_right_inputs_pass_the_checks() -> None:
    check_attention_inputs(q, cache, tables, lens, starts)
    write_kv_cache(k, k, cache, slots)
    assert silu_and_mul(_t(TOKENS, 8)).shape == (TOKENS, 4)
    assert apply_rotary(pos, q, k, cos_sin)[0].shape == q.shape
    assert rms_norm(x, w, 1e-6).shape == x.shape


def test_host_helpers_are_tritons() -> None:
    for n in range(0, 5000):
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
    for n in range(0, 300):
        for d in (1, 2, 3, 16, 64, 100):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)


def test_interpreted_kernels_are_known_once() -> None:
    # Triton chose the interpreter when the kernels were defined (conftest set the variable
    # first when there is no GPU); the constant says so, and the bf16 emulation follows it.
    assert KERNELS_INTERPRETED == (not HAS_CUDA) == interpreting()
    assert emulate_bf16_rounding() == KERNELS_INTERPRETED
