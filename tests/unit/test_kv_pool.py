"""The KV slot allocator (services/scheduler/memory.py): freed slots are batched until an allocation
needs them, and every slot is handed out once at a time."""

from __future__ import annotations

import random
from types import SimpleNamespace

import torch

from services.scheduler.memory import KVPool

SHAPE = SimpleNamespace(num_layers=1, num_kv_heads=1, head_dim=1)


def test_frees_are_counted_at_once_and_reused_when_needed():
    pool = KVPool(SHAPE, 10, torch.float32, "cpu")
    a, b = pool.alloc(6), pool.alloc(4)
    assert pool.free_count == 0 and pool.alloc(1) is None
    pool.free(a[:2])
    pool.free(b[1:])
    assert pool.free_count == 5
    got = pool.alloc(5)  # only the returned slots are left: they are merged for this allocation
    assert sorted(got.tolist()) == sorted(a[:2].tolist() + b[1:].tolist())
    assert pool.free_count == 0 and pool.alloc(1) is None


def test_random_alloc_and_free_never_hand_out_a_slot_twice():
    rng = random.Random(0)
    pool = KVPool(SHAPE, 64, torch.float32, "cpu")
    held: list[torch.Tensor] = []
    for _ in range(500):
        if held and rng.random() < 0.5:
            pool.free(held.pop(rng.randrange(len(held))))
        else:
            got = pool.alloc(rng.randint(1, 9))
            if got is not None:
                held.append(got)
        in_use = [s for t in held for s in t.tolist()]
        assert len(set(in_use)) == len(in_use) and pool.free_count + len(in_use) == 64
        free = pool.free_slots().tolist()
        assert not set(free) & set(in_use) and len(free) == pool.free_count
