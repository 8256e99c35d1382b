"""The reasoning parser on `/v1/chat/completions` (services/gateway/openai_reasoning.py) without a server:
which requests split their answer, `reasoning_content` in whole answers and stream chunks, with n > 1,
tools and logprobs."""

from __future__ import annotations

import json

import pytest
from test_openai_shapes import MODELS, render, result

from services.gateway.openai_errors import OpenAIError
from services.gateway.openai_reasoning import plan_reasoning
from services.gateway.openai_requests import parse_chat
from services.gateway.openai_responses import StreamShaper, chat_response
from shared.finish import Stop

Q = [{"role": "user", "content": "q"}]
FN = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
CALL = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'


def chat(parser: str | None = "qwen3", **body):
    return parse_chat({"messages": Q, **body}, MODELS, render, parser)


def test_only_a_server_parser_and_separate_reasoning_split_the_answer():
    assert plan_reasoning({}, None) is None
    assert plan_reasoning({"separate_reasoning": True}, None) is None  # ignored, as SGLang does
    assert plan_reasoning({"separate_reasoning": False}, "qwen3") is None
    plan = plan_reasoning({"stream_reasoning": False}, "deepseek-r1")
    assert plan.model_type == "deepseek-r1" and not plan.stream_reasoning
    assert chat().reasoning.stream_reasoning and chat(None).reasoning is None
    for key in ("separate_reasoning", "stream_reasoning"):
        with pytest.raises(OpenAIError) as e:
            chat(**{key: "yes"})
        assert e.value.param == key and e.value.status == 400


def test_whole_answers_carry_reasoning_content_per_choice():
    texts = ["<think> a b </think>\nYes.", "No thinking."]
    (with_, without) = chat_response(chat(n=2), [result(t, finish=Stop(2)) for t in texts], 0)["choices"]
    assert with_["message"] == {"role": "assistant", "content": "Yes.", "reasoning_content": "a b"}
    assert without["message"] == {"role": "assistant", "content": "No thinking.", "reasoning_content": None}
    for req in (chat(None), chat(separate_reasoning=False)):  # unchanged: no reasoning_content key
        (choice,) = chat_response(req, [result(texts[0])], 0)["choices"]
        assert choice["message"] == {"role": "assistant", "content": texts[0]}
    (cut,) = chat_response(chat("deepseek-r1"), [result("thinking on")], 0)["choices"]
    assert cut["message"]["reasoning_content"] == "thinking on" and cut["message"]["content"] == ""


def test_tool_calls_are_read_from_the_answer_not_the_reasoning():
    req = chat(tools=[FN])
    (choice,) = chat_response(req, [result(f"<think>call f</think>{CALL}", finish=Stop(2))], 0)["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["reasoning_content"] == "call f"
    assert choice["message"]["content"] is None and json.loads(
        choice["message"]["tool_calls"][0]["function"]["arguments"]
    ) == {"a": 1}
    (choice,) = chat_response(req, [result(f"<think>{CALL}</think>Done.", finish=Stop(2))], 0)["choices"]
    assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]
    assert choice["message"]["content"] == "Done." and choice["message"]["reasoning_content"] == CALL


def run_stream(req, texts, lp=False):
    """Each choice's text in pieces of 3 characters, the choices' deltas interleaved; the chunks."""
    shaper = StreamShaper(req, [])
    states = [result(t, finish=None, lp=lp) for t in texts]
    chunks = []
    for st in states:
        st.text = ""
    for end in range(3, max(map(len, texts)) + 3, 3):
        for i, (st, full) in enumerate(zip(states, texts, strict=True)):
            if st.finished:
                continue
            st.text = full[:end]
            if end >= len(full):
                st.finish = Stop(2)
            chunks += shaper.chunks(st.delta(i))
    return chunks


def choices(chunks):
    return [c["choices"][0] for c in chunks]


def joined(chunks, i, key):
    return "".join(c["delta"].get(key) or "" for c in choices(chunks) if c["index"] == i)


def test_streamed_choices_split_as_the_whole_answer():
    texts = ["<think>\nsome thought</think> The answer.", "Plain answer.", "<think>cut sho"]
    req = chat(n=3, stream=True)
    chunks = run_stream(req, texts)
    whole = chat_response(req, [result(t) for t in texts], 0)["choices"]
    for i, choice in enumerate(whole):
        assert joined(chunks, i, "content") == choice["message"]["content"]
        assert (joined(chunks, i, "reasoning_content") or None) == choice["message"]["reasoning_content"]
    assert sum("reasoning_content" in c["choices"][0]["delta"] for c in chunks) > 2  # as it comes
    held = run_stream(chat(n=3, stream=True, stream_reasoning=False), texts)
    pieces = [
        (c["index"], c["delta"]["reasoning_content"])
        for c in choices(held)
        if "reasoning_content" in c["delta"]
    ]
    assert sorted(pieces) == [
        (0, "some thought"),
        (2, "cut sho"),
    ]  # one piece each: at its end tag, at the end
    plain = run_stream(chat(None, stream=True), texts)
    assert not any("reasoning_content" in c["choices"][0]["delta"] for c in plain)
    assert joined(plain, 0, "content") == texts[0]


@pytest.mark.parametrize("tools", [None, [FN]])
def test_streamed_logprob_rows_go_out_once_with_reasoning_and_tools(tools):
    text = f"<think>hm</think>{CALL}"
    req = chat(stream=True, logprobs=True, top_logprobs=1, tools=tools)
    chunks = run_stream(req, [text], lp=True)
    rows = [r["logprob"] for c in choices(chunks) if c["logprobs"] for r in c["logprobs"]["content"]]
    assert rows == [-0.5, -1.5]  # both output tokens' rows, in order (held with the tool call's answer)
    assert joined(chunks, 0, "reasoning_content") == "hm"
    last = chunks[-1]["choices"][0]
    if tools:
        assert (
            last["finish_reason"] == "tool_calls"
            and last["delta"]["tool_calls"][0]["function"]["name"] == "f"
        )
    else:
        assert joined(chunks, 0, "content") == CALL


def test_a_grammar_waits_for_the_reasoning_of_a_model_that_reasons_first():
    """SGLang's structured outputs for reasoning models: with a parser whose model reasons by default, a
    chat request's grammar (tool_choice "required", response_format, regex) applies after the end tag
    (`require_reasoning`), and the answer splits as any other; deepseek-v3 answers at once (it thinks
    only when asked), and a request without a grammar needs nothing."""
    forced = {"type": "function", "function": {"name": FN["function"]["name"]}}
    grammars = (
        {"tools": [FN], "tool_choice": "required"},
        {"tools": [FN], "tool_choice": forced},
        {"response_format": {"type": "json_object"}},
        {"regex": r"\{.*\}"},
    )
    for parser in ("deepseek-r1", "qwen3", "qwen3-thinking", "kimi", "glm45", "step3"):
        for body in grammars:
            assert chat(parser, **body).generate.get("require_reasoning") is True, (parser, body)
            assert chat(parser, separate_reasoning=False, **body).generate.get("require_reasoning") is True
        assert "require_reasoning" not in chat(parser).generate
    assert all("require_reasoning" not in chat("deepseek-v3", **body).generate for body in grammars)
    assert all("require_reasoning" not in chat(None, **body).generate for body in grammars)
    args = '{"name": "f", "arguments": {"a": 1}}'
    (choice,) = chat_response(
        chat("deepseek-r1", tools=[FN], tool_choice="required"), [result(f"hm</think>{args}")], 0
    )["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["reasoning_content"] == "hm"
    # the reasoning kept in the text (separate_reasoning: false): the call is read after the tag
    kept = chat("deepseek-r1", tools=[FN], tool_choice="required", separate_reasoning=False)
    (choice,) = chat_response(kept, [result(f"hm</think>{args}")], 0)["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "hm</think>"
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "f"
    (cut,) = chat_response(chat("deepseek-r1"), [result("thinking on")], 0)["choices"]
    assert cut["message"]["reasoning_content"] == "thinking on"


def test_completions_check_the_reasoning_fields_too():
    from services.gateway.openai_requests import parse_completion

    assert parse_completion({"prompt": "x", "separate_reasoning": True}, MODELS).kind == "completion"
    with pytest.raises(OpenAIError) as e:
        parse_completion({"prompt": "x", "stream_reasoning": 1}, MODELS)
    assert e.value.param == "stream_reasoning"
