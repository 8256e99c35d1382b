"""OpenAI's `/v1/completions` and `/v1/chat/completions` request bodies, checked under OpenAI's names and
turned into a SGLang `/generate` body (GenerateReqInput), which then goes the way every request goes.

Accepted beyond OpenAI, as SGLang accepts them: top_k, min_p, min_tokens, repetition_penalty, regex,
ebnf, json_schema, stop_token_ids, stop_regex, ignore_eos, skip_special_tokens,
spaces_between_special_tokens, no_stop_trim, rid. OpenAI fields that change nothing here (user,
metadata, store, service_tier, parallel_tool_calls) are accepted and ignored; fields that would change
the result and cannot be honoured (suffix, best_of > n, audio, ...) are refused by name."""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from services.gateway.openai_errors import OpenAIError
from services.gateway.openai_images import ChatImage, content_parts
from services.gateway.openai_reasoning import ReasoningPlan, plan_reasoning
from services.gateway.openai_tools import ToolPlan, plan_tools, tool_calls_text
from shared.reasoning_parser import reasoning_end, reasons_by_default
from shared.sampling_params import MAX_LOGIT_BIAS

# OpenAI's own fields per endpoint, beside `model` and the prompt or messages
_COMMON = (
    "max_tokens",
    "temperature",
    "top_p",
    "n",
    "stream",
    "stream_options",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "user",
    "metadata",
    "store",
    "service_tier",
    "safety_identifier",  # OpenAI's request metadata: accepted and not used, as `user`
    "prompt_cache_key",  # the radix cache needs no key
    "separate_reasoning",  # chat: the reasoning parser (openai_reasoning.py); completions: checked, unused
    "stream_reasoning",
    # SGLang's request fields that change nothing here at these values (refused otherwise, _REFUSED)
    "chat_template_kwargs",
    "return_hidden_states",
    "lora_path",
    "session_params",
)
_COMPLETION = (*_COMMON, "logprobs", "echo", "suffix", "best_of")
_CHAT = (
    *_COMMON,
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "response_format",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "functions",
    "function_call",
    "modalities",
    "audio",
    "prediction",
    "reasoning_effort",
    "web_search_options",
    "continue_final_message",
    "verbosity",  # for reasoning models' answers; accepted and not used
)
# SGLang's extra body fields: the sampling parameter each sets
_EXTRA_SAMPLING = {
    "top_k": "top_k",
    "min_p": "min_p",
    "min_tokens": "min_new_tokens",
    "repetition_penalty": "repetition_penalty",
    "regex": "regex",
    "ebnf": "ebnf",
    "json_schema": "json_schema",
    "stop_token_ids": "stop_token_ids",
    "stop_regex": "stop_regex",
    "ignore_eos": "ignore_eos",
    "skip_special_tokens": "skip_special_tokens",
    "spaces_between_special_tokens": "spaces_between_special_tokens",
    "no_stop_trim": "no_stop_trim",
}
# refused unless unset (or at the value given)
_REFUSED = {
    "suffix": None,
    "functions": None,
    "function_call": None,
    "audio": None,
    "prediction": None,
    "web_search_options": None,
    "continue_final_message": False,
    "chat_template_kwargs": {},
    "return_hidden_states": False,
    "lora_path": None,
    "session_params": None,
}
MAX_N = 128
MAX_STOP = 4  # OpenAI's limit on stop sequences
COMPLETION_MAX_TOKENS = 16  # OpenAI's (and SGLang's) default for /v1/completions


@dataclass
class OpenAIRequest:
    kind: str  # "completion" or "chat"
    model: str
    generate: dict[str, Any]  # the /generate body it becomes
    n: int
    prompts: int  # how many prompts (choices: prompts * n, prompt by prompt)
    stream: bool
    include_usage: bool  # stream_options.include_usage
    top_logprobs: int | None  # None: no logprobs asked
    echo: bool  # completions: the prompt before each choice's text
    tools: ToolPlan | None  # chat with tools: how the output is read
    reasoning: ReasoningPlan | None = None  # chat with the reasoning apart: how the output is split
    # chat with images: where each image_data entry was (messages[i].content[j].image_url), to name it
    image_params: tuple[str, ...] = ()


def parse_completion(body: Any, models: tuple[str, ...]) -> OpenAIRequest:
    obj = _object(body, _COMPLETION + ("prompt",))
    model = _model(obj, models)
    prompt = obj.get("prompt")
    gen: dict[str, Any] = {"rid": _rid(obj, "cmpl")}
    if isinstance(prompt, str):
        gen["text"], count = prompt, 1
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        gen["text"], count = prompt, len(prompt)
    elif isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
        gen["input_ids"], count = prompt, 1
    elif (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(p, list) and p and all(is_int(t) for t in p) for p in prompt)
    ):
        gen["input_ids"], count = prompt, len(prompt)
    else:
        raise OpenAIError(
            "prompt must be a non-empty string, a list of strings, a list of token ids or a list "
            "of such lists",
            "prompt",
        )
    sampling = _sampling(obj, _int_field(obj, "max_tokens", 0, None, COMPLETION_MAX_TOKENS))
    n = sampling["n"]
    best_of = _int_field(obj, "best_of", 1, MAX_N, n)
    if best_of != n:
        raise OpenAIError(f"best_of = {best_of} is not supported; leave it unset or equal to n", "best_of")
    top = _int_field(obj, "logprobs", 0, 5, None)
    echo = _bool_field(obj, "echo", False)
    plan_reasoning(obj, None)  # separate_reasoning / stream_reasoning: checked as on chat, not used
    gen["sampling_params"] = sampling
    _logprobs(gen, top, prompt_too=echo)
    return OpenAIRequest(
        "completion",
        model,
        _stream(gen, obj),
        n,
        count,
        bool(obj.get("stream")),
        _include_usage(obj),
        top,
        echo,
        None,
    )


def parse_chat(
    body: Any,
    models: tuple[str, ...],
    render: Callable[[list[dict[str, Any]]], list[int]],
    reasoning_parser: str | None = None,
    takes_images: bool = False,
) -> OpenAIRequest:
    """render: the messages (role / content dicts; a content with images is a list of text and image
    parts, openai_images.py) through the model's chat template, as ids; reasoning_parser: the server's
    (None: the answer is not split); takes_images: a vision-language model (image_url parts allowed)."""
    obj = _object(body, _CHAT + ("messages",))
    model = _model(obj, models)
    images: list[ChatImage] = []
    messages = _messages(obj.get("messages"), takes_images, images)
    limit = obj.get("max_completion_tokens")
    limit = _int_field(obj, "max_completion_tokens" if limit is not None else "max_tokens", 0, None, None)
    sampling = _sampling(obj, limit)
    fmt = _response_format(obj.get("response_format"))
    if fmt is not None:
        sampling["json_schema"] = fmt
    tools = plan_tools(obj.get("tools"), obj.get("tool_choice"))
    if tools is not None:
        messages = tools.add_to(messages)
        if tools.schema is not None:
            if fmt is not None:
                raise OpenAIError(
                    "response_format cannot be combined with a tool_choice that forces a call",
                    "response_format",
                )
            sampling["json_schema"] = tools.schema
    constrained = any(sampling.get(k) is not None for k in ("json_schema", "regex", "ebnf"))
    # a model that reasons first: its grammar applies after the reasoning (SGLang's structured outputs
    # for reasoning models), whether or not the reasoning is returned apart
    think_first = constrained and reasoning_parser is not None and reasons_by_default(reasoning_parser)
    reasoning = plan_reasoning(obj, reasoning_parser)
    if think_first and reasoning is None and tools is not None and tools.schema is not None:
        tools = dataclasses.replace(tools, after=reasoning_end(reasoning_parser))  # type: ignore[arg-type]
    want = _bool_field(obj, "logprobs", False)
    top = _int_field(obj, "top_logprobs", 0, 20, None)
    if top is not None and not want:
        raise OpenAIError("top_logprobs requires logprobs: true", "top_logprobs")
    try:
        ids = render(messages)
    except OpenAIError:  # the render's own checks, with their param
        raise
    except Exception as e:  # the template refused the conversation (roles out of order, ...)
        raise OpenAIError(
            f"messages could not be rendered with the model's chat template: {e}", "messages"
        ) from None
    gen: dict[str, Any] = {"rid": _rid(obj, "chatcmpl"), "input_ids": ids, "sampling_params": sampling}
    if think_first:
        gen["require_reasoning"] = True
    if images:
        gen["image_data"] = [im.url for im in images]
    _logprobs(gen, (top or 0) if want else None, prompt_too=False)
    return OpenAIRequest(
        "chat",
        model,
        _stream(gen, obj),
        sampling["n"],
        1,
        bool(obj.get("stream")),
        _include_usage(obj),
        (top or 0) if want else None,
        False,
        tools,
        reasoning,
        tuple(im.param for im in images),
    )


# -- the parts ---------------------------------------------------------------------------------
def _object(body: Any, known: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise OpenAIError("the request body must be a JSON object")
    allowed = set(known) | {"model"} | set(_EXTRA_SAMPLING) | {"rid"}
    unknown = sorted(k for k in body if k not in allowed)
    if unknown:
        raise OpenAIError(
            f"unrecognized request argument(s) {', '.join(map(repr, unknown))}; allowed: "
            f"{', '.join(sorted(allowed))}",
            unknown[0],
        )
    for key, default in _REFUSED.items():
        if body.get(key) not in (None, default):
            raise OpenAIError(f"{key} is not supported by this server; leave it unset", key)
    return body


def _model(obj: dict[str, Any], models: tuple[str, ...]) -> str:
    model = obj.get("model")
    if model is None:
        return models[0]
    if not isinstance(model, str):
        raise OpenAIError("model must be a string", "model")
    if model not in models:
        raise OpenAIError(
            f"The model `{model}` does not exist; this server serves {models[0]!r}",
            "model",
            404,
            code="model_not_found",
        )
    return model


def _sampling(obj: dict[str, Any], max_tokens: int | None) -> dict[str, Any]:
    sp: dict[str, Any] = {
        "max_new_tokens": max_tokens,
        "temperature": _num_field(obj, "temperature", 0.0, 2.0, 1.0),
        "top_p": _top_p(obj),
        "n": _int_field(obj, "n", 1, MAX_N, 1),
        "presence_penalty": _num_field(obj, "presence_penalty", -2.0, 2.0, 0.0),
        "frequency_penalty": _num_field(obj, "frequency_penalty", -2.0, 2.0, 0.0),
        "stop": _stop(obj.get("stop")),
    }
    seed = obj.get("seed")
    if seed is not None:
        if not is_int(seed):
            raise OpenAIError("seed must be an integer", "seed")
        sp["sampling_seed"] = seed
    bias = obj.get("logit_bias")
    if bias is not None:
        sp["logit_bias"] = _logit_bias(bias)
    for key, name in _EXTRA_SAMPLING.items():
        if obj.get(key) is not None:
            sp[name] = obj[key]
    return sp


def _stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise OpenAIError("stop must be a non-empty string or a list of them", "stop")
    if len(stops) > MAX_STOP:
        raise OpenAIError(f"stop has {len(stops)} sequences; at most {MAX_STOP} are allowed", "stop")
    return stops


def _logit_bias(bias: Any) -> dict[str, float]:
    if not isinstance(bias, dict):
        raise OpenAIError("logit_bias must be an object mapping token ids to biases", "logit_bias")
    if len(bias) > MAX_LOGIT_BIAS:  # before the loop below walks them
        raise OpenAIError(f"logit_bias: at most {MAX_LOGIT_BIAS} entries, got {len(bias)}", "logit_bias")
    out = {}
    for k, v in bias.items():
        if not re.fullmatch(r"-?[0-9]{1,10}", str(k)):  # ASCII digits: isdigit() takes "²", int() not
            raise OpenAIError(f"logit_bias key {str(k)[:40]!r} is not a token id", "logit_bias")
        if not isinstance(v, int | float) or isinstance(v, bool) or not -100 <= v <= 100:
            raise OpenAIError(
                f"logit_bias[{k}] = {v!r} is invalid; allowed: numbers in [-100, 100]", "logit_bias"
            )
        out[str(int(k))] = float(v)
    return out


def _response_format(fmt: Any) -> str | None:
    """The JSON schema a response_format asks for (None: plain text)."""
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return json.dumps({"type": "object"})
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema", spec.get("schema_")) if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise OpenAIError(
                "response_format.json_schema.schema must be a JSON schema object", "response_format"
            )
        return json.dumps(schema)
    raise OpenAIError(
        f"response_format.type = {kind!r} is invalid; allowed: text, json_object, json_schema",
        "response_format",
    )


def _messages(messages: Any, takes_images: bool, images: list[ChatImage]) -> list[dict[str, Any]]:
    """Plain role / content dicts; the image parts' urls go to `images`, in order."""
    if not isinstance(messages, list) or not messages:
        raise OpenAIError("messages must be a non-empty list of messages", "messages")
    out = []
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise OpenAIError(
                f"messages[{i}].role = {role!r} is invalid; allowed: system, developer, user, "
                "assistant, tool",
                "messages",
            )
        content = _content(m.get("content"), i, role, takes_images, images)
        if role == "assistant" and m.get("tool_calls"):  # the calls as the model wrote them
            content += tool_calls_text(m["tool_calls"], i)
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


def _content(
    content: Any, i: int, role: str, takes_images: bool, images: list[ChatImage]
) -> str | list[dict[str, str]]:
    """A string, or (a message with images) its list of text and image parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return content_parts(content, i, role, takes_images, images)
    parts = "text and image_url parts" if takes_images else "text parts"
    raise OpenAIError(f"messages[{i}].content must be a string or a list of {parts}", "messages")


def _logprobs(gen: dict[str, Any], top: int | None, prompt_too: bool) -> None:
    if top is None:
        return
    gen.update(return_logprob=True, top_logprobs_num=top, return_text_in_logprobs=True)
    gen["logprob_start_len"] = 0 if prompt_too else -1


def _stream(gen: dict[str, Any], obj: dict[str, Any]) -> dict[str, Any]:
    gen["stream"] = _bool_field(obj, "stream", False)
    return gen


def _include_usage(obj: dict[str, Any]) -> bool:
    opts = obj.get("stream_options")
    if opts is None:
        return False
    if not isinstance(opts, dict) or not isinstance(opts.get("include_usage", False), bool):
        raise OpenAIError("stream_options must be an object with a boolean include_usage", "stream_options")
    if not obj.get("stream"):
        raise OpenAIError("stream_options is only allowed with stream: true", "stream_options")
    return bool(opts.get("include_usage"))


def _rid(obj: dict[str, Any], prefix: str) -> str:
    rid = obj.get("rid")
    if rid is None:
        return f"{prefix}-{uuid.uuid4().hex}"
    if not isinstance(rid, str) or not rid:
        raise OpenAIError("rid must be a non-empty string", "rid")
    return rid


def _num_field(obj: dict[str, Any], key: str, lo: float, hi: float, default: float) -> float:
    v = obj.get(key)
    if v is None:
        return default
    if not isinstance(v, int | float) or isinstance(v, bool) or not lo <= v <= hi:
        raise OpenAIError(f"{key} = {v!r} is invalid; allowed: numbers in [{lo:g}, {hi:g}]", key)
    return float(v)


def _top_p(obj: dict[str, Any]) -> float:
    """(0, 1], as SGLang's sampling takes it (0 keeps no token)."""
    v = _num_field(obj, "top_p", 0.0, 1.0, 1.0)
    if v == 0.0:
        raise OpenAIError(
            "top_p = 0 is invalid; allowed: numbers in (0, 1] (use temperature 0 for greedy)", "top_p"
        )
    return v


def _int_field(obj: dict[str, Any], key: str, lo: int, hi: int | None, default: int | None) -> Any:
    v = obj.get(key)
    if v is None:
        return default
    if not is_int(v) or v < lo or (hi is not None and v > hi):
        allowed = f"integers in [{lo}, {hi}]" if hi is not None else f"integers >= {lo}"
        raise OpenAIError(f"{key} = {v!r} is invalid; allowed: {allowed}", key)
    return v


def _bool_field(obj: dict[str, Any], key: str, default: bool) -> bool:
    v = obj.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise OpenAIError(f"{key} must be true or false", key)
    return v


def is_int(v: Any) -> bool:
    """An integer that is not a bool (JSON true is not a token id)."""
    return isinstance(v, int) and not isinstance(v, bool)
