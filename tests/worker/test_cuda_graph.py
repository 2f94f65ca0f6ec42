"""``CudaGraphRunner``'s step staging: persistent buffers, padding, shape choice (CPU).

A CUDA graph replays the kernels it captured on the persistent buffers. Here "capture"
records the same forward as a call on those buffers, with the LoRA mapping active at capture
(``_EagerReplay``), so the runner's own work is checked on the CPU with the real Triton
attention and LoRA kernels under the interpreter: a step staged into a larger captured shape,
after earlier steps left stale rows behind, gives the eager forward's outputs and writes
exactly the eager forward's cache slots.
"""

from __future__ import annotations

# isort: off
from tests.kernels.conftest import DEVICE  # sets TRITON_INTERPRET=1 before Triton is imported
# isort: on
import torch
from octavo.attention.base import AttentionMetadata
from octavo.kernels.triton.attention import TritonAttentionImpl
from octavo.lora.layers import LoRABatch, LoRAGraphInputs, LoRALinear, LoRAMapping
from octavo.worker.cuda_graph import CudaGraphRunner, capture_sizes

HEADS, KV_HEADS, DIM, BLOCK, VOCAB = 4, 2, 64, 8, 97
MAX_MODEL_LEN = 64


MAX_LORAS, RANK = 3, 8


class _AttentionOnly(torch.nn.Module):
    """Queries, keys and values looked up from token ids; one paged attention layer whose
    output gets each row's LoRA of the queries added (``lora.add_to``)."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.q = torch.randn(VOCAB, HEADS, DIM, generator=gen).to(DEVICE)
        self.kv = torch.randn(2, VOCAB, KV_HEADS, DIM, generator=gen).to(DEVICE)
        self.attn = TritonAttentionImpl(HEADS, KV_HEADS, DIM, DIM**-0.5)
        self.batch = LoRABatch(use_kernels=True)  # the Triton kernels, interpreted on the CPU
        self.lora = LoRALinear(self.batch, MAX_LORAS, RANK, HEADS * DIM,
                               [(0, HEADS * DIM, 0)], None, torch.float32, torch.device(DEVICE))
        self.lora.lora_a.copy_(torch.randn(self.lora.lora_a.shape, generator=gen))
        self.lora.lora_b.copy_(torch.randn(self.lora.lora_b.shape, generator=gen))

    def forward(self, ids, positions, kv_caches, metadata):
        q = self.q[ids]
        out = self.attn.forward(q, self.kv[0][ids], self.kv[1][ids], kv_caches[0], metadata)
        out = out.reshape(ids.shape[0], HEADS * DIM)
        self.lora.add_to(q.reshape(ids.shape[0], HEADS * DIM), out)
        return out


class _EagerReplay:
    """Stands in for a captured graph: replay() runs the forward on the persistent buffers
    with the LoRA mapping that was active at capture (a graph holds its launches' args)."""

    def __init__(self, run, out: torch.Tensor, batch: LoRABatch) -> None:
        self._run, self._out, self._batch = run, out, batch
        self._mapping = batch.mapping

    def replay(self) -> None:
        step_mapping, self._batch.mapping = self._batch.mapping, self._mapping
        try:
            self._out.copy_(self._run())
        finally:
            self._batch.mapping = step_mapping

    def pool(self) -> None:
        return None


class _CpuRunner(CudaGraphRunner):
    def _capture_one(self, num_seqs, query_len, pool):
        metadata = self._metadata(num_seqs, query_len)
        tokens = num_seqs * query_len
        out = torch.empty(tokens, HEADS * DIM, device=DEVICE)

        def run():
            return self.model(self.input_ids[:tokens], self.positions[:tokens], self.kv_caches,
                              metadata)

        return _EagerReplay(run, out, self.model.batch), out


def _step(query_lens: list[int], context_lens: list[int], first_block: int = 1):
    """A step of sequences adding ``query_lens`` tokens after ``context_lens`` cached ones,
    each sequence on its own consecutive blocks starting at ``first_block``."""
    slots, qsl, seq_lens, tables, ids, positions = [], [0], [], [], [], []
    block = first_block
    for i, (q, c) in enumerate(zip(query_lens, context_lens)):
        n_blocks = -(-(q + c) // BLOCK)
        table = list(range(block, block + n_blocks))
        block += n_blocks
        for pos in range(c, c + q):
            slots.append(table[pos // BLOCK] * BLOCK + pos % BLOCK)
            ids.append((7 * i + pos) % VOCAB)
            positions.append(pos)
        qsl.append(qsl[-1] + q)
        seq_lens.append(q + c)
        tables.append(table)
    metadata = AttentionMetadata.from_lists(slots, qsl, seq_lens, tables, device=DEVICE)
    return (torch.tensor(ids, device=DEVICE), torch.tensor(positions, device=DEVICE), metadata)


def _cache() -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(2, 40, BLOCK, KV_HEADS, DIM, generator=gen).to(DEVICE)


def _runner(max_num_seqs: int, max_query_len: int, with_lora: bool = False) -> _CpuRunner:
    model = _AttentionOnly()
    lora = None
    if with_lora:
        lora = LoRAGraphInputs(model.batch, MAX_LORAS, max_num_seqs * max_query_len,
                               torch.device(DEVICE))
    runner = _CpuRunner(model, [_cache()], max_num_seqs=max_num_seqs,
                        max_model_len=MAX_MODEL_LEN, block_size=BLOCK, device=DEVICE,
                        max_query_len=max_query_len, lora=lora)
    runner.capture()
    return runner


def test_shapes_cover_decode_and_verification_steps():
    runner = _runner(max_num_seqs=8, max_query_len=5)
    assert runner.sizes == capture_sizes(8) == [1, 2, 4, 8]
    assert set(runner.graphs) == {(s, q, False) for s in (1, 2, 4, 8) for q in (1, 5)}
    assert runner.shape_for(_step([1, 1, 1], [3, 9, 4])[2]) == (4, 1, False)
    assert runner.shape_for(_step([5, 2, 1], [3, 9, 4])[2]) == (4, 5, False)
    assert runner.shape_for(_step([6, 1], [3, 9])[2]) is None  # more tokens than captured
    assert runner.shape_for(_step([1] * 9, [2] * 9)[2]) is None  # more sequences
    decode_only = _runner(max_num_seqs=4, max_query_len=1, with_lora=True)
    assert set(decode_only.graphs) == {(s, 1, lora) for s in (1, 2, 4) for lora in (0, 1)}
    assert decode_only.shape_for(_step([2, 1], [3, 9])[2]) is None
    decode_only.model.batch.mapping = LoRAMapping.from_requests([1, -1], [1, 1], DEVICE)
    assert decode_only.shape_for(_step([1, 1], [3, 9])[2]) == (2, 1, True)


# Adapter slot of each sequence (-1: none) in the steps below.
_STEPS = [
    (([5] * 7, [2 * i for i in range(7)], 1), [0, 1, 2, 0, -1, 1, 2]),
    (([1] * 6, [10] * 6, 3), [-1] * 6),
    (([5, 2, 1], [3, 17, 4], 5), [2, -1, 2]),
    (([3], [30], 2), [1]),
    (([1, 1, 1], [8, 9, 26], 9), [-1, 0, -1]),
]


def test_padded_replays_equal_the_eager_forward_and_write_only_its_slots():
    runner = _runner(max_num_seqs=8, max_query_len=5, with_lora=True)
    eager_cache = runner.kv_caches[0].clone()
    batch = runner.model.batch
    # Large steps first so that later, smaller ones find stale real rows in the buffers.
    for (query_lens, context_lens, first_block), slots in _STEPS:
        ids, positions, metadata = _step(query_lens, context_lens, first_block)
        batch.mapping = LoRAMapping.from_requests(slots, query_lens, torch.device(DEVICE))
        assert runner.shape_for(metadata)[2] == (batch.mapping is not None)
        with torch.inference_mode():  # as the model runner calls it
            got = runner.run(ids, positions, metadata)
        want = runner.model(ids, positions, [eager_cache], metadata)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        # Padding rows wrote nothing: the two caches hold exactly the same values.
        assert torch.equal(runner.kv_caches[0], eager_cache)
