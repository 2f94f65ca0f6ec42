"""A worker process's receive of a sample message (``WorkerSample`` with a step's grammar
bitmask, its rows in the message) over zmq ipc, as ``octavo.executor.multiproc.run_worker``
does it, against the way it did before 2026-12-03: the frame copied out of zmq (``recv()``)
and the bitmask decoded into a new ``bytes`` (a ``bytes`` field), then, both ways, the rows
staged as the runner stages them (one copy into a kept int32 array). Since the second session
of 2026-12-03 the multiprocess executor's messages name a buffer of ``SharedMasks`` instead
of carrying the rows: ``bench_shared_masks.py`` times that against the rows by value.

    python benchmarks/cpu/bench_worker_messages.py [--rows 256] [--vocab 49152] [--repeats 300]

Each message is sent and left a few milliseconds to arrive before the clock starts, so the
figure is the receiving process's own work. Prints the medians, both ways in turn for two
rounds, and one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path

import msgspec
import numpy as np
import zmq
from octavo.messages import GrammarBitmask
from octavo.messages.executor import WorkerInput, WorkerSample


@dataclasses.dataclass
class _CopiedBitmask:
    """``GrammarBitmask`` as it was declared before: ``data: bytes`` decodes to a copy."""

    req_ids: list[str]
    num_words: int
    data: bytes


class _CopiedSample(msgspec.Struct, tag="sample", kw_only=True):
    step_id: int
    grammar_bitmask: _CopiedBitmask | None = None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--repeats", type=int, default=300)
    args = parser.parse_args()
    words = (args.vocab + 31) // 32
    rng = np.random.default_rng(0)
    data = bytearray(rng.integers(-(2**31), 2**31 - 1, size=(args.rows, words),
                                  dtype=np.int32).tobytes())
    sample = WorkerSample(step_id=1, grammar_bitmask=GrammarBitmask(
        req_ids=[f"req-{i}" for i in range(args.rows)], num_words=words, data=memoryview(data)))
    frame = msgspec.msgpack.Encoder().encode(sample)
    decoders = {"view": msgspec.msgpack.Decoder(WorkerInput),
                "copies": msgspec.msgpack.Decoder(_CopiedSample)}
    staging = np.empty((args.rows, words), dtype=np.int32)
    context = zmq.Context()
    push, pull = context.socket(zmq.PUSH), context.socket(zmq.PULL)
    address = f"ipc://{Path(tempfile.mkdtemp(prefix='octavo-msg-')) / 'in'}"
    push.bind(address)
    pull.connect(address)

    def receive(way: str) -> float:
        push.send(frame, copy=False)
        time.sleep(0.005)  # arrived: the clock times the receiver's work only
        start = time.perf_counter()
        if way == "view":
            received = pull.recv(copy=False)
            message = decoders[way].decode(received.buffer)
        else:
            message = decoders[way].decode(pull.recv())
        rows = np.frombuffer(message.grammar_bitmask.data, dtype="<i4")
        np.copyto(staging, rows.reshape(args.rows, words))
        return time.perf_counter() - start

    results: dict[str, list[float]] = {"copies": [], "view": []}
    try:
        for round_ in range(2):
            for way in ("copies", "view"):
                median = float(np.median([receive(way) for _ in range(args.repeats)])) * 1e6
                results[way].append(round(median, 1))
                print(f"round {round_}: {way:6s} receive + decode + stage, median {median:7.1f} µs "
                      f"({len(frame) / 1e6:.2f} MB frame)")
    finally:
        push.close(linger=0)
        pull.close(linger=0)
        context.term()
    print(json.dumps({"bench": "worker-sample-receive", "rows": args.rows, "words": words,
                      "frame_bytes": len(frame), "median_us": results}))


if __name__ == "__main__":
    main()
