"""The pure parts of the OpenAI backend: how a speculated reply is matched against the program's text
and cut into gens, what a chat call is given, and how gen's parameters become OpenAI's. No server."""

from __future__ import annotations

import pytest

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


def test_num_api_spec_tokens_is_checked_and_cannot_stream():
    with pytest.raises(ValueError, match="num_api_spec_tokens must be an integer >= 1"):
        sgl.function(num_api_spec_tokens=0)(lambda s: None)

    @sgl.function(num_api_spec_tokens=16)
    def prog(s):
        s += sgl.assistant(sgl.gen("x"))

    # refused before any call: the client is only built, nothing listens on port 9
    pytest.importorskip("openai", reason="the openai client (a dev extra; a GPU host may not have it)")
    backend = sgl.OpenAI("some-model", base_url="http://127.0.0.1:9/v1")
    with pytest.raises(ValueError, match="stream=True cannot be combined with"):
        prog.run(backend=backend, stream=True)
    assert backend.usage.calls == 0
