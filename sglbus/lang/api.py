"""The language's primitives: what a program appends to its state (`s += sgl.gen(...)`), and the rest
of SGLang's `sglang.lang.api` (backends, Runtime, Engine, cache and server info)."""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Any

from sglbus.lang import ir
from sglbus.lang.backends.base import get_default_backend, resolve_backend, set_default_backend
from sglbus.lang.choices import ChoiceMethod, token_length_normalized
from sglbus.lang.function import Function
from sglbus.lang.global_config import global_config
from sglbus.lang.params import checked
from sglbus.lang.runtime import Runtime

__all__ = [  # Engine comes from __getattr__, lazily
    "Engine",  # noqa: F822
    "Runtime", "assistant", "assistant_begin", "assistant_end", "flush_cache", "function", "gen",
    "gen_int", "gen_string", "get_default_backend", "get_server_info", "global_config", "image", "select",
    "separate_reasoning", "set_default_backend", "system", "system_begin", "system_end", "user", "user_begin",
    "user_end", "video",
]  # fmt: skip


def __getattr__(name: str) -> Any:
    # `from sglbus.lang.api import Engine`: the Engine class, loaded (with torch) only when asked for
    if name == "Engine":
        from sglbus.engine import Engine

        return Engine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_GEN_PARAMS = ("name", "max_tokens", "min_tokens", "n", "stop", "stop_token_ids", "stop_regex", "temperature",
               "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty", "ignore_eos",
               "return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs",
               "dtype", "choices", "choices_method", "regex", "json_schema")  # fmt: skip

_OWN_CONSTRAINT = ("dtype", "regex", "json_schema", "choices", "choices_method")
# what gen_int / gen_string take: gen's parameters but the constraint they set themselves
_OWN_PARAMS = tuple(p for p in _GEN_PARAMS if p not in _OWN_CONSTRAINT)


def function(func: Callable[..., Any] | None = None, num_api_spec_tokens: int | None = None) -> Any:
    """`@sgl.function` or `@sgl.function(num_api_spec_tokens=...)`: the function becomes a program."""
    if func is not None:
        return Function(func, num_api_spec_tokens)
    return lambda f: Function(f, num_api_spec_tokens)


def gen(name: str | None = None, max_tokens: int | None = None, min_tokens: int | None = None,
        n: int | None = None, stop: str | list[str] | None = None, stop_token_ids: list[int] | None = None,
        stop_regex: str | list[str] | None = None, temperature: float | None = None,
        top_p: float | None = None, top_k: int | None = None, min_p: float | None = None,
        frequency_penalty: float | None = None, presence_penalty: float | None = None,
        ignore_eos: bool | None = None, return_logprob: bool | None = None,
        logprob_start_len: int | None = None, top_logprobs_num: int | None = None,
        return_text_in_logprobs: bool | None = None, dtype: type | str | None = None,
        choices: list[str] | None = None, choices_method: ChoiceMethod | None = None,
        regex: str | None = None, json_schema: Any = None, **unknown: Any) -> ir.Expr:  # fmt: skip
    """The model's continuation, stored as s[name]. Unset parameters come from run()'s defaults.
    With choices it is `select`; dtype (int, float, bool, str), regex and json_schema constrain it."""
    _no_unknown("gen", unknown, _GEN_PARAMS)
    if choices is not None:
        return select(name, choices, 0.0 if temperature is None else temperature,
                      choices_method or token_length_normalized)  # fmt: skip
    if choices_method is not None:
        raise ValueError("gen: choices_method needs choices")
    return _gen("gen", name, max_new_tokens=max_tokens, min_new_tokens=min_tokens, n=n, stop=stop,
                stop_token_ids=stop_token_ids, stop_regex=stop_regex, temperature=temperature, top_p=top_p,
                top_k=top_k, min_p=min_p, frequency_penalty=frequency_penalty,
                presence_penalty=presence_penalty, ignore_eos=ignore_eos, return_logprob=return_logprob,
                logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
                return_text_in_logprobs=return_text_in_logprobs, dtype=dtype, regex=regex,
                json_schema=json_schema)  # fmt: skip


def _typed_gen(dtype: type, what: str, doc: str):
    """gen_int / gen_string: gen with the constraint of `dtype`, positional parameters in SGLang's order."""

    def typed(name: str | None = None, max_tokens: int | None = None, n: int | None = None,
              stop: str | list[str] | None = None, stop_token_ids: list[int] | None = None,
              stop_regex: str | list[str] | None = None, temperature: float | None = None,
              top_p: float | None = None, top_k: int | None = None, min_p: float | None = None,
              frequency_penalty: float | None = None, presence_penalty: float | None = None,
              ignore_eos: bool | None = None, return_logprob: bool | None = None,
              logprob_start_len: int | None = None, top_logprobs_num: int | None = None,
              return_text_in_logprobs: bool | None = None, *, min_tokens: int | None = None,
              **unknown: Any) -> ir.Expr:  # fmt: skip
        _typed_gen_unknown(what, unknown)
        return gen(name, max_tokens, min_tokens, n, stop, stop_token_ids, stop_regex, temperature, top_p,
                   top_k, min_p, frequency_penalty, presence_penalty, ignore_eos, return_logprob,
                   logprob_start_len, top_logprobs_num, return_text_in_logprobs, dtype=dtype)  # fmt: skip

    typed.__name__ = typed.__qualname__ = what
    typed.__doc__ = doc
    return typed


gen_int = _typed_gen(
    int, "gen_int", "gen constrained to an integer (and stopped at the space or newline after it)."
)
gen_string = _typed_gen(
    str, "gen_string", "gen constrained to a double-quoted string of word characters and spaces."
)


def select(name: str | None = None, choices: list[str] | None = None, temperature: float = 0.0,
           choices_method: ChoiceMethod = token_length_normalized) -> ir.Expr:  # fmt: skip
    """One of choices, picked from the logprobs of every `prompt + choice` (scored, not sampled),
    stored as s[name] and appended to the text."""
    if not isinstance(choices, (list, tuple)) or not choices:
        raise ValueError(f"select: choices must be a non-empty list of strings, got {choices!r}")
    if not all(isinstance(c, str) for c in choices):  # "" is a choice too (nothing appended), as in SGLang
        raise ValueError(f"select: every choice must be a string, got {list(choices)!r}")
    if temperature != 0:
        raise ValueError(
            f"select: temperature must be 0 (choices are scored, not sampled), got {temperature!r}"
        )
    if not isinstance(choices_method, ChoiceMethod):
        raise ValueError(
            f"select: choices_method must be sgl.token_length_normalized, sgl.greedy_token_selection or "
            f"sgl.unconditional_likelihood_normalized (or another ChoiceMethod), got {choices_method!r}"
        )
    return ir.Select(name, list(choices), choices_method)


def separate_reasoning(expr: Any = None, model_type: str | None = None) -> ir.Expr:
    """SGLang's `separate_reasoning(gen("x"), model_type="deepseek-r1")`: after each gen or select of
    expr, its reasoning (`<think>`...`</think>` or the model's own tags, shared/reasoning_parser.py)
    moves from s["x"] and the text to s["x_reasoning_content"] (None when there is none). The output of
    a select, or of a gen with a regex, json_schema or dtype, holds reasoning only behind a leading
    opening tag, even for a model type that reasons without one (deepseek-r1): the grammar leaves the
    model no room to think first."""
    from shared.reasoning_parser import REASONING_PARSERS

    if model_type not in REASONING_PARSERS:
        allowed = ", ".join(REASONING_PARSERS)
        raise ValueError(f"separate_reasoning: model_type must be one of {allowed}, got {model_type!r}")
    steps: list[ir.Expr] = []
    for step in [] if expr is None else ir.leaves(expr):
        steps.append(step)
        if isinstance(step, (ir.Gen, ir.Select)):
            if step.name is None:
                raise ValueError(
                    "separate_reasoning: the gen or select needs a name (its reasoning goes to "
                    "name_reasoning_content)"
                )
            params = step.params if isinstance(step, ir.Gen) else None
            constrained = params is None or any(
                v is not None for v in (params.regex, params.json_schema, params.dtype)
            )  # a select's text is one of its choices
            steps.append(ir.SeparateReasoning(model_type, step.name, constrained))
    return ir.ExprList(steps)


def image(path: Any) -> ir.Expr:
    """An image in the prompt, as SGLang's: the model's image token goes in the text here, and every
    later gen / select sends the image with the text (`image_data`). path: a file path (read and sent
    as base64 by this client), bytes, a PIL image, a numpy array, a data URL or base64 (sent as they
    are). A backend whose model takes no images refuses it when the program reaches it."""
    return ir.Image(path)


def video(path: Any, num_frames: int) -> ir.Expr:
    """A video as num_frames images sampled evenly from it, one image token each (how a LLaVA-1.5 model,
    which has no video tower, takes a video). path: a video file's path or bytes (decoded with PyAV:
    `pip install av`), or its frames (a list of what `image` takes)."""
    if isinstance(num_frames, bool) or not isinstance(num_frames, int) or num_frames < 1:
        raise ValueError(f"video: num_frames must be an integer >= 1, got {num_frames!r}")
    return ir.Video(path, num_frames)


def _role(role: str, expr: Any = None) -> ir.Expr:
    inner = [] if expr is None else ir.leaves(expr)
    return ir.ExprList([ir.RoleBegin(role), *inner, ir.RoleEnd(role)])


def system(expr: Any = None) -> ir.Expr:
    return _role("system", expr)


def user(expr: Any = None) -> ir.Expr:
    return _role("user", expr)


def assistant(expr: Any = None) -> ir.Expr:
    return _role("assistant", expr)


def system_begin() -> ir.Expr:
    return ir.RoleBegin("system")


def system_end() -> ir.Expr:
    return ir.RoleEnd("system")


def user_begin() -> ir.Expr:
    return ir.RoleBegin("user")


def user_end() -> ir.Expr:
    return ir.RoleEnd("user")


def assistant_begin() -> ir.Expr:
    return ir.RoleBegin("assistant")


def assistant_end() -> ir.Expr:
    return ir.RoleEnd("assistant")


def flush_cache(backend: Any = None, empty_cache: bool = True) -> bool:
    """Empty the runtime's prefix cache (the default backend's without an argument); False when there
    is no backend at all, as in SGLang. empty_cache: see Backend.flush_cache."""
    if backend is None and global_config.default_backend is None:
        return False
    return resolve_backend(backend).flush_cache(empty_cache=empty_cache)


def get_server_info(backend: Any = None) -> dict[str, Any] | None:
    """The runtime's server info; None when there is no backend at all, as in SGLang."""
    if backend is None and global_config.default_backend is None:
        return None
    return resolve_backend(backend).get_server_info()


def _gen(where: str, name: str | None, **values: Any) -> ir.Gen:
    if name is not None and not isinstance(name, str):
        raise ValueError(f"{where}: name must be a string, got {name!r}")
    return ir.Gen(name, checked(where, **values))


def _typed_gen_unknown(where: str, unknown: dict[str, Any]) -> None:
    own = [k for k in unknown if k in _OWN_CONSTRAINT]
    if own:
        raise TypeError(f"{where}: {own[0]!r} cannot be set here (the function sets its own constraint)")
    _no_unknown(where, unknown, _OWN_PARAMS)


def _no_unknown(where: str, unknown: dict[str, Any], allowed: tuple[str, ...]) -> None:
    if not unknown:
        return
    bad = next(iter(unknown))
    close = difflib.get_close_matches(bad, allowed, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise TypeError(f"{where}: unknown parameter {bad!r} (parameters: {', '.join(allowed)}){hint}")
