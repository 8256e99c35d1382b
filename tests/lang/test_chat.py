"""Role prefixes and suffixes derived from Jinja chat templates, and the named ones (no model)."""

from __future__ import annotations

import pytest

from sglbus.lang.chat import from_jinja, get_chat_template, template_for_model

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
    with pytest.raises(ValueError, match="unknown chat template 'vicuna'; known: default, chatml"):
        get_chat_template("vicuna")
    with pytest.raises(ValueError, match="has no role 'tool'; roles: system, user, assistant"):
        get_chat_template("chatml").prefix_and_suffix("tool")
