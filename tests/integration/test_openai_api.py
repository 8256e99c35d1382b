"""The OpenAI-compatible endpoints through the official `openai` client (sync and async, streaming and
not) against the served system: the same greedy text as `/generate`, usage, logprobs, n, stop,
response_format, tools, the reasoning parser (a second gateway on the same bus), and errors in OpenAI's
shape."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
from it_helpers import generate, greedy

from shared.nats_server import free_port

PROMPT = "The capital of France is"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture
def oai(srv):
    with openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def thinking(server):
    """A second gateway on the shared server's bus, with `--reasoning-parser deepseek-r1` (reasoning until
    `</think>`: the model never writes one by itself, a regex makes it), as the `openai` client."""
    port, root = free_port(), os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cmd = [sys.executable, "-m", "services.gateway", "--nats-url", server.nats_url, "--host", "127.0.0.1",
           "--port", str(port), "--reasoning-parser", "deepseek-r1"]  # fmt: skip
    log_path = os.path.join(server.logdir, "gateway-reasoning.log")
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, cwd=root, env=server.env, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not _healthy(f"http://127.0.0.1:{port}/health"):
            assert proc.poll() is None and time.monotonic() < deadline, open(log_path).read()[-3000:]
            time.sleep(0.2)
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0) as c:
            yield c
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def chat_ids(tokenizer, messages):
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True)
    return list(out["input_ids"])


def test_completion_matches_generate_and_counts_usage(oai, client):
    ref = generate(client, {"text": PROMPT, "sampling_params": greedy(8, ignore_eos=True)})
    out = oai.completions.create(
        model="default", prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.object == "text_completion" and out.choices[0].text == ref["text"]
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == ref["meta_info"]["prompt_tokens"] and out.usage.completion_tokens == 8
    again = oai.completions.create(model="default", prompt=PROMPT, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # the prompt is in the radix cache now


def test_completion_stream_deltas_add_up_and_end_with_usage(oai):
    full = oai.completions.create(model="default", prompt=PROMPT, max_tokens=10, temperature=0, logprobs=1)
    chunks = list(
        oai.completions.create(
            model="default",
            prompt=PROMPT,
            max_tokens=10,
            temperature=0,
            logprobs=1,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert len(chunks) >= 3
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-2].choices[0].finish_reason == full.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    streamed = [
        lp
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for lp in c.choices[0].logprobs.token_logprobs
    ]
    assert streamed == full.choices[0].logprobs.token_logprobs  # each row sent once, in order


def test_completion_n_seed_stop_and_logprobs(oai):
    out = oai.completions.create(
        model="default", prompt=["Hello", PROMPT], max_tokens=6, n=2, seed=7, temperature=0.9, logprobs=2
    )
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    for c in out.choices:
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) > 0
        assert all(len(top) <= 2 for top in lp.top_logprobs) and "".join(lp.tokens) == c.text
    zero = oai.completions.create(model="default", prompt=PROMPT, max_tokens=3, logprobs=0, echo=True)
    lp = zero.choices[0].logprobs  # one entry per token; the echoed prompt's first has no logprob
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) > 3
    assert lp.top_logprobs[0] is None and lp.top_logprobs[-3:] == [{}, {}, {}]
    same = oai.completions.create(
        model="default", prompt=["Hello", PROMPT], max_tokens=6, n=2, seed=7, temperature=0.9
    )
    assert [c.text for c in same.choices] == [c.text for c in out.choices]  # the seed makes it repeatable
    first = oai.completions.create(model="default", prompt=PROMPT, max_tokens=12, temperature=0)
    word = first.choices[0].text.split()[1]
    cut = oai.completions.create(model="default", prompt=PROMPT, max_tokens=12, temperature=0, stop=[word])
    assert cut.choices[0].finish_reason == "stop" and word not in cut.choices[0].text


def test_chat_matches_generate_on_the_chat_template(oai, client, tokenizer):
    messages = [{"role": "user", "content": "Name a color."}]
    ids = chat_ids(tokenizer, messages)
    ref = generate(client, {"input_ids": ids, "sampling_params": greedy(12)})
    out = oai.chat.completions.create(
        model="default", messages=messages, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3
    )
    choice = out.choices[0]
    assert out.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.message.content == ref["text"] and out.usage.prompt_tokens == len(ids)
    assert "".join(t.token for t in choice.logprobs.content) == choice.message.content
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in choice.logprobs.content)


def test_async_chat_stream_gives_the_same_text(srv, tokenizer):
    async def run():
        async with openai.AsyncOpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0) as c:
            messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}]
            full = await c.chat.completions.create(
                model="default", messages=messages, max_completion_tokens=10, temperature=0
            )
            stream = await c.chat.completions.create(
                model="default", messages=messages, max_completion_tokens=10, temperature=0, stream=True
            )
            chunks = [chunk async for chunk in stream]
            return full, chunks

    full, chunks = asyncio.run(run())
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_response_format_json_schema_and_a_named_tool(oai):
    schema = {
        "type": "object",
        "properties": {"color": {"type": "string", "maxLength": 12}},
        "required": ["color"],
        "additionalProperties": False,
    }
    out = oai.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "A color as JSON."}],
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
    )
    assert set(json.loads(out.choices[0].message.content)) == {"color"}
    out = oai.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        max_tokens=40,
        temperature=0,
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city"}


def test_tool_calls_are_read_from_the_documented_format(srv, oai):
    # the answer itself is the model's; a call in the documented format, forced by a regex here,
    # must come back as tool_calls
    regex = (
        r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{1,8}"\}\}\n</tool_call>'
    )
    out = oai.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "Weather?"}],
        max_tokens=60,
        temperature=0,
        tools=[WEATHER],
        extra_body={"regex": regex},
    )
    choice = out.choices[0]
    assert (
        choice.finish_reason == "tool_calls" and choice.message.tool_calls[0].function.name == "get_weather"
    )


def test_errors_have_openai_shape_and_status(oai, client):
    with pytest.raises(openai.NotFoundError) as e:
        oai.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "x"}], temperature=3
        )
    assert e.value.body["param"] == "temperature" and "[0, 2]" in e.value.body["message"]
    for body, param in (
        ({"prompt": "x", "suffix": "y"}, "suffix"),
        ({"prompt": "x", "bogus": 1}, "bogus"),
        ({"prompt": []}, "prompt"),
        ({"prompt": "x", "logprobs": 9}, "logprobs"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "logit_bias": {"--5": 1}}, "logit_bias"),  # these three were 500s
        ({"prompt": "x", "logit_bias": {"\u00b2": 1}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"9" * 5000: 1}}, "logit_bias"),
    ):
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert r.json()["error"]["type"] == "invalid_request_error"
    # far too long for the context: refused before the template and the tokenizer see it
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a" * 1_000_000}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert "fit the context length" in r.json()["error"]["message"]
    tools = {"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER]}
    r = client.post(
        "/v1/chat/completions", json={**tools, "tool_choice": {"type": "function", "function": "f"}}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text


def test_fields_that_change_nothing_here_are_accepted(client):
    """OpenAI's metadata fields and SGLang's extra fields at values that change nothing (a client that
    sends them must not be refused); SGLang's at values we cannot honour are refused by name."""
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    noop = {"safety_identifier": "u1", "prompt_cache_key": "k", "verbosity": "low",
            "separate_reasoning": True, "stream_reasoning": True, "chat_template_kwargs": {},
            "return_hidden_states": False, "lora_path": None, "session_params": None}  # fmt: skip
    r = client.post("/v1/chat/completions", json={**chat, **noop})
    assert r.status_code == 200, r.text
    assert "reasoning_content" not in r.json()["choices"][0]["message"]  # no --reasoning-parser here
    r = client.post("/v1/chat/completions", json={**chat, "lora_path": "adapter"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path", r.text


def test_unknown_paths_and_methods_answer_json(client):
    for method, path, status in (("GET", "/v1/no-such-thing", 404), ("GET", "/v1/chat/completions", 405)):
        r = client.request(method, path)
        assert r.status_code == status and r.json()["error"]["type"] == "invalid_request_error", r.text


def test_models_list_and_retrieve(oai):
    name = oai.models.list().data[0].id
    card = oai.models.retrieve(name)
    assert card.id == name and card.object == "model"
    with pytest.raises(openai.NotFoundError) as e:
        oai.models.retrieve("no-such-model")
    assert e.value.body["code"] == "model_not_found"


def test_tokenize_and_detokenize(client, tokenizer):
    r = client.post("/tokenize", json={"prompt": PROMPT})
    ids = tokenizer.encode(PROMPT)
    assert r.status_code == 200 and r.json()["tokens"] == ids and r.json()["count"] == len(ids)
    r = client.post("/v1/detokenize", json={"tokens": [ids, ids[:2]]})
    assert r.json()["text"] == [tokenizer.decode(ids), tokenizer.decode(ids[:2])]
    assert client.post("/detokenize", json={"tokens": [10**9]}).status_code == 400


HI = [{"role": "user", "content": "Say hi."}]
# the default model answers this (greedy) with "The tag </think> is a type of HTML tag ...": its
# reasoning ends there, and a grammar then shapes what follows (require_reasoning)
TAG = [{"role": "user", "content": "Write the tag </think> and nothing else."}]
ANSWER = r"[A-Z][a-z]{1,6}( [a-z]{1,6})?"


def streamed(chunks):
    """(reasoning, content, the pieces of reasoning) of a one-choice chat stream."""
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    pieces = [d.reasoning_content for d in deltas if getattr(d, "reasoning_content", None)]
    return "".join(pieces), "".join(d.content or "" for d in deltas), pieces


def test_forced_reasoning_without_an_end_tag_is_all_reasoning(srv, oai, thinking):
    asked = {"model": "default", "messages": HI, "max_tokens": 6, "temperature": 0}
    plain = oai.chat.completions.create(**asked).choices[0].message
    assert plain.content.strip() and getattr(plain, "reasoning_content", None) is None
    whole = thinking.chat.completions.create(**asked).choices[0].message
    assert whole.content == "" and whole.reasoning_content == plain.content.strip()
    reasoning, content, _ = streamed(thinking.chat.completions.create(**asked, stream=True))
    assert (reasoning, content) == (whole.reasoning_content, "")
    kept = thinking.chat.completions.create(**asked, extra_body={"separate_reasoning": False}).choices[0]
    assert kept.message.content == plain.content and getattr(kept.message, "reasoning_content", None) is None


def test_reasoning_and_answer_split_alike_whole_and_streamed(srv, thinking):
    # logprobs in every request: without, the grammar's forced text is jump-forwarded (other tokens, so
    # another greedy answer); the regex shapes the answer after the reasoning only
    asked = {"model": "default", "messages": TAG, "max_tokens": 32, "temperature": 0, "logprobs": True}
    raw = thinking.chat.completions.create(**asked, extra_body={"regex": ANSWER, "separate_reasoning": False})
    text = raw.choices[0].message.content
    before, answer = text.split("</think>")
    assert before.strip() and re.fullmatch(ANSWER, answer), text
    whole = thinking.chat.completions.create(**asked, extra_body={"regex": ANSWER})
    msg = whole.choices[0].message
    assert (msg.reasoning_content, msg.content) == (before.strip(), answer)
    rows = whole.choices[0].logprobs.content  # every token's, the reasoning's too (and the EOS's)
    assert "".join(t.token for t in rows).startswith(text) and len(rows) == whole.usage.completion_tokens
    assert whole.usage.completion_tokens == raw.usage.completion_tokens
    chunks = list(thinking.chat.completions.create(
        **asked, stream=True, stream_options={"include_usage": True}, extra_body={"regex": ANSWER}
    ))  # fmt: skip
    assert streamed(chunks)[:2] == (msg.reasoning_content, msg.content)
    assert [
        t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content
    ] == rows
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    held = thinking.chat.completions.create(
        **asked, stream=True, extra_body={"regex": ANSWER, "stream_reasoning": False}
    )
    assert streamed(held) == (msg.reasoning_content, msg.content, [msg.reasoning_content])  # one piece


def test_a_json_schema_shapes_the_answer_after_the_reasoning(srv, oai, thinking):
    """SGLang's structured outputs for reasoning models: the grammar waits for `</think>`, with and
    without jump-forward's retokenization right after it, whole and streamed; a model that never ends
    its reasoning is never constrained."""
    schema = {
        "type": "object",
        "properties": {"tag": {"type": "string", "maxLength": 12}},
        "required": ["tag"],
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}
    asked = {"model": "default", "messages": TAG, "max_tokens": 40, "temperature": 0, "response_format": fmt}
    msg = thinking.chat.completions.create(**asked).choices[0].message
    assert msg.reasoning_content and set(json.loads(msg.content)) == {"tag"}, msg
    reasoning, content, _ = streamed(thinking.chat.completions.create(**asked, stream=True))
    assert (reasoning, content) == (msg.reasoning_content, msg.content)
    # no reasoning parser: the grammar shapes the answer from its first token
    plain = oai.chat.completions.create(**asked).choices[0].message
    assert set(json.loads(plain.content)) == {"tag"} and getattr(plain, "reasoning_content", None) is None
    # a reasoning that never ends: all reasoning, unconstrained
    cut = thinking.chat.completions.create(**{**asked, "messages": HI, "max_tokens": 6}).choices[0]
    assert cut.finish_reason == "length" and cut.message.content == "" and cut.message.reasoning_content
    # on /generate: require_reasoning needs a server that knows the tag
    body = {"text": "Hi", "require_reasoning": True, "sampling_params": {"json_schema": json.dumps(schema)}}
    r = httpx.post(f"{srv.url}/generate", json=body)
    assert r.status_code == 400 and "--reasoning-parser" in r.text


def test_tool_calls_come_from_the_answer_after_the_reasoning_for_each_choice(srv, thinking):
    call = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{1,8}"\}\}\n</tool_call>'
    out = thinking.chat.completions.create(
        model="default", messages=TAG, max_tokens=60, temperature=0, n=2, tools=[WEATHER],
        extra_body={"regex": call},
    )  # fmt: skip
    assert len(out.choices) == 2
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.reasoning_content
        assert choice.message.tool_calls[0].function.name == "get_weather" and not choice.message.content
    # a call the grammar forces (tool_choice "required"): it too waits for the reasoning
    forced = thinking.chat.completions.create(
        model="default", messages=TAG, max_tokens=60, temperature=0, tools=[WEATHER], tool_choice="required"
    )  # fmt: skip
    (choice,) = forced.choices
    assert (
        choice.finish_reason == "tool_calls" and choice.message.tool_calls[0].function.name == "get_weather"
    )
    assert choice.message.reasoning_content
    kept = thinking.chat.completions.create(
        model="default", messages=TAG, max_tokens=60, temperature=0, tools=[WEATHER], tool_choice="required",
        extra_body={"separate_reasoning": False},
    )  # fmt: skip
    (choice,) = kept.choices  # the reasoning stays in content, the call is read after the tag
    assert choice.finish_reason == "tool_calls" and choice.message.content.endswith("</think>")
    assert choice.message.tool_calls[0].function.name == "get_weather"
