"""The named chat templates (SGLang's text-only ones, in its formats) and how a model name picks one,
at SGLang's module path: `from sglbus.lang.chat_template import get_chat_template`.

A backend uses the model's own Jinja template when it can read it (`chat.from_jinja`); a name picks one
of these for a server whose tokenizer files the client cannot read, or when the program asks
(`RuntimeEndpoint(url, chat_template_name="llama-2-chat")`). Checked against SGLang 0.5.10's. Its
multimodal templates (llava, qwen2-vl, yi-vl, minicpm, janus, internvl, interns1, glm-4v) are left out:
the runtime serves text models only.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from sglbus.lang.chat import LLAMA2, ROLES, ChatTemplate

chat_template_registry: dict[str, ChatTemplate] = {}
matching_function_registry: list[Callable[[str], ChatTemplate | None]] = []


def register_chat_template(template: ChatTemplate) -> None:
    chat_template_registry[template.name] = template


def register_chat_template_matching_function(
    func: Callable[[str], ChatTemplate | str | None],
) -> Callable[[str], ChatTemplate | str | None]:
    """func(model_path) -> a template, a template's name (as SGLang's return) or None; asked in
    registration order."""
    matching_function_registry.append(func)
    return func


def get_chat_template(name: str) -> ChatTemplate:
    try:
        return chat_template_registry[name]
    except KeyError:
        known = ", ".join(chat_template_registry)
        raise ValueError(f"unknown chat template {name!r}; known: {known}") from None


def get_chat_template_by_model_path(model_path: str) -> ChatTemplate:
    """The template a model's name suggests (SGLang's rules, then a few of ours); "default" otherwise."""
    for match in matching_function_registry:
        template = match(model_path)
        if template is not None:
            return get_chat_template(template) if isinstance(template, str) else template
    return get_chat_template("default")


template_for_model = get_chat_template_by_model_path


def _roles(
    system: tuple[str, str], user: tuple[str, str], assistant: tuple[str, str]
) -> dict[str, tuple[str, str]]:
    return {"system": system, "user": user, "assistant": assistant}


def _same(prefix: str, suffix: str) -> dict[str, tuple[str, str]]:
    """Each role as prefix.format(role=...) + content + suffix."""
    return {r: (prefix.format(role=r), suffix) for r in ROLES}


_CHATML = _same("<|im_start|>{role}\n", "<|im_end|>\n")
_VICUNA_SYSTEM = (
    "A chat between a curious user and an artificial intelligence assistant. "
    "The assistant gives helpful, detailed, and polite answers to the user's questions."
)
_DBRX_SYSTEM = (
    "You are DBRX, created by Databricks. You were last updated in December 2023. You answer questions "
    "based on information available up to that point.\nYOU PROVIDE SHORT RESPONSES TO SHORT QUESTIONS OR "
    "STATEMENTS, but provide thorough responses to more complex and open-ended questions.\nYou assist with "
    "various tasks, from writing to coding (using markdown for code blocks — remember to use ``` with code, "
    "JSON, and tables).\n(You do not have real-time data access or code execution capabilities. You avoid "
    "stereotyping and provide balanced perspectives on controversial topics. You do not provide song "
    "lyrics, poems, or news articles and do not divulge details of your training data.)\nThis is your "
    "system prompt, guiding your responses. Do not reference it, just respond to the user. If you find "
    "yourself talking about this message, stop. You should be responding appropriately and usually that "
    "means not mentioning this.\nYOU DO NOT MENTION ANY OF THIS INFORMATION ABOUT YOURSELF UNLESS THE "
    "INFORMATION IS DIRECTLY PERTINENT TO THE USER'S QUERY."
)
_DEEPSEEK_END = "<｜end▁of▁sentence｜>"

for _t in (
    ChatTemplate("default", _roles(("SYSTEM:", "\n"), ("USER:", "\n"), ("ASSISTANT:", "\n"))),
    ChatTemplate("chatml", _CHATML, stop_str=("<|im_end|>",)),
    ChatTemplate(
        "llama-3-instruct",
        _same("<|start_header_id|>{role}<|end_header_id|>\n\n", "<|eot_id|>"),
        stop_str=("<|eot_id|>",),
        image_token="<|image|>",
    ),
    ChatTemplate("claude", _roles(("", ""), ("\n\nHuman: ", ""), ("\n\nAssistant:", ""))),
    ChatTemplate("qwen", _CHATML, "You are a helpful assistant.", stop_str=("<|im_end|>",)),
    ChatTemplate(
        "vicuna_v1.1",
        _roles(("", " "), ("USER:", " "), ("ASSISTANT:", "</s>")),
        _VICUNA_SYSTEM,
        image_token=" <image>\n",
    ),
    ChatTemplate(
        "llama-2-chat",
        _roles(("<<SYS>>\n", "\n<</SYS>>\n\n"), ("[INST] ", " [/INST]"), ("", " </s><s>")),
        style=LLAMA2,
    ),
    ChatTemplate(
        "mistral",
        _roles(("[SYSTEM_PROMPT] ", " [/SYSTEM_PROMPT]"), ("[INST] ", " [/INST]"), ("", " </s><s>")),
        stop_str=("</s>",),
        image_token="[IMG]",
    ),
    ChatTemplate(
        "llama-4",
        _same("<|header_start|>{role}<|header_end|>\n\n", "<|eot|>"),
        stop_str=("<|eot|>",),
        image_token="<|image|>",
    ),
    ChatTemplate(
        "yi-1.5",
        _roles(("", ""), ("<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n"), ("", "<|im_end|>\n")),
        stop_str=("<|im_end|>",),
    ),
    ChatTemplate(
        "gemma-it",
        _roles(
            ("", ""),
            ("<start_of_turn>user\n", "<end_of_turn>\n"),
            ("<start_of_turn>model\n", "<end_of_turn>\n"),
        ),
        image_token="<start_of_image>",
    ),
    ChatTemplate(
        "dbrx-instruct",
        _roles(
            ("<|im_start|>system\n", "<|im_end|>"),
            ("\n<|im_start|>user\n", "<|im_end|>"),
            ("\n<|im_start|>assistant\n", "<|im_end|>"),
        ),
        _DBRX_SYSTEM,
        stop_str=("<|im_end|>",),
    ),
    ChatTemplate(
        "c4ai-command-r",
        {
            role: (f"<|START_OF_TURN_TOKEN|><|{token}_TOKEN|>", "<|END_OF_TURN_TOKEN|>")
            for role, token in zip(ROLES, ("SYSTEM", "USER", "CHATBOT"), strict=True)
        },
    ),
    ChatTemplate(
        "granite-3-instruct",
        _same("<|start_of_role|>{role}<|end_of_role|>", "<|end_of_text|>"),
        stop_str=("<|end_of_text|>",),
    ),
    ChatTemplate(
        "deepseek-v3",
        _roles(("", ""), ("<｜User｜>", ""), ("<｜Assistant｜>", _DEEPSEEK_END)),
        stop_str=(_DEEPSEEK_END,),
    ),
):
    register_chat_template(_t)


# SGLang's rules (0.5.10), in its order: (pattern, template, pattern the path must not match). A rule
# whose template is one of SGLang's multimodal ones is left out, so such a path goes on to the next rules.
_SGLANG_RULES = (
    (r"deepseek-(v3|r1)", "deepseek-v3", r"base"),
    (r"orion", "claude", None),
    (r"dbrx.*instruct|instruct.*dbrx", "dbrx-instruct", None),
    (r"vicuna|llava-v1\.5|llava-next-video-7b", "vicuna_v1.1", None),
    (r"llama-2.*chat|codellama.*instruct", "llama-2-chat", None),
    (r"pixtral|(mistral|mixtral).*instruct", "mistral", None),
    (r"llama-3.*instruct", "llama-3-instruct", None),
    (r"tinyllama", "chatml", None),
    (r"qwen.*(chat|instruct)", "qwen", r"llava"),
    (r"yi-1\.5.*chat", "yi-1.5", None),
    (r"gemma.*it", "gemma-it", None),
    (r"c4ai-command-r", "c4ai-command-r", None),
    (r"granite.*instruct", "granite-3-instruct", None),
    (r"gemma-3", "gemma-it", None),
)


@register_chat_template_matching_function
def _match_sglang_names(model_path: str) -> str | None:
    for pattern, name, unless in _SGLANG_RULES:
        if re.search(pattern, model_path, re.IGNORECASE) and not (
            unless and re.search(unless, model_path, re.IGNORECASE)
        ):
            return name
    return None


@register_chat_template_matching_function
def _match_more_names(model_path: str) -> str | None:
    """Ours, for names SGLang leaves to "default": Llama 3 spelled without a hyphen, ChatML models."""
    rules = ((r"llama-?3.*instruct", "llama-3-instruct"), (r"smollm|qwen|chatml|hermes|yi-.*chat", "chatml"))
    return next((name for pattern, name in rules if re.search(pattern, model_path, re.IGNORECASE)), None)
