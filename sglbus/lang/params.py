"""Sampling parameters of `gen` and `run`, checked where the user wrote them.

Names are the native API's (`max_new_tokens`, ...); `gen(max_tokens=...)` maps onto them. Every field
is optional: a `gen` overrides only what it sets, on top of the defaults given to `run`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any

# what `gen(dtype=...)` constrains the output to: SGLang's patterns, under its names (`sglbus.lang.ir`
# exports them, as `sglang.lang.ir` does)
REGEX_INT = r"[-+]?[0-9]+[ \n]*"
REGEX_FLOAT = r"[-+]?[0-9]*\.?[0-9]+[ \n]*"
REGEX_BOOL = r"(True|False)"
REGEX_STR = r"\"[\w\d\s]*\""
DTYPE_REGEX = {"int": REGEX_INT, "float": REGEX_FLOAT, "bool": REGEX_BOOL, "str": REGEX_STR}
DTYPES = {int: "int", float: "float", bool: "bool", str: "str", **{k: k for k in DTYPE_REGEX}}
# numbers end at a space or a newline: the stop strings keep the number alone in the variable
DTYPE_STOPS = {"int": (" ", "\n"), "float": (" ", "\n")}


@dataclasses.dataclass
class SamplingParams:
    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    ignore_eos: bool | None = None
    return_logprob: bool | None = None
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    return_text_in_logprobs: bool | None = None
    dtype: str | None = None  # "int", "float", "bool" or "str": a regex the backend applies
    regex: str | None = None
    json_schema: str | None = None

    def over(self, defaults: SamplingParams) -> SamplingParams:
        """These values where set, the defaults elsewhere."""
        mine = {f.name: v for f in dataclasses.fields(self) if (v := getattr(self, f.name)) is not None}
        return dataclasses.replace(defaults, **mine)

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


# what run / run_batch take besides the program's arguments: the defaults of every gen (Function.run's)
RUN_DEFAULTS: dict[str, Any] = {
    "max_new_tokens": 128, "n": 1, "stop": [], "stop_token_ids": [], "stop_regex": [], "temperature": 1.0,
    "top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
    "ignore_eos": False, "return_logprob": None, "logprob_start_len": None, "top_logprobs_num": None,
    "return_text_in_logprobs": None,
}  # fmt: skip


def run_defaults(**values: Any) -> SamplingParams:
    """The defaults `run` / `run_batch` give every `gen` of the program, checked."""
    return checked("run", **values)


def checked(where: str, **values: Any) -> SamplingParams:
    """SamplingParams from keyword values (None: not set); ValueError naming the argument otherwise."""
    for name, value in values.items():
        if value is not None:
            values[name] = _check(where, name, value)
    if values.get("regex") is not None and values.get("json_schema") is not None:
        raise ValueError(f"{where}: give regex or json_schema, not both")
    if values.get("dtype") is not None and (values.get("regex") or values.get("json_schema")) is not None:
        raise ValueError(f"{where}: dtype already constrains the output; drop regex / json_schema")
    return SamplingParams(**values)


def _check(where: str, name: str, v: Any) -> Any:
    def bad(allowed: str) -> ValueError:
        return ValueError(f"{where}: {name} must be {allowed}, got {v!r}")

    def number(lo: float, hi: float, allowed: str) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (lo <= v <= hi) or math.isnan(v):
            raise bad(allowed)
        return float(v)

    def integer(lo: int, allowed: str) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise bad(allowed)
        return v

    if name in ("max_new_tokens", "min_new_tokens"):
        return integer(0, "an integer >= 0")
    if name == "n":
        return integer(1, "an integer >= 1")
    if name == "top_logprobs_num":
        return integer(0, "an integer >= 0")
    if name == "logprob_start_len":
        return integer(-1, "an integer >= -1 (-1: output logprobs only)")
    if name == "top_k":
        if isinstance(v, bool) or not isinstance(v, int) or v == 0 or v < -1:
            raise bad("-1 (no limit) or an integer >= 1")
        return v
    if name == "temperature":
        return number(0.0, math.inf, "a number >= 0 (0: greedy)")
    if name == "top_p":
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0.0 < v <= 1.0):
            raise bad("a number in (0, 1]")
        return float(v)
    if name == "min_p":
        return number(0.0, 1.0, "a number in [0, 1]")
    if name in ("frequency_penalty", "presence_penalty"):
        return number(-2.0, 2.0, "a number in [-2, 2]")
    if name in ("ignore_eos", "return_logprob", "return_text_in_logprobs"):
        if not isinstance(v, bool):
            raise bad("True or False")
        return v
    if name in ("stop", "stop_regex"):
        if isinstance(v, str) or (isinstance(v, (list, tuple)) and all(isinstance(s, str) for s in v)):
            if name == "stop_regex":
                for pattern in [v] if isinstance(v, str) else v:
                    _compiles(where, name, pattern)
            return v if isinstance(v, str) else list(v)
        raise bad("a string or a list of strings")
    if name == "stop_token_ids":
        if isinstance(v, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
            return list(v)
        raise bad("a list of token ids (integers)")
    if name == "regex":
        if not isinstance(v, str):
            raise bad("a regular expression (str)")
        return _compiles(where, name, v)
    if name == "json_schema":
        if isinstance(v, dict):
            return json.dumps(v)
        if isinstance(v, str):
            try:
                json.loads(v)
            except ValueError as e:
                raise ValueError(f"{where}: json_schema is not valid JSON: {e}") from None
            return v
        if hasattr(v, "model_json_schema"):  # a pydantic model class
            return json.dumps(v.model_json_schema())
        raise bad("a JSON schema (a dict, a JSON string or a pydantic model)")
    if name == "dtype":
        try:
            return DTYPES[v]
        except (KeyError, TypeError):
            raise bad("one of int, float, bool, str (or their names)") from None
    raise TypeError(f"{where}: unknown parameter {name!r}")  # the callers list their own parameters


class RegexError(re.error, ValueError):
    """An invalid regex or stop_regex: `re.error`, as SGLang's `gen` raises, and a ValueError like every
    other bad argument."""


def _compiles(where: str, name: str, pattern: str) -> str:
    try:
        re.compile(pattern)
    except re.error as e:
        err = RegexError(f"{where}: {name} is not a valid regular expression: {e}")
        err.pattern, err.pos, err.lineno, err.colno = e.pattern, e.pos, e.lineno, e.colno
        raise err from None
    return pattern
