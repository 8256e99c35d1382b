"""The blocks a radix cache publishes for the routers (shared/kv_blocks.py, radix_cache.BlockLog) and
the index a gateway builds from them (services/gateway/router/kv_index.py)."""

from __future__ import annotations

import random

import torch

from services.gateway.router.kv_index import KvIndex
from services.scheduler.radix_cache import BlockLog, RadixCache
from shared.kv_blocks import BLOCK_TOKENS as B
from shared.kv_blocks import block_hashes
from shared.messages import KvEvents, KvSnapshot, WorkerLoad


def test_block_hashes_chain_over_the_prefix() -> None:
    a = list(range(40))
    b = [*range(16), *range(100, 124)]
    ha, hb = block_hashes(a), block_hashes(b)
    assert len(ha) == 2 and len(hb) == 2  # whole blocks only: 40 tokens are two
    assert ha[0] == hb[0] and ha[1] != hb[1]
    # the second block alone, chained from the first's hash, is the same hash
    assert block_hashes(a, parent=ha[0], start=B) == ha[1:]
    # a block's hash depends on what came before it, not only on its tokens
    assert block_hashes([*range(16, 32), *range(16)])[1] != ha[0]


def _tree() -> RadixCache:
    tree = RadixCache(lambda slots: None)
    tree.block_log = BlockLog()
    return tree


def _expected(tree: RadixCache) -> set[int]:
    """Every whole block on every root-to-node path, each node checked to hold exactly the blocks
    that end on its edge (recomputed from the path's tokens)."""
    out: set[int] = set()
    for node in tree._walk():
        if node is tree.root:
            continue
        path, m = [], node
        while m is not tree.root:
            path, m = m.key + path, m.parent
        assert node.depth == len(path) - len(node.key)
        hashes = block_hashes(path)
        assert node.blocks == hashes[node.depth // B : len(path) // B]
        out |= set(node.blocks)
    return out


def test_tree_blocks_follow_inserts_splits_evictions_and_resets() -> None:
    rng = random.Random(7)
    tree, keys = _tree(), []
    for step in range(2500):
        op = rng.random()
        if op < 0.6:
            base = rng.choice(keys) if keys and rng.random() < 0.7 else []
            key = base[: rng.randrange(len(base) + 1)] + [
                rng.randrange(4) for _ in range(rng.randrange(1, 70))
            ]
            keys.append(key)
            tree.insert(key, torch.arange(len(key)))
        elif op < 0.8 and keys:
            tree.match_prefix(rng.choice(keys)[: rng.randrange(1, 90)])  # splits edges
        else:
            tree.evict(rng.randrange(1, 60))
        if step == 1500:
            tree.reset()
            assert tree.block_log.cleared and not tree.block_log.held
        if step % 100 == 0:
            held = _expected(tree)
            assert held == tree.block_log.held == set(tree.all_blocks())
    assert _expected(tree) == tree.block_log.held


def test_block_log_take_nets_what_came_and_went() -> None:
    log = BlockLog()
    log.store([1, 2, 3])
    log.remove([2])
    log.remove([4])
    log.store([4])  # evicted, then stored again: stored
    assert log.take() == ([1, 3, 4], [2], False)
    assert log.take() == ([], [], False)


def _ev(worker: str, seq: int, stored=(), removed=(), cleared=False, instance: str = "a") -> KvEvents:
    return KvEvents(worker=worker, instance=instance, seq=seq, stored=list(stored), removed=list(removed),
                    cleared=cleared, load=WorkerLoad())  # fmt: skip


def test_index_applies_events_in_order_and_counts_leading_blocks() -> None:
    idx = KvIndex()
    p = block_hashes(list(range(64)))  # 4 blocks
    assert not idx.on_events(_ev("0", 1, stored=p[:3]))
    assert not idx.on_events(_ev("1", 1, stored=p[:1]))
    assert idx.overlaps(p, ["0", "1", "2"]) == {"0": 3, "1": 1, "2": 0}
    assert not idx.on_events(_ev("0", 2, removed=[p[2]]))
    assert not idx.on_events(_ev("0", 2, stored=[p[3]]))  # a duplicate: ignored
    assert idx.overlaps(p, ["0", "1"]) == {"0": 2, "1": 1}
    # what this gateway routed lately counts too
    assert idx.overlaps(p, ["0", "1"], {p[0]: {"1": 1}, p[1]: {"1": 1}}) == {"0": 2, "1": 2}
    assert not idx.on_events(_ev("0", 3, cleared=True, stored=[p[0]]))
    assert idx.overlaps(p, ["0"]) == {"0": 1}
    idx.drop("1")
    assert idx.overlaps(p, ["1"]) == {"1": 0} and p[1] not in idx.holders


def test_index_asks_for_a_snapshot_on_a_gap_and_replays_what_came_meanwhile() -> None:
    idx = KvIndex()
    assert not idx.on_events(_ev("0", 1, stored=[1, 2]))
    assert idx.on_events(_ev("0", 3, stored=[5]))  # 2 is missing
    assert not idx.on_events(_ev("0", 4, stored=[6]))  # kept while syncing
    assert idx.overlaps([1], ["0"]) == {"0": 1}
    # the snapshot is as of seq 3: 4 applies after it, 3 is in it already
    assert not idx.on_snapshot(
        KvSnapshot(worker="0", instance="a", seq=3, blocks=[1, 3, 5], load=WorkerLoad())
    )
    assert idx.overlaps([1, 3, 5, 6], ["0"]) == {"0": 4} and 2 not in idx.holders
    assert not idx.on_events(_ev("0", 5, removed=[1]))
    assert idx.gaps == 1


def test_index_restarts_with_a_new_run_and_syncs_one_met_late() -> None:
    idx = KvIndex()
    idx.on_events(_ev("0", 1, stored=[1, 2]))
    assert not idx.on_events(_ev("0", 1, stored=[9], instance="b"))  # restarted: starts empty
    assert idx.overlaps([1], ["0"]) == {"0": 0} and idx.overlaps([9], ["0"]) == {"0": 1}
    assert idx.on_events(_ev("1", 7, stored=[4]))  # a worker first met past its first message
    # a snapshot of another run does not end the sync
    assert idx.on_snapshot(KvSnapshot(worker="1", instance="zz", seq=9, blocks=[4], load=WorkerLoad()))
    assert not idx.on_snapshot(KvSnapshot(worker="1", instance="a", seq=7, blocks=[4, 8], load=WorkerLoad()))
    assert idx.overlaps([4, 8], ["1"]) == {"1": 2}
