"""The stream executor: one per program state, running the state's steps in order.

`s += step` only queues the step, so the Python program runs ahead until it reads a result
(`s["x"]`, `s.text()`), the way a CUDA launch returns before the kernel ends. Each state has its own
worker thread; the branches of a `fork` are states of their own and so run concurrently, and the
runtime batches their requests (sharing the prefix in its radix cache).

After a step fails, the executor skips the rest of its queue; `error()` gives the exception and
reading a variable the program never produced raises with that exception as its cause.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from sglbus.lang import ir, media
from sglbus.lang.params import SamplingParams
from shared.reasoning_parser import ReasoningParser

if TYPE_CHECKING:
    from sglbus.lang.backends.base import Backend
    from sglbus.lang.chat import ChatTemplate

_END = object()


class StopTracing(Exception):
    """A traced program reached a step whose text is not known in advance."""


class Prompt(str):
    """The prompt of a program with images: its text, and `images`, the `image_data` items its image
    tokens stand for, in order. Every call on the prompt sends all of them (the runtime is stateless;
    its prefix cache makes a repeated image cheap)."""

    images: tuple[str, ...]

    def __new__(cls, text: str, images: tuple[str, ...] = ()) -> Prompt:
        self = super().__new__(cls, text)
        self.images = tuple(images)
        return self


def prompt_images(prompt: str) -> list[str]:
    """The images a prompt carries (none for a plain string)."""
    return list(getattr(prompt, "images", ()))


class ChatPrompt(str):
    """The prompt a backend that talks in messages (`is_chat_model`) gets: the text so far, as every
    backend does, with the finished turns, the open role and what the program wrote in it so far."""

    messages: tuple[dict[str, Any], ...]
    role: str | None
    role_text: str

    def __new__(
        cls, text: str, messages: tuple[dict[str, Any], ...], role: str | None, role_text: str
    ) -> ChatPrompt:
        self = super().__new__(cls, text)
        self.messages, self.role, self.role_text = messages, role, role_text
        return self

    def turn_start(self) -> ChatPrompt:
        """The prompt as it was when the open turn began."""
        return ChatPrompt(self[: len(self) - len(self.role_text)], self.messages, self.role, "")


class StreamExecutor:
    def __init__(self, backend: Backend, defaults: SamplingParams, stream: bool = False,
                 chat_template: ChatTemplate | None = None, threaded: bool = True,
                 tracing: bool = False, num_api_spec_tokens: int | None = None) -> None:  # fmt: skip
        self.backend, self.defaults, self.stream, self.tracing = backend, defaults, stream, tracing
        # API speculative execution: the backend's matcher decides which gens need a call
        self.num_api_spec_tokens = num_api_spec_tokens
        self.speculation: Any = (
            None if num_api_spec_tokens is None else backend.speculation(num_api_spec_tokens)
        )
        self.chat_template = chat_template or backend.get_chat_template()
        self.text_ = ""
        self.images_: list[str] = []  # image_data items, one per image token in text_, in order
        self.messages_: list[dict[str, Any]] = []
        self.variables: dict[str | None, Any] = {}
        self.meta_info: dict[str | None, Any] = {}
        self.role: str | None = None
        self.role_start = 0  # where the open role's content begins in text_
        self.fork_start = 0  # where this branch left its parent's text
        self.fork_images = 0  # and its images
        self.error_: BaseException | None = None
        self.finished = False  # ended and every queued step done
        self._ended = False
        self._scopes: dict[str, int] = {}
        self._pending: dict[str | None, int] = {}  # variable -> queued steps that will set it
        self._changed = threading.Condition()
        self._queue: queue.Queue[Any] | None = None
        if threaded:
            self._queue = queue.Queue()
            threading.Thread(target=self._work, name="sglbus-lang", daemon=True).start()

    # -- the program's side ----------------------------------------------------------------------
    def submit(self, x: Any) -> None:
        for step in ir.leaves(x):
            with self._changed:
                for name in ir.produced_names(step):
                    self._pending[name] = self._pending.get(name, 0) + 1
            if self._queue is None:
                self._run_step(step)
            else:
                self._queue.put(step)

    def end(self) -> None:
        """No more steps come: the worker exits once the queue is done."""
        if self._ended:
            return
        self._ended = True
        if self._queue is not None:
            self._queue.put(_END)
        else:
            with self._changed:
                self.finished = True
                self._changed.notify_all()

    def sync(self) -> None:
        if self._queue is not None:
            self._queue.join()

    def get_var(self, name: str) -> Any:
        if self.tracing:
            raise StopTracing
        with self._changed:
            self._changed.wait_for(lambda: not self._pending.get(name))
            if name in self.variables:
                return self.variables[name]
        self.sync()  # not known yet: the steps still queued may set it (set_var does not queue)
        if name in self.variables:
            return self.variables[name]
        if self.error_ is not None:
            raise RuntimeError(
                f"variable {name!r} was not produced: the program failed: {self.error_}"
            ) from (self.error_)
        known = ", ".join(repr(k) for k in self.variables if k is not None) or "none"
        raise KeyError(f"no variable {name!r} in this state (variables: {known})")

    def set_var(self, name: str, value: Any) -> None:
        with self._changed:
            self.variables[name] = value
            self._changed.notify_all()

    def get_meta_info(self, name: str) -> Any:
        with self._changed:
            self._changed.wait_for(lambda: not self._pending.get(name))
            return self.meta_info.get(name)

    def fork(self, size: int) -> list[StreamExecutor]:
        if self.tracing:
            raise StopTracing
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"fork: size must be an integer >= 1, got {size!r}")
        self.sync()
        if size > 1 and self.text_ and self.error_ is None:
            # a hint: the branches share this prefix; the runtime caches it once for all of them
            self.backend.cache_prefix(self._with_images(self.text_))
        return [self.branch(self._queue is not None) for _ in range(size)]

    def branch(self, threaded: bool) -> StreamExecutor:
        """One branch of a fork: a new executor that starts from this one's text, roles and variables."""
        child = StreamExecutor(self.backend, self.defaults, self.stream, self.chat_template,
                               threaded=threaded, num_api_spec_tokens=self.num_api_spec_tokens)  # fmt: skip
        child.text_, child.messages_ = self.text_, list(self.messages_)
        child.images_, child.fork_images = list(self.images_), len(self.images_)
        child.variables, child.meta_info = dict(self.variables), dict(self.meta_info)
        child.role, child.role_start, child.fork_start = self.role, self.role_start, len(self.text_)
        child.error_ = self.error_
        return child

    def iter_text(self, var_name: str | None = None) -> Iterator[str]:
        """New text as it arrives: of the whole state, or of one variable, until it is complete."""
        pos = 0
        while True:
            with self._changed:
                self._changed.wait_for(lambda p=pos: len(self._current(var_name)) > p or self._done(var_name))
                chunk, done = self._current(var_name)[pos:], self._done(var_name)
            pos += len(chunk)
            if chunk:
                yield chunk
            if done:
                return

    def _current(self, var_name: str | None) -> str:
        if var_name is None:
            return self.text_
        value = self.variables.get(var_name, "")
        return value if isinstance(value, str) else ""

    def _done(self, var_name: str | None) -> bool:
        if var_name is None or self.finished:
            return self.finished
        return var_name in self.variables and not self._pending.get(var_name)

    # -- the worker's side -----------------------------------------------------------------------
    def _work(self) -> None:
        assert self._queue is not None
        while (step := self._queue.get()) is not _END:
            self._run_step(step)
            self._queue.task_done()
        with self._changed:
            self.finished = True
            self._changed.notify_all()
        self._queue.task_done()

    def _run_step(self, step: ir.Expr) -> None:
        try:
            if self.error_ is None:
                self._execute(step)
        except StopTracing:
            raise
        except Exception as e:  # the program sees it through error() and its variables
            self.error_ = e
        finally:
            with self._changed:
                for name in ir.produced_names(step):
                    self._pending[name] -= 1
                self._changed.notify_all()

    def _append(self, text: str, var: str | None = None, new_var: bool = False,
                images: tuple[str, ...] | list[str] = ()) -> None:  # fmt: skip
        with self._changed:
            self.text_ += text
            self.images_ += images
            if new_var:
                self.variables[var] = text
            elif var is not None:
                self.variables[var] += text
            self._changed.notify_all()

    def _execute(self, step: ir.Expr) -> None:
        if isinstance(step, ir.Text):
            self._append(step.value, images=step.images)
            if self.speculation is not None:
                self.speculation.fill(step.value)
        elif isinstance(step, ir.Gen):
            self._gen(step)
        elif isinstance(step, ir.Select):
            self._select(step)
        elif isinstance(step, ir.RoleBegin):
            self._role_begin(step.role)
        elif isinstance(step, ir.RoleEnd):
            self._role_end(step.role)
        elif isinstance(step, (ir.Image, ir.Video)):
            self._media(step)
        elif isinstance(step, ir.VarScopeBegin):
            self._scopes[step.name] = len(self.text_)
        elif isinstance(step, ir.VarScopeEnd):
            if step.name not in self._scopes:
                raise ValueError(f"var_scope {step.name!r} ends without a beginning")
            self.set_var(step.name, self.text_[self._scopes.pop(step.name) :])
        elif isinstance(step, ir.SeparateReasoning):
            self._separate_reasoning(step)
        else:
            raise TypeError(f"cannot execute {type(step).__name__}")

    def _media(self, step: ir.Image | ir.Video) -> None:
        """SGLang's image / video: the model's image token in the text where each image goes, and the
        image (a video: its sampled frames, one token each) recorded for every later call."""
        if self.tracing:
            raise StopTracing
        self._spec_reset()
        kind = "image" if isinstance(step, ir.Image) else "video"
        self.backend.check_media(kind, step.path)
        if isinstance(step, ir.Image):
            images = [media.encode_image(step.path)]
        else:
            images = media.video_frames(step.path, step.num_frames)
        self._append(self.image_text() * len(images), images=images)

    def image_text(self) -> str:
        """What stands for one image in the text: the backend's image token (the model's), or the chat
        template's form of that same token where it adds spacing (vicuna_v1.1's " <image>\n", as
        LLaVA-1.5 was trained), as SGLang writes the template's."""
        token = self.backend.image_token()
        templated = self.chat_template.image_token
        return templated if templated.strip() == token else token

    def gen_params(self, gen: ir.Gen) -> SamplingParams:
        """The gen's own values over run()'s defaults, plus the chat template's stop strings."""
        params = gen.params.over(self.defaults)
        if self.chat_template.stop_str:
            stops = params.stops()
            params = dataclasses.replace(
                params, stop=stops + [s for s in self.chat_template.stop_str if s not in stops]
            )
        return params

    def _gen(self, gen: ir.Gen) -> None:
        if self.tracing:
            raise StopTracing
        if self.stream and self.speculation is not None:  # as SGLang: the program's error, not run()'s
            raise ValueError(
                "gen: run(stream=True) cannot be combined with @sgl.function(num_api_spec_tokens=...): a "
                "speculated reply is matched once it is complete; run without stream=True"
            )
        params = self.gen_params(gen)
        if not self.stream:
            generate = self.backend.generate if self.speculation is None else self.speculation.generate
            text, meta = generate(self.prompt(), params)
            with self._changed:  # n > 1: the variable holds every sample, the text goes on with the first
                self.text_ += text[0] if isinstance(text, list) else text
                self.variables[gen.name], self.meta_info[gen.name] = text, meta
            return
        self._append("", gen.name, new_var=True)
        for delta, meta in self.backend.generate_stream(self.prompt(), params):
            self.meta_info[gen.name] = meta
            self._append(delta, gen.name)

    def _select(self, sel: ir.Select) -> None:
        if self.tracing:
            raise StopTracing
        self._spec_reset()
        decision = self.backend.select(self.prompt(), sel.choices, sel.method)
        with self._changed:
            self.text_ += decision.decision
            self.variables[sel.name], self.meta_info[sel.name] = decision.decision, decision.meta_info

    def _separate_reasoning(self, step: ir.SeparateReasoning) -> None:
        """The gen just run (its text ends text_): the answer stays in its variable and in the text, the
        reasoning goes to its own variable (None when there is none). n > 1: each sample is split, the
        text goes on with the first's answer. Streamed, what was sent stays sent; the variables and the
        final text are split alike."""
        if self.tracing:
            raise StopTracing
        self._spec_reset()
        parser = ReasoningParser(step.model_type, force_reasoning=False if step.constrained else None)
        value = self.variables.get(step.name)
        samples = value if isinstance(value, list) else [value]
        if not all(isinstance(v, str) for v in samples):
            raise ValueError(f"separate_reasoning: no text in variable {step.name!r} to split")
        split = [parser.parse_non_stream(v) for v in samples]
        first = samples[0]
        with self._changed:
            if self.text_.endswith(first):
                self.text_ = self.text_[: len(self.text_) - len(first)] + split[0][1]
            answers, reasonings = [a for _, a in split], [r for r, _ in split]
            self.variables[step.name] = answers if isinstance(value, list) else answers[0]
            self.variables[step.reasoning_name] = reasonings if isinstance(value, list) else reasonings[0]
            self._changed.notify_all()

    def prompt(self) -> str:
        """The text so far, with its images (a Prompt) when it has any, or with the turns for a
        backend that talks in messages (a ChatPrompt)."""
        if not getattr(self.backend, "is_chat_model", False):
            return self._with_images(self.text_)
        return ChatPrompt(self.text_, tuple(self.messages_), self.role, self.text_[self.role_start :])

    def _with_images(self, text: str) -> str:
        return Prompt(text, tuple(self.images_)) if self.images_ else text

    def _spec_reset(self) -> None:
        if self.speculation is not None:
            self.speculation.reset()

    def _role_begin(self, role: str) -> None:
        self._spec_reset()
        if self.role is not None:
            raise ValueError(f"{role}_begin inside an open {self.role} role: roles do not nest")
        if not self.messages_ and role != "system" and self.chat_template.default_system_prompt:
            self._role_begin("system")
            self._append(self.chat_template.default_system_prompt)
            self._role_end("system")
        prefix, _ = self.chat_template.prefix_and_suffix(role, self.messages_)
        self.role = role
        self._append(prefix)
        self.role_start = len(self.text_)

    def _role_end(self, role: str) -> None:
        if self.role != role:
            raise ValueError(f"{role}_end without {role}_begin (the open role is {self.role})")
        self._spec_reset()
        content = self.text_[self.role_start :].lstrip()
        self.role = None
        self._append(self.chat_template.prefix_and_suffix(role, self.messages_)[1])
        self.messages_.append({"role": role, "content": content})


def __getattr__(name: str) -> Any:
    """`from sglang.lang.interpreter import ProgramState`, as sglbus (state.py imports this module)."""
    if name == "ProgramState":
        from sglbus.lang.state import ProgramState

        return ProgramState
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
