"""sgl.separate_reasoning (SGLang's frontend primitive): a gen's reasoning moved to name_reasoning_content,
in interpreter, streaming and compiler modes, on a scripted backend (no model)."""

from __future__ import annotations

import pytest
from scripted_backend import ScriptedBackend

import sglbus as sgl

HEAD = "Q: capital of France?\nA:"


@sgl.function
def answer(s, model_type="deepseek-r1"):
    s += HEAD + sgl.separate_reasoning(sgl.gen("a", stop="\n"), model_type=model_type)
    s += "\nDone."


def run(script: str, **kwargs):
    backend = ScriptedBackend(HEAD + script + "\nDone.")
    return answer.run(backend=backend, **kwargs)


@pytest.mark.parametrize("stream", [False, True])
def test_the_reasoning_leaves_the_answer_and_the_text(stream):
    state = run("<think> It is Paris. </think> Paris", stream=stream)
    if stream:
        "".join(state.text_iter())
    assert state.error() is None
    assert state["a"] == "Paris" and state["a_reasoning_content"] == "It is Paris."
    assert state.text() == HEAD + "Paris\nDone."


def test_no_end_tag_is_all_reasoning_and_a_model_that_did_not_think_has_none():
    state = run(" still thinking")  # deepseek-r1: reasoning from the start, cut short
    assert state["a"] == "" and state["a_reasoning_content"] == "still thinking"
    assert state.text() == HEAD + "\nDone."
    state = run(" Paris", model_type="qwen3")  # qwen3 thinks only inside <think>
    assert state["a"] == " Paris" and state["a_reasoning_content"] is None
    assert state.text() == HEAD + " Paris\nDone."


def test_in_a_role_the_message_is_the_answer_alone():
    @sgl.function
    def chat(s):
        s += sgl.user("Capital of France?")
        s += sgl.assistant(sgl.separate_reasoning(sgl.gen("a", max_tokens=64), model_type="qwen3"))

    backend = ScriptedBackend("")
    probe = chat.run(backend=backend)
    prefix = probe.text()  # what the program writes before the gen, with the default template
    backend.scripts = (prefix + "<think>easy</think>Paris",)
    state = chat.run(backend=backend)
    assert state["a"] == "Paris" and state["a_reasoning_content"] == "easy"
    assert state.messages()[-1] == {"role": "assistant", "content": "Paris"}


def test_compiled_programs_split_alike():
    compiled = answer.compile(model_type="deepseek-r1")
    assert any(n.kind == "separate_reasoning" for n in compiled.trace.streams[0])
    backend = ScriptedBackend(HEAD + "<think>x</think>Paris\nDone.")
    state = compiled.run(backend=backend)
    assert state.error() is None and state["a"] == "Paris" and state["a_reasoning_content"] == "x"
    assert state.text() == run("<think>x</think>Paris").text()


def test_bad_arguments_name_what_is_allowed():
    with pytest.raises(ValueError, match="model_type must be one of deepseek-r1, .*qwen3"):
        sgl.separate_reasoning(sgl.gen("a"), model_type="gpt-9")
    with pytest.raises(ValueError, match="needs a name"):
        sgl.separate_reasoning(sgl.gen(), model_type="qwen3")


def test_a_constrained_gen_or_a_select_is_not_taken_for_forced_reasoning():
    """deepseek-r1 reasons without an opening tag; a gen under a regex (or a select, whose text is a
    choice) cannot think first, so its text is the answer unless it starts with the tag."""

    @sgl.function
    def pick(s):
        gen = sgl.gen("n", regex=r" [A-Z][a-z]+", max_tokens=8)
        s += HEAD + sgl.separate_reasoning(gen, model_type="deepseek-r1")

    state = pick.run(backend=ScriptedBackend(HEAD + " Paris"))
    assert state.error() is None, state.error()
    assert (state["n"], state["n_reasoning_content"]) == (" Paris", None)
    steps = sgl.separate_reasoning(sgl.select("c", choices=["yes", "no"]), model_type="deepseek-r1").items
    assert (
        steps[-1].constrained
        and not sgl.separate_reasoning(sgl.gen("g"), model_type="qwen3").items[-1].constrained
    )
