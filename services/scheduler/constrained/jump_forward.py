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

from services.scheduler.constrained.grammar import GrammarError, Retokenizer, accept_tokens
from services.scheduler.memory import KVPool, ReqToTokenPool
from services.scheduler.request import Req
from shared.finish import Abort, Stop

log = logging.getLogger(__name__)
RETOKENIZE_TAIL = 4  # output tokens before a forced continuation that retokenization may merge with it


class GrammarDecode:
    def __init__(self, kv: KVPool, req_to_token: ReqToTokenPool, context_len: int, eos_ids: tuple[int, ...],
                 jump_forward: bool, stats: dict) -> None:  # fmt: skip
        self.kv, self.req_to_token, self.context_len = kv, req_to_token, context_len
        self.eos, self.jump_forward, self.stats = eos_ids[0], jump_forward, stats
        stats.update(jump_forward_steps=0, jump_forward_tokens=0, retokenized=0)

    def start(self, r: Req, retokenizer: Retokenizer) -> None:
        """At admission, once r's matcher exists: a forced start is appended (prefilled with the prompt).
        GrammarError (500) if the grammar machinery fails."""
        try:
            if not r.output:
                self._jump(r, retokenizer)
                self._end_if_done(r)
        except Exception as e:
            log.exception("jump-forward failed for request %s", r.rid)
            raise GrammarError(f"internal error in constrained decoding: {type(e).__name__}: {e}", 500) from e

    def accept_all(self, reqs: list[Req], tokens: list[int]) -> dict[int, bool]:
        """The matchers of the constrained requests among `reqs` still running take their sampled
        tokens in one batched call (`accept_tokens`), before `advance` handles each request; by uid,
        whether it took it. A stop token is left to `advance`; {} when the batched call fails (then
        each request's own accept in `advance` says which one fails)."""
        rows = [(r, t) for r, t in zip(reqs, tokens, strict=True)
                if r.matcher is not None and r.finish is None and t not in r.stop_ids]  # fmt: skip
        if not rows:
            return {}
        try:
            ok = accept_tokens([r.matcher for r, _ in rows], [t for _, t in rows])  # type: ignore[misc]
        except Exception:
            log.exception("batched grammar accept failed for %d requests; one by one", len(rows))
            return {}
        return {r.uid: good for (r, _), good in zip(rows, ok, strict=True)}

    def advance(self, r: Req, tok: int, retokenizer: Retokenizer, accepted: bool | None = None) -> int | None:
        """r sampled `tok`: the matcher takes it (None, and r aborted, when the grammar refuses it or
        fails), it is appended, the forced continuation follows, and a grammar that can take nothing
        more ends r. Returns the output index from which r's tokens are new or replaced. accepted:
        whether the matcher already took `tok` (`accept_all`); None: it takes it here."""
        m = r.matcher
        assert m is not None and r.grammar is not None
        try:
            if accepted is None:
                accepted = (tok in r.stop_ids and m.done) or m.accept([tok])
            if not accepted:
                return self._abort(r, f"the {r.grammar.kind} refused token {tok}: {m.error}")
            r.output.append(tok)
            r.check_finished(tok, self.context_len)
            start = len(r.output) - 1
            if r.finish is None:
                start = min(start, self._jump(r, retokenizer))
                self._end_if_done(r)
            return start
        except Exception as e:  # one request's grammar must not fail the step
            log.exception("constrained decoding failed for request %s", r.rid)
            return self._abort(r, f"internal error in constrained decoding: {type(e).__name__}: {e}")

    def _abort(self, r: Req, message: str) -> None:
        r.finish = Abort(message, 500)
        self.stats["request_failures"] += 1

    def _end_if_done(self, r: Req) -> None:
        """The grammar allows only EOS now: EOS is appended without a forward (even with ignore_eos,
        which has nothing else to sample)."""
        if r.finish is None and r.matcher is not None and r.matcher.done and len(r.output) < r.max_new_tokens:
            r.output.append(self.eos)
            r.finish = Stop(self.eos)

    def _jump(self, r: Req, retokenizer: Retokenizer) -> int:
        """Append r's forced continuation, if any; returns the output index from which r's tokens are
        new or replaced (len(r.output) when nothing moved)."""
        m, out = r.matcher, r.output
        assert m is not None
        room = min(r.max_new_tokens, self.context_len - len(r.prompt) - 1) - len(out)
        forced = m.forced()[:room] if self.jump_forward and r.lp is None and room > 0 else []
        if not forced:
            return len(out)
        tail = self._tail(r)
        new = retokenizer.retokenize(out[len(out) - tail :] + forced) if tail else None
        keep, taken = len(out), False
        if new is not None and new != out[len(out) - tail :] + forced:
            same = _common(out[len(out) - tail :], new)
            changed = new[same:][: room + tail - same]
            m.rollback(tail - same)
            if taken := m.accept(changed):  # all of them or none
                keep, forced = len(out) - tail + same, changed
                self.stats["retokenized"] += 1
            else:  # the grammar does not take the canonical tokens: the old ones back, forced as they are
                m.accept(out[len(out) - tail + same :])
        if not taken:
            assert m.accept(forced), m.error
        self._replace(r, keep, forced)
        self.stats["jump_forward_steps"] += 1
        self.stats["jump_forward_tokens"] += len(forced)
        return keep

    def _tail(self, r: Req) -> int:
        """Output tokens at the end that retokenization may replace: not in the radix tree."""
        return min(RETOKENIZE_TAIL, len(r.output) - max(r.num_cached - len(r.prompt), 0))

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


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < len(a) and n < len(b) and a[n] == b[n]:
        n += 1
    return n
