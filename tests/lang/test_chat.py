"""Role prefixes and suffixes derived from Jinja chat templates, and the named ones: SGLang's formats,
and how a model's name picks one (no model)."""

from __future__ import annotations

import pytest
from scripted_backend import ScriptedBackend

import sglbus as sgl
from sglbus.lang.chat import from_jinja
from sglbus.lang.chat_template import get_chat_template, get_chat_template_by_model_path, template_for_model

# SmolLM2-Instruct's template (ChatML with a default system message)
SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, '"
    "'trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Llama 3 Instruct's, shortened: BOS written by the template, content stripped
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


def test_chatml_with_a_default_system_prompt():
    t = from_jinja(SMOLLM2, "<|im_start|>", "<|im_end|>")
    for role in ("system", "user", "assistant"):
        assert t.prefix_and_suffix(role) == (f"<|im_start|>{role}\n", "<|im_end|>\n")
    assert t.default_system_prompt == "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    assert t.stop_str == ("<|im_end|>",)
    # whole messages render as the model's own template does
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    from jinja2 import Template

    assert t.render(msgs) == Template(SMOLLM2).render(messages=msgs, add_generation_prompt=False)


def test_llama3_drops_the_bos_the_tokenizer_adds():
    t = from_jinja(LLAMA3, "<|begin_of_text|>", "<|eot_id|>")
    assert t.prefix_and_suffix("system") == ("<|start_header_id|>system<|end_header_id|>\n\n", "<|eot_id|>")
    assert t.prefix_and_suffix("user")[0] == "<|start_header_id|>user<|end_header_id|>\n\n"
    assert t.default_system_prompt is None
    assert t.stop_str == ("<|eot_id|>",)


def test_a_template_that_changes_the_content_is_refused():
    with pytest.raises(ValueError, match="not rendered verbatim"):
        from_jinja("{% for m in messages %}{{ m['content'] * 2 }}{% endfor %}")


def test_named_templates():
    assert get_chat_template("chatml").prefix_and_suffix("user") == ("<|im_start|>user\n", "<|im_end|>\n")
    assert template_for_model("/models/SmolLM2-135M-Instruct.gguf").name == "chatml"
    assert template_for_model("Meta-Llama-3-8B-Instruct").name == "llama-3-instruct"
    assert template_for_model("gpt2").name == "default"
    with pytest.raises(
        ValueError, match="unknown chat template 'vicuna'; known: default, chatml, .*vicuna_v1.1"
    ):
        get_chat_template("vicuna")
    with pytest.raises(ValueError, match="has no role 'tool'; roles: system, user, assistant"):
        get_chat_template("chatml").prefix_and_suffix("tool")


CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello"},
    {"role": "user", "content": "Bye"},
]


GEMMA = (
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHello<end_of_turn>\n<start_of_turn>user\nBye"
)
QWEN = (
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n"
    "<|im_start|>user\nBye<|im_end|>\n"
)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("llama-2-chat", "[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST]Hello </s><s>[INST] Bye [/INST]"),
        ("claude", "Be brief.\n\nHuman: Hi\n\nAssistant:Hello\n\nHuman: Bye"),
        ("vicuna_v1.1", "Be brief. USER:Hi ASSISTANT:Hello</s>USER:Bye "),
        ("gemma-it", "Be brief." + GEMMA + "<end_of_turn>\n"),
        ("qwen", "<|im_start|>system\nBe brief.<|im_end|>\n" + QWEN),
    ],
)
def test_sglangs_named_templates_render_its_formats(name, expected):
    assert get_chat_template(name).render(CONVERSATION) == expected


def test_llama2_without_a_system_message_and_sglangs_method_names():
    t = get_chat_template("llama-2-chat")
    assert t.render(CONVERSATION[1:]) == "[INST] Hi [/INST]Hello </s><s>[INST] Bye [/INST]"
    # SGLang's names: a system message with content None is the default prompt (none here: left out)
    assert t.get_prompt([{"role": "system", "content": None}, *CONVERSATION[1:]]) == t.render(
        CONVERSATION[1:]
    )
    assert t.get_prefix_and_suffix("system", []) == ("[INST] <<SYS>>\n", "\n<</SYS>>\n\n")
    assert t.role_prefix_and_suffix["user"] == ("[INST] ", " [/INST]")


def test_default_system_prompts_and_stops():
    qwen, vicuna = get_chat_template("qwen"), get_chat_template("vicuna_v1.1")
    assert qwen.default_system_prompt == "You are a helpful assistant." and qwen.stop_str == ("<|im_end|>",)
    assert qwen.render([{"role": "user", "content": "Hi"}]).startswith(
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi"
    )
    assert vicuna.default_system_prompt.startswith("A chat between a curious user and an artificial")
    names = (
        "mistral",
        "llama-4",
        "yi-1.5",
        "dbrx-instruct",
        "c4ai-command-r",
        "granite-3-instruct",
        "deepseek-v3",
    )
    for name in names:
        assert set(get_chat_template(name).roles) == {"system", "user", "assistant"}


@pytest.mark.parametrize(
    ("model_path", "name"),
    [
        ("meta-llama/Llama-2-7b-chat-hf", "llama-2-chat"),
        ("mistralai/Mistral-7B-Instruct-v0.2", "mistral"),
        ("OrionStarAI/Orion-14B-Chat", "claude"),
        ("deepseek-ai/DeepSeek-V3-Base", "default"),
        ("lmsys/vicuna-7b-v1.5", "vicuna_v1.1"),
        ("Qwen/Qwen2-7B-Instruct", "qwen"),
        ("Qwen/Qwen2-7B", "chatml"),  # ours: a base Qwen still speaks ChatML
        ("google/gemma-2-9b-it", "gemma-it"),
        ("deepseek-ai/DeepSeek-V3", "deepseek-v3"),
        ("meta-llama/Meta-Llama-3.1-8B-Instruct", "llama-3-instruct"),
        ("HuggingFaceTB/SmolLM2-135M-Instruct", "chatml"),
        ("gpt2", "default"),
    ],
)
def test_a_model_path_picks_sglangs_template(model_path, name):
    assert get_chat_template_by_model_path(model_path).name == name


def test_a_registered_matching_function_may_return_a_name_as_sglangs_do():
    from sglbus.lang.chat_template import matching_function_registry, register_chat_template_matching_function

    @register_chat_template_matching_function
    def match_mine(model_path):
        return "claude" if "my-model" in model_path else None

    try:
        assert get_chat_template_by_model_path("org/my-model").name == "claude"
    finally:
        matching_function_registry.remove(match_mine)


def test_roles_follow_the_llama2_history_in_a_program():
    """The interpreter passes the turns so far, so a program's first system message opens the [INST]."""

    @sgl.function
    def chat(s):
        s += sgl.system("Be brief.") + sgl.user("Hi") + sgl.assistant("Hello") + sgl.user("Bye")

    state = chat.run(backend=ScriptedBackend(template="llama-2-chat"))
    assert state.text() == get_chat_template("llama-2-chat").render(CONVERSATION)
    assert state.messages() == CONVERSATION
