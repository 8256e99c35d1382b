"""Which heads, MLP columns and vocabulary rows each tensor-parallel rank holds."""

from __future__ import annotations

import pytest

from services.scheduler.parallel.shard import Heads, Shard, check_heads, split, split_heads


def test_split_is_contiguous_and_covers_everything():
    for n in (1, 7, 9, 96, 1536):
        for size in (1, 2, 3, 4, 8):
            parts = [split(n, r, size) for r in range(size)]
            assert parts[0][0] == 0 and sum(c for _, c in parts) == n
            assert all(a + c == b for (a, c), (b, _) in zip(parts, parts[1:], strict=False))
            assert max(c for _, c in parts) - min(c for _, c in parts) <= 1


@pytest.mark.parametrize(
    ("heads", "kv", "size"),
    [(32, 8, 2), (32, 8, 8), (9, 3, 2), (64, 8, 4), (4, 2, 4), (32, 4, 8), (12, 1, 4)],
)
def test_each_rank_uses_only_its_kv_heads_and_the_q_heads_are_covered_once(heads, kv, size):
    group = heads // kv
    seen = []
    for r in range(size):
        h = split_heads(heads, kv, r, size)
        assert h.q_count >= 1 and h.kv_count >= 1
        q = range(h.q_start, h.q_start + h.q_count)
        assert {i // group for i in q} <= set(range(h.kv_start, h.kv_start + h.kv_count))
        seen += q
    assert sorted(seen) == list(range(heads))


def test_uneven_heads_go_by_whole_groups():
    assert split_heads(9, 3, 0, 2) == Heads(0, 6, 0, 2)
    assert split_heads(9, 3, 1, 2) == Heads(6, 3, 2, 1)


@pytest.mark.parametrize(("heads", "kv", "size"), [(12, 3, 8), (4, 2, 8), (8, 2, 3), (2, 2, 4)])
def test_impossible_splits_are_refused_with_the_fix(heads, kv, size):
    with pytest.raises(ValueError, match="tp_size"):
        check_heads(heads, kv, size)


def test_vocab_rows_are_padded_to_one_size():
    rows = [Shard(r, 3).vocab(10) for r in range(3)]
    assert rows == [(0, 4), (4, 4), (8, 4)]
