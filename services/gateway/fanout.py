"""Control requests to every scheduler at once: one publish on `<prefix>.ctl.all.<what>`, which every
scheduler subscribes to (no queue group), answered on one private inbox; the gateway gathers the
answers until each worker it expects (those with a live heartbeat) has answered, or the time is up.
Each answer names its worker (`worker_id`); an empty message on the inbox is NATS's notice that nobody
subscribes to the subject, which ends the wait at once."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson

from shared.transport import Message, Transport


@dataclass
class FanOut:
    answers: dict[str, dict[str, Any]] = field(default_factory=dict)  # worker id -> its answer
    missing: list[str] = field(default_factory=list)  # expected workers that did not answer in time

    def ordered(self) -> list[dict[str, Any]]:
        return [self.answers[w] for w in sorted(self.answers)]


async def gather(transport: Transport, subject: str, payload: dict[str, Any], expected: Iterable[str],
                 timeout: float, repeat: float | None = None) -> FanOut:  # fmt: skip
    """Every answer that came within `timeout`; done as soon as all `expected` workers answered (with
    none expected: at the first answer). TimeoutError when nobody answered. `repeat`: publish again
    this often while waiting, for schedulers that subscribe meanwhile (they are still starting)."""
    want = set(expected)
    fan = FanOut()
    complete = asyncio.Event()

    async def on_reply(m: Message) -> None:
        if not m.data:  # NATS's "no responders" notice: no scheduler subscribes (none has started)
            complete.set()
            return
        try:
            answer = orjson.loads(m.data)
            worker = str(answer["worker_id"])
        except (orjson.JSONDecodeError, KeyError, TypeError):
            return
        fan.answers[worker] = answer
        if want <= fan.answers.keys():
            complete.set()

    inbox = transport.new_inbox()
    sub = await transport.subscribe(inbox, on_reply)
    try:
        loop = asyncio.get_running_loop()
        data, deadline = orjson.dumps(payload), loop.time() + timeout
        while not complete.is_set() and (left := deadline - loop.time()) > 0:
            await transport.publish(subject, data, reply=inbox)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(complete.wait(), left if repeat is None else min(repeat, left))
    finally:
        await sub.unsubscribe()
    if not fan.answers:
        raise TimeoutError(f"no scheduler answered {subject} within {timeout:g} s")
    fan.missing = sorted(want - fan.answers.keys())
    return fan


# what a scheduler's server_info reports about its own load: summed over the workers at the top level
_LOAD = ("num_running_reqs", "num_queue_reqs", "num_used_tokens")


def combine_server_info(fan: FanOut) -> dict[str, Any]:
    """`/get_server_info` for several workers: the top level keeps one scheduler's fields (the first
    worker's server arguments, as SGLang reports its first rank's), with the load summed over every
    worker that answered (running, queued, used tokens, `stats`; the hit rate from the summed
    counters) and a KV integrity error of any; `internal_states` has each worker's own answer (SGLang's
    per-rank list) and `missing_workers` the live workers that did not answer."""
    infos = fan.ordered()
    top = dict(infos[0])
    for key in _LOAD:
        top[key] = sum(info.get(key, 0) for info in infos)
    stats: dict[str, Any] = {}
    for info in infos:
        for key, value in info.get("stats", {}).items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                stats[key] = stats.get(key, 0) + value
    top["stats"] = stats
    top["cache_hit_rate"] = stats.get("cached_tokens", 0) / max(1, stats.get("prompt_tokens", 0))
    top["last_gen_throughput"] = sum(info.get("last_gen_throughput", 0.0) for info in infos)
    errors = [f"worker {info['worker_id']}: {info['kv_integrity_error']}" for info in infos
              if info.get("kv_integrity_error")]  # fmt: skip
    top["kv_integrity_error"] = "; ".join(errors) or None
    top["context_length"] = min(info["context_length"] for info in infos)
    top["internal_states"] = infos
    top["missing_workers"] = fan.missing
    return top
