"""Incremental detokenization and stop strings, one scheduler step at a time.

Per request we decode a small window of ids (from `prefix_offset`) and only accept new text when it
does not end in U+FFFD, so a multi-byte character split across tokens is never emitted half-done.
Text that could still turn into a stop string is held back, so a streaming client never receives
text that is trimmed later. A row whose offset is below the ids we hold replaces them from there
(jump-forward's retokenization: the same text, other tokens); one above them means a lost message.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import regex

from shared.finish import Abort, FinishReason, Stop
from shared.messages import AbortReq, BatchTextOut, BatchTokenOut, NewReqInfo, TextOut
from shared.sampling_params import regex_width

_REGEX_TIMEOUT_S = 0.05  # per request and step, for all its stop_regex searches together
_FORGET_AFTER = 100_000  # finished rids remembered, to drop tokens that arrive after a stop string

log = logging.getLogger(__name__)


@dataclass
class _State:
    info: NewReqInfo
    ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0
    text: str = ""  # all text decoded so far
    sent_text: int = 0  # characters already sent
    sent_ids: int = 0
    broken: bool = False  # lost tokens: waiting for the restarted attempt
    searched: int = 0  # characters of text searched for stop strings and patterns (no match there)
    patterns: list[tuple[regex.Pattern, int]] | None = None  # stop_regex compiled, with match widths


class Detokenizer:
    def __init__(self, tokenizer: Any) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._decode = backend.decode if backend is not None else tokenizer.decode
        self._states: dict[str, _State] = {}
        self._done: OrderedDict[str, int] = OrderedDict()  # finished rid -> its attempt
        self._restarting: OrderedDict[str, None] = OrderedDict()  # asked the scheduler to restart

    def step(self, msg: BatchTokenOut) -> tuple[dict[str, BatchTextOut], list[AbortReq]]:
        """Returns the text outputs grouped by gateway subject, and what the scheduler must stop or
        restart: requests that hit a stop string, that lost tokens on the bus, or whose announcement
        never arrived (this detokenizer restarted, or NATS dropped it)."""
        n = len(msg.rids)
        if not (
            len(msg.token_ids) == len(msg.cached_tokens) == len(msg.offsets) == len(msg.finish_reasons) == n
        ) or (msg.logprobs and len(msg.logprobs) != n):
            raise ValueError(f"a BatchTokenOut whose lists do not have one entry per rid ({n})")
        for info in msg.new_reqs:
            self._announce(info)
        outs: dict[str, BatchTextOut] = {}
        stopped: list[AbortReq] = []
        logprobs = msg.logprobs or [None] * len(msg.rids)
        for rid, tokens, cached, offset, finish, lp in zip(
            msg.rids, msg.token_ids, msg.cached_tokens, msg.offsets, msg.finish_reasons, logprobs, strict=True
        ):
            st = self._states.get(rid)
            if st is None or st.broken or offset > len(st.ids):
                # NATS is at-most-once: never return a gap; the work queue runs the request again
                if st is not None:
                    st.broken = True
                if rid not in self._done and rid not in self._restarting and finish is None:
                    self._restarting[rid] = None
                    _trim(self._restarting)
                    stopped.append(AbortReq(rids=[rid], restart=True))
                continue
            try:
                if offset < len(st.ids):
                    self._replace(st, offset)
                st.ids.extend(tokens)
                matched = self._advance(st, finish)
            except Exception as e:  # one request's text must not break the others'
                log.exception("detokenizing %s failed", rid)
                matched = None
                if finish is None:
                    stopped.append(AbortReq(rids=[rid]))
                finish = Abort(f"detokenization failed: {e}", 500)
            if matched is not None:
                if finish is None:  # the scheduler is still generating: tell it to stop
                    stopped.append(AbortReq(rids=[rid], finish=Stop(matched)))
                finish = Stop(matched)
            out = self._out(st, finish, cached)
            out.logprobs = lp
            outs.setdefault(st.info.out_subject, BatchTextOut()).outs.append(out)
            if finish is not None:
                del self._states[rid]
                self._done[rid] = st.info.attempt
                _trim(self._done)
        return outs, stopped

    def _announce(self, info: NewReqInfo) -> None:
        """A new request: a scheduler announces each run of a request once, after every output of an
        earlier run (one subject, in order), so it replaces whatever that earlier run left: the last
        attempt of a request, or a finished request whose rid a client reuses."""
        self._states[info.rid] = _State(info)
        self._done.pop(info.rid, None)
        self._restarting.pop(info.rid, None)

    def _replace(self, st: _State, offset: int) -> None:
        """The scheduler retokenized (jump-forward): its ids from `offset` on replace ours. They decode
        to the same bytes, and `offset` is on a character boundary, so the text is rebuilt up to
        `offset` and grows back to what was sent; the gateway gets the ids from `offset` again."""
        del st.ids[offset:]
        skip = st.info.skip_special_tokens
        st.text = self._decode(st.ids, skip_special_tokens=skip)
        st.prefix_offset, st.read_offset = max(0, offset - 5), offset
        st.sent_ids, st.searched = min(st.sent_ids, offset), min(st.searched, len(st.text))

    def _advance(self, st: _State, finish: FinishReason | None) -> str | None:
        skip = st.info.skip_special_tokens
        if finish is not None:
            # a matched stop token stays in output_ids but not in the text (SGLang's trim_matched_stop)
            trim = isinstance(finish, Stop) and isinstance(finish.matched, int) and not st.info.no_stop_trim
            st.text = self._decode(st.ids[:-1] if trim else st.ids, skip_special_tokens=skip)
            st.searched = 0  # decoded afresh: search it all, once
        else:
            prefix = self._decode(st.ids[st.prefix_offset : st.read_offset], skip_special_tokens=skip)
            window = self._decode(st.ids[st.prefix_offset :], skip_special_tokens=skip)
            if len(window) > len(prefix) and not window.endswith("\ufffd"):
                st.text += window[len(prefix) :]
                st.prefix_offset, st.read_offset = st.read_offset, len(st.ids)
        return self._match_stop(st) if st.info.stop or st.info.stop_regex else None

    def _match_stop(self, st: _State) -> str | None:
        """The earliest stop string, or text a stop_regex matches; the text is cut before it (after it
        with no_stop_trim). The text before `searched` held no match, so a new one ends after it and
        starts at most its length before: each step searches that tail, not the whole text (a pattern
        of unbounded width still searches from the start, as SGLang's does)."""
        stops, searched = st.info.stop, st.searched
        start = max(0, searched - max(map(len, stops)) + 1) if stops else 0
        best: tuple[int, str] | None = None
        for s in stops:
            pos = st.text.find(s, start)
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, s)
        if st.patterns is None and st.info.stop_regex:
            st.patterns = [(regex.compile(p), regex_width(p)) for p in st.info.stop_regex]
        deadline = time.monotonic() + _REGEX_TIMEOUT_S
        for pattern, width in st.patterns or ():
            try:  # `regex`, not `re`: a client's pattern must not hold this service (the request fails)
                # pos, not a slice: lookbehinds still see the text before it, and ^ does not match there
                left = max(deadline - time.monotonic(), 1e-4)
                m = pattern.search(st.text, max(0, searched - width + 1), timeout=left)
            except TimeoutError:
                raise ValueError(f"stop_regex {pattern.pattern!r} took over {_REGEX_TIMEOUT_S:g} s") from None
            if m is not None and (best is None or m.start() < best[0]):
                best = (m.start(), m.group())
        st.searched = len(st.text)
        if best is None:
            return None
        pos, s = best
        st.text = st.text[: pos + len(s)] if st.info.no_stop_trim else st.text[:pos]
        return s

    def _out(self, st: _State, finish: FinishReason | None, cached: int) -> TextOut:
        end = len(st.text) if finish is not None else len(st.text) - _stop_prefix_len(st.text, st.info.stop)
        # text is append-only, except that the final output cuts a stop_regex match that began in text
        # already sent (a regex cannot be held back as a stop string's prefix is)
        start = end if finish is not None and end < st.sent_text else st.sent_text
        end, sent = max(end, start), st.sent_ids
        out = TextOut(rid=st.info.rid, text=st.text[start:end], text_offset=start, output_ids=st.ids[sent:],
                      offset=sent, attempt=st.info.attempt)  # fmt: skip
        st.sent_text, st.sent_ids = end, len(st.ids)
        if finish is not None:
            out.finish, out.cached_tokens, out.work_token = finish, cached, st.info.work_token
        return out


def _trim(d: OrderedDict) -> None:
    if len(d) > _FORGET_AFTER:
        d.popitem(last=False)


def _stop_prefix_len(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of a stop string (held back): per
    stop string, its last len(s) - 1 characters are tried from each place s's first character occurs,
    longest first (a few tries each, not one per length)."""
    best = 0
    for s in stops:
        tail = text[max(0, len(text) - len(s) + 1) :]
        i = tail.find(s[0])
        while i != -1 and len(tail) - i > best:
            if s.startswith(tail[i:]):
                best = len(tail) - i
                break
            i = tail.find(s[0], i + 1)
    return best
