"""The prefix-cache interface the scheduler talks to, and its two implementations.

    RadixPrefixCache   RadixAttention (radix_cache.py): finished and prefilled requests leave their KV
                       in a tree that later requests match; unlocked leaves are evicted LRU
    NoPrefixCache      `--disable-radix-cache`: nothing is shared, a finished request's KV goes
                       straight back to the pool

A request's slots are always in exactly one place (memory.py); these two methods are where they move:

    cache_unfinished(req, n)  after a prefill chunk: share its first n computed tokens (radix: insert,
                            point the request's row at the cached copies, move its lock down the tree);
                            n, not num_computed: under overlap scheduling its next chunk may be in flight
    cache_finished(req)     the request is done or retracted: hand its KV over (radix: insert, free our
                            duplicates, unlock) or free it (none), and give back its req_to_token row
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from services.scheduler.memory import KVPool, ReqToTokenPool
from services.scheduler.radix_cache import MatchResult, RadixCache, TreeNode
from services.scheduler.request import Req


class PrefixCache(ABC):
    shares = True  # False: matches are always empty (the admission policy falls back to fcfs)

    def __init__(self, kv: KVPool, req_to_token: ReqToTokenPool) -> None:
        self.kv, self.req_to_token = kv, req_to_token

    @abstractmethod
    def match_prefix(self, key: Sequence[int]) -> MatchResult: ...

    @abstractmethod
    def inc_lock_ref(self, node: TreeNode) -> None: ...

    @abstractmethod
    def dec_lock_ref(self, node: TreeNode) -> None: ...

    @abstractmethod
    def cache_unfinished(self, req: Req, n: int) -> None: ...

    @abstractmethod
    def cache_finished(self, req: Req) -> None: ...

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least num_tokens unlocked slots if there are that many; returns how many."""

    @abstractmethod
    def evictable_size(self) -> int: ...

    @abstractmethod
    def total_size(self) -> int: ...

    @abstractmethod
    def all_slots(self) -> torch.Tensor:
        """Every slot the cache holds (on the pool's device)."""

    @abstractmethod
    def reset(self) -> None:
        """Free everything the cache holds."""

    def _release_row(self, req: Req) -> None:
        self.req_to_token.free(req.row)
        req.row, req.last_node = None, None


class RadixPrefixCache(RadixCache, PrefixCache):
    def __init__(self, kv: KVPool, req_to_token: ReqToTokenPool) -> None:
        PrefixCache.__init__(self, kv, req_to_token)
        RadixCache.__init__(self, kv.free, device=kv.device)

    def cache_unfinished(self, req: Req, n: int) -> None:
        table = self.req_to_token.table
        key, slots = req.fill[:n], table[req.row, :n].clone()
        prefix = self.insert(key, slots)
        self.kv.free(slots[req.num_cached : prefix])  # our duplicates of what another request cached
        match = self.match_prefix(key)
        self.req_to_token.write(req.row, 0, match.indices)
        self.inc_lock_ref(match.last_node)
        self.dec_lock_ref(req.last_node)
        req.last_node, req.num_cached = match.last_node, n

    def cache_finished(self, req: Req) -> None:
        n = req.num_computed
        slots = self.req_to_token.table[req.row, :n].clone()
        prefix = self.insert(req.fill[:n], slots)
        self.kv.free(slots[req.num_cached : prefix])
        self.dec_lock_ref(req.last_node)
        self._release_row(req)


class NoPrefixCache(PrefixCache):
    shares = False

    def __init__(self, kv: KVPool, req_to_token: ReqToTokenPool) -> None:
        super().__init__(kv, req_to_token)
        self._root = TreeNode([], self._empty(), None, lock_ref=1)

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.kv.device)

    def match_prefix(self, key: Sequence[int]) -> MatchResult:
        return MatchResult(self._empty(), self._root)

    def inc_lock_ref(self, node: TreeNode) -> None:
        pass

    def dec_lock_ref(self, node: TreeNode) -> None:
        pass

    def cache_unfinished(self, req: Req, n: int) -> None:
        pass

    def cache_finished(self, req: Req) -> None:
        self.kv.free(self.req_to_token.table[req.row, : req.num_computed].clone())
        self._release_row(req)

    def evict(self, num_tokens: int) -> int:
        return 0

    def evictable_size(self) -> int:
        return 0

    def total_size(self) -> int:
        return 0

    def all_slots(self) -> torch.Tensor:
        return self._empty()

    def reset(self) -> None:
        pass


def make_prefix_cache(disable: bool, kv: KVPool, req_to_token: ReqToTokenPool) -> PrefixCache:
    return (NoPrefixCache if disable else RadixPrefixCache)(kv, req_to_token)
