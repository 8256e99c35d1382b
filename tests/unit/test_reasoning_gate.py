"""ReasoningGate on both grammar backends and the default model's tokenizer: a grammar that waits for
the end of the reasoning allows every token until the output's bytes hold the end tag, then applies
as from the output's start (no model, no bus)."""

from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("llguidance")

from services.scheduler.constrained.admission import backend_class  # noqa: E402
from services.scheduler.constrained.grammar import (  # noqa: E402
    GrammarSpec,
    accept_sequences,
    done_flags,
    fill_bitmasks,
    forced_tokens,
)
from services.scheduler.constrained.reasoning_gate import ReasoningGate, TagGuard  # noqa: E402
from shared.model_config import ModelConfig  # noqa: E402
from shared.tokenizer import load_tokenizer  # noqa: E402

SCHEMA = {"type": "object", "properties": {"ab": {"type": "integer"}}, "required": ["ab"]}


@pytest.fixture(scope="module", params=["llguidance", "xgrammar"])
def setup(request, model_folder):
    mc = ModelConfig.from_folder(model_folder)
    cls = backend_class(request.param)
    backend = cls(os.path.join(model_folder, "tokenizer.json"), mc.vocab_size, mc.eos_token_ids)
    compiled = backend.compile(GrammarSpec("json_schema", json.dumps(SCHEMA)))
    tok = load_tokenizer(model_folder)
    return backend, compiled, lambda text: tok.encode(text, add_special_tokens=False), mc.vocab_size


_GUARDS: dict = {}


def gate(setup, tag: str = "</think>"):
    backend, compiled, _, _ = setup
    m = compiled.matcher()
    key = (id(backend), tag)
    if key not in _GUARDS:
        _GUARDS[key] = TagGuard(tag, backend.vocab_bytes(), m.mask_words)
    return ReasoningGate(m, _GUARDS[key], backend.decode_bytes)


def allows(row: torch.Tensor, t: int) -> bool:
    return bool((int(row[t // 32]) >> (t % 32)) & 1)


def mask(m, vocab):
    row = torch.zeros((vocab + 31) // 32, dtype=torch.int32)
    m.fill_bitmask(row)
    return row


def test_while_thinking_every_token_is_allowed_and_nothing_forced(setup):
    backend, compiled, encode, vocab = setup
    g = gate(setup)
    assert g.thinking and (mask(g, vocab) == -1).all()
    assert g.forced() == [] and not g.done and g.undoable == 0
    assert g.accept(encode("Let me think: } is not JSON, nor is <think>"))
    assert g.thinking and (mask(g, vocab) == -1).all()
    with pytest.raises(ValueError, match="cannot roll back"):
        g.rollback(1)


@pytest.mark.parametrize(
    "text",
    ["hm</think>", "</think>", " </think>", "ok</think>", "Yes </think>", "Yes, I think so. So </think>"],
)
def test_after_the_tag_the_grammar_applies_from_its_start(setup, text):
    """Token by token, however the tag is spelled in tokens."""
    backend, compiled, encode, vocab = setup
    g, fresh = gate(setup), compiled.matcher()
    for t in encode(text):
        assert g.accept([t])
    assert not g.thinking and g.undoable == 0
    assert torch.equal(mask(g, vocab), mask(fresh, vocab))
    assert g.forced() == fresh.forced()
    bad = encode("}")
    assert not g.accept(bad) and g.error
    body = next(b for b in (encode('{"ab": 12}'), encode('{"ab":12}')) if compiled.matcher().accept(b))
    assert g.accept(body) and fresh.accept(body)  # (whichever separators the backend writes)
    assert g.done == fresh.done and g.undoable == len(body)


def test_one_accept_across_the_tag_is_all_or_nothing(setup):
    backend, compiled, encode, vocab = setup
    g = gate(setup)
    assert not g.accept(encode("hm</think>") + encode("}"))  # the answer's part refused: none taken
    assert g.thinking and g.error
    answer = encode('{"ab"')
    assert g.accept(encode("hm</think>") + answer)
    assert not g.thinking and g.undoable == len(answer)
    g.rollback(len(answer))  # back to the grammar's start, never into the reasoning
    assert torch.equal(mask(g, vocab), mask(compiled.matcher(), vocab))
    with pytest.raises(ValueError):
        g.rollback(1)


def test_batched_calls_over_gates_and_plain_matchers_equal_one_by_one(setup):
    backend, compiled, encode, vocab = setup
    thinking, open_, plain = gate(setup), gate(setup), compiled.matcher()
    assert open_.accept(encode("x</think>{"))
    assert plain.accept(encode("{"))
    ms = [thinking, open_, plain]
    out = torch.zeros((3, (vocab + 31) // 32), dtype=torch.int32)
    fill_bitmasks(ms, out)
    assert all(torch.equal(out[j], mask(m, vocab)) for j, m in enumerate(ms))
    assert (out[0] == -1).all() and torch.equal(out[1], out[2])
    assert forced_tokens(ms) == [m.forced() for m in ms] and forced_tokens(ms)[0] == []
    assert done_flags(ms) == [False, False, False]
    assert accept_sequences(ms, [encode("}"), encode("}"), encode('"ab"')]) == [True, False, True]
    key = encode('"ab"')
    assert accept_sequences([open_], [key]) == [True] and open_.undoable == 1 + len(key)  # counted
    open_.rollback(len(key))
    assert (
        thinking.thinking
        and open_.undoable == 1
        and (plain.accept(encode(": 1}")) or plain.accept(encode(":1}")))
    )
    assert plain.done


@pytest.mark.parametrize("tag", ["</think>", "\u25c1/think\u25b7"])  # kimi's: 12 bytes in few tokens
def test_the_tag_is_found_after_any_text(setup, tag):
    """The bytes kept between tokens are the last len(tag) - 1 of the output, however few came before."""
    backend, compiled, encode, vocab = setup
    for before in ("The tag ", "Yes ", "a", "", "Hm, so the answer is: "):
        g = gate(setup, tag)
        for t in encode(before + tag):
            assert g.accept([t])
        assert not g.thinking, before


def test_while_thinking_no_token_ends_the_tag_with_bytes_the_grammar_would_not_see(setup):
    """`>"` after `</think` would put a quote before the grammar's answer: masked; `>` is not."""
    backend, compiled, encode, vocab = setup
    table = backend.vocab_bytes()
    ids = {b: t for t, b in enumerate(table) if b in (b">", b'>"', b"</", b"think")}
    if b'>"' not in ids:
        pytest.skip('no `>"` token in this vocabulary')
    g = gate(setup)
    row = mask(g, vocab)
    assert allows(row, ids[b'>"']) and allows(row, ids[b">"])  # no tag begun: both fine
    assert g.accept([ids[b"</"], ids[b"think"]])
    row = mask(g, vocab)
    assert not allows(row, ids[b'>"']) and allows(row, ids[b">"])
    assert g.accept([ids[b">"]]) and not g.thinking


@pytest.mark.parametrize("name", ["llguidance", "xgrammar"])
def test_ids_of_a_padded_vocabulary_are_never_allowed_while_waiting(model_folder, name):
    mc = ModelConfig.from_folder(model_folder)
    padded = mc.vocab_size + 64
    backend = backend_class(name)(os.path.join(model_folder, "tokenizer.json"), padded, mc.eos_token_ids)
    compiled = backend.compile(GrammarSpec("json_schema", json.dumps(SCHEMA)))
    m = compiled.matcher()
    guard = TagGuard("</think>", backend.vocab_bytes(), m.mask_words)
    row = guard.rows[0]
    assert allows(row, mc.vocab_size - 1)
    assert not any(allows(row, t) for t in range(mc.vocab_size, min(padded, 32 * m.mask_words)))


def test_the_scheduler_takes_only_the_parsers_end_tags():
    from services.scheduler.request import check_request
    from shared.messages import GenerateReq
    from shared.reasoning_parser import REASONING_ENDS
    from shared.sampling_params import SamplingParams

    def msg(end: str) -> GenerateReq:
        return GenerateReq(
            rid="r", input_ids=[1, 2], sampling=SamplingParams(), out_subject="x", reasoning_end=end
        )

    assert all(check_request(msg(end), 100, 64, 64) is None for end in ["", *REASONING_ENDS])
    why = check_request(msg("x" * 100_000), 100, 64, 64)
    assert why is not None and why.startswith("reasoning_end must be one of") and "</think>" in why
