"""The detokenizer's bookkeeping of attempts and lost output (no bus, no model: a fake tokenizer whose
token i decodes to the letter chr(97 + i))."""

from __future__ import annotations

import pytest

from services.detokenizer.detokenizer import Detokenizer
from shared.finish import Abort, Length, Stop
from shared.messages import AbortReq, BatchTokenOut, NewReqInfo


class Letters:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(97 + i) for i in ids)


def info(rid: str, attempt: int = 1, token: str = "") -> NewReqInfo:
    return NewReqInfo(rid=rid, out_subject="gw", attempt=attempt, work_token=token)


def step(rid: str, tokens: list[int], offset: int, finish=None, announce: NewReqInfo | None = None):
    return BatchTokenOut(new_reqs=[announce] if announce else [], rids=[rid], token_ids=[tokens],
                         cached_tokens=[0], offsets=[offset], finish_reasons=[finish])  # fmt: skip


def texts(outs) -> list[tuple[str, int, bool]]:
    return [(o.text, o.attempt, o.finished) for o in outs["gw"].outs] if outs else []


def test_final_output_carries_the_work_token_and_attempt():
    d = Detokenizer(Letters())
    outs, stopped = d.step(step("r", [0, 1], 0, announce=info("r", 2, "tok")))
    assert texts(outs) == [("ab", 2, False)] and not stopped
    outs, _ = d.step(step("r", [2], 2, Length(3)))
    (out,) = outs["gw"].outs
    assert out.finished and out.work_token == "tok" and out.text == "c" and out.attempt == 2


def test_a_gap_asks_for_a_restart_once_and_sends_nothing_until_the_next_attempt():
    d = Detokenizer(Letters())
    d.step(step("r", [0], 0, announce=info("r")))
    outs, stopped = d.step(step("r", [2], 2))  # offset 1 was lost
    assert not outs and stopped == [AbortReq(rids=["r"], restart=True)]
    outs, stopped = d.step(step("r", [3], 3))  # later steps of the broken attempt: dropped, not re-asked
    assert not outs and not stopped
    outs, stopped = d.step(step("r", [4, 5], 0, announce=info("r", 2)))  # the new attempt starts over
    assert texts(outs) == [("ef", 2, False)] and not stopped


def test_tokens_of_an_unknown_request_restart_it():
    """A restarted detokenizer never saw the announcement: the scheduler must run the request again."""
    d = Detokenizer(Letters())
    outs, stopped = d.step(step("r", [7], 5))
    assert not outs and stopped == [AbortReq(rids=["r"], restart=True)]
    assert d.step(step("r", [8], 6)) == ({}, [])


def test_a_new_announcement_replaces_the_state_of_its_rid():
    """Each run of a request is announced once, after the outputs of earlier runs: a client may reuse
    the rid of a finished request, and it is a new request."""
    d = Detokenizer(Letters())
    d.step(step("r", [0], 0, Length(1), announce=info("r")))
    outs, stopped = d.step(step("r", [1, 2], 0, Length(2), announce=info("r")))
    assert texts(outs) == [("bc", 1, True)] and not stopped


def test_a_malformed_step_is_refused_whole():
    d = Detokenizer(Letters())
    bad = BatchTokenOut(rids=["x"], token_ids=[[1]], offsets=[0], finish_reasons=[None])  # no cached_tokens
    with pytest.raises(ValueError, match="one entry per rid"):
        d.step(bad)


def test_a_finished_request_can_come_back_as_a_new_attempt():
    """Its final output was lost before the gateway had it: the work queue delivers it again."""
    d = Detokenizer(Letters())
    d.step(step("r", [0], 0, Length(1), announce=info("r")))
    assert d.step(step("r", [1], 1)) == ({}, [])  # after the end: ignored, nothing to restart
    outs, _ = d.step(step("r", [0], 0, Length(1), announce=info("r", 2)))
    assert texts(outs) == [("a", 2, True)]


def test_a_detokenization_failure_ends_that_request_alone():
    class Fragile(Letters):
        def decode(self, ids, skip_special_tokens=True):
            if 9 in ids:
                raise ValueError("bad id")
            return super().decode(ids, skip_special_tokens)

    d = Detokenizer(Fragile())
    batch = BatchTokenOut(new_reqs=[info("bad"), info("good")], rids=["bad", "good"], token_ids=[[9], [0]],
                          cached_tokens=[0, 0], offsets=[0, 0], finish_reasons=[None, None])  # fmt: skip
    outs, stopped = d.step(batch)
    bad, good = outs["gw"].outs
    assert isinstance(bad.finish, Abort) and bad.finish.status_code == 500
    assert "bad id" in bad.finish.message
    assert good.text == "a" and not good.finished
    assert stopped == [AbortReq(rids=["bad"])]


class Pairs(Letters):
    """Letters, and token 26 + i for the two letters chr(97 + i) chr(98 + i) ("bc" is 27)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(97 + i) if i < 26 else chr(71 + i) + chr(72 + i) for i in ids)


def test_a_lower_offset_replaces_ids_and_keeps_the_text():
    """Jump-forward's retokenization: "b" then a forced "c" become the one token "bc"; the text the
    client got stays, only the new character is sent, and the ids from the offset come again."""
    d = Detokenizer(Pairs())
    d.step(step("r", [0, 1], 0, announce=info("r")))  # "ab"
    outs, stopped = d.step(step("r", [27, 3], 1))  # from offset 1: "bc" "d"
    (out,) = outs["gw"].outs
    assert (out.text, out.output_ids, out.offset) == ("cd", [27, 3], 1) and not stopped
    outs, _ = d.step(step("r", [4], 3, Length(4)))
    (out,) = outs["gw"].outs
    assert (out.text, out.output_ids, out.offset) == ("e", [4], 3)
    assert out.finished and out.offset + len(out.output_ids) == 4


def test_stop_regex_ends_the_request_and_cuts_its_match():
    d = Detokenizer(Letters())
    d.step(step("r", [0, 1, 2], 0, announce=info("r")))  # "abc" sent
    d._states["r"].info.stop_regex = [r"c+d"]
    outs, stopped = d.step(step("r", [3], 3))  # "abcd": the match began in text already sent
    (out,) = outs["gw"].outs
    assert stopped == [AbortReq(rids=["r"], finish=Stop("cd"))]
    assert out.finished and (out.text, out.text_offset) == ("", 2)  # the gateway cuts "c"
