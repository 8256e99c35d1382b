"""The gateway's side of a request: tokenize, publish to the schedulers, collect the detokenizer's
text into typed request states (`request_state.py`), and hand them out finished (`wait`) or as typed
deltas while they run (`stream`); `generate` / `generate_stream` shape them as SGLang's `/generate`
(`sglang_shape.py`), the OpenAI API as its own (`openai_responses.py`).

Requests go into the schedulers' work queue, which keeps each one until this gateway acknowledges it
with its final output. A request whose worker died, or whose output the bus lost, comes back as a new
attempt that starts over: a JSON response is simply built from the new attempt; a stream that has
already sent tokens cannot continue with a different sample, so it ends with an error instead.
Output that nobody here waits for any more (its client went away, or the gateway failed it while its
worker was down, and the abort went to a scheduler that then died) still arrives on this gateway's own
subject when a new attempt of it runs: that attempt is aborted, once, and its final output settles it.
Tokenizing a long prompt runs on a thread, never on the event loop."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from services.gateway import sglang_shape
from services.gateway.body_parser import BodyParser
from services.gateway.generate_input import GenerateInput, Prompt, check_states, parse_generate_input
from services.gateway.image_inputs import ImageInputs, prompt_images
from services.gateway.prompt_tokens import PromptTokens
from services.gateway.request_prep import check_logprobs, logprob_factory, nth_sample, warm_prompt
from services.gateway.request_state import Delta, RequestState
from services.gateway.router.router import Dispatch, Route, Router
from shared.finish import Abort, describe
from shared.grammar_text import check_grammar, grammar_of
from shared.messages import MAX_DELIVERIES, AbortReq, BatchTextOut, Decoder, GenerateReq, TextOut, encode
from shared.reasoning_parser import reasoning_end
from shared.transport import ACK, BusUnavailable, Message, Subjects, Subscription, Transport

T = TypeVar("T")

if TYPE_CHECKING:
    from services.gateway.metrics import GatewayMetrics
    from shared.messages import ImageInput

log = logging.getLogger(__name__)


class NotAccepting(BusUnavailable):
    """The gateway takes no new requests (it is shutting down, or it has `max_inflight_requests` in
    flight): answered 503 with Retry-After, as a bus that cannot take one; the client may retry
    elsewhere or later."""

    status = 503


class OverClientLimit(NotAccepting):
    """This client has `max_inflight_per_client` requests in flight: 429 with Retry-After (the others
    are still served)."""

    status = 429


# prompts longer than this (characters or ids) are tokenized and checked on a thread
_OFF_LOOP_LEN = 8192
_ABORTED_KEPT = 10_000  # rids aborted lately, so that a stray attempt's outputs bring one abort each


class RequestManager:
    def __init__(
        self,
        tokenizer: Any,
        transport: Transport,
        subject_prefix: str,
        vocab_size: int,
        context_len: int | None = None,
        gateway_id: str | None = None,
        reasoning_parser: str | None = None,
        max_request_states: int = 4096,
        max_inflight: int = 16384,
        max_inflight_per_client: int | None = None,
        images: ImageInputs | None = None,
    ) -> None:
        """reasoning_parser: the server's --reasoning-parser, whose end tag a request with
        require_reasoning holds its grammar back for (None: such a request is refused).
        max_request_states: prompts x n per request (400 past it); max_inflight: requests in flight
        here (503 past it): one client's request cannot make millions of states.
        images: a vision-language model's image handling (None: a text model; image_data is refused)."""
        self.images = images
        self.max_request_states, self.max_inflight = max_request_states, max_inflight
        self.max_per_client = max_inflight_per_client
        self._per_owner: Counter[str] = Counter()  # requests in flight per owner (its states)
        self.tokenizer = tokenizer
        self.reasoning_parser = reasoning_parser
        self.prompt_tokens = PromptTokens(tokenizer, vocab_size, context_len)
        self.transport = transport
        self.subjects = Subjects(subject_prefix)
        self.vocab_size = vocab_size
        self.gateway_id = gateway_id or uuid.uuid4().hex[:12]
        self.out_subject = self.subjects.out(self.gateway_id)
        # the bus's request ids are this gateway's own (the client's rid is a label): two clients, or two
        # gateways, never share one, and a reused label is a new request; the boot part keeps a
        # restarted gateway's ids apart from its last run's, still in the work queue
        boot = uuid.uuid4().hex[:6]
        self._ids = (f"{self.gateway_id}-{boot}-{n}" for n in itertools.count())
        self._states: dict[str, RequestState] = {}
        self._labels: dict[tuple[str, str], RequestState] = {}  # (owner, label) of those in flight
        self._dec = Decoder(BatchTextOut)
        self._sub: Subscription | None = None
        # bus_s: summed time from publishing a request to its final output arriving (the bus path:
        # scheduler, detokenizer and their NATS hops); with one request in flight, minus the
        # scheduler's step time, it is what the bus adds (benchmarks/bus_latency.py)
        self.stats: dict[str, float] = {"finished": 0, "bus_s": 0.0}
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize")
        self.bodies = BodyParser(vocab_size, max_request_states)
        self.metrics: GatewayMetrics | None = None  # the gateway's /metrics (the offline Engine has none)
        # which worker runs each request (the served gateway's); None: the shared lane of the queue
        self.router: Router | None = None
        self.refusing: str | None = None  # why new requests are refused (shutting down), or None
        # rid -> the highest attempt an abort was sent for: a later attempt runs on a scheduler that
        # never heard that abort (the one that had it died), and is aborted again
        self._aborted: OrderedDict[str, int] = OrderedDict()

    @property
    def context_len(self) -> int | None:
        return self.prompt_tokens.context_len

    @context_len.setter
    def context_len(self, n: int | None) -> None:  # the gateway learns it from a scheduler at start
        self.prompt_tokens.context_len = n

    async def start(self) -> None:
        self._sub = await self.transport.subscribe(self.out_subject, self._on_text)
        # decodes the whole vocabulary once (~0.4 s): now, off the loop, not during a first long prompt
        await asyncio.get_running_loop().run_in_executor(self._pool, self.prompt_tokens.max_token_chars)

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
        self._pool.shutdown(wait=False, cancel_futures=True)
        await self.bodies.stop()

    # -- requests -----------------------------------------------------------------------------
    async def generate(self, obj: dict[str, Any] | GenerateInput) -> dict[str, Any] | list[dict[str, Any]]:
        """SGLang's `/generate` response (a dict, or a list for batch input or n > 1)."""
        req = obj if isinstance(obj, GenerateInput) else parse_generate_input(obj)
        return sglang_shape.results(await self.wait(await self.submit(req)), req.is_batch)

    async def generate_stream(self, obj: dict[str, Any] | GenerateInput) -> AsyncIterator[dict[str, Any]]:
        """SGLang's `/generate` stream chunks (cumulative; batch chunks carry `index`)."""
        req = obj if isinstance(obj, GenerateInput) else parse_generate_input(obj)
        async for event in self.stream(await self.submit(req)):
            yield sglang_shape.stream_chunk(event, req.is_batch)

    async def submit(self, req: GenerateInput, owner: str = "") -> list[RequestState]:
        """Tokenize, validate and publish every prompt; ValueError (nothing published) on bad input.
        owner: who may abort them by their rids (`abort_owned`); a rid is unique per owner.
        n > 1: each prompt goes out as one group for one scheduler: a prefill (max_new_tokens=0) that
        leaves it in the prefix cache and computes the prompt logprobs, if asked, for all samples;
        then, once it ended, its n samples `{rid}_{j}`, with seeds derived from sampling_seed. The
        states returned are the samples'."""
        self._check_accepting()
        self._admit(req, owner)
        many = len(req.prompts) > 1
        prompts = [await self._checked(p, f"image_data[{i}]" if many else "image_data")
                   for i, p in enumerate(req.prompts)]  # fmt: skip
        n = prompts[0].sampling.n
        if n == 1:
            return [st for (st,) in await self._publish([[p] for p in prompts], owner)]
        groups = []
        for p in prompts:
            warm = warm_prompt(p)
            samples = [nth_sample(p, j) for j in range(n)]
            if warm.logprob is not None:  # the prefill computes the prompt's logprobs for all samples
                shared = dataclasses.replace(p.logprob, input_shared=True)
                samples = [dataclasses.replace(s, logprob=shared) for s in samples]
            groups.append([warm, *samples])
        return [st for group in await self._publish(groups, owner) for st in group[1:]]

    def _check_accepting(self) -> None:
        if self.refusing is not None:
            raise NotAccepting(self.refusing)

    def _admit(self, req: GenerateInput, owner: str) -> None:
        """Before anything is tokenized: the request's states (prompts x n) within max_request_states
        (ValueError: 400) and, with those in flight, within max_inflight (NotAccepting: 503) and the
        owner's within max_inflight_per_client (OverClientLimit: 429)."""
        n = req.prompts[0].sampling.n if req.prompts else 1
        check_states(len(req.prompts), n, self.max_request_states)  # (a parse with the bound did it too)
        held = len(req.prompts) * n + (len(req.prompts) if n > 1 else 0)  # n > 1: each prompt's prefill too
        if len(self._states) + held > self.max_inflight:
            raise NotAccepting(
                f"the gateway has {len(self._states)} requests in flight (max_inflight_requests "
                f"{self.max_inflight}); retry shortly"
            )
        if self.max_per_client is not None and owner and self._per_owner[owner] + held > self.max_per_client:
            raise OverClientLimit(
                f"you have {self._per_owner[owner]} requests in flight (the gateway's "
                f"max_inflight_per_client {self.max_per_client}); retry once some have finished"
            )

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) on the tokenizer's threads, so the event loop keeps answering meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def _checked(self, p: Prompt, field: str) -> Prompt:
        """The prompt as it goes on the bus: its ids (images expanded: image_inputs), no text or raw
        images. `_validate` runs on a thread for a long prompt or one with images (decoding them takes
        milliseconds each), so the event loop keeps answering."""
        short = len(p.text or p.input_ids or ()) <= _OFF_LOOP_LEN
        if short and p.images is None and grammar_of(p.sampling) is None:
            ids, images = self._validate(p, field)
        else:
            ids, images = await self.off_loop(self._validate, p, field)
        return dataclasses.replace(p, text=None, input_ids=ids, images=None, image_inputs=images or None)

    def _validate(self, p: Prompt, field: str = "image_data") -> tuple[list[int], list[ImageInput]]:
        """The prompt's token ids and images, after every check that needs the tokenizer, the vocabulary
        or the images; `field`: where its images are in the request (image_data[i] in a batch)."""
        ids = self.prompt_tokens.ids(p)
        p.sampling.verify(self.vocab_size)
        grammar = grammar_of(p.sampling)
        if grammar is not None:
            check_grammar(*grammar)  # a 400 here, not a compile failure in a scheduler
        todo = p.sampling.unsupported()
        if todo:
            names = ", ".join(todo)
            raise ValueError(f"sampling parameter(s) {names} cannot be honoured yet; leave them unset")
        max_payload = self.transport.max_payload
        ids, images = prompt_images(self.images, p, ids, field, self.context_len, max_payload)
        if p.input_ids is None and self.context_len is not None:  # the prompt, and + max_new_tokens
            p.sampling.verify_length(len(ids), self.context_len)
        if p.logprob is not None:
            check_logprobs(p.logprob, len(ids), self.vocab_size, max_payload)
        if p.dp_rank is not None and self.router is not None and str(p.dp_rank) not in self.router.live():
            live = ", ".join(self.router.live()) or "none yet"
            raise ValueError(f"data_parallel_rank {p.dp_rank} names no live worker; live workers: {live}")
        if p.require_reasoning and self.reasoning_parser is None:
            raise ValueError("require_reasoning needs a server started with --reasoning-parser (it names the "
                             "tag that ends the reasoning); leave it unset")  # fmt: skip
        return ids, images

    async def _publish(self, groups: list[list[Prompt]], owner: str) -> list[list[RequestState]]:
        """Each group is one message for one scheduler: its first request, and the others to run there
        after it (`GenerateReq.then`); a request with `input_shared` logprobs takes its prompt's from
        the first."""
        self._check_accepting()  # again: tokenizing may have outlasted the start of a shutdown
        states: list[list[RequestState]] = []
        msgs, labels = [], set()
        for group in groups:
            members: list[RequestState] = []
            reqs = []
            for p in group:
                assert p.input_ids is not None
                if (owner, p.rid) in self._labels or p.rid in labels:
                    raise ValueError(f"rid {p.rid!r} is already in use by a request of yours that is running")
                labels.add(p.rid)
                now = time.time()
                st = RequestState(next(self._ids), len(p.input_ids), now, label=p.rid, owner=owner,
                                  prompt_ids=p.input_ids if p.return_prompt_ids else None)  # fmt: skip
                if p.logprob is not None:
                    source = members[0] if members and p.logprob.input_shared else None
                    st.new_logprobs = logprob_factory(p, self.prompt_tokens.token_texts, source)
                    st.logprobs = st.new_logprobs()
                members.append(st)
                end = (
                    reasoning_end(self.reasoning_parser)
                    if p.require_reasoning and self.reasoning_parser
                    else ""
                )
                reqs.append(GenerateReq(rid=st.rid, input_ids=p.input_ids, sampling=p.sampling,
                                        out_subject=self.out_subject, created=now,
                                        logprob=p.logprob.request() if p.logprob else None,
                                        reasoning_end=end, images=p.image_inputs or []))  # fmt: skip
            if len(members) > 1:
                for st in members:
                    st.group = members
            states.append(members)
            msgs.append(msgspec.structs.replace(reqs[0], then=reqs[1:]))
        for i, (members, msg) in enumerate(zip(states, msgs, strict=True)):
            pin = groups[i][0].dp_rank
            dispatch = Dispatch(msg, self._route(msg.input_ids, pin=None if pin is None else str(pin)))
            if self.router is not None:
                await self.router.agree(dispatch.route)
                await self.router.announce(dispatch.route)
            for st in members:
                self._states[st.rid] = st
                self._labels[(owner, st.label)] = st
                self._per_owner[owner] += 1
                st.published = time.perf_counter()
                st.dispatch = dispatch
            try:
                dispatch.receipt = await self.transport.publish_work(
                    self.subjects.req, encode(msg), dispatch.route.worker
                )
            except BaseException:  # BusUnavailable (answered 503), or the caller went away
                self._release(dispatch, 0)
                for later in states[i:]:
                    for st in later:
                        self._drop(st)
                await self._forget([st for g in states[:i] for st in g])
                raise
        return states

    def _route(self, prompt: list[int], exclude: tuple[str, ...] = (), pin: str | None = None) -> Route:
        if self.router is None:
            return Route(None, "shared")
        return self.router.route(prompt, exclude, pin)

    def _release(self, dispatch: Dispatch | None, grace: float | None = None) -> None:
        """Its prompt is computed, or it ended: the router's overlay lets go of its blocks."""
        if self.router is not None and dispatch is not None:
            self.router.release(dispatch.route, *(() if grace is None else (grace,)))

    async def reroute(self, dead: set[str]) -> int:
        """Send the unfinished requests waiting on these dead workers to live ones: each message is
        taken back from its worker's lane first (so the worker, if it comes back, does not run it
        too), then published again with a higher attempt base (its new run starts over: the
        gateway follows the highest attempt). Returns how many messages moved."""
        moved = 0
        for dispatch in {id(st.dispatch): st.dispatch for st in self._states.values()
                         if st.dispatch is not None and not st.finished}.values():  # fmt: skip
            if dispatch.route.worker not in dead:
                continue
            if not await self.transport.withdraw_work(self.subjects.req, dispatch.receipt):
                continue  # acknowledged meanwhile, or never stored: nothing to move
            self._release(dispatch, 0)
            seen = max((st.attempt for st in self._states.values() if st.dispatch is dispatch), default=1)
            msg = msgspec.structs.replace(dispatch.msg, attempt_base=seen + MAX_DELIVERIES)
            dispatch.msg, dispatch.route = msg, self._route(msg.input_ids, tuple(dead))
            assert self.router is not None  # only a router's dispatches name a worker
            await self.router.announce(dispatch.route)
            dispatch.reroutes += 1
            dispatch.receipt = await self.transport.publish_work(
                self.subjects.req, encode(msg), dispatch.route.worker
            )
            log.warning("%s: its worker is gone; routed again to %s", msg.rid,
                        dispatch.route.worker or "the shared lane")  # fmt: skip
            moved += 1
        return moved

    def routed_to(self, workers: set[str]) -> list[str]:
        """Unfinished requests routed to these workers."""
        return [rid for rid, st in self._states.items() if not st.finished and st.dispatch is not None
                and st.dispatch.route.worker in workers]  # fmt: skip

    async def wait(self, states: list[RequestState]) -> list[RequestState]:
        """The states once all have finished (a cancelled wait aborts what is unfinished)."""
        try:
            for st in states:
                while not st.finished:
                    await st.changed.wait()
                    st.changed.clear()
        finally:
            await self._forget(states)
        return states

    async def stream(self, states: list[RequestState]) -> AsyncIterator[Delta]:
        """Each request's deltas as its outputs arrive (`Delta.index`: its place in `states`), the
        last with its finish reason; closing the stream early aborts what is unfinished."""
        if len(states) == 1:  # the common case, without a task per event (~20k events/s at load)
            st = states[0]
            try:
                while True:  # the finished state's event is the last
                    await st.changed.wait()
                    st.changed.clear()
                    st.streamed = st.streamed or bool(st.output_ids)
                    yield st.delta(0)
                    if st.finished:
                        break
            finally:
                await self._forget(states)
            return
        pending = {asyncio.ensure_future(st.changed.wait()): i for i, st in enumerate(states)}
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for fut in done:
                    i = pending.pop(fut)
                    st = states[i]
                    st.changed.clear()
                    event = st.delta(i)
                    st.streamed = st.streamed or bool(st.output_ids)
                    yield event
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
                log.warning("request %s failed: %s", rid, message)
                st.end(Abort(message, 503))
                st.changed.set()

    def quiet_rids(self, seconds: float) -> list[str]:
        """Unfinished requests that got no output for `seconds`."""
        now = time.monotonic()
        return [rid for rid, st in self._states.items() if not st.finished and now - st.updated > seconds]

    def active_rids(self) -> list[str]:
        return [rid for rid, st in self._states.items() if not st.finished]

    def streamed_rids(self) -> list[str]:
        """Unfinished requests whose stream has sent tokens: a restart cannot continue them."""
        return [rid for rid, st in self._states.items() if not st.finished and st.streamed]

    @property
    def in_flight(self) -> int:
        return len(self._states)

    async def abort(self, rids: list[str]) -> None:
        for rid in rids:
            st = self._states.get(rid)
            if st is not None:
                self._note_aborted(rid, st.attempt)
        await self.transport.publish(self.subjects.abort, encode(AbortReq(rids=rids)))

    async def abort_owned(self, owner: str | None, label: str | None) -> int:
        """`/abort_request`: the unfinished requests of `owner` (None: of every client) whose rid is
        `label`, else those whose rid is `label` + "_<i>" (a batch, n > 1; None: all of them)."""
        exact = self._labels.get((owner, label)) if owner is not None and label is not None else None
        if exact is not None:
            found = [exact]
        else:
            found = [st for st in self._states.values() if (owner is None or st.owner == owner) and (
                label is None or st.label == label or st.label.startswith(f"{label}_"))]  # fmt: skip
        rids = [st.rid for st in found if not st.finished]
        if rids:
            await self.abort(rids)
        return len(rids)

    def _drop(self, st: RequestState) -> bool:
        """Forget the state here; False when it was not held."""
        if self._labels.get((st.owner, st.label)) is st:
            del self._labels[(st.owner, st.label)]
        if self._states.pop(st.rid, None) is None:
            return False
        self._per_owner[st.owner] -= 1
        if not self._per_owner[st.owner]:
            del self._per_owner[st.owner]
        return True

    def _note_aborted(self, rid: str, attempt: int) -> None:
        self._aborted[rid] = max(attempt, self._aborted.pop(rid, 0))
        while len(self._aborted) > _ABORTED_KEPT:
            self._aborted.popitem(last=False)

    async def _forget(self, states: list[RequestState]) -> None:
        """Done with these requests (and the rest of their groups)."""
        states = list({id(m): m for st in states for m in (st.group or (st,))}.values())
        unfinished = [st.rid for st in states if not st.finished]
        for st in states:
            if not st.finished:
                self._note_aborted(st.rid, st.attempt)
            self._release(st.dispatch)
            if self._drop(st) and self.metrics is not None:
                self._count(st)
        if unfinished:  # the caller went away: free the scheduler's KV for these
            await asyncio.shield(self.abort(unfinished))

    # -- detokenizer output -------------------------------------------------------------------
    async def _on_text(self, m: Message) -> None:
        try:
            batch = self._dec(m.data)
            outs = batch.outs
        except (msgspec.DecodeError, msgspec.ValidationError) as e:  # not from a detokenizer
            log.warning("ignoring a message on %s that is not a text output: %s", m.subject, e)
            return
        strays: list[str] = []
        for out in outs:
            st = self._states.get(out.rid)
            if st is None or st.finished:
                # Nobody waits for this output. Our subject carries only our requests, so an unknown
                # rid is one we forgot. A finished one's work item is settled with its final output
                # (non-final outputs carry no token); one still running is aborted, once per attempt,
                # and its abort's final output settles it. A sibling that still waits (n > 1: one
                # delivery) settles the group itself, and its shared prefill must not be aborted.
                if st is None or all(m.finished for m in st.group or ()):
                    if out.finished:
                        await self.transport.settle_work(out.work_token, ACK)
                    elif self._aborted.get(out.rid, 0) < out.attempt:
                        self._note_aborted(out.rid, out.attempt)
                        strays.append(out.rid)
                continue
            if out.attempt != st.attempt:
                if out.attempt < st.attempt or not await self._start_over(st, out.attempt):
                    continue  # a late output of a replaced attempt, or a stream that cannot restart
            if st.broken:
                continue
            st.updated = time.monotonic()
            if out.offset > len(st.output_ids):
                # NATS is at-most-once: never return a gap; the work queue runs the request again
                log.warning("%s: %d output tokens lost on the bus; restarting it", st.rid,
                            out.offset - len(st.output_ids))  # fmt: skip
                st.broken = True
                await self.transport.publish(
                    self.subjects.abort, encode(AbortReq(rids=[st.rid], restart=True))
                )
                continue
            self._add(st, out, batch.worker)
            st.changed.set()
            if out.finished and all(m.finished for m in st.group or ()):
                # the request (with the rest of its group: one delivery) is done: the work queue may forget it
                await self.transport.settle_work(out.work_token, ACK)
        if strays:
            log.warning("aborting %d requests whose output nobody here waits for: %s",
                        len(strays), strays[:5])  # fmt: skip
            await self.transport.publish(self.subjects.abort, encode(AbortReq(rids=strays)))

    def _add(self, st: RequestState, out: TextOut, worker: str = "") -> None:
        if out.text_offset < len(st.text):  # the final output cut a stop_regex match short
            st.text = st.text[: out.text_offset]
        st.text += out.text  # a retokenization replaces ids (below), never text
        before = len(st.output_ids)
        del st.output_ids[out.offset :]  # (an offset below our length: those ids were retokenized)
        st.sent_ids = min(st.sent_ids, out.offset)  # a delta stream sends them again from there
        st.output_ids.extend(out.output_ids)
        st.worker = worker or st.worker
        if st.output_ids or out.finish is not None:  # its prompt is computed (in the worker's cache)
            self._release(st.dispatch)
        if self.metrics is not None and len(st.output_ids) > before:
            self._observe_tokens(st, len(st.output_ids) - before)
        if out.logprobs is not None and st.logprobs is not None:
            st.logprobs.add(out.logprobs)
        if out.finish is not None:
            st.cached_tokens = out.cached_tokens
            st.end(out.finish)
            self.stats["finished"] += 1
            self.stats["bus_s"] += time.perf_counter() - st.published
            log.info(
                "finished %s (rid %s): %d prompt + %d output tokens (%d cached), %.3f s, %s",
                st.rid, st.label, st.prompt_tokens, len(st.output_ids), st.cached_tokens,
                time.time() - st.created, describe(st.finish),
            )  # fmt: skip

    def _observe_tokens(self, st: RequestState, n: int) -> None:
        """n new output tokens: the first ones give the time to first token, later ones the latency
        since the previous output, shared among them (SGLang's inter-token latency)."""
        assert self.metrics is not None
        now = time.time()
        if st.first_token_at is None:
            st.first_token_at = now
            self.metrics.first_token(st.worker, now - st.created)
        else:
            self.metrics.inter_token(st.worker, now - st.last_token_at, n)
        st.last_token_at = now

    def _count(self, st: RequestState) -> None:
        """The gateway is done with the request (answered, or its client went away): its token counts
        as in its response's meta_info; aborted when it ended with an abort or never finished."""
        assert self.metrics is not None
        aborted = not st.finished or isinstance(st.finish, Abort)
        e2e = None if st.finished_at is None else st.finished_at - st.created
        self.metrics.request_done(st.worker, st.prompt_tokens, len(st.output_ids), st.cached_tokens,
                                  e2e, aborted)  # fmt: skip

    async def _start_over(self, st: RequestState, attempt: int) -> bool:
        """A new attempt of the request (its worker died, or its output was lost) begins: forget what
        the last one produced. A stream that already sent tokens ends with an error instead: the new
        attempt samples anew, and splicing two different outputs would be silent corruption."""
        if st.streamed:
            self.fail(
                f"the request was restarted after {len(st.output_ids)} streamed tokens (its worker or the "
                "bus failed); a restarted request samples anew, so this stream cannot continue; send it "
                "again",
                [st.rid],
            )
            self._note_aborted(st.rid, attempt)  # its later outputs need no abort of their own
            await self.abort([st.rid])
            return False
        log.warning("%s: attempt %d starts over (attempt %d did not finish)", st.rid, attempt, st.attempt)
        st.attempt, st.broken = attempt, False
        st.text, st.output_ids, st.finish, st.cached_tokens = "", [], None, 0
        st.sent_text = st.sent_ids = st.sent_rows = 0
        st.sent_input = False
        if st.new_logprobs is not None:
            st.logprobs = st.new_logprobs()
        return True
