"""The scheduler's grammar compiles in worker processes (services/scheduler/constrained/admission.py):
a compile past `grammar_compile_timeout` ends its request and is really stopped, the next grammar
compiles, and the step loop's thread is not held meanwhile; jump-forward over a long forced repeat
stays cheap with xgrammar (xgrammar_backend.py). The default model's tokenizer, no model, no bus."""

from __future__ import annotations

import json
import os
import random
import time
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("llguidance")

from services.scheduler.constrained.admission import GrammarAdmission, backend_class  # noqa: E402
from services.scheduler.constrained.grammar import GrammarError, GrammarSpec  # noqa: E402
from services.scheduler.constrained.xgrammar_backend import bounded_repeats  # noqa: E402
from shared.model_config import ModelConfig  # noqa: E402


def admission(model_folder: str, backend: str, timeout_s: float) -> GrammarAdmission:
    config = SimpleNamespace(grammar_compile_timeout=timeout_s, grammar_backend=backend, tokenizer_path=None)
    runner = SimpleNamespace(model_config=ModelConfig.from_folder(model_folder), model_folder=model_folder)
    return GrammarAdmission(config, runner)  # type: ignore[arg-type]


def compile_now(adm: GrammarAdmission, kind: str, text: str):
    return adm._grammars().submit(GrammarSpec(kind, text)).result(timeout=300)


def classes(n: int) -> str:
    """A regex of n distinct character classes in a row: xgrammar's compile grows with each (~13 s for
    40,000 here), llguidance's does not."""
    r = random.Random(0)
    return "".join(f"[{c if c.isalnum() else 'a'}-~]" for c in (chr(r.randrange(48, 120)) for _ in range(n)))


def test_a_compile_past_the_timeout_ends_its_request_and_the_next_grammar_compiles(model_folder):
    pytest.importorskip("xgrammar")
    adm = admission(model_folder, "xgrammar", timeout_s=1.0)
    try:
        adm.backend()  # started, workers included: the compile's own timeout runs from here
        t0 = time.monotonic()
        with pytest.raises(GrammarError, match="compiling the regex took longer than 1 s; simplify it") as e:
            compile_now(adm, "regex", classes(40_000))
        assert e.value.status_code == 400 and time.monotonic() - t0 < 60
        assert adm._sandbox is not None and adm._sandbox.kills == 1  # stopped, not left running
        m = compile_now(adm, "regex", r"\d{3}").matcher()
        assert m.accept(adm.retokenizer.encode("123")) and m.done  # type: ignore[attr-defined]
    finally:
        adm.shutdown()


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_grammars_compile_through_the_workers_and_refuse_as_before(model_folder, backend):
    pytest.importorskip(backend)
    adm = admission(model_folder, backend, timeout_s=60.0)
    try:
        schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
        m = compile_now(adm, "json_schema", json.dumps(schema)).matcher()
        row = torch.zeros(m.mask_words, dtype=torch.int32)
        m.fill_bitmask(row)
        assert int(row.count_nonzero()) > 0
        with pytest.raises(GrammarError, match="never ends") as e:
            compile_now(adm, "ebnf", 'root ::= "a" root')
        assert e.value.status_code == 400  # the worker's GrammarError comes back as it was
        doubled = "root ::= r1 r1\n" + "\n".join(f"r{i} ::= r{i + 1} r{i + 1}" for i in range(1, 40))
        with pytest.raises(GrammarError, match="a part of it needs over 10"):
            compile_now(adm, "ebnf", doubled + '\nr40 ::= "a"')
    finally:
        adm.shutdown()


def test_a_json_array_with_many_forced_items_jumps_forward_at_once_with_xgrammar(model_folder):
    """minItems over constant items: xgrammar's forced string walked `x{m,}` in time quadratic in m
    (26 s for 10,000, on the step loop); given as `x{m,m} x*` it takes milliseconds."""
    pytest.importorskip("xgrammar")
    mc = ModelConfig.from_folder(model_folder)
    backend = backend_class("xgrammar")(
        os.path.join(model_folder, "tokenizer.json"), mc.vocab_size, mc.eos_token_ids
    )
    schema = {"type": "array", "items": {"const": 1}, "minItems": 30_000}
    m = backend.compile(GrammarSpec("json_schema", json.dumps(schema))).matcher()
    t0 = time.monotonic()
    forced = m.forced()
    assert time.monotonic() - t0 < 30
    assert backend.decode_bytes(forced) == b"[" + b", ".join([b"1"] * 30_000)
    assert m.accept(forced) and not m.done
    assert m.accept(backend.encode("]")) and m.done


def test_only_repeats_of_one_string_are_rewritten():
    text = "\n".join([
        'root ::= (("[" a b{40, -1} c{40, -1} "x"{20, -1} d{3, -1} "]"))',
        'a ::= (("1"))', 'b ::= ((", " a))', "c ::= (([a-z]))", 'd ::= (("q"))',
    ])  # fmt: skip
    out = bounded_repeats(text)
    assert 'b{40, 40} b* c{40, -1} "x"{20, 20} "x"* d{3, -1}' in out
    assert bounded_repeats('root ::= (("y{40, -1}"))') == 'root ::= (("y{40, -1}"))'  # inside a literal
