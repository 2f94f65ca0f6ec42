"""``GrammarMaskUpload``: the greedy path's grammar masks, from the engine core's buffer to the
logits' device, by logits row; on a GPU through two pinned staging buffers used in turn."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from octavo.messages import GrammarBitmask
from octavo.sample.sampler import mask_by_bitmask, unpack_bitmask
from octavo.worker.grammar_masks import GrammarMaskUpload

VOCAB = 100
WORDS = (VOCAB + 31) // 32

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def random_bitmask(req_ids: list[str], seed: int, readonly: bool = False) -> GrammarBitmask:
    rng = np.random.default_rng(seed)
    rows = rng.integers(-(2**31), 2**31 - 1, size=(len(req_ids), WORDS), dtype=np.int32)
    data = rows.astype("<i4").tobytes()
    return GrammarBitmask(req_ids=list(req_ids), num_words=WORDS,
                          data=memoryview(data if readonly else bytearray(data)))


def rows_of(bitmask: GrammarBitmask) -> torch.Tensor:
    """The bitmask's rows as an int32 tensor (a copy, on the host)."""
    data = np.frombuffer(bitmask.data, dtype="<i4").reshape(len(bitmask.req_ids), WORDS)
    return torch.from_numpy(data.copy())


def reference_masked(logits: torch.Tensor, bitmask: GrammarBitmask,
                     sampled_req_ids: list[str]) -> torch.Tensor:
    """The logits each sampled request's row of ``bitmask`` leaves, one row at a time."""
    out = logits.clone()
    allowed = unpack_bitmask(rows_of(bitmask), logits.shape[1])
    for i, req_id in enumerate(bitmask.req_ids):
        if req_id in sampled_req_ids:
            row = sampled_req_ids.index(req_id)
            out[row] = out[row].masked_fill(~allowed[i], float("-inf"))
    return out


@pytest.mark.parametrize("readonly", [False, True])
def test_the_rows_of_every_sampled_request_in_order_take_no_row_ids(readonly: bool) -> None:
    ids = ["a", "b", "c"]
    bitmask = random_bitmask(ids, seed=1, readonly=readonly)
    masks = GrammarMaskUpload(torch.device("cpu"), max_rows=4).upload(bitmask, list(ids))
    assert masks is not None and masks.row_ids is None
    assert torch.equal(masks.bitmask, rows_of(bitmask))


def test_rows_of_some_sampled_requests_name_their_logits_rows() -> None:
    # "gone" finished while its step was in flight; "b" and "d" sample without a mask.
    bitmask = random_bitmask(["c", "gone", "a"], seed=2)
    sampled = ["a", "b", "c", "d"]
    masks = GrammarMaskUpload(torch.device("cpu"), max_rows=4).upload(bitmask, sampled)
    assert masks is not None and masks.row_ids is not None
    assert masks.row_ids.tolist() == [2, 0]
    assert torch.equal(masks.bitmask, rows_of(bitmask)[[0, 2]])


def test_no_masks_when_none_of_the_requests_samples() -> None:
    bitmask = random_bitmask(["x", "y"], seed=3)
    assert GrammarMaskUpload(torch.device("cpu"), max_rows=4).upload(bitmask, ["a"]) is None


@pytest.mark.parametrize("sampled", [["a", "b", "c"], ["c", "z", "a", "b"], ["b"]])
def test_masked_logits_equal_the_row_by_row_reference(sampled: list[str]) -> None:
    bitmask = random_bitmask(["a", "b", "c"], seed=4)
    logits = torch.randn(len(sampled), VOCAB, generator=torch.Generator().manual_seed(4))
    want = reference_masked(logits, bitmask, sampled)
    masks = GrammarMaskUpload(torch.device("cpu"), max_rows=4).upload(bitmask, sampled)
    assert masks is not None
    mask_by_bitmask(logits, masks.row_ids, masks.bitmask)
    assert torch.equal(logits, want)


def test_logits_rows_place_each_mask_on_its_requests_row() -> None:
    # Speculative verification: "a" has two draft rows before "b"'s row; "c" is not
    # constrained, "gone" finished while its step was in flight.
    bitmask = random_bitmask(["b", "gone", "a"], seed=6)
    masks = GrammarMaskUpload(torch.device("cpu"), max_rows=4).upload(
        bitmask, ["a", "b", "c"], logits_rows=[0, 3, 4])
    assert masks is not None and masks.row_ids is not None
    assert masks.row_ids.tolist() == [3, 0]
    assert torch.equal(masks.bitmask, rows_of(bitmask)[[0, 2]])
    # Rows named even when they are every sampled request in order (the logits have more).
    same = random_bitmask(["a", "b"], seed=7)
    masks = GrammarMaskUpload(torch.device("cpu"), max_rows=4).upload(
        same, ["a", "b"], logits_rows=[0, 1])
    assert masks is not None and masks.row_ids is not None and masks.row_ids.tolist() == [0, 1]


@pytest.mark.gpu
@needs_cuda
def test_on_the_gpu_the_sampler_path_takes_the_staged_masks() -> None:
    """Sampled (non-greedy) rows with staged masks: every token is one its row allows, and
    the tokens equal those of the same rows given to the sampler as host rows."""
    from octavo.sample import GrammarRows, Sampler
    from octavo.sample.metadata import SamplingRow
    from octavo.sampling_params import SamplingParams

    device = torch.device("cuda")
    upload = GrammarMaskUpload(device, max_rows=2)
    ids = ["a", "b", "c", "d"]
    for seed, (constrained, sampled) in enumerate([(ids, ids), (["d", "b"], ids)]):
        bitmask = random_bitmask(constrained, seed=20 + seed)
        logits = torch.randn(len(sampled), VOCAB, device=device,
                             generator=torch.Generator(device).manual_seed(seed))
        rows = [SamplingRow(SamplingParams(temperature=1.0, seed=i), [1, 2], [])
                for i in range(len(sampled))]
        masks = upload.upload(bitmask, sampled)
        assert masks is not None and masks.bitmask.device.type == "cuda"
        got = Sampler()(logits, rows, masks).sampled_token_ids.tolist()
        host_rows = [sampled.index(r) for r in constrained]
        want = Sampler()(logits, rows, GrammarRows(host_rows, rows_of(bitmask)))
        assert got == want.sampled_token_ids.tolist()
        allowed = unpack_bitmask(rows_of(bitmask), VOCAB)
        for i, row in enumerate(host_rows):
            assert allowed[i, got[row]]


@pytest.mark.gpu
@needs_cuda
def test_on_the_gpu_staged_masks_equal_the_host_rows_step_after_step() -> None:
    """Steps in a row, some with every row and some with a subset, more rows than the
    staging buffers were made for: each step's masked logits equal the CPU reference, also
    after the engine core's buffer is reused and after two later steps reused the staging
    buffer it went through."""
    device = torch.device("cuda")
    upload = GrammarMaskUpload(device, max_rows=3)
    generator = torch.Generator().manual_seed(5)
    steps = [(["a", "b", "c"], ["a", "b", "c"]), (["c", "a"], ["a", "b", "c", "d"]),
             (["a", "b", "c", "d", "e"], ["a", "b", "c", "d", "e"]), (["e"], ["d", "e"]),
             (["a", "b"], ["a", "b"])]
    results = []
    for seed, (ids, sampled) in enumerate(steps):
        bitmask = random_bitmask(ids, seed=10 + seed)
        logits = torch.randn(len(sampled), VOCAB, generator=generator)
        want = reference_masked(logits, bitmask, sampled)
        on_device = logits.to(device)
        masks = upload.upload(bitmask, sampled)
        assert masks is not None and masks.bitmask.device.type == "cuda"
        assert (masks.row_ids is None) == (ids == sampled)
        mask_by_bitmask(on_device, masks.row_ids, masks.bitmask)
        bitmask.data[:] = bytes(len(bitmask.data))  # the engine core's buffer, reused
        results.append((on_device, want))
    torch.cuda.synchronize()
    for on_device, want in results:
        assert torch.equal(on_device.cpu(), want)


def shared_masks_with(ids: list[str], seed: int, buffer: int = 0):
    """``SharedMasks`` of VOCAB tokens whose buffer ``buffer`` holds random rows for ``ids``."""
    from octavo.messages.shared_masks import SharedMasks

    shared = SharedMasks.create(max_rows=4, vocab_size=VOCAB)
    rng = np.random.default_rng(seed)
    shared.array[buffer, :len(ids)] = rng.integers(-(2**31), 2**31 - 1, size=(len(ids), WORDS),
                                                   dtype=np.int32)
    return shared, shared.bitmask(buffer, list(ids))


def test_nothing_is_page_locked_off_cuda() -> None:
    shared, bitmask = shared_masks_with(["a", "b"], seed=30)
    upload = GrammarMaskUpload(torch.device("cpu"), max_rows=4)
    assert not upload.use_host_buffers(shared.array)
    masks = upload.upload(bitmask, ["a", "b"])
    assert masks is not None and torch.equal(masks.bitmask, rows_of(bitmask))
    shared.close()


def test_the_uniproc_executor_hands_the_shared_masks_to_its_worker(monkeypatch) -> None:
    from octavo.executor import uniproc

    taken = []

    class FakeWorker:
        def init_device(self): ...
        def init_distributed(self): ...
        def load_model(self): ...
        def use_grammar_mask_buffers(self, buffers):
            taken.append(buffers)

    monkeypatch.setattr(uniproc, "create_worker", lambda config, pm: FakeWorker())
    shared, _ = shared_masks_with(["a"], seed=31)
    uniproc.UniprocExecutor(config=None, shared_masks=shared)
    uniproc.UniprocExecutor(config=None)
    assert len(taken) == 1 and taken[0] is shared.array
    shared.close()


@pytest.mark.gpu
@needs_cuda
def test_on_the_gpu_rows_in_page_locked_shared_masks_upload_without_staging() -> None:
    """The engine core's shared buffers page-locked: a step of every row in order is copied
    from them (no staging buffer made) and equals its rows, also once the buffer is refilled
    after the copy ran; a subset of rows still stages."""
    device = torch.device("cuda")
    shared, bitmask = shared_masks_with(["a", "b", "c"], seed=32)
    upload = GrammarMaskUpload(device, max_rows=4)
    assert upload.use_host_buffers(shared.array)
    assert not upload.use_host_buffers(shared.array)  # once
    want = rows_of(bitmask)
    masks = upload.upload(bitmask, ["a", "b", "c"])
    assert masks is not None and masks.row_ids is None and upload._staging == []
    torch.cuda.synchronize()
    shared.array[0] = 0  # the grammars refill the buffer two steps later
    assert torch.equal(masks.bitmask.cpu(), want)
    _, other = shared_masks_with(["b", "c"], seed=33)
    subset = upload.upload(other, ["a", "b", "c"])
    assert subset is not None and subset.row_ids is not None and upload._staging != []
    shared.close()
