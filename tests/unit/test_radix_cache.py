"""Unit tests for the RadixAttention prefix tree (services/scheduler/radix_cache.py)."""

from __future__ import annotations

import random

import pytest
import torch

from services.scheduler.radix_cache import RadixCache


class FakePool:
    """A slot allocator that records frees and catches double frees."""

    def __init__(self) -> None:
        self.next = 0
        self.live: set[int] = set()
        self.freed: list[list[int]] = []  # one entry per free_slots call

    def alloc(self, n: int) -> torch.Tensor:
        out = torch.arange(self.next, self.next + n, dtype=torch.int64)
        self.next += n
        self.live.update(out.tolist())
        return out

    def free(self, idx: torch.Tensor) -> None:
        slots = idx.tolist()
        for s in slots:
            assert s in self.live, f"slot {s} freed twice or never allocated"
            self.live.remove(s)
        self.freed.append(slots)

    def freed_flat(self) -> list[int]:
        return [s for call in self.freed for s in call]


def make() -> tuple[RadixCache, FakePool]:
    pool = FakePool()
    return RadixCache(pool.free), pool


def slots(t: torch.Tensor) -> list[int]:
    return t.tolist()


def test_insert_then_match_exact_and_prefix():
    tree, pool = make()
    v = pool.alloc(5)
    assert tree.insert([1, 2, 3, 4, 5], v) == 0
    m = tree.match_prefix([1, 2, 3, 4, 5, 6, 7])
    assert slots(m.indices) == slots(v)
    assert m.last_node.key == [1, 2, 3, 4, 5]
    assert m.indices.dtype == torch.int64
    miss = tree.match_prefix([9, 9])
    assert miss.indices.numel() == 0 and miss.last_node is tree.root
    empty = tree.match_prefix([])
    assert empty.indices.numel() == 0 and empty.last_node is tree.root
    assert tree.total_size() == 5 == tree.evictable_size()
    tree._check_sizes()


def test_match_inside_edge_splits_node():
    tree, pool = make()
    v = pool.alloc(5)
    tree.insert([1, 2, 3, 4, 5], v)
    m = tree.match_prefix([1, 2, 3, 9])
    assert slots(m.indices) == slots(v[:3])
    upper = m.last_node
    assert upper.key == [1, 2, 3] and slots(upper.value) == slots(v[:3])
    assert tree.root.children == {1: upper} and upper.parent is tree.root
    (lower,) = upper.children.values()
    assert list(upper.children) == [4] and lower.key == [4, 5] and slots(lower.value) == slots(v[3:])
    assert lower.parent is upper and not lower.children
    assert tree.total_size() == 5
    tree._check_sizes()
    # a full match now walks both halves
    assert slots(tree.match_prefix([1, 2, 3, 4, 5]).indices) == slots(v)


def test_insert_returns_cached_prefix_and_branches():
    tree, pool = make()
    a = pool.alloc(4)
    assert tree.insert([1, 2, 3, 4], a) == 0
    b = pool.alloc(5)
    # caller frees its own duplicates for the cached part; the tree keeps a[:2] and stores b[2:]
    assert tree.insert([1, 2, 7, 8, 9], b) == 2
    pool.free(b[:2])
    assert tree.total_size() == 4 + 3
    assert slots(tree.match_prefix([1, 2, 7, 8, 9]).indices) == slots(a[:2]) + slots(b[2:])
    assert slots(tree.match_prefix([1, 2, 3, 4]).indices) == slots(a)
    (mid,) = tree.root.children.values()
    assert mid.key == [1, 2] and sorted(c.key[0] for c in mid.children.values()) == [3, 7]
    # re-inserting an existing key stores nothing new
    assert tree.insert([1, 2, 3, 4], pool.alloc(4)) == 4
    assert tree.total_size() == 7
    tree._check_sizes()


def test_insert_prefix_of_existing_edge_splits():
    tree, pool = make()
    v = pool.alloc(6)
    tree.insert([1, 2, 3, 4, 5, 6], v)
    assert tree.insert([1, 2, 3], pool.alloc(3)) == 3
    (upper,) = tree.root.children.values()
    assert upper.key == [1, 2, 3] and slots(upper.value) == slots(v[:3])
    (lower,) = upper.children.values()
    assert lower.key == [4, 5, 6] and slots(lower.value) == slots(v[3:])
    assert tree.total_size() == 6
    tree._check_sizes()


def test_lru_eviction_order():
    tree, pool = make()
    a, b, c = pool.alloc(3), pool.alloc(4), pool.alloc(2)
    tree.insert([1, 1, 1], a)
    tree.insert([2, 2, 2, 2], b)
    tree.insert([3, 3], c)
    tree.match_prefix([1, 1, 1])  # A becomes most recent; B is now the LRU leaf
    assert tree.evict(len(b)) == 4
    assert pool.freed == [slots(b)]
    assert tree.match_prefix([2, 2, 2, 2]).indices.numel() == 0
    assert tree.evict(1) == 2  # then C
    assert pool.freed[-1] == slots(c)
    tree._check_sizes()


def test_locked_nodes_survive_eviction():
    tree, pool = make()
    a, b = pool.alloc(3), pool.alloc(2)
    tree.insert([1, 2, 3], a)
    tree.insert([1, 2, 3, 4, 5], torch.cat([a, b]))
    m = tree.match_prefix([1, 2, 3, 4, 5])
    tree.inc_lock_ref(m.last_node)
    assert tree.protected_size() == 5 and tree.evictable_size() == 0
    tree._check_sizes()
    assert tree.evict(10**9) == 0 and pool.freed == []
    assert slots(tree.match_prefix([1, 2, 3, 4, 5]).indices) == slots(a) + slots(b)
    tree.dec_lock_ref(m.last_node)
    assert tree.protected_size() == 0 and tree.evictable_size() == 5
    assert tree.evict(10**9) == 5
    assert pool.live == set() and tree.total_size() == 0


def test_dec_lock_ref_below_zero_asserts():
    tree, pool = make()
    tree.insert([7, 8], pool.alloc(2))
    node = tree.match_prefix([7, 8]).last_node
    with pytest.raises(AssertionError):
        tree.dec_lock_ref(node)
    tree.dec_lock_ref(tree.root)  # root is a no-op: its lock is permanent
    assert tree.root.lock_ref == 1


def test_lock_on_branch_protects_only_its_path():
    tree, pool = make()
    tree.insert([1, 2, 3], pool.alloc(3))
    b = tree.insert([1, 2, 9, 9], v := pool.alloc(4))
    pool.free(v[:b])
    m = tree.match_prefix([1, 2, 3])
    tree.inc_lock_ref(m.last_node)
    assert tree.protected_size() == 3 and tree.evictable_size() == 2
    pool.freed.clear()  # forget the caller's duplicate free above
    freed = tree.evict(100)
    assert freed == 2 and sorted(pool.freed_flat()) == sorted(slots(v[2:]))
    tree.dec_lock_ref(m.last_node)
    tree._check_sizes()


def test_split_of_locked_node_keeps_sizes_and_unlock_works():
    tree, pool = make()
    tree.insert([1, 2, 3, 4], pool.alloc(4))
    node = tree.match_prefix([1, 2, 3, 4]).last_node
    tree.inc_lock_ref(node)
    tree.match_prefix([1, 2, 8])  # splits the locked edge
    assert node.parent is not tree.root and node.parent.lock_ref == 1
    assert tree.protected_size() == 4
    tree._check_sizes()
    tree.dec_lock_ref(node)
    assert tree.protected_size() == 0 and tree.evictable_size() == 4
    tree._check_sizes()


def test_evict_cascades_to_parent():
    tree, pool = make()
    base = pool.alloc(2)
    tree.insert([1, 2], base)
    x, y = pool.alloc(2), pool.alloc(2)
    tree.insert([1, 2, 3, 4], torch.cat([base, x]))
    tree.insert([1, 2, 5, 6], torch.cat([base, y]))
    (parent,) = tree.root.children.values()
    assert parent.key == [1, 2] and len(parent.children) == 2
    assert tree.evict(5) == 6  # both children, then the parent that became a leaf
    assert sorted(pool.freed_flat()) == sorted(slots(base) + slots(x) + slots(y))
    assert pool.freed[-1] == slots(base)  # parent only after its children
    assert tree.root.children == {} and tree.total_size() == 0
    tree._check_sizes()


def test_evict_does_not_cascade_into_locked_parent():
    tree, pool = make()
    tree.insert([1, 2], pool.alloc(2))
    parent = tree.match_prefix([1, 2]).last_node
    tree.inc_lock_ref(parent)
    tree.insert([1, 2, 3], torch.cat([parent.value, pool.alloc(1)]))
    assert tree.evict(100) == 1
    assert tree.root.children == {1: parent} and tree.protected_size() == 2
    tree._check_sizes()


def test_reset_frees_everything():
    tree, pool = make()
    tree.insert([1, 2, 3], pool.alloc(3))
    v = pool.alloc(3)
    pool.free(v[: tree.insert([1, 5, 6], v)])
    tree.match_prefix([1, 2])
    assert tree.total_size() == 5
    tree.reset()
    assert pool.live == set()
    assert tree.total_size() == 0 and tree.root.children == {} and tree.all_slots().numel() == 0
    tree._check_sizes()
    # still usable afterwards
    assert tree.insert([4], pool.alloc(1)) == 0 and tree.total_size() == 1


def test_pretty_and_tensor_keys():
    tree, pool = make()
    tree.insert(torch.tensor([1, 2, 3]), pool.alloc(3))
    assert tree.match_prefix((1, 2, 3)).indices.numel() == 3
    text = tree.pretty()
    assert "[1, 2, 3]" in text and "lock=0" in text


def test_random_ops_keep_counters_and_slots_exact():
    rng = random.Random(1234)
    tree, pool = make()
    prefix_slot: dict[tuple[int, ...], int] = {}  # oracle: token prefix -> slot the tree should hold
    slot_prefix: dict[int, tuple[int, ...]] = {}
    locked: list = []  # (last_node, key matched) of "running requests"

    def rand_key() -> list[int]:
        # small alphabet + shared stems => lots of shared prefixes, splits and branches
        stem = rng.choice([[], [0, 1], [0, 1, 2, 3], [5]])
        return stem + [rng.randrange(4) for _ in range(rng.randrange(0, 10))]

    def expected(key: list[int]) -> list[int]:
        out = []
        for i in range(len(key)):
            s = prefix_slot.get(tuple(key[: i + 1]))
            if s is None:
                break
            out.append(s)
        return out

    def record(key: list[int], value: torch.Tensor, cached: int) -> None:
        for i in range(cached, len(key)):
            p = tuple(key[: i + 1])
            prefix_slot[p] = int(value[i])
            slot_prefix[int(value[i])] = p

    for _step in range(500):
        op = rng.random()
        key = rand_key()
        if op < 0.3:  # a request that reuses its match (the normal scheduler path)
            m = tree.match_prefix(key)
            assert slots(m.indices) == expected(key)
            n = len(m.indices)
            value = torch.cat([m.indices, pool.alloc(len(key) - n)])
            assert tree.insert(key, value) == n
            record(key, value, n)
        elif op < 0.45:  # a request that computed everything itself: caller frees its duplicates
            value = pool.alloc(len(key))
            before = len(expected(key))
            cached = tree.insert(key, value)
            assert cached == before
            pool.free(value[:cached])
            record(key, value, cached)
        elif op < 0.65:  # start a running request: lock its matched path
            m = tree.match_prefix(key)
            assert slots(m.indices) == expected(key)
            tree.inc_lock_ref(m.last_node)
            locked.append((m.last_node, key[: len(m.indices)]))
        elif op < 0.8 and locked:  # finish a running request
            node, _ = locked.pop(rng.randrange(len(locked)))
            tree.dec_lock_ref(node)
        else:
            protected_before = tree.protected_size()
            must_keep = {s for _, k in locked for s in expected(k)}
            n_calls = len(pool.freed)
            want = rng.randrange(1, 20)
            evictable = tree.evictable_size()
            got = tree.evict(want)
            new = [s for call in pool.freed[n_calls:] for s in call]
            assert got == len(new)
            assert got >= min(want, evictable)  # everything unlocked is reachable via cascading
            assert not must_keep & set(new), "evicted a slot on a locked path"
            assert tree.protected_size() == protected_before
            for s in new:
                del prefix_slot[slot_prefix.pop(s)]

        tree._check_sizes()
        held = slots(tree.all_slots())
        assert len(held) == len(set(held)) == tree.total_size()
        assert tree.evictable_size() + tree.protected_size() == tree.total_size()
        assert set(held) == pool.live, "slot leaked or freed while still in the tree"
        assert set(held) == set(slot_prefix)
        for _, k in locked:  # locked paths are always fully present
            assert len(expected(k)) == len(k)

    while locked:
        tree.dec_lock_ref(locked.pop()[0])
    assert tree.protected_size() == 0
    tree.evict(10**9)
    assert tree.total_size() == 0 and pool.live == set()
    tree._check_sizes()
