"""Prefix-cache blocks as the router sees them: a token sequence cut into blocks of BLOCK_TOKENS
tokens, each named by a hash chained over everything before it, so two sequences share a block hash
exactly when they share every token up to that block's end (up to hash collisions, 1 in 2^64).

A scheduler publishes the hashes of the blocks its radix cache stores and evicts (`shared.messages.
KvEvents`); a gateway hashes a prompt the same way and counts, per worker, how many leading blocks
that worker holds. Only whole blocks count: a cached prefix is seen rounded down to a block.

The hash of a block is CPython's `hash((parent, *tokens))` of the parent block's hash (0 for the
first block) and its token ids: deterministic across processes and hosts (int and tuple hashes are
not salted), a signed 64-bit int, and 3.5x cheaper than blake2b in Python (54 against 187 us for 2048
tokens). Every service of a deployment must therefore run a 64-bit CPython (3.8 or later)."""

from __future__ import annotations

from collections.abc import Sequence

BLOCK_TOKENS = 16


def block_hashes(tokens: Sequence[int], parent: int = 0, start: int = 0, end: int | None = None) -> list[int]:
    """The chained hashes of the whole blocks of tokens[start:end] (`start` a multiple of
    BLOCK_TOKENS; `parent`: the hash of the block that ends at `start`, 0 when it is 0)."""
    stop = len(tokens) if end is None else min(end, len(tokens))
    out = []
    for i in range(start, stop - BLOCK_TOKENS + 1, BLOCK_TOKENS):
        parent = hash((parent, *tokens[i : i + BLOCK_TOKENS]))
        out.append(parent)
    return out
