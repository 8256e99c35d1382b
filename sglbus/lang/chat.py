"""Chat templates for `system` / `user` / `assistant`: the text around each role's content.

The interpreter renders a role piece by piece (`assistant_begin()`, a `gen`, `assistant_end()`), so it
needs each role's prefix and suffix rather than a whole-conversation template. `from_jinja` derives
them from a model's own Jinja template (tokenizer_config.json) by rendering small conversations with
a marker as the content; SGLang's named templates (`chat_template.py`) cover servers whose template
cannot be read.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

ROLES = ("system", "user", "assistant")
_MARK = "\x00sglbus-content\x00"
PLAIN, LLAMA2 = "plain", "llama2"  # styles: LLAMA2 writes the system prompt inside the first [INST]


@dataclass(frozen=True)
class ChatTemplate:
    name: str
    roles: dict[str, tuple[str, str]]  # role -> (prefix, suffix)
    default_system_prompt: str | None = None  # put before a conversation that does not start with one
    stop_str: tuple[str, ...] = ()  # added to every gen's stop strings
    image_token: str = "<image>"
    extra: dict[str, Any] = field(default_factory=dict)
    style: str = PLAIN

    def prefix_and_suffix(self, role: str, history: Sequence[dict[str, Any]] = ()) -> tuple[str, str]:
        """The role's prefix and suffix after the messages in history (only LLAMA2 looks at them: a
        first system message opens the user's [INST], and the user's message after it has no prefix)."""
        if role not in self.roles:
            raise ValueError(
                f"chat template {self.name!r} has no role {role!r}; roles: {', '.join(self.roles)}"
            )
        prefix, suffix = self.roles[role]
        if self.style == LLAMA2:
            if role == "system" and not history:
                return self.roles["user"][0] + prefix, suffix
            if role == "user" and len(history) == 1 and history[0].get("content") is not None:
                return "", suffix
        return prefix, suffix

    def render(self, messages: list[dict[str, str]]) -> str:
        """The prompt text of whole messages (as the interpreter would build it role by role)."""
        if messages and messages[0]["role"] != "system" and self.default_system_prompt:
            messages = [{"role": "system", "content": self.default_system_prompt}, *messages]
        return self._join(messages)

    # SGLang's names for the same things
    @property
    def role_prefix_and_suffix(self) -> dict[str, tuple[str, str]]:
        return self.roles

    def get_prefix_and_suffix(self, role: str, hist_messages: list[dict[str, Any]]) -> tuple[str, str]:
        return self.prefix_and_suffix(role, hist_messages)

    def get_prompt(self, messages: list[dict[str, Any]]) -> str:
        """render, with SGLang's convention: a system message whose content is None is the default
        system prompt (left out when there is none)."""
        resolved = []
        for m in messages:
            if m["role"] == "system" and m["content"] is None:
                if self.default_system_prompt is None:
                    continue
                m = {**m, "content": self.default_system_prompt}
            resolved.append(m)
        return self._join(resolved)

    def _join(self, messages: list[dict[str, Any]]) -> str:
        out = []
        for i, m in enumerate(messages):
            prefix, suffix = self.prefix_and_suffix(m["role"], messages[:i])
            out.append(prefix + m["content"] + suffix)
        return "".join(out)


def template_from_folder(folder: str) -> ChatTemplate | None:
    """The template in a model folder's tokenizer_config.json; None if there is none to read."""
    try:
        with open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None
    source = cfg.get("chat_template")
    if source is None:  # newer transformers save it beside the config
        try:
            with open(os.path.join(folder, "chat_template.jinja"), encoding="utf-8") as f:
                source = f.read()
        except OSError:
            return None
    if isinstance(source, list):  # named variants: the default one
        source = next((t["template"] for t in source if t.get("name") == "default"), None)
    if not isinstance(source, str):
        return None

    def token(key: str) -> str:
        v = cfg.get(key)
        return v.get("content", "") if isinstance(v, dict) else (v or "")

    return from_jinja(source, token("bos_token"), token("eos_token"), name=os.path.basename(folder))


def from_jinja(source: str, bos_token: str = "", eos_token: str = "", name: str = "model") -> ChatTemplate:
    """Role prefixes and suffixes of a Hugging Face Jinja chat template (ValueError if it does not
    put each message's content verbatim between a fixed prefix and suffix)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(message: str) -> None:
        raise ValueError(message)

    env.globals["raise_exception"] = raise_exception
    template = env.from_string(source)
    writes_bos = bool(bos_token) and "bos_token" in source

    def render(messages: list[dict[str, str]]) -> str:
        text = template.render(messages=messages, bos_token=bos_token, eos_token=eos_token,
                               add_generation_prompt=False)  # fmt: skip
        # the tokenizer adds its BOS itself; one the template writes would come twice
        if writes_bos and text.startswith(bos_token):
            return text[len(bos_token) :]
        return text

    def piece(before: list[dict[str, str]], role: str) -> tuple[str, str]:
        head = render(before) if before else ""
        full = render([*before, {"role": role, "content": _MARK}])
        if not full.startswith(head) or full.count(_MARK) != 1:
            raise ValueError(f"chat template {name!r}: the {role} message is not rendered verbatim")
        prefix, suffix = full[len(head) :].split(_MARK)
        return prefix, suffix

    system = piece([], "system")
    sys_msg = {"role": "system", "content": "S"}
    roles = {
        "system": system,
        "user": piece([sys_msg], "user"),
        "assistant": piece([sys_msg, {"role": "user", "content": "U"}], "assistant"),
    }
    # a template that writes a system message of its own when the conversation has none
    lone_user = render([{"role": "user", "content": _MARK}]).split(_MARK)[0]
    head = lone_user[: len(lone_user) - len(roles["user"][0])] if lone_user.endswith(roles["user"][0]) else ""
    default_system = None
    if head.startswith(system[0]) and head.endswith(system[1]) and len(head) > len(system[0] + system[1]):
        default_system = head[len(system[0]) : len(head) - len(system[1])]
    stop = roles["assistant"][1].strip()
    return ChatTemplate(name, roles, default_system, (stop,) if stop else ())
