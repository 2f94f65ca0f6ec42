"""BlockTable: the runner's persistent per-request rows of KV block ids."""

from __future__ import annotations

import random

import numpy as np
import pytest
from octavo.worker.block_table import BlockTable


def test_rows_gather_in_step_order_zero_padded():
    table = BlockTable(num_rows=4, num_cols=4)
    a = table.add_row([7, 8])
    b = table.add_row([3])
    table.append(b, [9, 10])
    got = table.gather([b, a], width=4)
    np.testing.assert_array_equal(got, [[3, 9, 10, 0], [7, 8, 0, 0]])
    assert got.dtype == np.int32
    got[0, 0] = 99  # a copy: the persistent rows are untouched
    np.testing.assert_array_equal(table.gather([b], 1), [[3]])


def test_a_freed_row_is_reused_clean():
    table = BlockTable(num_rows=2, num_cols=2)
    a = table.add_row([1, 2, 3, 4, 5])  # grows the columns
    table.free_row(a)
    c = table.add_row([6])
    assert c == a
    np.testing.assert_array_equal(table.gather([c], 5), [[6, 0, 0, 0, 0]])


def test_grows_rows_and_matches_a_list_model():
    rng = random.Random(0)
    table = BlockTable(num_rows=1, num_cols=1)
    model: dict[int, list[int]] = {}
    for _ in range(2000):
        action = rng.random()
        if action < 0.3 or not model:
            ids = [rng.randrange(1000) for _ in range(rng.randrange(0, 5))]
            row = table.add_row(ids)
            assert row not in model
            model[row] = ids
        elif action < 0.8:
            row = rng.choice(list(model))
            ids = [rng.randrange(1000) for _ in range(rng.randrange(0, 3))]
            table.append(row, ids)
            model[row].extend(ids)
        else:
            row = rng.choice(list(model))
            table.free_row(row)
            del model[row]
        assert table.num_live_rows == len(model)
    rows = list(model)
    width = max(len(v) for v in model.values()) + 2
    expected = np.array([v + [0] * (width - len(v)) for v in model.values()], dtype=np.int32)
    np.testing.assert_array_equal(table.gather(rows, width), expected)


def test_needs_a_row_and_a_column():
    with pytest.raises(ValueError, match="at least one row"):
        BlockTable(num_rows=0)
