"""`sgl.OpenAI` against our own `/v1` endpoints on the real served system: a completion model gives the
same greedy text, variables and select scores as the native backend; a chat model the same answers as
the native backend with the same template; API speculative execution the same variables as one call
per gen, from fewer calls and input tokens (the usage counter, checked exactly where it is exact)."""

from __future__ import annotations

import pytest

import sglbus as sgl

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:Error in stream_executor:UserWarning")]

SYSTEM = "Extract the name, birthday and job from the biography."
EXAMPLES = [
    ("Ada Lovelace was born on December 10, 1815 in London. She was a mathematician.",
     "Name: Ada Lovelace\nBirthday: December 10, 1815\nJob: mathematician"),
    ("Born on March 14, 1879 in Ulm, Albert Einstein worked as a physicist.",
     "Name: Albert Einstein\nBirthday: March 14, 1879\nJob: physicist"),
]  # fmt: skip
BIO = "Marie Curie was born on November 7, 1867 in Warsaw. She was a chemist."
FIELDS = ("name", "birthday", "job")


def extraction(s, bio, first="Name:"):
    """The paper's few-shot field extraction: three gens in one assistant turn."""
    s += sgl.system(SYSTEM)
    for example, answer in EXAMPLES:
        s += sgl.user(example)
        s += sgl.assistant(answer)
    s += sgl.user(bio)
    s += sgl.assistant(first + sgl.gen("name", stop="\n") + "\nBirthday:" + sgl.gen("birthday", stop="\n")
                       + "\nJob:" + sgl.gen("job", stop="\n"))  # fmt: skip


plain_extraction = sgl.function(extraction)
spec_extraction = sgl.function(num_api_spec_tokens=32)(extraction)


@pytest.fixture(scope="module")
def model(server):
    return server.http.get("/v1/models").json()["data"][0]["id"]


@pytest.fixture
def completion(server, model, srv):
    # chatml: SmolLM2's own template once a system message is given, so the server renders the same
    return sgl.OpenAI(model, base_url=server.url + "/v1", is_chat_model=False, chat_template="chatml")


@pytest.fixture
def chat(server, model, srv):
    return sgl.OpenAI(model, base_url=server.url + "/v1", is_chat_model=True, chat_template="chatml")


@pytest.fixture(scope="module")
def native(server):
    return sgl.RuntimeEndpoint(server.url, chat_template_name="chatml")


def test_completion_model_gives_the_native_backends_text_variables_and_select_scores(completion, native):
    @sgl.function
    def qa(s):
        s += "Q: What is the capital of France?\nA:" + sgl.gen("answer", max_tokens=8, stop="\n")
        s += "\nIs that right? Answer:" + sgl.select("ok", choices=[" yes", " no", " maybe"])
        s += "\n2 + 2 =" + sgl.gen("sum", dtype=int, max_tokens=4)

    ours, theirs = qa.run(temperature=0, backend=completion), qa.run(temperature=0, backend=native)
    assert ours.error() is None and theirs.error() is None, (ours.error(), theirs.error())
    assert ours.text() == theirs.text()
    assert [ours[v] for v in ("answer", "ok", "sum")] == [theirs[v] for v in ("answer", "ok", "sum")]
    assert ours["sum"].strip().lstrip("+-").isdigit()
    mine, other = ours.get_meta_info("ok"), theirs.get_meta_info("ok")
    assert mine["normalized_prompt_logprobs"] == pytest.approx(other["normalized_prompt_logprobs"], abs=1e-3)
    assert [[t[2] for t in r] for r in mine["input_token_logprobs"]] == [
        [t[2] for t in r] for r in other["input_token_logprobs"]
    ]
    assert completion.usage.calls == 3  # gen, select (one echo call for every choice), gen


def test_chat_model_answers_like_the_native_backend(chat, native):
    @sgl.function
    def talk(s):
        s += sgl.system("You are a helpful assistant.")
        s += sgl.user("Name a fruit.")
        s += sgl.assistant(sgl.gen("fruit", max_tokens=8))
        s += sgl.user("And a color?")
        s += sgl.assistant(sgl.gen("color", max_tokens=8))

    ours, theirs = talk.run(temperature=0, backend=chat), talk.run(temperature=0, backend=native)
    assert ours.error() is None, ours.error()
    assert (ours["fruit"], ours["color"]) == (theirs["fruit"], theirs["color"])
    assert ours.messages() == theirs.messages()
    meta = ours.get_meta_info("color")
    assert meta["finish_reason"] in ("stop", "length") and meta["completion_tokens"] <= 8
    assert chat.usage.calls == 2
    assert (
        chat.usage.completion_tokens
        == ours.get_meta_info("fruit")["completion_tokens"] + meta["completion_tokens"]
    )


def test_api_speculative_execution_gives_the_same_fields_from_one_call(chat, completion):
    baseline = plain_extraction.run(bio=BIO, temperature=0, max_new_tokens=16, backend=completion)
    assert baseline.error() is None, baseline.error()
    expected = [baseline[f] for f in FIELDS]
    assert expected[0].strip() == "Marie Curie"
    without = completion.reset_usage()
    assert without.calls == 3  # one call per gen, each with the whole prompt again

    state = spec_extraction.run(bio=BIO, temperature=0, max_new_tokens=16, backend=chat)
    assert state.error() is None, state.error()
    assert [state[f] for f in FIELDS] == expected
    assert state.get_meta_info("name")["api_speculative"] == "call"
    assert state.get_meta_info("job") == {"api_speculative": "matched"}
    with_chat = chat.reset_usage()
    assert with_chat.calls == 1
    # the three calls each send the prompt the one speculative call sends, and more
    assert without.prompt_tokens > 3 * with_chat.prompt_tokens

    # a completion model speculates too: its one call sends the prompt of the baseline's first call
    state = spec_extraction.run(bio=BIO, temperature=0, max_new_tokens=16, backend=completion)
    assert [state[f] for f in FIELDS] == expected
    with_completion = completion.reset_usage()
    assert with_completion.calls == 1
    assert with_completion.prompt_tokens == baseline.get_meta_info("name")["prompt_tokens"]


def test_a_speculated_reply_that_does_not_fit_the_program_is_an_error(chat):
    state = spec_extraction.run(bio=BIO, first="Full name:", temperature=0, max_new_tokens=16, backend=chat)
    assert isinstance(state.error(), RuntimeError)
    assert "does not go on with the program's text 'Full name:'" in str(state.error())
    assert chat.usage.calls == 1  # at temperature 0 another call would give the same reply
    with pytest.raises(RuntimeError, match="was not produced"):
        state["name"]

    short = sgl.function(num_api_spec_tokens=4)(extraction)  # "Name: Marie Cur": no "\n" to end the name
    state = short.run(bio=BIO, temperature=0, max_new_tokens=4, backend=chat)
    assert "ended before this gen's stop" in str(state.error()) and chat.usage.calls == 2


def test_what_a_chat_model_cannot_do_is_refused_before_any_call(chat):
    state = plain_extraction.run(bio=BIO, temperature=0, backend=chat)
    assert "a chat API cannot continue a partial reply" in str(state.error())

    @sgl.function
    def pick(s):
        s += sgl.user("Yes or no?")
        s += sgl.assistant(sgl.select("answer", choices=["yes", "no"]))

    assert "cannot score given choices" in str(pick.run(backend=chat).error())

    @sgl.function
    def ask(s):
        s += sgl.user("Hello" + sgl.gen("more"))

    assert "gen in a user turn" in str(ask.run(backend=chat).error())
    assert chat.usage.calls == 0


def test_streaming_and_server_errors(server, completion, chat, model):
    @sgl.function
    def story(s):
        s += sgl.system("You are a helpful assistant.")
        s += sgl.user("Tell me about the sea.")
        s += sgl.assistant(sgl.gen("story", max_tokens=12))

    whole = story.run(temperature=0, backend=chat)
    for backend in (chat, completion):
        state = story.run(temperature=0, backend=backend, stream=True)
        pieces = list(state.text_iter("story"))
        assert len(pieces) > 2 and "".join(pieces) == whole["story"], backend.is_chat_model
        assert (
            state.get_meta_info("story")["completion_tokens"]
            == whole.get_meta_info("story")["completion_tokens"]
        )
    assert chat.usage.completion_tokens == 2 * whole.get_meta_info("story")["completion_tokens"]

    wrong = sgl.OpenAI("no-such-model", base_url=server.url + "/v1", is_chat_model=True)
    error = story.run(backend=wrong).error()
    assert isinstance(error, RuntimeError) and "HTTP 404" in str(error) and "no-such-model" in str(error)


def test_a_native_backend_speculates_as_a_completion_model(native, srv):
    """SGLang speculates on any non-chat backend: one wide /generate, the same greedy fields."""
    baseline = plain_extraction.run(bio=BIO, temperature=0, max_new_tokens=16, backend=native)
    state = spec_extraction.run(bio=BIO, temperature=0, max_new_tokens=16, backend=native)
    assert baseline.error() is None and state.error() is None, (baseline.error(), state.error())
    assert [state[f] for f in FIELDS] == [baseline[f] for f in FIELDS]
    assert state.get_meta_info("name")["api_speculative"] == "call"
    assert state.get_meta_info("job") == {"api_speculative": "matched"}
