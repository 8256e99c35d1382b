"""`sgl.OpenAI(model)`: programs against an OpenAI-compatible API (OpenAI itself, or our `/v1`).

A completion model continues the program's text (`/v1/completions`); a chat model answers the state's
messages (`/v1/chat/completions`), so a `gen` must sit in an assistant turn. Parameters OpenAI does
not have (top_k, min_p, regex, json_schema, dtype as a regex, ...) go in `extra_body`, as SGLang's
server (and ours) accepts them; they are sent only when set away from their neutral value, so a plain
OpenAI endpoint sees only its own fields.

API speculative execution (the SGLang paper, §5): a chat API cannot continue a half-written reply, so
a turn like `"Name:" + gen("name", stop="\\n") + "\\nJob:" + gen("job")` would need one call per gen,
each paying for the whole prompt again. With `@sgl.function(num_api_spec_tokens=N)` the turn's first
gen asks for max(N, its max_tokens) tokens without stop strings, and the program's own text and later
gens are matched against that speculated reply (`sglbus/lang/speculation.py`). Every call is counted
in `usage` (SGLang's `token_usage`).
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Iterator
from typing import Any

from sglbus.lang.backends.base import Backend
from sglbus.lang.chat import ChatTemplate
from sglbus.lang.chat_template import get_chat_template, template_for_model
from sglbus.lang.choices import ChoiceDecision, ChoiceMethod, Row, mean_logprob, trim_prompt_token
from sglbus.lang.interpreter import ChatPrompt
from sglbus.lang.params import DTYPE_REGEX, DTYPE_STOPS, SamplingParams
from sglbus.lang.speculation import Speculation

# models OpenAI serves on /v1/completions; any other name is taken for a chat model
COMPLETION_MODELS = ("gpt-3.5-turbo-instruct", "davinci-002", "babbage-002")


@dataclasses.dataclass
class TokenUsage:
    """What the backend's calls cost, as the API reported it: `backend.usage`, also under SGLang's name
    `backend.token_usage` (the same object). Counted from the threads of run_batch under its lock."""

    calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, init=False, repr=False,
                                              compare=False)  # fmt: skip

    def add(self, calls: int, usage: Any) -> None:
        with self._lock:
            self.calls += calls
            if usage is not None:
                self.prompt_tokens += usage.prompt_tokens
                self.completion_tokens += usage.completion_tokens

    def reset(self) -> TokenUsage:
        """Back to zero (SGLang's `token_usage.reset()`); returns the counts before, as a copy."""
        with self._lock:
            before = dataclasses.replace(self)
            self.calls = self.prompt_tokens = self.completion_tokens = 0
        return before


class OpenAI(Backend):
    supports_api_speculative_execution = True

    def __init__(self, model_name: str, base_url: str | None = None, api_key: str | None = None,
                 is_chat_model: bool | None = None, chat_template: ChatTemplate | str | None = None,
                 max_spec_tries: int = 3, **client_options: Any) -> None:  # fmt: skip
        """base_url: e.g. `http://127.0.0.1:30000/v1` (unset: OpenAI's). is_chat_model: unset, every
        model but OpenAI's completion ones. chat_template (a ChatTemplate or a name) renders the roles
        into the text a completion model continues; unset, one picked by the model's name.
        max_spec_tries: calls per assistant turn when a sampled speculated reply does not match the
        program's text. client_options go to `openai.OpenAI` (timeout, max_retries, ...)."""
        import openai  # here, so that `import sglbus` does not load the client

        if api_key is None:  # a local server without --api-key takes any key; the client needs one
            api_key = os.environ.get("OPENAI_API_KEY") or ("EMPTY" if base_url else None)
        self.client = openai.OpenAI(base_url=base_url, api_key=api_key, **client_options)
        self._errors = (openai.APIStatusError, openai.APIConnectionError)
        self.model_name = model_name
        self.is_chat_model = model_name not in COMPLETION_MODELS if is_chat_model is None else is_chat_model
        if isinstance(chat_template, str):
            chat_template = get_chat_template(chat_template)
        self.chat_template = chat_template or template_for_model(model_name)
        if isinstance(max_spec_tries, bool) or not isinstance(max_spec_tries, int) or max_spec_tries < 1:
            raise ValueError(f"OpenAI: max_spec_tries must be an integer >= 1, got {max_spec_tries!r}")
        self.max_spec_tries = max_spec_tries
        self.usage = TokenUsage()  # one counter for the backend's life: reset() clears it in place

    def get_chat_template(self) -> ChatTemplate:
        return self.chat_template

    def get_model_info(self) -> dict[str, Any]:
        return {"model_path": self.model_name, "is_generation": True, "has_image_understanding": False}

    @property
    def token_usage(self) -> TokenUsage:
        """SGLang's name for `usage`."""
        return self.usage

    def reset_usage(self) -> TokenUsage:
        """The usage so far (a copy), and the counter back at zero."""
        return self.usage.reset()

    def speculation(self, num_tokens: int) -> Speculation:
        """The per-state matcher of `@sgl.function(num_api_spec_tokens=...)`."""
        return Speculation(self, num_tokens, self.max_spec_tries)

    # -- gen ------------------------------------------------------------------------------------
    def generate(self, prompt: str, params: SamplingParams) -> tuple[str | list[str], Any]:
        ret = self._create(prompt, openai_kwargs(params, self.is_chat_model))
        texts = [self._text(c) for c in ret.choices]
        metas = [self._meta(ret, c) for c in ret.choices]
        if len(texts) == 1:
            return texts[0], metas[0]
        return texts, metas

    def generate_stream(self, prompt: str, params: SamplingParams) -> Iterator[tuple[str, Any]]:
        if params.n not in (None, 1):
            raise ValueError("gen: n > 1 cannot be streamed; run without stream=True")
        kwargs = {**openai_kwargs(params, self.is_chat_model), "stream": True,
                  "stream_options": {"include_usage": True}}  # fmt: skip
        meta: dict[str, Any] = {}
        chunks = iter(self._create(prompt, kwargs))
        while True:
            try:
                chunk = next(chunks)
            except StopIteration:
                return
            except self._errors as e:
                raise RuntimeError(f"{self.model_name}: the stream failed: {_describe(e)}") from None
            if chunk.usage is not None:  # the last chunk: no choices, the usage of the whole call
                meta.update(prompt_tokens=chunk.usage.prompt_tokens,
                            completion_tokens=chunk.usage.completion_tokens)  # fmt: skip
                self._count(0, chunk.usage)
                yield "", dict(meta)
            for c in chunk.choices:
                delta = (c.delta.content if self.is_chat_model else c.text) or ""
                if c.finish_reason is not None:
                    meta["finish_reason"] = c.finish_reason
                meta["id"] = chunk.id
                yield delta, dict(meta)

    def _create(self, prompt: str, kwargs: dict[str, Any]) -> Any:
        if self.is_chat_model:
            call, endpoint = self.client.chat.completions.create, "chat/completions"
            kwargs = {**kwargs, "messages": chat_messages(prompt)}
        else:
            call, endpoint = self.client.completions.create, "completions"
            kwargs = {**kwargs, "prompt": str(prompt)}
        try:
            ret = call(model=self.model_name, **kwargs)
        except self._errors as e:
            raise RuntimeError(f"{self.model_name} /v1/{endpoint}: {_describe(e)}") from None
        self._count(1, None if kwargs.get("stream") else ret.usage)  # a stream's comes in its last chunk
        return ret

    def _count(self, calls: int, usage: Any) -> None:
        self.usage.add(calls, usage)

    def _text(self, choice: Any) -> str:
        return (choice.message.content if self.is_chat_model else choice.text) or ""

    def _meta(self, ret: Any, choice: Any) -> dict[str, Any]:
        meta = {"id": ret.id, "model": ret.model, "finish_reason": choice.finish_reason}
        if ret.usage is not None:
            meta.update(prompt_tokens=ret.usage.prompt_tokens, completion_tokens=ret.usage.completion_tokens)
        if choice.logprobs is not None:
            meta["output_token_logprobs"] = _rows(choice.logprobs, self.is_chat_model)
        return meta

    # -- select ---------------------------------------------------------------------------------
    def select(self, prompt: str, choices: list[str], method: ChoiceMethod) -> ChoiceDecision:
        """A completion model scores every `prompt + choice` from its echoed prompt logprobs, in one
        call that also sends the prompt alone (its token count tells where a choice begins): the
        same rows and methods as the native backends. A chat API has no logprobs of given text."""
        if self.is_chat_model:
            raise ValueError(
                f"select: {self.model_name!r} is used as a chat model (is_chat_model=True), and a chat API "
                "cannot score given choices; use gen(name, regex='a|b') on a server that takes regex, or "
                "a completion model (is_chat_model=False)"
            )
        echoed = self._echo([prompt, *(prompt + c for c in choices)])
        start = max(len(echoed[0]) - 2, 0)  # two tokens early: token healing, as the native backends do
        rows = [trim_prompt_token(prompt, r[start:]) for r in echoed[1:]]
        unconditional = None
        if method.needs_unconditional:  # the choice's tokens alone, their text sent again
            unconditional = self._echo(["".join(t[2] for t in r) for r in rows])
        return method(
            choices=choices,
            normalized_prompt_logprobs=[mean_logprob(r) for r in rows],
            input_token_logprobs=rows,
            output_token_logprobs=[[] for _ in rows],
            unconditional_token_logprobs=unconditional,
        )

    def _echo(self, prompts: list[str]) -> list[Row]:
        try:
            ret = self.client.completions.create(model=self.model_name, prompt=prompts, echo=True,
                                                 logprobs=0, max_tokens=0, temperature=0)  # fmt: skip
        except self._errors as e:
            raise RuntimeError(
                f"select: {self.model_name} /v1/completions (echo, logprobs): {_describe(e)}"
            ) from None
        self._count(1, ret.usage)
        return [_rows(c.logprobs, False) for c in sorted(ret.choices, key=lambda c: c.index)]


def openai_kwargs(params: SamplingParams, chat: bool) -> dict[str, Any]:
    """The create() arguments of one gen: OpenAI's own fields, and SGLang's others in extra_body,
    each only when set away from the value that changes nothing."""
    out: dict[str, Any] = {}
    for ours, theirs in (("max_new_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                         ("presence_penalty", "presence_penalty"), ("frequency_penalty", "frequency_penalty"),
                         ("n", "n")):  # fmt: skip
        if (value := getattr(params, ours)) is not None:
            out[theirs] = value
    stop = params.stops()
    extra: dict[str, Any] = {}
    if params.dtype is not None:
        extra["regex"] = DTYPE_REGEX[params.dtype]
        stop += [s for s in DTYPE_STOPS.get(params.dtype, ()) if s not in stop]
    if stop:
        out["stop"] = stop
    neutral = {"top_k": -1, "min_p": 0.0, "min_new_tokens": 0, "ignore_eos": False}
    for ours, theirs in (("top_k", "top_k"), ("min_p", "min_p"), ("min_new_tokens", "min_tokens"),
                         ("ignore_eos", "ignore_eos"), ("regex", "regex"), ("json_schema", "json_schema"),
                         ("stop_token_ids", "stop_token_ids"), ("stop_regex", "stop_regex")):  # fmt: skip
        value = getattr(params, ours)
        if value is not None and value != [] and value != neutral.get(ours, object()):
            extra[theirs] = value
    if extra:
        out["extra_body"] = extra
    if params.return_logprob:
        top = params.top_logprobs_num or 0
        out.update({"logprobs": True, "top_logprobs": top} if chat else {"logprobs": top})
    return out


def chat_messages(prompt: str) -> list[dict[str, Any]]:
    """The messages of a chat call: the finished turns, for a gen that opens an assistant turn."""
    if not isinstance(prompt, ChatPrompt):
        raise TypeError("a chat model needs the program's messages: run gen inside an @sgl.function")
    if prompt.role != "assistant":
        where = f"in a {prompt.role} turn" if prompt.role else "outside any role"
        raise ValueError(
            f"gen {where}: a chat model writes only assistant turns; put the gen in sgl.assistant(...)"
        )
    if prompt.role_text.strip():
        raise ValueError(
            f"gen after {prompt.role_text[-40:]!r} in the same assistant turn: a chat API cannot continue a "
            "partial reply, so a chat model's gen must open its turn. @sgl.function(num_api_spec_tokens=N) "
            "lets the turn's later gens come out of one speculated reply"
        )
    return list(prompt.messages)


def _rows(logprobs: Any, chat: bool) -> Row:
    """OpenAI's logprobs as our rows, [logprob, token_id (unknown: None), token text] per token."""
    if chat:
        return [[t.logprob, None, t.token] for t in logprobs.content or []]
    return [[lp, None, tok] for tok, lp in zip(logprobs.tokens, logprobs.token_logprobs, strict=True)]


def _describe(e: Exception) -> str:
    status = getattr(e, "status_code", None)
    body = getattr(e, "body", None)
    message = body.get("message", body) if isinstance(body, dict) else str(e)
    return f"HTTP {status}: {message}" if status is not None else str(message)
