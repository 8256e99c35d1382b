"""Our frontend (`import sglbus as sgl`) against the real served system through `RuntimeEndpoint`, and
the same programs through SGLang's own frontend (`import sglang`) on the same server: with greedy
decoding both must give the same text and the same variables."""

from __future__ import annotations

import pytest

import sglbus as sgl

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:Error in stream_executor:UserWarning")]


@pytest.fixture(scope="module")
def endpoint(server):
    return sgl.RuntimeEndpoint(server.url)


@pytest.fixture
def backend(endpoint, srv):
    sgl.set_default_backend(endpoint)
    return endpoint


def programs(lang):
    """The compatibility programs, written once against either frontend module."""

    @lang.function
    def qa(s, question):
        s += "Q: " + question + "\nA:" + lang.gen("answer", max_tokens=12, stop="\n")
        s += "\nIs that correct? Answer yes or no.\nA:" + lang.select("ok", choices=[" yes", " no"])

    @lang.function
    def vote(s, topic):
        s += f"Two short facts about {topic}.\n"
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += f"Fact {i + 1}:" + lang.gen("fact", max_tokens=8, stop="\n")
        s += "The best fact is:" + lang.gen("best", choices=[forks[0]["fact"], forks[1]["fact"]])

    @lang.function
    def chat(s):
        s += lang.system("You are a helpful assistant.")
        s += lang.user("Name a fruit.")
        s += lang.assistant(lang.gen("fruit", max_tokens=6))
        s += lang.user("And a color?")
        s += lang.assistant_begin() + lang.gen("color", max_tokens=6) + lang.assistant_end()

    @lang.function
    def pick(s):
        s += "The color of grass is" + lang.select(
            "c", choices=[" green", " purple", " greenish"], choices_method=lang.greedy_token_selection
        )

    return {"qa": (qa, {"question": "What is the capital of France?"}), "vote": (vote, {"topic": "the Moon"}),
            "chat": (chat, {}), "pick": (pick, {})}  # fmt: skip


def test_same_results_as_sglangs_frontend(backend, server):
    sglang = pytest.importorskip(
        "sglang", reason="SGLang's frontend client (pip install --no-deps sglang ...)"
    )
    # SmolLM2's template is ChatML; SGLang has no SmolLM2 entry, so both are given the named one
    theirs_backend = sglang.RuntimeEndpoint(server.url, chat_template_name="chatml")
    ours_backend = sgl.RuntimeEndpoint(server.url, chat_template_name="chatml")
    ours, theirs = programs(sgl), programs(sglang)
    for name, (program, kwargs) in ours.items():
        mine = program.run(**kwargs, temperature=0, backend=ours_backend)
        other = theirs[name][0].run(**kwargs, temperature=0, backend=theirs_backend)
        assert mine.error() is None and other.error() is None, (name, mine.error(), other.error())
        assert mine.text() == other.text(), name
        assert mine.messages() == other.messages(), name
        names = {"qa": ["answer", "ok"], "vote": ["best"], "chat": ["fruit", "color"], "pick": ["c"]}[name]
        for var in names:
            assert mine[var] == other[var], (name, var)
    qa_ours, qa_theirs = ours["qa"][0], theirs["qa"][0]
    mine = qa_ours.run(question="What is 2 + 2?", temperature=0, backend=ours_backend).get_meta_info("ok")
    other = qa_theirs.run(question="What is 2 + 2?", temperature=0, backend=theirs_backend).get_meta_info(
        "ok"
    )
    assert mine["normalized_prompt_logprobs"] == pytest.approx(other["normalized_prompt_logprobs"], abs=1e-6)


def test_endpoint_programs(backend, srv):
    assert backend.get_model_info()["model_path"]
    # the model's own template, read from the server's tokenizer folder (same host)
    assert backend.get_chat_template().default_system_prompt.startswith("You are a helpful AI assistant")
    qa = programs(sgl)["qa"][0]
    state = qa.run(question="What is the capital of France?", temperature=0)
    assert state.error() is None, state.error()
    assert "\n" not in state["answer"] and state["ok"] in (" yes", " no")
    assert state.get_meta_info("answer")["finish_reason"]["type"] in ("stop", "length")
    streamed = qa.run(question="What is the capital of France?", temperature=0, stream=True)
    assert "".join(streamed.text_iter()) == state.text()
    states = qa.run_batch([{"question": q} for q in ("Where is Rome?", "Where is Oslo?")], temperature=0)
    assert all(s.error() is None for s in states)
    assert sgl.flush_cache() is True and isinstance(sgl.get_server_info(), dict)


def test_fork_sends_a_prefix_hint(backend, srv):
    intro = "A long shared introduction that every branch of this program starts from, word for word.\n"

    @sgl.function
    def branches(s):
        s += intro
        forks = s.fork(3)
        forks += lambda i: f"Branch {i}:" + sgl.gen("x", max_tokens=3, temperature=0)
        return [f.get_meta_info("x") for f in forks]

    sgl.flush_cache()
    state = branches.run()
    assert state.error() is None
    # the hint cached the intro before the branches ran: each of them found all of it in the cache
    intro_tokens = len(backend._json("POST", "/tokenize", {"prompt": intro})["tokens"])
    assert [m["cached_tokens"] >= intro_tokens - 1 for m in state.ret_value] == [True] * 3


def test_endpoint_errors(backend, srv):
    @sgl.function
    def bad(s):
        s += "x" + sgl.gen("a", max_tokens=10**7)

    err = bad.run().error()
    assert isinstance(err, RuntimeError) and "HTTP 400" in str(err)

    @sgl.function
    def with_image(s):
        s += sgl.image("cat.png") + "What is this?" + sgl.gen("a", max_tokens=2)

    assert "text-only model" in str(with_image.run().error())
    with pytest.raises(ConnectionError, match="127.0.0.1:9"):
        sgl.RuntimeEndpoint("http://127.0.0.1:9")
