"""``apply_token_bitmask`` (``octavo.kernels.triton.token_bitmask``): a step's grammar bitmask
applied in one kernel, equal to the torch ops it replaces (``mask_by_bitmask_reference``), under
the interpreter here and compiled on a GPU; and ``mask_by_bitmask``'s choice between them."""

from __future__ import annotations

import pytest
import torch
from octavo.kernels.triton.token_bitmask import BLOCK, apply_token_bitmask
from octavo.sample import sampler
from octavo.sample.sampler import mask_by_bitmask_reference

from tests.kernels.conftest import DEVICE


def random_case(rows: int, vocab: int, num_words: int, dtype: torch.dtype, seed: int,
                device: str = DEVICE) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g).to(dtype).to(device)
    words = torch.randint(-(2**31), 2**31 - 1, (rows, num_words), generator=g,
                          dtype=torch.int64).to(torch.int32).to(device)
    return logits, words


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab, num_words", [
    (100, 4),  # the mask's last word covers the vocabulary's tail
    (BLOCK + 37, (BLOCK + 37 + 31) // 32),  # two programs, the second mostly past the vocabulary
    (70, 2),  # a mask shorter than the vocabulary: tokens 64.. refused
])
def test_every_row_in_order_equals_the_torch_ops(dtype, vocab, num_words):
    logits, words = random_case(3, vocab, num_words, dtype, seed=vocab)
    want = logits.clone()
    mask_by_bitmask_reference(want, None, words)
    apply_token_bitmask(logits, None, words)
    assert torch.equal(logits, want)
    if 32 * num_words < vocab:
        assert torch.isinf(logits[:, 32 * num_words:]).all()


def test_rows_by_id_leave_the_other_rows_alone():
    logits, _ = random_case(5, 300, 10, torch.float32, seed=3)
    _, words = random_case(2, 300, 10, torch.float32, seed=4)
    row_ids = torch.tensor([4, 1], device=DEVICE)
    want = logits.clone()
    mask_by_bitmask_reference(want, row_ids, words)
    apply_token_bitmask(logits, row_ids, words)
    assert torch.equal(logits, want)
    assert not torch.isinf(logits[[0, 2, 3]]).any()


def test_a_row_strided_logits_view_and_an_empty_mask():
    base, words = random_case(4, 256, 8, torch.float32, seed=5)
    view = base[:, :200]  # row stride 256, unit stride along the vocabulary
    want = view.clone()
    mask_by_bitmask_reference(want, None, words)
    apply_token_bitmask(view, None, words)
    assert torch.equal(view, want)
    untouched = base[:, 200:].clone()
    assert torch.equal(base[:, 200:], untouched)
    apply_token_bitmask(view, torch.empty(0, dtype=torch.long, device=DEVICE),
                        words[:0])  # no constrained row: nothing to do
    assert torch.equal(view, want)


@pytest.mark.parametrize("logits, words, row_ids, message", [
    (torch.zeros(2, 64).t(), torch.zeros(64, 2, dtype=torch.int32), None, "unit stride"),
    (torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.int64), None, "int32"),
    (torch.zeros(3, 64), torch.zeros(2, 2, dtype=torch.int32), None, "needs row_ids"),
    (torch.zeros(3, 64), torch.zeros(2, 2, dtype=torch.int32), torch.tensor([0]), "row_ids"),
])
def test_bad_operands_are_refused(logits, words, row_ids, message):
    with pytest.raises(ValueError, match=message):
        apply_token_bitmask(logits, row_ids, words)


def test_mask_by_bitmask_takes_the_kernel_on_cuda_only(monkeypatch):
    calls = []

    class Kernel:
        @staticmethod
        def apply_token_bitmask(logits, row_ids, bitmask):
            calls.append(logits.device.type)

    monkeypatch.setattr(sampler, "_bitmask_kernel", lambda: Kernel)
    logits, words = random_case(2, 64, 2, torch.float32, seed=6, device="cpu")
    want = logits.clone()
    mask_by_bitmask_reference(want, None, words)
    sampler.mask_by_bitmask(logits, None, words)  # the CPU: the torch ops
    assert calls == [] and torch.equal(logits, want)
    fake_cuda = torch.empty(0, device="meta")
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: torch.device("cuda")))
    sampler.mask_by_bitmask(fake_cuda, None, words)
    assert calls == ["cuda"]


def test_the_switch_turns_the_kernel_off(monkeypatch):
    sampler._bitmask_kernel.cache_clear()
    try:
        monkeypatch.setenv("OCTAVO_BITMASK_KERNEL", "0")
        assert sampler._bitmask_kernel() is None
        sampler._bitmask_kernel.cache_clear()
        monkeypatch.delenv("OCTAVO_BITMASK_KERNEL")
        assert sampler._bitmask_kernel() is not None
    finally:
        sampler._bitmask_kernel.cache_clear()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_at_a_full_batch_of_a_49k_vocabulary_on_gpu(dtype):
    """256 rows of SmolLM2's vocabulary (JSON W1's step), all rows and a subset by id."""
    vocab = 49152
    logits, words = random_case(256, vocab, vocab // 32, dtype, seed=7, device="cuda")
    for row_ids in (None, torch.arange(0, 256, 3, device="cuda")):
        k = 256 if row_ids is None else len(row_ids)
        got, want = logits.clone(), logits.clone()
        mask_by_bitmask_reference(want, row_ids, words[:k])
        apply_token_bitmask(got, row_ids, words[:k])
        assert torch.equal(got, want)
