"""Which part of the model a tensor-parallel rank holds: its attention heads (whole GQA groups, or a
share of one group when there are fewer KV heads than ranks), its slice of each MLP and of the
vocabulary. Splits are as even as the shapes allow; an uneven one (9 heads over 2 ranks) gives the
first ranks one more, so any head count whose KV heads divide among the ranks (or the ranks among
them) works."""

from __future__ import annotations

from dataclasses import dataclass


def split(n: int, rank: int, size: int) -> tuple[int, int]:
    """(start, count) of rank's share of n items, the first n % size ranks taking one more."""
    base, extra = divmod(n, size)
    return rank * base + min(rank, extra), base + (rank < extra)


@dataclass(frozen=True)
class Heads:
    """A rank's attention heads: q heads q_start.. (q_count of them), KV heads kv_start.. (kv_count)."""

    q_start: int
    q_count: int
    kv_start: int
    kv_count: int


def split_heads(num_heads: int, num_kv_heads: int, rank: int, size: int) -> Heads:
    """A rank's heads. Its q heads always use only its own KV heads: with at least as many KV heads
    as ranks each rank takes whole groups; with fewer, each KV head is replicated on size / kv ranks
    that share its group's q heads."""
    group = num_heads // num_kv_heads
    if num_kv_heads >= size:
        kv_start, kv_count = split(num_kv_heads, rank, size)
        return Heads(kv_start * group, kv_count * group, kv_start, kv_count)
    if size % num_kv_heads or group < size // num_kv_heads:
        raise ValueError(
            f"tp_size {size} does not divide {num_heads} attention heads with {num_kv_heads} KV heads: "
            f"use a tp_size that divides {num_kv_heads} or a multiple of it up to {num_heads}"
        )
    replicas = size // num_kv_heads
    kv = rank // replicas
    start, count = split(group, rank % replicas, replicas)
    return Heads(kv * group + start, count, kv, 1)


def check_heads(num_heads: int, num_kv_heads: int, size: int) -> None:
    """ValueError (naming the fix) when `size` ranks cannot share these heads, or one would have none."""
    if size > num_heads:
        raise ValueError(f"tp_size {size} is larger than the model's {num_heads} attention heads")
    for rank in range(size):
        split_heads(num_heads, num_kv_heads, rank, size)


@dataclass(frozen=True)
class Shard:
    """Rank `rank` of `size`: what it holds of each split dimension."""

    rank: int = 0
    size: int = 1

    def heads(self, num_heads: int, num_kv_heads: int) -> Heads:
        return split_heads(num_heads, num_kv_heads, self.rank, self.size)

    def slice(self, n: int) -> tuple[int, int]:
        """(start, count) of an MLP's intermediate width n (or any other evenly shared dimension)."""
        return split(n, self.rank, self.size)

    def vocab(self, vocab_size: int) -> tuple[int, int]:
        """(start, rows): the rank's rows of the embedding and LM head. Every rank has the same number
        of rows (padded past the vocabulary, zeros never looked up), so the logits all-gather."""
        rows = -(-vocab_size // self.size)
        return self.rank * rows, rows


SINGLE = Shard()
