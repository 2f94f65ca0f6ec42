"""The two-kernel greedy argmax (``octavo.kernels.triton.argmax``) against
``torch.argmax(dim=-1)``: under the interpreter at real vocabulary sizes (ties inside and
across chunks, rows of ``-inf``, strided rows, three dtypes), the dispatch in
``octavo.kernels.argmax``, and on the GPU eagerly and after the LM head's matmul."""

from __future__ import annotations

import pytest
import torch
from octavo.kernels.argmax import MAX_KERNEL_ROWS
from octavo.kernels.argmax import argmax_rows as dispatch_argmax
from octavo.kernels.triton.argmax import BLOCK, argmax_rows

from tests.kernels.conftest import DEVICE

VOCABS = [151_936, 128_256, 32_000, 100, BLOCK, BLOCK + 1]


def logits_for(rows: int, vocab: int, dtype: torch.dtype, seed: int = 0,
               device: str = DEVICE) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=gen) * 4).to(device=device, dtype=dtype)


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_matches_torch_argmax(vocab, dtype):
    logits = logits_for(3, vocab, dtype, seed=vocab)
    assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))


def test_ties_take_the_first_index_inside_and_across_chunks():
    logits = torch.zeros(4, 3 * BLOCK + 5, device=DEVICE, dtype=torch.bfloat16)
    logits[0, [7, 9]] = 3.0  # two maxima in one chunk
    logits[1, [BLOCK + 2, 2 * BLOCK + 1]] = 3.0  # in two chunks
    logits[2, [3 * BLOCK + 4, 5]] = 3.0  # the later one in the short last chunk
    logits[3] = float("-inf")  # nothing but -inf: torch answers 0
    out = argmax_rows(logits)
    assert out.tolist() == [7, BLOCK + 2, 5, 0] == logits.argmax(dim=-1).tolist()
    assert out.dtype == torch.int64


def test_strided_rows_and_no_rows():
    wide = logits_for(4, 2 * 40_000, torch.bfloat16, seed=1)
    rows = wide[:, :40_000]  # row stride 80,000: a view of the LM head's padded output
    assert torch.equal(argmax_rows(rows), rows.argmax(dim=-1))
    assert argmax_rows(wide[:0]).shape == (0,)


def test_a_nan_row_gets_a_nans_index():
    logits = logits_for(1, 20_000, torch.float32, seed=2)
    logits[0, [11, 15_000]] = float("nan")
    assert argmax_rows(logits).item() in (11, 15_000)


@pytest.mark.parametrize("bad", ["one dim", "strided logits", "no logits"])
def test_bad_logits_are_refused(bad):
    logits = logits_for(2, 64, torch.float32)
    if bad == "one dim":
        logits = logits[0]
    elif bad == "strided logits":
        logits = logits[:, ::2]
    else:
        logits = logits[:, :0]
    with pytest.raises(ValueError, match="argmax_rows"):
        argmax_rows(logits)


def test_dispatch_is_torchs_off_the_gpu():
    logits = logits_for(2, 1_000, torch.bfloat16, device="cpu")
    assert torch.equal(dispatch_argmax(logits), logits.argmax(dim=-1))


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 4, MAX_KERNEL_ROWS, MAX_KERNEL_ROWS + 1])
@pytest.mark.parametrize("vocab", [151_936, 128_256])
def test_after_the_lm_head_on_gpu(rows, vocab):
    gen = torch.Generator(device="cuda").manual_seed(rows)
    hidden = torch.randn(rows, 896, device="cuda", generator=gen).to(torch.bfloat16)
    head = torch.randn(vocab, 896, device="cuda", generator=gen).mul_(0.05).to(torch.bfloat16)
    for _ in range(3):
        logits = hidden @ head.T
        assert torch.equal(dispatch_argmax(logits), logits.argmax(dim=-1))
        hidden.normal_(generator=gen)
