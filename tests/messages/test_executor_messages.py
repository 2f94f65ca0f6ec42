"""The executor's messages to the workers: a step's grammar bitmask decodes as a view of the
received frame (no copy of its ~1.5 MB a step), and the rows read back as they were sent."""

from __future__ import annotations

import msgspec
import numpy as np
import zmq
from octavo.messages import GrammarBitmask
from octavo.messages.executor import WorkerInput, WorkerSample


def test_a_sample_messages_bitmask_is_a_view_of_the_received_frame(tmp_path) -> None:
    rows = np.random.default_rng(0).integers(-(2**31), 2**31 - 1, size=(3, 5), dtype=np.int32)
    sent = WorkerSample(step_id=7, grammar_bitmask=GrammarBitmask(
        req_ids=["a", "b", "c"], num_words=5, data=memoryview(bytearray(rows.tobytes()))))
    context = zmq.Context()
    push, pull = context.socket(zmq.PUSH), context.socket(zmq.PULL)
    try:
        push.bind(f"ipc://{tmp_path / 'in'}")
        pull.connect(f"ipc://{tmp_path / 'in'}")
        push.send(msgspec.msgpack.Encoder().encode(sent), copy=False)
        frame = pull.recv(copy=False)  # as run_worker receives it
        message = msgspec.msgpack.Decoder(WorkerInput).decode(frame.buffer)
    finally:
        push.close(linger=0)
        pull.close(linger=0)
        context.term()
    assert isinstance(message, WorkerSample) and message.step_id == 7
    bitmask = message.grammar_bitmask
    assert bitmask is not None and bitmask.req_ids == ["a", "b", "c"]
    assert isinstance(bitmask.data, memoryview)
    got = np.frombuffer(bitmask.data, dtype="<i4").reshape(3, 5)
    assert np.shares_memory(got, np.frombuffer(frame.buffer, dtype=np.uint8))
    assert np.array_equal(got, rows)
