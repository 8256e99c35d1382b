"""The gateway's side of a request: tokenize, publish to the schedulers, collect the detokenizer's
text, and shape SGLang's `/generate` response (one dict per prompt, cumulative text when streaming)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from services.gateway.generate_input import GenerateInput, Prompt, parse_generate_input
from shared.messages import AbortReq, BatchTextOut, Decoder, GenerateReq, encode
from shared.transport import Message, Subjects, Subscription, Transport


@dataclass
class _State:
    rid: str
    prompt_tokens: int
    created: float
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    finished: bool = False
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    updated: float = field(default_factory=time.monotonic)  # last output, for the lost-request check
    published: float = 0.0  # perf_counter when the request went on the bus

    def response(self) -> dict[str, Any]:
        meta = {
            "id": self.rid,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": len(self.output_ids),
            "cached_tokens": 0,
            "finish_reason": None,
            **self.meta,
        }
        if self.finished:
            meta["e2e_latency"] = time.time() - self.created
        return {"text": self.text, "output_ids": list(self.output_ids), "meta_info": meta}


class RequestManager:
    def __init__(
        self,
        tokenizer: Any,
        transport: Transport,
        subject_prefix: str,
        vocab_size: int,
        context_len: int | None = None,
        gateway_id: str | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.context_len = context_len
        self.transport = transport
        self.subjects = Subjects(subject_prefix)
        self.vocab_size = vocab_size
        self.out_subject = self.subjects.out(gateway_id or uuid.uuid4().hex[:12])
        self._states: dict[str, _State] = {}
        self._dec = Decoder(BatchTextOut)
        self._sub: Subscription | None = None
        # bus_s: summed time from publishing a request to its final output arriving (the bus path:
        # scheduler, detokenizer and their NATS hops); with one request in flight, minus the
        # scheduler's step time, it is what the bus adds (benchmarks/bus_latency.py)
        self.stats: dict[str, float] = {"finished": 0, "bus_s": 0.0}

    async def start(self) -> None:
        self._sub = await self.transport.subscribe(self.out_subject, self._on_text)

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()

    # -- requests -----------------------------------------------------------------------------
    async def generate(self, obj: dict[str, Any] | GenerateInput) -> dict[str, Any] | list[dict[str, Any]]:
        req = obj if isinstance(obj, GenerateInput) else parse_generate_input(obj)
        return await self.wait(req, await self.submit(req))

    async def generate_stream(self, obj: dict[str, Any] | GenerateInput) -> AsyncIterator[dict[str, Any]]:
        req = obj if isinstance(obj, GenerateInput) else parse_generate_input(obj)
        async for chunk in self.stream(req, await self.submit(req)):
            yield chunk

    async def submit(self, req: GenerateInput) -> list[_State]:
        """Tokenize, validate and publish every prompt; ValueError (nothing published) on bad input."""
        states, msgs = [], []
        for p in req.prompts:
            ids = self._tokenize(p)
            p.sampling.verify(self.vocab_size)
            todo = p.sampling.unsupported()
            if todo:
                raise ValueError(
                    f"sampling parameter(s) {', '.join(todo)} cannot be honoured yet; leave them unset"
                )
            if self.context_len is not None and len(ids) >= self.context_len:
                limit = self.context_len - 1
                raise ValueError(f"the prompt has {len(ids)} tokens; at most {limit} fit the context length")
            if p.rid in self._states:
                raise ValueError(f"rid {p.rid!r} is already in use")
            now = time.time()
            states.append(_State(p.rid, len(ids), now))
            msgs.append(GenerateReq(rid=p.rid, input_ids=ids, sampling=p.sampling,
                                    out_subject=self.out_subject, created=now))  # fmt: skip
        for st, msg in zip(states, msgs, strict=True):
            self._states[st.rid] = st
            st.published = time.perf_counter()
            await self.transport.publish(self.subjects.req, encode(msg))
        return states

    async def wait(self, req: GenerateInput, states: list[_State]) -> dict[str, Any] | list[dict[str, Any]]:
        try:
            for st in states:
                while not st.finished:
                    await st.changed.wait()
                    st.changed.clear()
        finally:
            await self._forget(states)
        results = [st.response() for st in states]
        return results if req.is_batch else results[0]

    async def stream(self, req: GenerateInput, states: list[_State]) -> AsyncIterator[dict[str, Any]]:
        """Chunks with the cumulative text and output ids of one prompt; batch chunks carry `index`."""
        pending = {asyncio.ensure_future(st.changed.wait()): i for i, st in enumerate(states)}
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for fut in done:
                    i = pending.pop(fut)
                    st = states[i]
                    st.changed.clear()
                    chunk = st.response()
                    if req.is_batch:
                        chunk["index"] = i
                    yield chunk
                    if not st.finished:
                        pending[asyncio.ensure_future(st.changed.wait())] = i
        finally:
            for fut in pending:
                fut.cancel()
            await self._forget(states)

    def fail(self, message: str, rids: list[str] | None = None) -> None:
        """End in-flight requests with an abort carrying `message` (a service they depend on died)."""
        for rid in list(self._states) if rids is None else rids:
            st = self._states.get(rid)
            if st is not None and not st.finished:
                st.meta["finish_reason"] = {"type": "abort", "message": message, "status_code": 503}
                st.finished = True
                st.changed.set()

    def quiet_rids(self, seconds: float) -> list[str]:
        """Unfinished requests that got no output for `seconds`."""
        now = time.monotonic()
        return [rid for rid, st in self._states.items() if not st.finished and now - st.updated > seconds]

    def active_rids(self) -> list[str]:
        return [rid for rid, st in self._states.items() if not st.finished]

    @property
    def in_flight(self) -> int:
        return len(self._states)

    async def abort(self, rids: list[str]) -> None:
        await self.transport.publish(self.subjects.abort, encode(AbortReq(rids=rids)))

    def _tokenize(self, p: Prompt) -> list[int]:
        if p.input_ids is not None:
            bad = [t for t in p.input_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(
                    f"input_ids contains token id(s) {bad[:5]} outside the vocabulary [0, {self.vocab_size})"
                )
            return p.input_ids
        return self.tokenizer.encode(p.text)

    async def _forget(self, states: list[_State]) -> None:
        unfinished = [st.rid for st in states if not st.finished]
        for st in states:
            self._states.pop(st.rid, None)
        if unfinished:  # the caller went away: free the scheduler's KV for these
            await asyncio.shield(self.abort(unfinished))

    # -- detokenizer output -------------------------------------------------------------------
    async def _on_text(self, m: Message) -> None:
        for out in self._dec(m.data).outs:
            st = self._states.get(out.rid)
            if st is None or st.finished:
                continue
            st.updated = time.monotonic()
            if out.offset != len(st.output_ids):  # NATS is at-most-once: fail loudly, never a gap
                self.fail(f"{out.offset - len(st.output_ids)} output tokens lost on the bus", [st.rid])
                await self.abort([st.rid])
                continue
            st.text += out.text
            st.output_ids.extend(out.output_ids)
            if out.finished:
                st.meta.update(out.meta)
                st.finished = True
                self.stats["finished"] += 1
                self.stats["bus_s"] += time.perf_counter() - st.published
            st.changed.set()
