"""SGLang's sampling parameters: names, defaults and valid ranges, as one typed struct.

`SamplingParams.from_dict` turns a client's dict into the struct (`null` means the default), `verify`
checks ranges and `verify_length` the prompt against the context; all raise `ValueError` with a message
naming the field and what is allowed. The scheduler runs the same checks on what reaches it over the bus.
SGLang's parameters that are not fields here (shared/sglang_fields.py lists them all) are accepted at
their defaults and refused by name otherwise; `unsupported` names the fields here not honoured yet.
"""

from __future__ import annotations

import json
import math
import re
import re._parser as re_parser
from typing import Any

import msgspec
import regex

from shared.sglang_fields import SAMPLING_PARAMS, SGLANG_VERSION

# Below this temperature sampling is greedy (SGLang's rule).
GREEDY_TEMPERATURE = 1e-6
# max_new_tokens when the client leaves it unset; then it is also cut to what the context has room for
DEFAULT_MAX_NEW_TOKENS = 128
# sampling_seed: any integer the bus (msgpack) carries; the sampler reduces it mod 2^63 into int64
SEED_MIN, SEED_END = -(1 << 63), 1 << 64
MAX_TOKENS_END = 1 << 63  # max_new_tokens stays an int64 everywhere
# Caps on the list-valued parameters (SGLang has none). Each entry costs work at every decode step of a
# service all requests share: stop strings and patterns are searched by the detokenizer, logit_bias and
# stop ids are gathered by the scheduler, so one request with 100,000 of them would stall everyone's.
# They sit far above real use (OpenAI allows 4 stop sequences; a ban list is dozens of tokens; a larger
# mask is a grammar's job: regex / ebnf).
MAX_STOP = 128  # stop strings
MAX_STOP_CHARS = 256  # per stop string: the detokenizer holds back and searches that much text per step
MAX_STOP_REGEX = 16  # stop_regex patterns: each is searched at every step
MAX_STOP_REGEX_CHARS = 512  # per pattern
# per pattern, its size with fixed repeats unrolled: `regex` compiles them unrolled, so `a{1000000}`
# (10 characters) takes 8 s and 200 MB to compile, on the gateway's event loop; `\d{4}-\d{2}` is 7
MAX_STOP_REGEX_SIZE = 1000
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024  # entries
_REPEATS = (re_parser.MAX_REPEAT, re_parser.MIN_REPEAT, re_parser.POSSESSIVE_REPEAT)


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    max_new_tokens: int | None = None  # None: DEFAULT_MAX_NEW_TOKENS (see max_new_tokens_for)
    min_new_tokens: int = 0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    stop_regex: list[str] = []
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    n: int = 1
    logit_bias: dict[str, float] | None = None
    sampling_seed: int | None = None
    custom_params: dict[str, Any] | None = None
    stream_interval: int | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SamplingParams:
        if d is None:
            return cls()
        if not isinstance(d, dict):
            raise ValueError(f"sampling_params must be an object, got {type(d).__name__}")
        honoured = cls.__struct_fields__
        unknown = sorted(k for k in d if k not in honoured and k not in SAMPLING_PARAMS)
        if unknown:
            raise ValueError(
                f"unknown sampling parameter(s) {', '.join(map(repr, unknown))}; allowed (SGLang "
                f"{SGLANG_VERSION}'s): {', '.join(SAMPLING_PARAMS)}"
            )
        todo = [k for k, v in d.items() if k not in honoured and v is not None and v != SAMPLING_PARAMS[k]]
        if todo:
            raise ValueError(
                f"sampling parameter(s) {', '.join(todo)} cannot be honoured yet; leave them unset"
            )
        clean = {k: v for k, v in d.items() if v is not None and k in honoured}
        for key in ("stop", "stop_regex"):
            if isinstance(clean.get(key), str):
                clean[key] = [clean[key]]
        if isinstance(clean.get("stop_token_ids"), int):
            clean["stop_token_ids"] = [clean["stop_token_ids"]]
        if isinstance(clean.get("json_schema"), dict):  # SGLang takes a JSON string; an object works too
            clean["json_schema"] = json.dumps(clean["json_schema"])
        try:
            return msgspec.convert(clean, cls, strict=False)
        except msgspec.ValidationError as e:
            raise ValueError(f"sampling_params: {e}") from None

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    def max_new_tokens_for(self, prompt_len: int, context_len: int) -> int:
        """The output limit: as given, or the default cut to the room the context leaves (SGLang's
        scheduler does the same; only an explicit value is checked against the context)."""
        if self.max_new_tokens is not None:
            return self.max_new_tokens
        return max(0, min(DEFAULT_MAX_NEW_TOKENS, context_len - prompt_len))

    def verify_length(self, prompt_len: int, context_len: int) -> None:
        """The prompt, and prompt + an explicit max_new_tokens, against the context (SGLang's checks;
        prompt + max_new_tokens may reach the context exactly: the last token needs no KV)."""
        if prompt_len >= context_len:
            raise ValueError(
                f"the prompt has {prompt_len} tokens; at most {context_len - 1} fit the context length "
                f"({context_len})"
            )
        m = self.max_new_tokens
        if m is not None and prompt_len + m > context_len:
            raise ValueError(
                f"Requested token count exceeds the model's maximum context length of {context_len} "
                f"tokens. You requested a total of {prompt_len + m} tokens: {prompt_len} tokens from the "
                f"input messages and {m} tokens for the completion (sampling_params.max_new_tokens). "
                "Please reduce the number of tokens in the input messages or the completion to fit "
                "within the limit."
            )

    def verify(self, vocab_size: int) -> None:
        """Check every range SGLang checks; raise ValueError naming the field and the allowed values."""

        def bad(field: str, allowed: str) -> None:
            raise ValueError(
                f"sampling_params.{field} = {getattr(self, field)!r} is invalid; allowed: {allowed}"
            )

        if not math.isfinite(self.temperature) or self.temperature < 0:
            bad("temperature", "a finite number >= 0 (0 means greedy)")
        if not (0 < self.top_p <= 1):
            bad("top_p", "0 < top_p <= 1")
        if self.top_k == 0 or self.top_k < -1:
            bad("top_k", "-1 (all tokens) or an integer >= 1")
        if not (0 <= self.min_p <= 1):
            bad("min_p", "0 <= min_p <= 1")
        if not (-2 <= self.frequency_penalty <= 2):
            bad("frequency_penalty", "-2 <= frequency_penalty <= 2")
        if not (-2 <= self.presence_penalty <= 2):
            bad("presence_penalty", "-2 <= presence_penalty <= 2")
        if not (0 < self.repetition_penalty <= 2):
            bad("repetition_penalty", "0 < repetition_penalty <= 2")
        max_new = DEFAULT_MAX_NEW_TOKENS if self.max_new_tokens is None else self.max_new_tokens
        if not (0 <= max_new < MAX_TOKENS_END):
            bad("max_new_tokens", "an integer >= 0 and < 2^63")
        if not (0 <= self.min_new_tokens <= max_new):
            bad("min_new_tokens", f"0 <= min_new_tokens <= max_new_tokens ({max_new})")
        if self.n < 1:
            bad("n", "an integer >= 1")
        if self.sampling_seed is not None and not (SEED_MIN <= self.sampling_seed < SEED_END):
            bad("sampling_seed", "an integer in [-2^63, 2^64); seeds equal mod 2^63 draw the same tokens")
        self._verify_sizes()
        for t in self.stop_token_ids:
            if not (0 <= t < vocab_size):
                bad("stop_token_ids", f"token ids in [0, {vocab_size})")
        for token, bias in (self.logit_bias or {}).items():
            if not token.removeprefix("-").isdecimal() or not 0 <= int(token) < vocab_size:
                allowed = f"token ids in [0, {vocab_size})"
                raise ValueError(f"sampling_params.logit_bias key {token!r} is invalid; allowed: {allowed}")
            if not math.isfinite(bias):
                raise ValueError(
                    f"sampling_params.logit_bias[{token!r}] = {bias!r} is invalid; allowed: finite numbers"
                )
        if any(not s for s in self.stop):
            bad("stop", "non-empty strings")
        for pattern in self.stop_regex:
            size = regex_size(pattern)  # before compiling: the cap bounds the compile's cost
            if size > MAX_STOP_REGEX_SIZE:
                raise ValueError(
                    f"sampling_params.stop_regex: patterns of size at most {MAX_STOP_REGEX_SIZE} (fixed "
                    f"repeats unrolled), got {pattern[:40]!r} of size {size}"
                )
            try:
                empty = regex.compile(pattern).fullmatch("", timeout=0.05) is not None
            except (regex.error, TimeoutError) as e:
                raise ValueError(f"sampling_params.stop_regex {pattern!r} is not a regular expression "
                                 f"({e}); allowed: Python regular expressions") from None  # fmt: skip
            if empty:
                bad("stop_regex", "regular expressions that match at least one character")
        if sum(x is not None for x in (self.regex, self.json_schema, self.ebnf)) > 1:
            raise ValueError("sampling_params: only one of regex, json_schema, ebnf may be set")
        if self.json_schema is not None:
            try:
                schema = json.loads(self.json_schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"sampling_params.json_schema is not JSON ({e}); allowed: a JSON schema, "
                                 "as a string or an object") from None  # fmt: skip
            if not isinstance(schema, dict | bool):
                bad("json_schema", "a JSON schema: an object (or true / false)")
        for key in ("regex", "ebnf", "json_schema"):
            if getattr(self, key) == "":
                bad(key, "a non-empty string")

    def _verify_sizes(self) -> None:
        """The caps on list sizes, checked before anything walks the lists."""

        def cap(field: str, items: list[str], most: int, what: str, most_chars: int) -> None:
            allowed = f"sampling_params.{field}: at most {most} {what}s of at most {most_chars} characters"
            if len(items) > most:
                raise ValueError(f"{allowed}, got {len(items)} {what}s")
            longest = max(map(len, items), default=0)
            if longest > most_chars:
                raise ValueError(f"{allowed}, got one of {longest} characters")

        cap("stop", self.stop, MAX_STOP, "string", MAX_STOP_CHARS)
        cap("stop_regex", self.stop_regex, MAX_STOP_REGEX, "pattern", MAX_STOP_REGEX_CHARS)
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"sampling_params.stop_token_ids: at most {MAX_STOP_TOKEN_IDS} token ids, "
                             f"got {len(self.stop_token_ids)}")  # fmt: skip
        if len(self.logit_bias or ()) > MAX_LOGIT_BIAS:
            raise ValueError(f"sampling_params.logit_bias: at most {MAX_LOGIT_BIAS} entries, "
                             f"got {len(self.logit_bias or ())}")  # fmt: skip

    def unsupported(self) -> list[str]:
        """Parameters set to a non-default value that the engine cannot honour yet."""
        todo = {"structural_tag": None}
        return [k for k, default in todo.items() if getattr(self, k) != default]


def regex_size(pattern: str) -> int:
    """A pattern's size with its fixed repeats unrolled (what compiling it with `regex` costs);
    ValueError when Python's `re` cannot parse it (SGLang matches stop_regex with `re`)."""
    try:
        return _size(re_parser.parse(pattern))
    except (re.error, RecursionError, OverflowError) as e:
        raise ValueError(f"sampling_params.stop_regex {pattern[:40]!r} is not a regular expression "
                         f"({e}); allowed: Python regular expressions") from None  # fmt: skip


def regex_width(pattern: str) -> int:
    """The longest text a match of pattern can span (huge when unbounded), so that a search for a
    match ending in new text starts that far back; unbounded when `re` cannot tell."""
    try:
        return re_parser.parse(pattern).getwidth()[1]
    except (re.error, RecursionError, OverflowError):
        return re_parser.MAXREPEAT


def _size(node: Any) -> int:
    if isinstance(node, re_parser.SubPattern):
        return sum(_size(item) for item in node.data)
    if isinstance(node, list | tuple):
        if len(node) == 2 and node[0] in _REPEATS:  # (op, (lo, hi, subpattern))
            lo, _, sub = node[1]
            return max(1, lo) * _size(sub)
        return sum(_size(x) for x in node) or 1
    return 0
