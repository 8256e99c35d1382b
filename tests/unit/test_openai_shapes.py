"""OpenAI request bodies to `/generate` bodies and the gateway's request states and deltas to OpenAI's
shapes, without a server: every field checked under OpenAI's name, tool plans and their parsing, stream
deltas, logprob shapes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from services.gateway.generate_input import parse_generate_input
from services.gateway.logprob_meta import LogprobAccumulator
from services.gateway.logprob_options import LogprobOptions
from services.gateway.openai_errors import OpenAIError
from services.gateway.openai_requests import parse_chat, parse_completion
from services.gateway.openai_responses import StreamShaper, chat_response, completion_response
from services.gateway.openai_tools import plan_tools
from services.gateway.request_state import RequestState
from services.scheduler.logprobs import Rows, pack
from shared.finish import Length, Stop

MODELS = ("served", "/path/to/model", "default")
FN = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def render(messages):
    return [len(m["content"]) for m in messages]  # a stand-in template: one id per message


PROMPT = [1, 2]
_NO_IDS = np.zeros((2, 0), np.float32)
TWO_TOKENS = Length(2)


def result(text, n_tokens=2, finish=TWO_TOKENS, lp=False, echo=False) -> RequestState:
    """A request state as the gateway holds it: prompt ids 1, 2 ("a", "b"); output ids 7, 8,
    whose texts are text[:1] and text[1:]; with lp, their logprobs -0.5 and -1.5 and the top 2 of each
    (the other being id 9, "z"); with echo, the prompt's too."""
    names = {1: "a", 2: "b", 7: text[:1], 8: text[1:], 9: "z"}
    st = RequestState("r", len(PROMPT), 0.0, text=text, output_ids=[7, 8][:n_tokens], finish=finish,
                      cached_tokens=1)  # fmt: skip
    if lp:
        opts = LogprobOptions(start_len=0 if echo else -1, top_k=2, token_ids=None, text=True, flat=False,
                              flat_b64=False, output_b64=False)  # fmt: skip
        st.logprobs = LogprobAccumulator(opts, PROMPT, lambda ids: [names[i] for i in ids])
        out = Rows(np.array([-0.5, -1.5], np.float32), np.array([[-0.5, -2.0], [-1.5, -2.5]], np.float32),
                   np.array([[7, 9], [8, 9]], np.int32), _NO_IDS)  # fmt: skip
        inp = Rows(np.array([-0.125], np.float32), np.array([[-0.125, -3.0]], np.float32),
                   np.array([[2, 9]], np.int32), _NO_IDS[:1])  # fmt: skip
        st.logprobs.add(pack([inp] if echo else [], [out]))
    return st


def test_a_completion_becomes_a_generate_body():
    req = parse_completion(
        {
            "model": "served",
            "prompt": ["a", "b"],
            "max_tokens": 5,
            "n": 2,
            "seed": 3,
            "stop": "x",
            "logit_bias": {"11": -100},
            "top_k": 4,
            "min_tokens": 1,
            "logprobs": 2,
            "echo": True,
        },
        MODELS,
    )
    gen = req.generate
    assert (
        gen["text"] == ["a", "b"] and req.n == 2 and req.prompts == 2 and req.echo and req.top_logprobs == 2
    )
    sp = gen["sampling_params"]
    assert sp["max_new_tokens"] == 5 and sp["sampling_seed"] == 3 and sp["stop"] == ["x"]
    assert sp["logit_bias"] == {"11": -100.0} and sp["top_k"] == 4 and sp["min_new_tokens"] == 1
    assert gen["return_logprob"] and gen["top_logprobs_num"] == 2 and gen["logprob_start_len"] == 0
    parsed = parse_generate_input(gen)  # what the RequestManager takes
    assert len(parsed.prompts) == 2 and parsed.prompts[0].sampling.n == 2
    assert parse_completion({"prompt": "x"}, MODELS).generate["sampling_params"]["max_new_tokens"] == 16


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "top_p": 2}, "top_p"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
        ({"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
        ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"1": 101}}, "logit_bias"),
        ({"prompt": "x", "seed": "1"}, "seed"),
        ({"prompt": "x", "echo": "yes"}, "echo"),
        ({"prompt": "x", "best_of": 3}, "best_of"),
        ({"prompt": "x", "suffix": "y"}, "suffix"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": "x", "model": "gpt-4"}, "model"),
        ({"prompt": "x", "what": 1}, "what"),
    ],
)
def test_a_bad_completion_field_is_named(body, param):
    with pytest.raises(OpenAIError) as e:
        parse_completion(body, MODELS)
    assert e.value.param == param and e.value.status == (404 if param == "model" else 400)


def test_a_chat_renders_its_messages_and_maps_its_options():
    body = {
        "messages": [
            {
                "role": "developer",
                "content": [{"type": "text", "text": "be"}, {"type": "text", "text": " brief"}],
            },
            {"role": "user", "content": "hi"},
        ],
        "max_completion_tokens": 9,
        "logprobs": True,
        "top_logprobs": 2,
        "response_format": {"type": "json_object"},
    }
    req = parse_chat(body, MODELS, render)
    assert req.generate["input_ids"] == [8, 2] and req.top_logprobs == 2
    sp = req.generate["sampling_params"]
    assert sp["max_new_tokens"] == 9 and json.loads(sp["json_schema"]) == {"type": "object"}
    for bad, param in (
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "bot", "content": "x"}]}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
        (
            {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}},
            "response_format",
        ),
    ):
        with pytest.raises(OpenAIError) as e:
            parse_chat(bad, MODELS, render)
        assert e.value.param == param


def test_tool_plans_and_their_answers():
    assert plan_tools(None, None) is None and plan_tools([FN], "none") is None
    auto = plan_tools([FN], None)
    assert auto.choice == "auto" and auto.schema is None
    messages = auto.add_to([{"role": "user", "content": "q"}])
    assert messages[0]["role"] == "system" and '"name": "f"' in messages[0]["content"]
    content, calls = auto.parse('Sure. <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>')
    assert content == "Sure." and calls[0]["function"] == {"name": "f", "arguments": '{"a": 1}'}
    assert auto.parse("<tool_call>{not json}</tool_call>") == ("<tool_call>{not json}</tool_call>", [])
    named = plan_tools([FN], {"type": "function", "function": {"name": "f"}})
    assert json.loads(named.schema)["properties"]["name"] == {"const": "f"}
    assert named.parse('{"name": "f", "arguments": {}}')[0] is None
    with pytest.raises(OpenAIError):
        plan_tools([FN], {"type": "function", "function": {"name": "g"}})
    with pytest.raises(OpenAIError):
        plan_tools(None, "required")


def test_completion_and_chat_responses():
    req = parse_completion({"prompt": "ab", "n": 2, "logprobs": 1, "echo": False}, MODELS)
    out = completion_response(req, [result("xy", lp=True), result("uv", finish=Stop(2))], ["ab"], 0)
    assert [c["finish_reason"] for c in out["choices"]] == ["length", "stop"]
    lp = out["choices"][0]["logprobs"]
    assert lp["tokens"] == ["x", "y"] and lp["token_logprobs"] == [-0.5, -1.5] and lp["text_offset"] == [0, 1]
    assert lp["top_logprobs"][0] == {"x": -0.5, "z": -2.0}
    assert out["usage"] == {
        "prompt_tokens": 2,
        "completion_tokens": 4,
        "total_tokens": 6,
        "prompt_tokens_details": {"cached_tokens": 1},
    }
    chat = parse_chat({"messages": [{"role": "user", "content": "q"}], "logprobs": True}, MODELS, render)
    (choice,) = chat_response(chat, [result("hi", lp=True)], 0)["choices"]
    assert choice["message"] == {"role": "assistant", "content": "hi"}
    assert choice["logprobs"]["content"][0] == {
        "token": "h",
        "logprob": -0.5,
        "bytes": [104],
        "top_logprobs": [
            {"token": "h", "logprob": -0.5, "bytes": [104]},
            {"token": "z", "logprob": -2.0, "bytes": [122]},
        ],
    }


def test_stream_chunks_pass_the_deltas_on():
    req = parse_chat({"messages": [{"role": "user", "content": "q"}], "stream": True}, MODELS, render)
    shaper = StreamShaper(req, [])
    st = result("He", n_tokens=1, finish=None)
    first = shaper.chunks(st.delta())
    assert [c["choices"][0]["delta"] for c in first] == [
        {"role": "assistant", "content": ""},
        {"content": "He"},
    ]
    st.text, st.finish = "Hello", Stop(2)
    st.output_ids.append(8)
    (last,) = shaper.chunks(st.delta())
    assert last["choices"][0]["delta"] == {"content": "llo"} and last["choices"][0]["finish_reason"] == "stop"
    assert shaper.usage_chunk()["usage"]["completion_tokens"] == 2


def test_streamed_completion_logprobs_follow_the_text_offsets_after_an_echo():
    req = parse_completion({"prompt": "ab", "stream": True, "echo": True, "logprobs": 1}, MODELS)
    shaper = StreamShaper(req, ["ab"])
    echo, xy = shaper.chunks(result("xy", finish=None, lp=True, echo=True).delta())
    assert echo["choices"][0]["text"] == "ab" and echo["choices"][0]["logprobs"]["tokens"] == ["a", "b"]
    assert echo["choices"][0]["logprobs"]["token_logprobs"] == [None, -0.125]
    lp = xy["choices"][0]["logprobs"]
    assert xy["choices"][0]["text"] == "xy" and lp["tokens"] == ["x", "y"] and lp["text_offset"] == [2, 3]


def test_a_zero_token_request_keeps_one_entry_per_token():
    """max_tokens=0 with logprobs: the scheduler sends the next position's top row without a token
    (SGLang's `output_top_logprobs[0]`, in /generate's meta_info); OpenAI's lists stay one entry per
    token: the echoed prompt's with echo, none without."""
    st = result("", n_tokens=0, finish=Length(0), lp=True, echo=True)
    st.logprobs = LogprobAccumulator(st.logprobs.opts, PROMPT, st.logprobs.text_of)
    nxt = Rows(np.zeros(0, np.float32), np.array([[-0.25, -2.0]], np.float32), np.array([[7, 9]], np.int32),
               _NO_IDS[:1])  # fmt: skip
    inp = Rows(np.array([-0.125], np.float32), np.array([[-0.125, -3.0]], np.float32),
               np.array([[2, 9]], np.int32), _NO_IDS[:1])  # fmt: skip
    st.logprobs.add(pack([inp], [nxt]))
    meta = st.logprob_meta()
    assert meta["output_token_logprobs"] == [] and meta["output_top_logprobs"] == [
        [[-0.25, 7, ""], [-2.0, 9, "z"]]
    ]
    echo = parse_completion({"prompt": "ab", "echo": True, "logprobs": 2, "max_tokens": 0}, MODELS)
    (choice,) = completion_response(echo, [st], ["ab"], 0)["choices"]
    assert choice["text"] == "ab" and choice["logprobs"]["tokens"] == ["a", "b"]
    assert choice["logprobs"]["top_logprobs"] == [None, {"b": -0.125, "z": -3.0}]
    plain = parse_completion({"prompt": "ab", "logprobs": 2, "max_tokens": 0}, MODELS)
    (choice,) = completion_response(plain, [st], ["ab"], 0)["choices"]
    assert choice["logprobs"] == {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    body = {
        "messages": [{"role": "user", "content": "q"}],
        "logprobs": True,
        "top_logprobs": 2,
        "max_tokens": 0,
    }
    (choice,) = chat_response(parse_chat(body, MODELS, render), [st], 0)["choices"]
    assert choice["logprobs"] == {"content": []} and choice["finish_reason"] == "length"
    for req in (echo, parse_chat({**body, "stream": True}, MODELS, render)):
        shaper = StreamShaper(req, ["ab"])
        st.sent_rows = st.sent_ids = st.sent_text = 0
        st.sent_input = False
        for chunk in shaper.chunks(st.delta()):
            lp = chunk["choices"][0]["logprobs"] if chunk["choices"] else None
            if lp and "tokens" in lp:
                assert len(lp["top_logprobs"]) == len(lp["tokens"])
