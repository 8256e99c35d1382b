"""The pure parts of the OpenAI backend: how a speculated reply is matched against the program's text
and cut into gens, what a chat call is given, how gen's parameters become OpenAI's, and its usage
counter; speculation on a completion-style native backend (a scripted one). No server."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
from scripted_backend import ScriptedBackend

import sglbus as sgl
from sglbus.lang.backends.openai import chat_messages, openai_kwargs
from sglbus.lang.interpreter import ChatPrompt
from sglbus.lang.params import checked
from sglbus.lang.speculation import after_prefix, consume, take

REPLY = "Name: Marie Curie\nBirthday: November 7, 1867\nJob: chemist"


def test_a_turn_is_cut_into_its_gens_by_their_stops_and_the_programs_text():
    rest = after_prefix(REPLY, "Name:")
    name, rest = take(rest, ["\n"], complete=True)
    rest = consume(rest, "\nBirthday:")
    birthday, rest = take(rest, ["\n"], complete=True)
    rest = consume(rest, "\nJob:")
    job, rest = take(rest, ["\n"], complete=True)
    assert (name, birthday, job, rest) == (" Marie Curie", " November 7, 1867", " chemist", "")


def test_the_earliest_stop_wins_and_stays_in_the_rest():
    assert take("abc. def\nghi", ["\n", "."], complete=False) == ("abc", ". def\nghi")
    assert take("\nx", ["\n"], complete=False) == ("", "\nx")  # the model stopped at once


def test_a_reply_cut_by_the_token_limit_cannot_answer_a_gen_whose_stop_it_lacks():
    assert take(" Marie Cu", ["\n"], complete=False) is None
    assert take(" Marie Cu", [], complete=False) is None
    assert take(" Marie Curie", [], complete=True) == (" Marie Curie", "")


def test_text_the_model_did_not_speculate_ends_the_speculation():
    assert consume("\nBirthday: 1867", "\nBorn:") is None
    assert consume(None, "anything") is None
    assert consume("", "") == ""


def test_a_turns_reply_must_start_with_what_the_program_wrote():
    assert after_prefix(REPLY, "") == REPLY
    assert after_prefix("\n  Name: X", "Name:") == " X"  # the message content is stripped
    assert after_prefix("name: X", "Name:") is None


def test_chat_calls_get_the_finished_turns_and_only_open_an_assistant_turn():
    msgs = ({"role": "user", "content": "Hi"},)
    assert chat_messages(ChatPrompt("<text>", msgs, "assistant", "")) == list(msgs)
    with pytest.raises(ValueError, match="a chat API cannot continue a partial reply"):
        chat_messages(ChatPrompt("<text>Name:", msgs, "assistant", "Name:"))
    with pytest.raises(ValueError, match="in a user turn"):
        chat_messages(ChatPrompt("<text>", msgs, "user", ""))
    with pytest.raises(ValueError, match="outside any role"):
        chat_messages(ChatPrompt("<text>", msgs, None, ""))
    turn = ChatPrompt("head|Name: X", msgs, "assistant", "Name: X").turn_start()
    assert (turn, turn.role_text, turn.messages) == ("head|", "", msgs)


def test_openai_fields_go_as_they_are_and_the_others_in_extra_body_only_when_they_change_something():
    plain = checked(
        "gen", max_new_tokens=8, temperature=0.0, top_k=-1, min_p=0.0, ignore_eos=False, stop="\n"
    )
    assert openai_kwargs(plain, chat=True) == {"max_tokens": 8, "temperature": 0.0, "stop": ["\n"]}
    extra = checked("gen", top_k=5, min_p=0.1, min_new_tokens=2, regex="a+", stop_token_ids=[7])
    assert openai_kwargs(extra, chat=False)["extra_body"] == {
        "top_k": 5, "min_p": 0.1, "min_tokens": 2, "regex": "a+", "stop_token_ids": [7],
    }  # fmt: skip
    number = openai_kwargs(checked("gen", dtype=int, stop="."), chat=False)
    assert number["extra_body"] == {"regex": r"[-+]?[0-9]+[ \n]*"} and number["stop"] == [".", " ", "\n"]
    logprobs = checked("gen", return_logprob=True, top_logprobs_num=2)
    assert openai_kwargs(logprobs, chat=True) == {"logprobs": True, "top_logprobs": 2}
    assert openai_kwargs(logprobs, chat=False) == {"logprobs": 2}


def test_num_api_spec_tokens_is_checked_and_a_streamed_run_fails_in_its_state():
    with pytest.raises(ValueError, match="num_api_spec_tokens must be an integer >= 1"):
        sgl.function(num_api_spec_tokens=0)(lambda s: None)

    @sgl.function(num_api_spec_tokens=16)
    def prog(s):
        s += sgl.assistant("Sure." + sgl.gen("x"))

    # as SGLang: run() returns, the error is the state's, text_iter ends (no call is made: the client
    # is only built, nothing listens on port 9)
    pytest.importorskip("openai", reason="the openai client (a dev extra; a GPU host may not have it)")
    backend = sgl.OpenAI("some-model", base_url="http://127.0.0.1:9/v1")
    with pytest.warns(UserWarning, match=r"prog.run\(stream=True\) with num_api_spec_tokens"):
        state = prog.run(backend=backend, stream=True)
    assert "".join(state.text_iter()).endswith("Sure.")
    assert list(state.text_iter("x")) == []
    assert isinstance(state.error(), ValueError) and "cannot be combined with" in str(state.error())
    assert backend.usage.calls == 0


def test_token_usage_is_the_usage_counter_under_sglangs_name():
    pytest.importorskip("openai", reason="the openai client (a dev extra; a GPU host may not have it)")
    backend = sgl.OpenAI("some-model", base_url="http://127.0.0.1:9/v1")
    usage = backend.token_usage
    assert usage is backend.usage and (usage.prompt_tokens, usage.completion_tokens) == (0, 0)
    reply = SimpleNamespace(prompt_tokens=10, completion_tokens=3)
    threads = [threading.Thread(target=backend._count, args=(1, reply)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (usage.calls, usage.prompt_tokens, usage.completion_tokens) == (8, 80, 24)
    assert str(usage) == "TokenUsage(calls=8, prompt_tokens=80, completion_tokens=24)"
    before = backend.reset_usage()  # ours: a copy of the counts, the counter cleared in place
    assert (before.calls, before.prompt_tokens) == (8, 80) and backend.token_usage is usage
    assert (usage.calls, usage.prompt_tokens, usage.completion_tokens) == (0, 0, 0)
    backend._count(1, reply)
    usage.reset()  # SGLang's way
    assert backend.usage.prompt_tokens == 0 and backend.usage.calls == 0


CHARACTER = "Construct a character.\nName:"


@sgl.function(num_api_spec_tokens=32)
def character(s):
    s += "Construct a character.\n"
    s += "Name:" + sgl.gen("name", stop="\n") + "\nJob:" + sgl.gen("job", stop="\n") + "\n"


def test_a_completion_style_native_backend_speculates_as_sglang_does():
    backend = ScriptedBackend(CHARACTER + " Ada Lovelace\nJob: engineer\nName: B")
    state = character.run(backend=backend)
    assert state.error() is None and (state["name"], state["job"]) == (" Ada Lovelace", " engineer")
    assert len(backend.bodies) == 1  # one speculated call for both gens (without speculation: two)
    sampling = backend.bodies[0]["sampling_params"]
    assert sampling["max_new_tokens"] == 128 and "stop" not in sampling  # max(32, the run's 128), no stop
    assert state.get_meta_info("job") == {"api_speculative": "matched"}
    plain = sgl.function(character.func)  # the same program without speculation
    backend.bodies = []
    assert plain.run(backend=backend)["job"] == " engineer" and len(backend.bodies) == 2


def test_a_backend_without_speculation_ignores_the_setting():
    class Plain(ScriptedBackend):
        supports_api_speculative_execution = False

    backend = Plain(CHARACTER + " Ada\nJob: engineer\n")
    state = character.run(backend=backend)
    assert state.error() is None and state["job"] == " engineer" and len(backend.bodies) == 2
