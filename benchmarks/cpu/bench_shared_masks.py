"""From the engine core's ``sample_tokens`` to every worker process holding the step's grammar
rows, the rows in the message (by value, as before 2026-12-03) against a reference to the
grammar process's shared buffers (``octavo.messages.shared_masks``).

    python benchmarks/cpu/bench_shared_masks.py [--rows 256] [--vocab 49152] [--ranks 1]

As ``MultiprocExecutor`` and ``run_worker`` do it: the engine side encodes a ``WorkerSample``
(msgspec) and sends it on each rank's zmq ipc socket; each worker process (spawned, the masks
inherited as it starts) receives it without a copy, decodes it, takes the rows as
``WorkerHost`` does (``SharedMasks.resolve``), stages them as the runner does (one copy into a
kept int32 array) and answers with one byte. The clock runs from the encode to the last
answer. The rows are written into the shared buffer before the clock starts (the grammar
process's work, the same both ways). Both ways in turn, two rounds; prints the medians and
one JSON line.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import tempfile
import time
from pathlib import Path

import msgspec
import numpy as np
import zmq
from octavo.messages.executor import WorkerInput, WorkerSample
from octavo.messages.shared_masks import SharedMasks, by_reference


def worker(masks: SharedMasks, input_address: str, output_address: str) -> None:
    context = zmq.Context()
    pull, push = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    pull.connect(input_address)
    push.connect(output_address)
    decoder = msgspec.msgpack.Decoder(WorkerInput)
    staging = np.empty((masks.max_rows, masks.num_words), dtype=np.int32)
    while True:
        while not pull.poll(0):  # spinning, as the workers do between a step's messages
            pass
        frame = pull.recv(copy=False)
        message = decoder.decode(frame.buffer)
        if message.grammar_bitmask is None:
            break
        bitmask = masks.resolve(message.grammar_bitmask)
        rows = np.frombuffer(bitmask.data, dtype="<i4").reshape(len(bitmask.req_ids), -1)
        np.copyto(staging[:len(rows)], rows)
        push.send(b"k")
    pull.close(linger=0)
    push.close(linger=0)
    context.term()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--ranks", type=int, default=1, help="worker processes (TP ranks)")
    parser.add_argument("--repeats", type=int, default=300)
    args = parser.parse_args()
    masks = SharedMasks.create(args.rows, args.vocab)
    rng = np.random.default_rng(0)
    masks.array[:] = rng.integers(-(2**31), 2**31 - 1, size=masks.array.shape, dtype=np.int32)
    req_ids = [f"req-{i}" for i in range(args.rows)]
    folder = Path(tempfile.mkdtemp(prefix="octavo-masks-bench-"))
    context = zmq.Context()
    answers = context.socket(zmq.PULL)
    answers.bind(f"ipc://{folder / 'out'}")
    inputs, workers = [], []
    spawn = multiprocessing.get_context("spawn")
    for rank in range(args.ranks):
        sock = context.socket(zmq.PUSH)
        sock.bind(f"ipc://{folder / f'in-{rank}'}")
        inputs.append(sock)
        process = spawn.Process(target=worker, args=(masks, f"ipc://{folder / f'in-{rank}'}",
                                                     f"ipc://{folder / 'out'}"), daemon=True)
        process.start()
        workers.append(process)
    encoder = msgspec.msgpack.Encoder()

    def send_and_wait(way: str, buffer: int) -> float:
        bitmask = masks.bitmask(buffer, req_ids)
        start = time.perf_counter()
        if way == "reference":
            bitmask = by_reference(bitmask)
        frame = encoder.encode(WorkerSample(step_id=1, grammar_bitmask=bitmask))
        for sock in inputs:
            sock.send(frame, copy=False)
        for _ in inputs:
            answers.recv()
        return time.perf_counter() - start

    results: dict[str, list[float]] = {"value": [], "reference": []}
    try:
        for way in results:  # warm-up: connections up, pages mapped
            for i in range(20):
                send_and_wait(way, i % 2)
        for round_ in range(2):
            for way in results:
                times = []
                for i in range(args.repeats):
                    times.append(send_and_wait(way, i % 2))
                    time.sleep(0.001)  # a step's other work: the workers go back to spinning
                median = float(np.median(times)) * 1e6
                results[way].append(round(median, 1))
                print(f"round {round_}: rows by {way:9s} send -> staged on {args.ranks} rank(s),"
                      f" median {median:7.1f} µs")
    finally:
        for sock in inputs:
            sock.send(encoder.encode(WorkerSample(step_id=0)))
        for process in workers:
            process.join(10)
        for sock in [*inputs, answers]:
            sock.close(linger=0)
        context.term()
        masks.close()
    print(json.dumps({"bench": "shared-masks", "rows": args.rows, "words": masks.num_words,
                      "ranks": args.ranks, "median_us": results}))


if __name__ == "__main__":
    main()
