"""`sgl.BusEndpoint` on the real served system: programs over the NATS bus API give the same greedy text,
messages and variables as over HTTP (`RuntimeEndpoint`), stream, and surface the gateway's refusals
as the state's error."""

from __future__ import annotations

import pytest

import sglbus as sgl

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:Error in stream_executor:UserWarning")]


@pytest.fixture(scope="module")
def runtime(server):
    return sgl.RuntimeEndpoint(server.url)


@pytest.fixture(scope="module")
def bus_endpoint(server, runtime):
    # the bus API does not tell the tokenizer folder: given here, both use the model's own template
    folder = runtime.get_model_info()["tokenizer_path"]
    backend = sgl.BusEndpoint(server.nats_url, token=server.nats_token, tokenizer_path=folder)
    yield backend
    backend.close()


@pytest.fixture
def bus(bus_endpoint, srv):
    return bus_endpoint


@sgl.function
def qa(s, question):
    s += "Q: " + question + "\nA:" + sgl.gen("answer", max_tokens=10, stop="\n")
    s += "\nIs that correct? Answer yes or no.\nA:" + sgl.select("ok", choices=[" yes", " no"])
    forks = s.fork(2)
    for i, f in enumerate(forks):
        f += f"\nReason {i + 1}:" + sgl.gen("reason", max_tokens=6, stop="\n")
    forks.join()


@sgl.function
def chat(s):
    s += sgl.user("Name a fruit.")  # no system message: the template's default one comes first
    s += sgl.assistant(sgl.gen("fruit", max_tokens=8))


def test_same_greedy_results_as_over_http(bus, runtime):
    assert bus.get_chat_template() == runtime.get_chat_template()
    assert bus.get_model_name() in runtime.get_model_info()["model_path"]  # the served name: the file's
    question = {"question": "What is the capital of France?"}
    for program, kwargs, names in ((qa, question, ["answer", "ok", "reason"]), (chat, {}, ["fruit"])):
        ours = program.run(**kwargs, temperature=0, backend=bus)
        http = program.run(**kwargs, temperature=0, backend=runtime)
        assert ours.error() is None, ours.error()
        assert ours.text() == http.text() and ours.messages() == http.messages()
        assert [ours[n] for n in names] == [http[n] for n in names]
    assert ours.messages()[0]["role"] == "system"


def test_streaming_over_the_bus(bus):
    whole = chat.run(temperature=0, backend=bus)
    state = chat.run(temperature=0, backend=bus, stream=True)
    pieces = list(state.text_iter("fruit"))
    assert len(pieces) > 2 and "".join(pieces) == whole["fruit"]
    assert (
        state.get_meta_info("fruit")["completion_tokens"] == whole.get_meta_info("fruit")["completion_tokens"]
    )


def test_the_gateways_refusal_is_the_states_error(bus):
    too_long = "word " * 9000  # over the 8192-token context
    for stream in (False, True):
        state = qa.run(question=too_long, temperature=0, backend=bus, stream=stream)
        assert "".join(state.text_iter()).startswith("Q: word")  # waits for the end of the program
        error = state.error()
        assert isinstance(error, RuntimeError), (stream, error)
        assert "sglbus.api.generate: error 400" in str(error) and "context length" in str(error)
        if not stream:  # a streamed gen's variable exists (empty) from its first chunk on
            with pytest.raises(RuntimeError, match="was not produced"):
                state["answer"]


def test_connecting_needs_the_token_and_a_gateway_on_the_prefix(server):
    with pytest.raises(PermissionError, match="refused the credentials"):
        sgl.BusEndpoint(server.nats_url, token="not-the-token")
    with pytest.raises(TimeoutError, match="subject_prefix 'elsewhere'"):
        sgl.BusEndpoint(server.nats_url, subject_prefix="elsewhere", token=server.nats_token)
