"""What backends speaking the native `/generate` request format share: the request each call sends
and how `select` scores choices (the facts of SGLang's frontend, so both give the same results).

A subclass only moves request dicts: `_request` (one response, or a list for a batch) and
`_request_stream` (the cumulative chunks of a streamed response). A prompt with images (`sgl.image`,
`sgl.video`) sends them as `image_data`, a list in prompt order, with every request on that prompt:
gens, the prefix-cache hint of a fork, and `select`'s scoring requests.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterator
from typing import Any

from sglbus.lang.backends.base import Backend
from sglbus.lang.choices import ChoiceDecision, ChoiceMethod, mean_logprob, trim_prompt_token
from sglbus.lang.global_config import global_config
from sglbus.lang.interpreter import prompt_images
from sglbus.lang.params import DTYPE_REGEX, DTYPE_STOPS, SamplingParams

_SAMPLING = ("max_new_tokens", "min_new_tokens", "n", "stop_token_ids", "stop_regex", "temperature", "top_p",
             "top_k", "min_p", "frequency_penalty", "presence_penalty", "ignore_eos", "regex",
             "json_schema")  # fmt: skip
_LOGPROBS = ("return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs")
_PER_PROMPT = ("text", "sampling_params", "image_data")  # a batch body has one of these per prompt


def generate_request(prompt: str, params: SamplingParams, stream: bool = False) -> dict[str, Any]:
    """The `/generate` body of one gen: dtype becomes its regex (numbers also stop at a space or a
    newline); empty lists and unset values are left out."""
    sampling: dict[str, Any] = {
        "skip_special_tokens": global_config.skip_special_tokens_in_output,
        "spaces_between_special_tokens": global_config.spaces_between_special_tokens_in_out,
    }
    for name in _SAMPLING:
        value = getattr(params, name)
        if value is not None and value != []:
            sampling[name] = value
    stop = params.stops()
    if params.dtype is not None:
        sampling["regex"] = DTYPE_REGEX[params.dtype]
        stop += [s for s in DTYPE_STOPS.get(params.dtype, ()) if s not in stop]
    if stop:
        sampling["stop"] = stop
    body: dict[str, Any] = {"text": str(prompt), "sampling_params": sampling, **image_data(prompt)}
    body.update({k: v for k in _LOGPROBS if (v := getattr(params, k)) is not None})
    if stream:
        body["stream"] = True
    return body


def image_data(prompt: str, copies: int | None = None) -> dict[str, Any]:
    """`{"image_data": [...]}` for a prompt with images (one entry per prompt for a batch of `copies`
    prompts on it), else nothing: a text prompt's request stays as it was."""
    images = prompt_images(prompt)
    if not images:
        return {}
    return {"image_data": images if copies is None else [images] * copies}


def check_response(response: dict[str, Any]) -> dict[str, Any]:
    """The response, or RuntimeError when the runtime aborted the request."""
    reason = (response.get("meta_info") or {}).get("finish_reason") or {}
    if isinstance(reason, dict) and reason.get("type") == "abort":
        raise RuntimeError(f"the runtime aborted the request: {reason.get('message', reason)}")
    return response


class NativeBackend(Backend):
    sends_images = True

    @abstractmethod
    def _request(self, body: dict[str, Any]) -> Any:
        """POST /generate semantics: a response dict, or a list of them for a batch."""

    @abstractmethod
    def _request_stream(self, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """The cumulative response chunks of a streamed /generate."""

    def generate(self, prompt: str, params: SamplingParams) -> tuple[str | list[str], Any]:
        out = self._request(generate_request(prompt, params))
        if isinstance(out, list):  # n > 1
            out = [check_response(r) for r in out]
            return [r["text"] for r in out], [r["meta_info"] for r in out]
        check_response(out)
        return out["text"], out["meta_info"]

    def generate_batch(
        self, prompts: list[str], params: list[SamplingParams]
    ) -> list[tuple[str | list[str], Any] | Exception]:
        """One batch `/generate` per group of gens that share n and the logprob fields (a batch body has
        one value of each); a group the runtime refuses as a whole is retried gen by gen, so the error
        lands on the gen that caused it."""
        bodies = [generate_request(prompt, p) for prompt, p in zip(prompts, params, strict=True)]
        groups: dict[tuple[Any, ...], list[int]] = {}
        for i, b in enumerate(bodies):
            shared = tuple(sorted((k, v) for k, v in b.items() if k not in _PER_PROMPT))
            groups.setdefault((b["sampling_params"].get("n", 1), shared), []).append(i)
        out: dict[int, tuple[str | list[str], Any] | Exception] = {}
        for (n, shared), rows in groups.items():
            batch = {
                "text": [bodies[i]["text"] for i in rows],
                "sampling_params": [bodies[i]["sampling_params"] for i in rows],
                **dict(shared),
            }
            if any("image_data" in bodies[i] for i in rows):  # per prompt: its list, or null
                batch["image_data"] = [bodies[i].get("image_data") for i in rows]
            try:
                responses = self._request(batch) if len(rows) > 1 else None
            except Exception:
                responses = None
            if not isinstance(responses, list) or len(responses) != len(rows) * n:
                for i in rows:
                    out[i] = _or_error(self.generate, prompts[i], params[i])
                continue
            for j, i in enumerate(rows):  # n > 1: n responses per prompt, prompt after prompt
                mine = responses[j * n : (j + 1) * n]
                out[i] = _or_error(_result, mine if n > 1 else mine[0])
        return [out[i] for i in range(len(bodies))]

    def generate_stream(self, prompt: str, params: SamplingParams) -> Iterator[tuple[str, Any]]:
        if params.n not in (None, 1):
            raise ValueError("gen: n > 1 cannot be streamed; run without stream=True")
        pos = 0
        for chunk in self._request_stream(generate_request(prompt, params, stream=True)):
            check_response(chunk)
            text = chunk["text"]
            yield text[pos:], chunk["meta_info"]
            pos = len(text)

    def cache_prefix(self, prefix: str) -> None:
        body = {"text": str(prefix), "sampling_params": {"max_new_tokens": 0}, **image_data(prefix)}
        check_response(self._request(body))

    def select(self, prompt: str, choices: list[str], method: ChoiceMethod) -> ChoiceDecision:
        # 1. the prompt alone, once: it lands in the prefix cache and tells its token count
        text = str(prompt)
        head = check_response(
            self._request({"text": text, "sampling_params": {"max_new_tokens": 0}, **image_data(prompt)})
        )
        start = max(head["meta_info"]["prompt_tokens"] - 2, 0)  # two tokens early: token healing
        # 2. every choice in one batch, scored from its prompt logprobs
        scored = self._request({
            "text": [text + c for c in choices],
            "sampling_params": {"max_new_tokens": 0, "temperature": 0},
            "return_logprob": True, "return_text_in_logprobs": True, "logprob_start_len": start,
            **image_data(prompt, copies=len(choices)),
        })  # fmt: skip
        metas = [check_response(r)["meta_info"] for r in scored]
        rows = [trim_prompt_token(text, m["input_token_logprobs"]) for m in metas]
        unconditional = None
        if method.needs_unconditional:
            # 3. the same tokens without the prompt
            plain = self._request({
                "input_ids": [[t[1] for t in row] for row in rows],
                "sampling_params": {"max_new_tokens": 0},
                "return_logprob": True, "logprob_start_len": 0,
            })  # fmt: skip
            unconditional = [check_response(r)["meta_info"]["input_token_logprobs"] for r in plain]
        return method(
            choices=choices,
            normalized_prompt_logprobs=[mean_logprob(r) for r in rows],
            input_token_logprobs=rows,
            output_token_logprobs=[m.get("output_token_logprobs", []) for m in metas],
            unconditional_token_logprobs=unconditional,
        )


def _result(out: dict[str, Any] | list[dict[str, Any]]) -> tuple[str | list[str], Any]:
    """A gen's (text, meta_info) from its response, or from its n responses as lists."""
    if isinstance(out, list):
        out = [check_response(r) for r in out]
        return [r["text"] for r in out], [r["meta_info"] for r in out]
    check_response(out)
    return out["text"], out["meta_info"]


def _or_error(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception as e:
        return e
