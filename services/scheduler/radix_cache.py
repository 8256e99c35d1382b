"""RadixAttention's prefix cache (SGLang paper §3) over a token-level KV pool (page size 1).

The tree maps token-id sequences to the KV-pool slots that hold their keys/values, so a new request
whose prompt shares a prefix with an earlier one reuses those slots instead of recomputing them.
Each edge stores a run of tokens (``key``) and the slots for exactly those tokens (``value``).

The tree never talks to the pool directly: eviction hands slots back through ``free_slots``, so
the pool class (and its device) can change without touching this file.

Lock refs on a path — why a running request locks its whole prefix, not just its last node::

    root (lock_ref 1, always)
     └── [The, cat]            lock 2   <- shared by req A and req B
          ├── [sat, on]        lock 1   <- req A's last_node
          └── [ran, off, to]   lock 1   <- req B's last_node

A request reads the KV of *every* token from the root to its last node, so each node on that path
must outlive the request. Evicting an ancestor while a descendant survives would also break the
invariant that the tree is prefix-closed (a match walks edges from the root). inc_lock_ref walks
last_node..root adding 1, so a node's lock_ref counts the running requests that pass through it;
only nodes with lock_ref 0 are evictable, and a parent's count is always >= each child's.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import torch

from shared.kv_blocks import BLOCK_TOKENS, block_hashes


class TreeNode:
    __slots__ = ("children", "key", "value", "parent", "lock_ref", "last_access_time", "access_seq",
                 "depth", "blocks")  # fmt: skip

    def __init__(self, key: list[int], value: torch.Tensor, parent: TreeNode | None, lock_ref: int = 0):
        self.children: dict[int, TreeNode] = {}  # keyed by the first token of the child's edge
        self.key = key
        self.value = value
        self.parent = parent
        self.lock_ref = lock_ref
        self.last_access_time = 0.0
        # monotonic() can return equal values for back-to-back touches; the counter makes LRU exact.
        self.access_seq = 0
        # with a BlockLog: tokens above this edge, and the hashes of the blocks that end on it
        self.depth = 0
        self.blocks: list[int] = []

    def __repr__(self) -> str:
        return f"TreeNode(key={self.key}, lock_ref={self.lock_ref})"


class MatchResult(NamedTuple):
    indices: torch.Tensor  # int64 slots of the matched prefix (empty when nothing matched)
    last_node: TreeNode  # deepest node of the match (root when nothing matched)


def _common_prefix_len(edge: list[int], key: list[int], start: int) -> int:
    n = min(len(edge), len(key) - start)
    i = 0
    while i < n and edge[i] == key[start + i]:
        i += 1
    return i


class BlockLog:
    """The blocks (shared/kv_blocks.py) a tree stored and evicted since the last `take`: what its
    scheduler publishes for the routers (services/scheduler/kv_events.py). `held`: every block in the
    tree now."""

    def __init__(self) -> None:
        self.stored: list[int] = []
        self.removed: list[int] = []
        self.cleared = False
        self.held: set[int] = set()

    def store(self, blocks: list[int]) -> None:
        self.stored += blocks
        self.held.update(blocks)

    def remove(self, blocks: list[int]) -> None:
        self.removed += blocks
        self.held.difference_update(blocks)

    def clear(self) -> None:
        self.stored, self.removed, self.cleared = [], [], True
        self.held = set()

    def take(self) -> tuple[list[int], list[int], bool]:
        """What changed since the last take, netted against what the tree holds now (a block evicted
        and stored again is stored; one stored and evicted again is removed), so the three apply in
        any order: cleared, then stored and removed."""
        held = self.held
        stored = list(dict.fromkeys(h for h in self.stored if h in held))
        removed = list(dict.fromkeys(h for h in self.removed if h not in held))
        out = (stored, removed, self.cleared)
        self.stored, self.removed, self.cleared = [], [], False
        return out


class RadixCache:
    shares = True  # matches can be non-empty (prefix_cache.NoPrefixCache: never)

    def __init__(self, free_slots: Callable[[torch.Tensor], None], device: torch.device | str = "cpu"):
        self.free_slots = free_slots
        self._empty = torch.empty(0, dtype=torch.int64, device=device)
        self._seq = itertools.count(1)
        self.block_log: BlockLog | None = None  # set by a scheduler that publishes its blocks
        self._reset_tree()

    def _reset_tree(self) -> None:
        """Empty the tree WITHOUT freeing slots (reset() is the variant that frees)."""
        # root is permanently "locked" so evict/lock walks can stop there and it is never a victim.
        self.root = TreeNode([], self._empty, None, lock_ref=1)
        self._touch(self.root)
        self._evictable = 0
        self._protected = 0
        self._leaves: set[TreeNode] = set()  # non-root nodes without children (eviction candidates)

    # ------------------------------------------------------------------ lookup / insert
    def match_prefix(self, key: Sequence[int]) -> MatchResult:
        if len(key) == 0:
            return MatchResult(self._empty, self.root)
        key = self._as_list(key)
        node, i, parts = self.root, 0, []
        while i < len(key) and key[i] in node.children:
            child = node.children[key[i]]
            self._touch(child)
            n = _common_prefix_len(child.key, key, i)
            if n < len(child.key):
                # Split so the caller can lock exactly the matched prefix, not the whole edge.
                child = self._split(child, n)
            parts.append(child.value)
            i += n
            node = child
        indices = torch.cat(parts) if parts else self._empty
        return MatchResult(indices, node)

    def insert(self, key: Sequence[int], value: torch.Tensor) -> int:
        if len(key) == 0:
            return 0
        key = self._as_list(key)
        assert value.dim() == 1 and len(value) == len(key), "value must hold one slot per key token"
        node, i = self.root, 0
        while i < len(key) and key[i] in node.children:
            child = node.children[key[i]]
            self._touch(child)
            n = _common_prefix_len(child.key, key, i)
            if n < len(child.key):
                child = self._split(child, n)
            i += n
            node = child
        if i < len(key):
            # clone: a slice would pin the caller's whole tensor and alias memory it may reuse.
            leaf = TreeNode(key[i:], value[i:].to(torch.int64).clone(), node)
            if self.block_log is not None:
                leaf.depth, leaf.blocks = i, self._new_blocks(node, key, i)
                self.block_log.store(leaf.blocks)
            self._touch(leaf)
            node.children[key[i]] = leaf
            self._evictable += len(leaf.key)  # a fresh leaf is unlocked even under a locked parent
            self._leaves.discard(node)
            self._leaves.add(leaf)
        return i

    # ------------------------------------------------------------------ eviction / locking
    def evict(self, num_tokens: int) -> int:
        # (time, seq, node) entries: tuples compare in C; access_seq is unique, so nodes never compare
        # (a heap of the nodes themselves compared in Python: ms per step on a GPU host)
        heap = [(n.last_access_time, n.access_seq, n) for n in self._leaves if n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            node = heapq.heappop(heap)[2]
            self.free_slots(node.value)
            if self.block_log is not None:
                self.block_log.remove(node.blocks)
            freed += len(node.value)
            parent = node.parent
            assert parent is not None
            del parent.children[node.key[0]]
            node.parent = None
            self._evictable -= len(node.key)
            self._leaves.discard(node)
            # Cascade: once its last child is gone the parent is itself an LRU candidate.
            if parent is not self.root and not parent.children:
                self._leaves.add(parent)
                if parent.lock_ref == 0:
                    heapq.heappush(heap, (parent.last_access_time, parent.access_seq, parent))
        return freed

    def inc_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.lock_ref += 1
            assert node.parent is not None, "locking a node that was evicted"
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root:
            assert node.lock_ref > 0, "dec_lock_ref without matching inc_lock_ref"
            if node.lock_ref == 1:
                self._protected -= len(node.key)
                self._evictable += len(node.key)
            node.lock_ref -= 1
            assert node.parent is not None
            node = node.parent

    # ------------------------------------------------------------------ sizes / maintenance
    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def total_size(self) -> int:
        return self._evictable + self._protected

    def reset(self) -> None:
        slots = self.all_slots()
        if len(slots):
            self.free_slots(slots)
        self._reset_tree()
        if self.block_log is not None:
            self.block_log.clear()

    def all_blocks(self) -> list[int]:
        """The hashes of every block the tree holds (with a BlockLog)."""
        return [h for n in self._walk() for h in n.blocks]

    def all_slots(self) -> torch.Tensor:
        parts = [n.value for n in self._walk() if n is not self.root]
        return torch.cat(parts) if parts else self._empty

    def pretty(self) -> str:
        lines = [f"root  evictable={self._evictable} protected={self._protected}"]

        def rec(node: TreeNode, indent: str) -> None:
            kids = list(node.children.values())
            for j, c in enumerate(kids):
                last = j == len(kids) - 1
                k = c.key if len(c.key) <= 8 else [*c.key[:8], "..."]
                lines.append(
                    f"{indent}{'└── ' if last else '├── '}{k} len={len(c.key)} lock={c.lock_ref} "
                    f"slots={c.value[:8].tolist()}{'...' if len(c.value) > 8 else ''}"
                )
                rec(c, indent + ("    " if last else "│   "))

        rec(self.root, "")
        return "\n".join(lines)

    # ------------------------------------------------------------------ internals
    def _touch(self, node: TreeNode) -> None:
        node.last_access_time = time.monotonic()
        node.access_seq = next(self._seq)

    @staticmethod
    def _as_list(key: Sequence[int]) -> list[int]:
        # a tensor's elements are 0-d tensors that hash by identity, so convert to plain ints
        return key.tolist() if isinstance(key, torch.Tensor) else list(key)

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut child's edge after n tokens; return the new upper node (which ends at the cut)."""
        parent = child.parent
        assert parent is not None and 0 < n < len(child.key)
        # The upper half inherits lock_ref: every request locking child also covers these tokens,
        # so evictable/protected stay exact with no counter change.
        # Views are safe here: the shared base is our own copy (cloned at insert), not caller memory.
        new = TreeNode(child.key[:n], child.value[:n], parent, lock_ref=child.lock_ref)
        new.last_access_time, new.access_seq = child.last_access_time, child.access_seq
        if child.blocks:  # the blocks that end above the cut go up with it
            upper = max(0, (child.depth + n) // BLOCK_TOKENS - child.depth // BLOCK_TOKENS)
            new.blocks, child.blocks = child.blocks[:upper], child.blocks[upper:]
        new.depth = child.depth
        child.depth += n
        new.children = {child.key[n]: child}
        parent.children[child.key[0]] = new
        child.key = child.key[n:]
        child.value = child.value[n:]
        child.parent = new
        return new  # never a leaf, so the leaf set is unchanged

    def _new_blocks(self, node: TreeNode, key: list[int], i: int) -> list[int]:
        """The hashes of the blocks of `key` that end past `i`, where a new leaf below `node` (which
        ends at token i) begins; chained from the hash of the block that ends at or before i."""
        start = i // BLOCK_TOKENS * BLOCK_TOKENS
        if start + BLOCK_TOKENS > len(key):
            return []
        return block_hashes(key, self._block_ending(node, start), start)

    @staticmethod
    def _block_ending(node: TreeNode, pos: int) -> int:
        """The hash of the block that ends at token `pos` on the path up from `node` (0 for pos 0)."""
        while pos > 0:
            if node.depth < pos <= node.depth + len(node.key):
                first_end = (node.depth // BLOCK_TOKENS + 1) * BLOCK_TOKENS
                return node.blocks[(pos - first_end) // BLOCK_TOKENS]
            assert node.parent is not None
            node = node.parent
        return 0

    def _walk(self) -> Iterator[TreeNode]:
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _check_sizes(self) -> None:
        """Recompute every maintained quantity from scratch and assert the counters match."""
        evictable = protected = 0
        leaves = set()
        for node in self._walk():
            for tok, c in node.children.items():
                assert c.parent is node and c.key and c.key[0] == tok
                assert len(c.key) == len(c.value) and c.value.dtype == torch.int64
                assert 0 <= c.lock_ref and (node is self.root or c.lock_ref <= node.lock_ref)
            if node is self.root:
                assert node.lock_ref == 1 and not node.key
                continue
            if node.lock_ref:
                protected += len(node.key)
            else:
                evictable += len(node.key)
            if not node.children:
                leaves.add(node)
        assert (evictable, protected) == (self._evictable, self._protected), (
            f"counters ({self._evictable}, {self._protected}) != recomputed ({evictable}, {protected})"
        )
        assert leaves == self._leaves
