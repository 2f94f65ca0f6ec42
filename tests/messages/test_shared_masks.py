"""``SharedMasks``: a step's grammar rows written in one process are read in place by another
that inherited the file at its start; a bitmask sent by reference is a few bytes and resolves
to the same rows; references the buffers cannot hold are refused."""

from __future__ import annotations

import multiprocessing
import os

import msgspec
import numpy as np
import pytest
from octavo.messages import GrammarBitmask
from octavo.messages.executor import WorkerInput, WorkerSample
from octavo.messages.shared_masks import SharedMasks, by_reference, carries_rows

VOCAB = 1000  # 32 words a row


def rows_of(bitmask: GrammarBitmask) -> np.ndarray:
    return np.frombuffer(bitmask.data, dtype="<i4").reshape(len(bitmask.req_ids),
                                                            bitmask.num_words)


def pattern(buffer: int, rows: int, words: int) -> np.ndarray:
    return (np.arange(rows * words, dtype=np.int32).reshape(rows, words) * 7 + buffer * 1001)


@pytest.fixture
def masks():
    masks = SharedMasks.create(max_rows=8, vocab_size=VOCAB)
    yield masks
    masks.close()


def test_a_bitmask_is_a_view_of_its_buffer_rows(masks) -> None:
    assert masks.array.shape == (2, 8, 32)
    masks.array[1, :3] = pattern(1, 3, 32)
    bitmask = masks.bitmask(1, ["a", "b", "c"])
    assert bitmask.shared_buffer == 1 and bitmask.num_words == 32 and carries_rows(bitmask)
    np.testing.assert_array_equal(rows_of(bitmask), pattern(1, 3, 32))
    masks.array[1, 0, 0] = -5  # a view, not a copy
    assert rows_of(bitmask)[0, 0] == -5


def test_by_reference_travels_without_its_rows_and_resolves_to_them(masks) -> None:
    masks.array[0, :5] = pattern(0, 5, 32)
    bitmask = masks.bitmask(0, [f"r{i}" for i in range(5)])
    frame = msgspec.msgpack.encode(WorkerSample(step_id=4, grammar_bitmask=by_reference(bitmask)))
    full = msgspec.msgpack.encode(WorkerSample(step_id=4, grammar_bitmask=bitmask))
    assert len(frame) < 100 < 5 * 32 * 4 < len(full)
    sent = msgspec.msgpack.Decoder(WorkerInput).decode(frame).grammar_bitmask
    assert not carries_rows(sent) and sent.shared_buffer == 0
    np.testing.assert_array_equal(rows_of(masks.resolve(sent)), pattern(0, 5, 32))
    # Sent by value (the rows in the frame, a Ray actor's way), the rows are used as they are.
    by_value = msgspec.msgpack.Decoder(WorkerInput).decode(full).grammar_bitmask
    assert masks.resolve(by_value) is by_value


def test_bitmasks_outside_shared_buffers_go_as_they_are() -> None:
    own = GrammarBitmask(req_ids=["a"], num_words=2, data=memoryview(bytes(8)))
    assert by_reference(own) is own and carries_rows(own)
    empty = GrammarBitmask(req_ids=[], num_words=2, data=memoryview(b""), shared_buffer=1)
    assert by_reference(empty) is empty and carries_rows(empty)


@pytest.mark.parametrize("buffer, rows, words", [(2, 1, 32), (-1, 1, 32), (0, 9, 32), (1, 1, 31)])
def test_a_reference_the_buffers_cannot_hold_is_refused(masks, buffer, rows, words) -> None:
    reference = GrammarBitmask(req_ids=["x"] * rows, num_words=words, data=memoryview(b""),
                               shared_buffer=buffer)
    with pytest.raises(ValueError, match="shared masks hold two buffers of 8 rows of 32 words"):
        masks.resolve(reference)


def _child(masks: SharedMasks, frame: bytes) -> None:
    bitmask = masks.resolve(msgspec.msgpack.Decoder(WorkerInput).decode(frame).grammar_bitmask)
    ok = np.array_equal(rows_of(bitmask), pattern(0, 4, 32))
    masks.array[1, :2] = pattern(1, 2, 32)  # the parent reads it back
    os._exit(0 if ok else 3)


def test_another_process_reads_the_rows_in_place(masks) -> None:
    """A spawned child (as the multiprocess executor starts its workers) inherits the file as a
    descriptor, reads rows the parent wrote, and its writes are seen by the parent."""
    masks.array[0, :4] = pattern(0, 4, 32)
    frame = msgspec.msgpack.encode(WorkerSample(
        step_id=1, grammar_bitmask=by_reference(masks.bitmask(0, list("abcd")))))
    child = multiprocessing.get_context("spawn").Process(target=_child, args=(masks, frame))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    np.testing.assert_array_equal(masks.array[1, :2], pattern(1, 2, 32))


def test_close_is_idempotent_and_leaves_views_readable(masks) -> None:
    masks.array[0, :1] = 9
    view = masks.bitmask(0, ["a"])
    fd = masks.fileno()
    masks.close()
    masks.close()
    assert rows_of(view)[0, 0] == 9  # the mapping lives while a view does
    with pytest.raises(OSError):
        os.fstat(fd)
