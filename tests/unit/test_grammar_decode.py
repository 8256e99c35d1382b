"""GrammarDecode.advance_all on random walks (benchmarks/grammar_decode.py, small): rows that take
random allowed tokens, with and without jump-forward, all end as valid JSON of the schema (no model,
no bus)."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("xgrammar")

from benchmarks.grammar_decode import run  # noqa: E402
from services.scheduler.constrained.xgrammar_backend import XGrammarBackend  # noqa: E402
from shared.model_config import ModelConfig  # noqa: E402


@pytest.mark.parametrize("jump_forward", [False, True])
def test_random_walks_end_as_valid_json(model_folder, jump_forward):
    vocab = ModelConfig.from_folder(model_folder).vocab_size
    backend = XGrammarBackend(os.path.join(model_folder, "tokenizer.json"), vocab, (0,))
    s = run(backend, vocab, batch=6, steps=400, jump_forward=jump_forward, seed=3)
    assert s["finished"] == s["valid"] == 6, s
    assert s["request_failures"] == 0
    assert (s["jump_forward_steps"] > 0) == jump_forward
