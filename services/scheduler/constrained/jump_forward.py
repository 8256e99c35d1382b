"""Grammar decoding at the end of a step (`Scheduler._complete`): the sampled token goes through the
request's matcher, then, where the grammar allows only one continuation, jump-forward appends all of
it at once (the paper's compressed FSM, §4 and Appendix B of seed 001).

Retokenization (the paper's fix for the boundary problem): the forced tokens alone are not always
the tokens the model would have seen; `{` then a forced `"name` gives `{` `"` `name`, where the
tokenizer writes `{"` `name`. So the last few output tokens and the forced ones are tokenized again
as one string, and the output from the first token that changed is replaced: the matcher rolls back
over the old tokens and takes the new ones, the KV of replaced positions is freed (the next step
prefills every new token in one extend), and the detokenizer and gateway get the tokens from that
offset again (`BatchTokenOut.offsets`: an offset below the length they hold replaces from there; the
text is the same bytes, so what a client already received stays right). Only tokens the request
alone holds are replaced, never a prefix already in the radix tree; a tail that is not whole UTF-8
characters, or holds a special token, is not retokenized (the forced tokens are appended as they
are). Requests that asked for logprobs do not jump (forced tokens have no logprobs), and penalties
count sampled tokens only."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NamedTuple

from services.scheduler.constrained.grammar import (
    GrammarError,
    Retokenizer,
    accept_sequences,
    done_flags,
    forced_tokens,
)
from services.scheduler.memory import KVPool, ReqToTokenPool
from services.scheduler.request import Req
from shared.finish import Abort, Stop

log = logging.getLogger(__name__)
RETOKENIZE_TAIL = 4  # output tokens before a forced continuation that retokenization may merge with it


class _Jump(NamedTuple):
    """One request's jump: roll the matcher back `back` tokens, keep output[:keep], append `tokens`;
    `forced`: the forced tokens as they are (taken instead when retokenized tokens are refused)."""

    back: int
    keep: int
    tokens: list[int]
    forced: list[int]
    retokenized: bool


class GrammarDecode:
    def __init__(self, kv: KVPool, req_to_token: ReqToTokenPool, context_len: int, eos_ids: tuple[int, ...],
                 jump_forward: bool, stats: dict) -> None:  # fmt: skip
        self.kv, self.req_to_token, self.context_len = kv, req_to_token, context_len
        self.eos, self.jump_forward, self.stats = eos_ids[0], jump_forward, stats
        stats.update(jump_forward_steps=0, jump_forward_tokens=0, retokenized=0)

    def start(self, r: Req, retokenizer: Retokenizer) -> None:
        """At admission, once r's matcher exists: a forced start is appended (prefilled with the prompt).
        GrammarError (500) if the grammar machinery fails."""
        if r.output:
            return
        self._jump_all([r], retokenizer)
        self._end_all_done([r])
        if isinstance(r.finish, Abort):
            raise GrammarError(r.finish.message, 500)

    def advance_all(self, rows: list[tuple[Req, int]], retokenizer: Retokenizer) -> list[int | None]:
        """Each constrained request r of `rows` sampled its token: its matcher takes it (r is aborted
        when the grammar refuses it or fails), it is appended, the forced continuation follows, and a
        grammar that can take nothing more ends r. Per row: the output index from which r's tokens
        are new or replaced, or None when r was aborted. The matchers' work is batched: the tokens in
        one call, the forced continuations, their retokenization and their accepts in one each."""
        starts: list[int | None] = [None] * len(rows)
        going = []
        for i, ((r, tok), took) in enumerate(zip(rows, self._accept_sampled(rows), strict=True)):
            if not took:
                self._refused(r, f"token {tok}")
                continue
            r.output.append(tok)
            r.check_finished(tok, self.context_len)
            starts[i] = len(r.output) - 1
            if r.finish is None:
                going.append(i)
        reqs = [rows[i][0] for i in going]
        keeps = self._jump_all(reqs, retokenizer)
        self._end_all_done(reqs)
        for i, keep in zip(going, keeps, strict=True):
            r = rows[i][0]
            starts[i] = None if isinstance(r.finish, Abort) else min(starts[i], keep)  # type: ignore[type-var]
        return starts

    def _accept_sampled(self, rows: list[tuple[Req, int]]) -> list[bool]:
        """Whether each matcher took its request's token (a stop token: whether the grammar is done),
        in one batched call."""
        took = [tok in r.stop_ids and self._guard(r, lambda r=r: r.matcher.done) is True for r, tok in rows]  # type: ignore[union-attr]
        idx = [i for i, (r, _) in enumerate(rows) if not took[i] and r.finish is None]
        ok = self._accept([rows[i][0] for i in idx], [[rows[i][1]] for i in idx])
        for i, good in zip(idx, ok, strict=True):
            took[i] = good
        return took

    def _accept(self, reqs: list[Req], seqs: list[list[int]]) -> list[bool]:
        """accept_sequences; when the batched call fails, one by one (a failing request aborted)."""
        batch = lambda ss: accept_sequences([r.matcher for r in reqs], ss)  # type: ignore[misc]  # noqa: E731
        return [ok is True for ok in self._each(reqs, seqs, batch, lambda r, s: r.matcher.accept(s))]

    def _guard(self, r: Req, fn: Callable):
        """fn(), or None and r aborted when it raises: one request's grammar must not fail the step."""
        try:
            return fn()
        except Exception as e:
            self._fail(r, e)
            return None

    def _fail(self, r: Req, e: Exception) -> None:
        log.exception("constrained decoding failed for request %s", r.rid)
        self._abort(r, f"internal error in constrained decoding: {type(e).__name__}: {e}")

    def _refused(self, r: Req, what: str) -> None:
        """r's matcher refused `what`: r ends, with a 400 when its grammar is at fault (one that never
        ends), else a 500."""
        m = r.matcher
        try:
            status = m.error_status if m is not None else 500
        except Exception:
            status = 500
        self._abort(r, f"the {r.grammar.kind} refused {what}: {m.error if m else ''}", status)  # type: ignore[union-attr]

    def _abort(self, r: Req, message: str, status: int = 500) -> None:
        if not isinstance(r.finish, Abort):
            r.finish = Abort(message, status)
            self.stats["request_failures"] += 1

    def _end_all_done(self, reqs: list[Req]) -> None:
        """A request whose grammar allows only EOS now ends: EOS is appended without a forward (even
        with ignore_eos, which has nothing else to sample). The matchers asked in one batched call.
        A request that wants logprobs draws its EOS instead (the mask allows nothing else), so every
        output token has its logprob, unless min_new_tokens would mask that EOS too."""
        live = [
            r for r in reqs
            if r.finish is None and r.matcher is not None and len(r.output) < r.max_new_tokens
            and not _draws_its_eos(r)
        ]  # fmt: skip
        flags = self._each(live, [r.matcher for r in live], done_flags, lambda r, m: m.done)
        for r, done in zip(live, flags, strict=True):
            if done is True and r.finish is None:
                r.output.append(self.eos)
                r.finish = Stop(self.eos)

    def _jump_all(self, reqs: list[Req], retokenizer: Retokenizer) -> list[int]:
        """Append each request's forced continuation, if any. Per request: the output index from which
        its tokens are new or replaced (len(r.output) when nothing moved)."""
        keeps = [len(r.output) for r in reqs]
        jumps = self._plan(reqs, retokenizer)
        rows = [i for i in jumps if reqs[i].finish is None]
        for i in rows:  # over the tokens that retokenization replaces
            if jumps[i].back:
                self._guard(reqs[i], lambda r=reqs[i], n=jumps[i].back: r.matcher.rollback(n))  # type: ignore[union-attr]
        rows = [i for i in rows if reqs[i].finish is None]
        ok = self._accept([reqs[i] for i in rows], [jumps[i].tokens for i in rows])
        for i, good in zip(rows, ok, strict=True):
            r, jump = reqs[i], jumps[i]
            keep, tokens = jump.keep, jump.tokens
            if r.finish is not None:
                continue
            if jump.retokenized and good:
                self.stats["retokenized"] += 1
            elif jump.retokenized:  # the grammar does not take the canonical tokens: the old ones back,
                # the forced ones as they are
                keep, tokens = len(r.output), jump.forced
                back_then_forced = [*r.output[jump.keep :], *jump.forced]  # all or nothing, as one
                good = self._guard(r, lambda r=r, ts=back_then_forced: r.matcher.accept(ts)) is True
            if not good:
                self._refused(r, "its forced tokens")
                continue
            self._replace(r, keep, tokens)
            keeps[i] = keep
            self.stats["jump_forward_steps"] += 1
            self.stats["jump_forward_tokens"] += len(tokens)
        return keeps

    def _plan(self, reqs: list[Req], retokenizer: Retokenizer) -> dict[int, _Jump]:
        """By index in reqs: the jump of each request with a forced continuation (and room for it, and
        no logprobs), found and retokenized with the output's tail in one batched call each."""
        if not self.jump_forward:
            return {}
        rooms = [min(r.max_new_tokens, self.context_len - len(r.prompt) - 1) - len(r.output) for r in reqs]
        can = [i for i, r in enumerate(reqs) if r.lp is None and rooms[i] > 0]
        found = self._each(
            [reqs[i] for i in can], [reqs[i].matcher for i in can], forced_tokens, lambda r, m: m.forced()
        )
        jumps = {}
        for i, f in zip(can, found, strict=True):
            if f := (f or [])[: rooms[i]]:
                jumps[i] = _Jump(0, len(reqs[i].output), f, f, False)
        again = [(i, t) for i in jumps if (t := self._tail(reqs[i]))]
        olds = [reqs[i].output[-t:] for i, t in again]
        seqs = [old + jumps[i].forced for (i, _), old in zip(again, olds, strict=True)]
        news = self._each(
            [reqs[i] for i, _ in again],
            seqs,
            retokenizer.retokenize_all,
            lambda r, s: retokenizer.retokenize(s),
        )
        for (i, tail), old, seq, new in zip(again, olds, seqs, news, strict=True):
            if new is not None and new != seq:
                same = _common(old, new)
                tokens = new[same:][: rooms[i] + tail - same]
                jumps[i] = _Jump(
                    tail - same, len(reqs[i].output) - tail + same, tokens, jumps[i].forced, True
                )
        return jumps

    def _each(self, reqs: list[Req], items: list, batch: Callable[[list], list], one: Callable) -> list:
        """batch(items), or when that fails one(r, item) for each request r and its item, a request
        whose item fails aborted (its result None)."""
        if not items:
            return []
        try:
            return batch(items)
        except Exception:
            log.exception("batched grammar call failed for %d requests; one by one", len(items))
        return [self._guard(r, lambda r=r, x=x: one(r, x)) for r, x in zip(reqs, items, strict=True)]

    def _tail(self, r: Req) -> int:
        """Output tokens at the end that retokenization may replace: not in the radix tree, and taken
        by the grammar (not the reasoning before it)."""
        undoable = r.matcher.undoable if r.matcher is not None else 0
        return min(RETOKENIZE_TAIL, len(r.output) - max(r.num_cached - len(r.prompt), 0), undoable)

    def _replace(self, r: Req, keep: int, tokens: list[int]) -> None:
        del r.output[keep:]
        start = len(r.prompt) + keep
        if r.num_computed > start:  # KV of replaced tokens: freed, computed again with the new ones
            assert start >= r.num_cached, "a replaced token is in the radix tree"
            self.kv.free(self.req_to_token.table[r.row, start : r.num_computed].clone())
            r.num_computed = start
        for tok in tokens:
            r.output.append(tok)
            r.check_finished(tok, self.context_len)
            if r.finish is not None:
                break


def _draws_its_eos(r: Req) -> bool:
    s = r.sampling
    return r.lp is not None and not s.ignore_eos and len(r.output) >= s.min_new_tokens


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < len(a) and n < len(b) and a[n] == b[n]:
        n += 1
    return n
