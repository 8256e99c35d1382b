"""SGLang's reasoning parser (shared/reasoning_parser.py): every model type on whole texts, and streams cut
at every place (tags split across pieces) giving the same split as the whole text."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.reasoning_parser import REASONING_PARSERS, ReasoningParser

FORCED = ("deepseek-r1", "qwen3-thinking", "step3")
OPENED = ("deepseek-v3", "qwen3", "glm45", "kimi")
TAGS = {name: ("<think>", "</think>") for name in REASONING_PARSERS} | {"kimi": ("◁think▷", "◁/think▷")}


def stream(parser: ReasoningParser, pieces: list[str]) -> tuple[str, str, list[tuple[str, str]]]:
    """The pieces through parse_stream_chunk, then flush: (reasoning, answer, every output)."""
    outs = [parser.parse_stream_chunk(p) for p in pieces] + [parser.flush()]
    return "".join(r for r, _ in outs), "".join(a for _, a in outs), outs


def same_split(name: str, pieces: list[str], stream_reasoning: bool = True) -> tuple[str | None, str]:
    """The whole text's split, after checking that the stream of `pieces` gives it too."""
    whole = ReasoningParser(name).parse_non_stream("".join(pieces))
    reasoning, answer, _ = stream(ReasoningParser(name, stream_reasoning), pieces)
    assert (reasoning or None, answer) == whole, pieces
    return whole


def cuts(text: str) -> list[list[str]]:
    """Every way to cut text in two, and one piece per character."""
    return [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]


def test_the_documented_model_types_are_accepted_and_others_refused_by_name():
    assert set(REASONING_PARSERS) == set(FORCED) | set(OPENED)
    with pytest.raises(ValueError, match="deepseek-r1") as e:
        ReasoningParser("deepseek_r1")
    assert "qwen3-thinking" in str(e.value) and "'deepseek_r1'" in str(e.value)


@pytest.mark.parametrize("name", REASONING_PARSERS)
def test_a_closed_block_is_split_and_stripped(name):
    start, end = TAGS[name]
    text = f"\n{start}\n  Two plus two.\nFour. \n{end}\n\n The answer is 4.\n"
    assert ReasoningParser(name).parse_non_stream(text) == ("Two plus two.\nFour.", "The answer is 4.\n")
    for pieces in cuts(text):
        same_split(name, pieces)
        same_split(name, pieces, stream_reasoning=False)


@pytest.mark.parametrize("name", REASONING_PARSERS)
def test_without_an_opening_tag_only_forced_types_reason(name):
    _, end = TAGS[name]
    text = f"Let me see. {end} Paris."
    got = ReasoningParser(name).parse_non_stream(text)
    assert got == (("Let me see.", "Paris.") if name in FORCED else (None, text))
    plain = " Paris is the capital."
    got = ReasoningParser(name).parse_non_stream(plain)
    assert got == (("Paris is the capital.", "") if name in FORCED else (None, plain))
    for sample in (text, plain):
        for pieces in cuts(sample):
            same_split(name, pieces)


@pytest.mark.parametrize("name", REASONING_PARSERS)
def test_a_block_cut_short_is_all_reasoning(name):
    start, end = TAGS[name]
    for text in (f"{start}Thinking about it", f"{start}Thinking {end[:4]}"):
        assert ReasoningParser(name).parse_non_stream(text) == (text[len(start) :].strip(), "")
        for pieces in cuts(text):
            same_split(name, pieces)
            same_split(name, pieces, stream_reasoning=False)
    assert ReasoningParser(name).parse_non_stream(f"{start}{end}Hi") == (None, "Hi")  # empty: None


@pytest.mark.parametrize("name", ["deepseek-r1", "qwen3", "kimi"])
def test_a_partial_tag_is_never_given_out(name):
    start, end = TAGS[name]
    text = f"{start}abc{end}xyz"
    for pieces in cuts(text):
        _, _, outs = stream(ReasoningParser(name), pieces)
        for r, a in outs:
            assert not any(t[:k] in r + a for t in (start, end) for k in range(2, len(t) + 1)), (pieces, outs)


def test_reasoning_streams_as_it_comes_or_in_one_piece_at_its_end():
    p = ReasoningParser("qwen3")
    assert p.parse_stream_chunk("<think>") == ("", "")
    assert p.parse_stream_chunk("I think ") == ("I think", "")  # its trailing space waits
    assert p.parse_stream_chunk("so</") == (" so", "")  # "</" may begin the end tag
    assert p.parse_stream_chunk("b>.") == ("</b>.", "")
    assert p.parse_stream_chunk("</think> Yes") == ("", "Yes")
    assert p.parse_stream_chunk(" </think>") == ("", " </think>")  # in the answer, a tag is text
    assert p.flush() == ("", "")
    held = ReasoningParser("qwen3", stream_reasoning=False)
    assert [held.parse_stream_chunk(p) for p in ("<think>a ", "b", "</thi", "nk>c")] == [
        ("", ""),
        ("", ""),
        ("", ""),
        ("a b", "c"),
    ]
    cut_short = ReasoningParser("deepseek-r1", stream_reasoning=False)
    assert cut_short.parse_stream_chunk("still thinking ") == ("", "")
    assert cut_short.flush() == ("still thinking", "")


def test_glm45_reasoning_ends_at_a_tool_call_which_stays_in_the_answer():
    text = '<think>Need the weather. <tool_call>{"name": "w"}</tool_call>'
    assert ReasoningParser("glm45").parse_non_stream(text) == (
        "Need the weather.",
        '<tool_call>{"name": "w"}</tool_call>',
    )
    assert ReasoningParser("qwen3").parse_non_stream(text)[1] == ""  # qwen3: still reasoning
    for pieces in cuts(text):
        same_split("glm45", pieces)


def test_opened_types_look_for_the_tag_at_the_start_only():
    assert ReasoningParser("qwen3").parse_non_stream("Hi <think>x</think>y") == (None, "Hi <think>x</think>y")
    # forced: an opening tag at the start is dropped; later ones are reasoning text
    assert ReasoningParser("deepseek-r1").parse_non_stream("a<think>b</think>c") == ("a<think>b", "c")
    assert ReasoningParser("qwen3").parse_non_stream("   ") == (None, "   ")
    assert ReasoningParser("deepseek-r1").parse_non_stream("") == (None, "")
    assert stream(ReasoningParser("qwen3"), ["  ", "<thi"])[:2] == ("", "  <thi")


@settings(max_examples=300, deadline=None)
@given(
    name=st.sampled_from(REASONING_PARSERS),
    parts=st.lists(
        st.sampled_from(
            [
                "<think>",
                "</think>",
                "◁think▷",
                "◁/think▷",
                "<tool_call>",
                "<",
                "</",
                "</th",
                "◁",
                " ",
                "\n",
                "a",
                "bc",
                "<t",
                "think>",
                "ink>",
            ]
        ),
        max_size=12,
    ),  # fmt: skip
    sizes=st.lists(st.integers(1, 6), min_size=1, max_size=40),
    stream_reasoning=st.booleans(),
)
def test_any_stream_gives_the_whole_texts_split(name, parts, sizes, stream_reasoning):
    text = "".join(parts)
    pieces, at = [], 0
    for i in range(len(text)):
        size = sizes[i % len(sizes)]
        if at >= len(text):
            break
        pieces.append(text[at : at + size])
        at += size
    same_split(name, pieces, stream_reasoning)
