"""Which decoding requests share a long cached prefix, for the cascade decode kernel
(sglbus_kernels/cascade_attention.py; `--enable-cascade-attention`, backends with `supports_cascade`).

The radix cache already knows: a running request locks every node from its last cached node up to
the root, so a node's lock_ref counts the running requests whose prompt passes through it. A request
joins the deepest node on its path that at least CASCADE_MIN_GROUP running requests pass through and
that ends at least CASCADE_MIN_PREFIX tokens in; the requests of this step that joined the same node
form a group (kept if it still has CASCADE_MIN_GROUP members here). Each member's req_to_token row
holds the node's slots for its first `prefix_len` tokens (admission copies the cached slots; a
request's own prefill is swapped for the cached ones when it is inserted), so one row serves the tile.
Per step this walks each decode's path to the root: a few nodes each.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.scheduler.host_copy import to_device
from services.scheduler.radix_cache import TreeNode
from services.scheduler.request import Req
from sglbus_kernels.cascade_plan import CascadePlan, block_r

CASCADE_MIN_GROUP = 8  # members sharing the prefix, in the tree and in the step
CASCADE_MIN_PREFIX = 256  # tokens of shared prefix


def _group_node(req: Req) -> tuple[TreeNode, int] | None:
    """The deepest node of req's cached path shared by enough running requests, and its end."""
    path: list[TreeNode] = []
    node: TreeNode | None = req.last_node
    while node is not None and node.parent is not None:  # stop at the root
        path.append(node)
        node = node.parent
    end = sum(len(n.key) for n in path)
    for n in path:  # deepest first
        if n.lock_ref >= CASCADE_MIN_GROUP and end >= CASCADE_MIN_PREFIX:
            return n, end
        end -= len(n.key)
    return None


class CascadePlanner:
    """The scheduler's side (built with `--enable-cascade-attention` for a backend that reads the
    plan, `supports_cascade`): tiles sized for the model's GQA group."""

    def __init__(self, device: torch.device, num_heads: int, num_kv_heads: int) -> None:
        self.device = device
        self.tile = block_r(device, num_heads // num_kv_heads)

    def plan(self, decodes: Sequence[Req]) -> CascadePlan | None:
        return plan_cascade(decodes, self.tile, self.device)


def plan_cascade(decodes: Sequence[Req], block_r: int, device: torch.device) -> CascadePlan | None:
    """A plan over the step's decode rows (batch indices 0..len(decodes)-1), or None without a group."""
    if len(decodes) < CASCADE_MIN_GROUP:
        return None
    groups: dict[int, tuple[int, list[int]]] = {}
    for i, r in enumerate(decodes):
        if r.last_node is None:
            continue
        found = _group_node(r)
        if found is not None:
            node, end = found
            groups.setdefault(id(node), (end, []))[1].append(i)
    groups = {k: g for k, g in groups.items() if len(g[1]) >= CASCADE_MIN_GROUP}
    if not groups:
        return None
    starts = [0] * len(decodes)
    members: list[int] = []
    first: list[int] = []
    count: list[int] = []
    length: list[int] = []
    rows: list[int] = []
    for end, idx in groups.values():
        for i in idx:
            starts[i] = end
        for a in range(0, len(idx), block_r):
            tile = idx[a : a + block_r]
            first.append(len(members))
            count.append(len(tile))
            length.append(end)
            rows.append(decodes[tile[0]].row)
            members.extend(tile)
    t = len(first)
    packed = to_device(starts + members + first + count + length + rows, torch.int64, device)
    kv_starts, members_d, first_d, count_d, len_d, rows_d = packed.split(
        (len(starts), len(members), t, t, t, t)
    )
    return CascadePlan(kv_starts, members_d, first_d, count_d, len_d, rows_d, t, block_r)
