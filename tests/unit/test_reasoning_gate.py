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
from services.scheduler.constrained.reasoning_gate import ReasoningGate  # noqa: E402
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


def gate(setup):
    backend, compiled, _, _ = setup
    return ReasoningGate(compiled.matcher(), "</think>", backend.decode_bytes)


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


@pytest.mark.parametrize("text", ["hm</think>", "</think>", " </think>", "ok</think>"])
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
