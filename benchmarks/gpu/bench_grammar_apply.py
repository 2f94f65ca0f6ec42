"""Device-side cost of applying a step's grammar bitmask: each stage of the runner's greedy
path (host rows -> pinned copy -> device -> unpack -> mask -> argmax), timed with CUDA syncs;
the path through per-step pin_memory and row ids beside the one through the runner's staging
buffers (``GrammarMaskUpload``).

    python benchmarks/gpu/bench_grammar_apply.py --rows 229 --vocab 49152
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=229)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()

    from octavo.messages import GrammarBitmask
    from octavo.sample.sampler import mask_by_bitmask, unpack_bitmask
    from octavo.transfer import host_to_device
    from octavo.sample.metadata import GrammarRows
    from octavo.worker.grammar_masks import GrammarMaskUpload

    class State:
        def __init__(self, req_id: str) -> None:
            self.req_id = req_id

    def _grammar_rows(bitmask, states):
        """The host rows the sampler path built before it used the staging buffers too
        (every request constrained: the engine core's buffer as it is, row ids 0..k-1)."""
        rows = np.frombuffer(bitmask.data, dtype="<i4").reshape(len(bitmask.req_ids), -1)
        return GrammarRows(row_ids=list(range(len(states))), bitmask=torch.from_numpy(rows))

    words = (args.vocab + 31) // 32
    ids = [str(i) for i in range(args.rows)]
    rng = np.random.default_rng(0)
    data = bytearray(rng.integers(-2**31, 2**31 - 1, size=(args.rows, words),
                                  dtype=np.int32).tobytes())
    bitmask = GrammarBitmask(req_ids=ids, num_words=words, data=data)
    states = [State(r) for r in ids]
    # Every other row constrained: the masks go to rows named by their ids.
    half = GrammarBitmask(req_ids=ids[::2], num_words=words,
                          data=bytearray(data[: len(ids[::2]) * words * 4]))
    logits = torch.randn(args.rows, args.vocab, dtype=torch.bfloat16, device="cuda")
    device = logits.device
    upload = GrammarMaskUpload(device, args.rows)

    def timed(label, fn):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.iters):
            out = fn()
        torch.cuda.synchronize()
        print(f"{label:<44} {(time.perf_counter() - start) / args.iters * 1e3:8.3f} ms")
        return out

    # The path before the staging buffers: host rows, then pin_memory + copy of each tensor.
    grammar = timed("_grammar_rows (host)", lambda: _grammar_rows(bitmask, states))
    timed("pin_memory of the bitmask", lambda: grammar.bitmask.pin_memory())
    dev = timed("host_to_device(bitmask)", lambda: host_to_device(grammar.bitmask, device))
    rows = timed("host_to_device(row ids)",
                 lambda: host_to_device(torch.tensor(grammar.row_ids), device))
    # The staging buffers (GrammarMaskUpload), every row and every other row.
    sampled_ids = [s.req_id for s in states]
    timed("GrammarMaskUpload.upload, every row", lambda: upload.upload(bitmask, sampled_ids))
    timed("GrammarMaskUpload.upload, every other row", lambda: upload.upload(half, sampled_ids))
    timed("unpack_bitmask", lambda: unpack_bitmask(dev, args.vocab))
    timed("mask_by_bitmask, row ids", lambda: mask_by_bitmask(logits, rows, dev))
    timed("mask_by_bitmask, every row", lambda: mask_by_bitmask(logits, None, dev))
    timed("argmax", lambda: logits.argmax(dim=-1))

    def before():
        g = _grammar_rows(bitmask, states)
        row_ids = torch.tensor(g.row_ids, dtype=torch.int64)
        mask_by_bitmask(logits, host_to_device(row_ids, device), host_to_device(g.bitmask, device))
        return logits.argmax(dim=-1)

    def staged():
        masks = upload.upload(bitmask, [s.req_id for s in states])
        mask_by_bitmask(logits, masks.row_ids, masks.bitmask)
        return logits.argmax(dim=-1)

    timed("whole greedy path, pin_memory + row ids", before)
    timed("whole greedy path, staged", staged)


if __name__ == "__main__":
    main()
