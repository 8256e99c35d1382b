"""The llguidance grammar backend on the default model's tokenizer: masks, accept, rollback, forced
tokens and errors (no model, no bus)."""

from __future__ import annotations

import json
import os
import random
import re

import pytest
import torch

pytest.importorskip("llguidance")

from services.scheduler.constrained.admission import backend_class  # noqa: E402
from services.scheduler.constrained.grammar import GrammarCache, GrammarError, GrammarSpec  # noqa: E402
from shared.model_config import ModelConfig  # noqa: E402
from shared.tokenizer import load_tokenizer  # noqa: E402


@pytest.fixture(scope="module", params=["llguidance", "xgrammar"])
def setup(request, model_folder):
    mc = ModelConfig.from_folder(model_folder)
    cls = backend_class(request.param)
    backend = cls(os.path.join(model_folder, "tokenizer.json"), mc.vocab_size, mc.eos_token_ids)
    return backend, load_tokenizer(model_folder), mc


def allowed(matcher, vocab):
    row = torch.zeros((vocab + 31) // 32, dtype=torch.int32)
    matcher.fill_bitmask(row)
    bits = (row.unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:vocab].nonzero().flatten().tolist()


def walk(compiled, vocab, eos, seed, limit=200):
    """Random allowed tokens until the grammar is done (or allows EOS and the coin says stop)."""
    rng, m, out = random.Random(seed), compiled.matcher(), []
    for _ in range(limit):
        if m.done:
            break
        ok = allowed(m, vocab)
        assert ok, "the mask allows nothing before the grammar is done"
        t = rng.choice(ok)
        if t in eos:
            break
        assert m.accept([t]), m.error
        out.append(t)
    return out


def test_regex_outputs_match(setup):
    backend, tok, mc = setup
    pattern = r"[0-9]{3}-[a-z]{2,4}"
    compiled = backend.compile(GrammarSpec("regex", pattern))
    for seed in range(5):
        text = tok.decode(walk(compiled, mc.vocab_size, mc.eos_token_ids, seed))
        assert re.fullmatch(pattern, text), text


def test_json_schema_outputs_parse_and_follow_it(setup):
    backend, tok, mc = setup
    props = {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}}
    schema = {"type": "object", "properties": props, "required": ["name", "age"]}
    schema["additionalProperties"] = False
    compiled = backend.compile(GrammarSpec("json_schema", json.dumps(schema)))
    for seed in range(5):
        obj = json.loads(tok.decode(walk(compiled, mc.vocab_size, mc.eos_token_ids, seed, limit=400)))
        assert set(obj) == {"name", "age"} and isinstance(obj["age"], int) and len(obj["name"]) <= 8


def test_ebnf_and_forced_tokens(setup):
    backend, tok, mc = setup
    compiled = backend.compile(GrammarSpec("ebnf", 'root ::= "The answer is " ("yes" | "no")'))
    m = compiled.matcher()
    forced = m.forced()
    assert tok.decode(forced).startswith("The answer")  # a forced run: jump-forward material
    text = tok.decode(walk(compiled, mc.vocab_size, mc.eos_token_ids, 0))
    assert text in ("The answer is yes", "The answer is no")


def test_rollback_restores_the_mask(setup):
    backend, tok, mc = setup
    m = backend.compile(GrammarSpec("regex", r"(ab|cd)+")).matcher()
    first = allowed(m, mc.vocab_size)
    t = tok.encode("ab", add_special_tokens=False)
    assert m.accept(t)
    assert allowed(m, mc.vocab_size) != first
    m.rollback(len(t))
    assert allowed(m, mc.vocab_size) == first


def test_a_disallowed_token_is_refused_with_a_reason(setup):
    backend, tok, mc = setup
    m = backend.compile(GrammarSpec("regex", r"[0-9]+")).matcher()
    assert not m.accept(tok.encode("x", add_special_tokens=False))
    assert m.error
    # all or nothing: "12" then "x" refused leaves the matcher where it was (it still takes "3")
    enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    assert not m.accept(enc("12") + enc("x"))
    assert m.accept(enc("3")), m.error


@pytest.mark.parametrize("spec", [GrammarSpec("regex", "(unclosed"), GrammarSpec("json_schema", "{not json"),
                                  GrammarSpec("json_schema", '{"type": "no such type"}'),
                                  GrammarSpec("ebnf", "root ::= (")])  # fmt: skip
def test_bad_grammars_raise_grammar_error(setup, spec):
    with pytest.raises(GrammarError):
        setup[0].compile(spec)


def test_cache_compiles_once_and_keeps_a_failure(setup):
    backend = setup[0]
    calls = []
    cache = GrammarCache(lambda spec: calls.append(spec) or backend.compile(spec))
    spec = GrammarSpec("regex", "a+")
    assert cache.get(spec, 10) is cache.get(spec, 10)
    bad = GrammarSpec("regex", "(")
    for _ in range(2):
        with pytest.raises(GrammarError):
            cache.get(bad, 10)
    assert calls.count(spec) == 1 and calls.count(bad) == 1
    with pytest.raises(GrammarError):
        cache.get(GrammarSpec("xml", "<a/>"), 10)
    cache.shutdown()


def test_cache_keeps_the_most_recently_used(setup):
    calls = []
    cache = GrammarCache(lambda spec: calls.append(spec) or setup[0].compile(spec), capacity=2)
    a, b, c = (GrammarSpec("regex", x) for x in ("a", "b", "c"))
    for spec in (a, b, a, c, a, b):  # c pushes out b (a was used after it), then b pushes out c
        cache.get(spec, 10)
    assert calls == [a, b, c, b]
    cache.shutdown()


def test_retokenize_gives_canonical_tokens_of_the_same_bytes(setup):
    backend, tok, _ = setup

    def enc(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    brace, forced = enc("{"), enc('"name')
    new = backend.retokenize(brace + forced)
    assert new == enc('{"name') != brace + forced
    assert tok.decode(new) == '{"name'
    assert backend.retokenize(enc("aé")) == enc("aé")
    half = tok.convert_tokens_to_ids("\u00c3")  # the byte-level token of the byte 0xC3 alone
    assert backend.retokenize(enc("a") + [half]) is None  # half a character


def test_batched_masks_equal_the_rows_one_by_one(setup):
    from services.scheduler.constrained.grammar import fill_bitmasks

    backend, tok, mc = setup
    specs = [GrammarSpec("regex", r"\d{3}-[a-z]+"), GrammarSpec("json_schema", '{"type": "integer"}'),
             GrammarSpec("ebnf", 'root ::= "yes" | "no"')]  # fmt: skip
    matchers = [backend.compile(s).matcher() for s in specs for _ in range(2)]
    assert matchers[0].accept(tok.encode("123", add_special_tokens=False))  # not all at their start
    words = (mc.vocab_size + 31) // 32
    batched = torch.zeros((len(matchers), words), dtype=torch.int32)
    fill_bitmasks(matchers, batched)
    for j, m in enumerate(matchers):
        row = torch.zeros(words, dtype=torch.int32)
        m.fill_bitmask(row)
        assert torch.equal(batched[j], row), j
    assert not torch.equal(batched[0], batched[1])
    rows = [7, 0, 5, 2, 6, 1]  # into given rows, every word written
    scattered = torch.full((8, words), -1, dtype=torch.int32)
    fill_bitmasks(matchers, scattered, rows)
    assert all(torch.equal(scattered[r], batched[j]) for j, r in enumerate(rows))


@pytest.mark.parametrize("gone", [2, 5])  # a row inside the draw's plan, or its last constrained one
def test_masks_filled_while_matchers_advance_equal_the_draws_own(setup, monkeypatch, gone):
    """GrammarMaskProcessor: rows reported ready one by one are filled in chunks on the worker thread
    (`begin` / `ready`), the rest at the draw, a ready row of a request that left is ignored; the
    masked logits equal those of a draw that fills every row itself."""
    from types import SimpleNamespace

    import services.scheduler.sampling.grammar_mask as gm

    monkeypatch.setattr(gm, "CHUNK", 2)
    backend, tok, mc = setup
    specs = [GrammarSpec("regex", r"\d{3}-[a-z]+"), GrammarSpec("json_schema", '{"type": "integer"}')]

    def reqs():
        out = []
        for i in range(7):  # the last without a grammar
            m = backend.compile(specs[i % 2]).matcher() if i != 6 else None
            out.append(SimpleNamespace(uid=i, matcher=m, grammar=m and specs[i % 2], pending=1))
        out[0].matcher.accept(tok.encode("12", add_special_tokens=False))
        return out

    def masked(plan: bool) -> torch.Tensor:
        p = gm.GrammarMaskProcessor(mc.vocab_size, torch.device("cpu"))
        batch = reqs()
        for r in batch:
            p.admit(r)
        logits = torch.randn(len(batch), mc.vocab_size, generator=torch.Generator().manual_seed(0))
        if plan:
            p.begin(batch)
            for r in batch[:5]:  # rows 5 and 6 never reported: filled by apply
                p.ready(r)
            p.ready(SimpleNamespace(uid=99, matcher=batch[0].matcher))  # not in this draw
        kept = [r for r in batch if r.uid != gone]  # a request that finished meanwhile: dropped
        logits = logits[[r.uid for r in kept]]
        p.apply(logits, kept, torch.zeros(len(kept), 1, dtype=torch.int64))
        return logits

    planned, plain = masked(True), masked(False)
    assert torch.equal(planned, plain)
    free = [u for u in range(7) if u != gone].index(6)
    assert torch.isinf(plain[0]).sum() > 0 and not torch.isinf(plain[free]).any()  # the free request


@pytest.mark.parametrize("name", ["llguidance", "xgrammar"])
def test_a_byte_level_vocabulary_saved_with_a_decoder_sequence_is_read_as_bytes(model_folder, tmp_path, name):
    """transformers 5.17 saves the default model's GGUF tokenizer with a decoder Sequence around
    ByteLevel; read as is, llguidance takes "\u0120" for two bytes, not a space. The backend reads it
    as the byte-level vocabulary it is: a space is allowed where the grammar wants one."""
    import llguidance

    data = json.loads(open(os.path.join(model_folder, "tokenizer.json"), encoding="utf-8").read())
    data["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "ByteFallback"}, {"type": "Fuse"},
        {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "}, data["decoder"]]}  # fmt: skip
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    raw = llguidance.LLTokenizer(str(path))
    assert raw.decode_bytes(raw.tokenize_bytes(b"a b")) != b"a b"  # the misreading this guards against
    mc = ModelConfig.from_folder(model_folder)
    backend = backend_class(name)(str(path), mc.vocab_size, mc.eos_token_ids)
    tok = load_tokenizer(model_folder)
    space = tok.encode(" ", add_special_tokens=False)
    m = backend.compile(GrammarSpec("regex", r"\(\d{3}\) \d")).matcher()
    assert m.accept(tok.encode("(100)", add_special_tokens=False)) and m.accept(space), m.error


def test_regex_classes_are_ascii(setup):
    """\\d, \\w and \\s mean [0-9], [0-9a-zA-Z_] and ASCII blanks, as in xgrammar and JavaScript: a
    Unicode digit (here Arabic-Indic) is refused."""
    backend, tok, _ = setup
    m = backend.compile(GrammarSpec("regex", r"\d\w\s")).matcher()
    assert not m.accept(tok.encode("\u0663", add_special_tokens=False))
    m = backend.compile(GrammarSpec("regex", r"\d\w\s")).matcher()
    assert m.accept(tok.encode("7_ ", add_special_tokens=False)) and m.done, m.error


def test_json_strings_refuse_raw_control_characters(setup):
    """JSON strings take control characters only escaped (json.loads refuses them raw), with or
    without maxLength (xgrammar's grammar for maxLength strings allowed them: patched)."""
    backend, tok, _ = setup
    for string in ({"type": "string", "maxLength": 8}, {"type": "string"}):
        schema = {"type": "object", "properties": {"a": string}, "required": ["a"]}
        m = backend.compile(GrammarSpec("json_schema", json.dumps(schema))).matcher()
        starts = [tok.encode(s, add_special_tokens=False) for s in ('{"a":"x', '{"a": "x')]  # separators
        assert any(m.accept(ids) for ids in starts), m.error  # the separators differ by backend
        assert not m.accept(tok.encode("\x10", add_special_tokens=False))


def test_batched_accepts_equal_one_by_one(setup, monkeypatch):
    """accept_sequences (batched and, for xgrammar, split over threads) takes and refuses what each
    matcher's own accept does, all of a sequence or none: a refused matcher is unchanged and says why."""
    import services.scheduler.constrained.xgrammar_backend as xb
    from services.scheduler.constrained.grammar import accept_sequences

    monkeypatch.setattr(xb, "_ACCEPT_THREADS", 2)
    monkeypatch.setattr(xb, "_ACCEPT_TOKENS", 2)
    backend, tok, mc = setup
    compiled = backend.compile(GrammarSpec("regex", r"\d{3}-[a-z]+"))
    digit, letter = tok.encode("7", add_special_tokens=False)[0], tok.encode("x", add_special_tokens=False)[0]
    seqs = [[digit], [letter], [digit, digit], [digit, letter], [digit, digit, digit, digit], [], [digit]]
    batched, single = [compiled.matcher() for _ in seqs], [compiled.matcher() for _ in seqs]
    ok = accept_sequences(batched, seqs)
    assert ok == [m.accept(s) for m, s in zip(single, seqs, strict=True)]
    assert ok == [True, False, True, False, False, True, True]
    for m, s, good in zip(batched, seqs, ok, strict=True):
        assert bool(m.error) != good
        taken = len(s) if good else 0  # a refused one is where it started
        assert m.accept([digit] * (3 - taken))
        assert m.accept([tok.encode("-", add_special_tokens=False)[0]])


def test_batched_forced_done_and_retokenized_equal_one_by_one(setup):
    """forced_tokens, done_flags and retokenize_all give what each matcher's forced(), done and
    retokenize() do."""
    from services.scheduler.constrained.grammar import done_flags, forced_tokens

    backend, tok, mc = setup
    schema = {"type": "object", "properties": {"ab": {"type": "integer"}, "cd": {"type": "string"}},
              "required": ["ab", "cd"]}  # fmt: skip
    compiled = backend.compile(GrammarSpec("json_schema", json.dumps(schema)))
    texts = ["", "{", '{"a', '{"ab": 12', '{"ab":12', '{"ab": 12, "cd": "x"', '{"ab":12,"cd":"x"']
    ms = [compiled.matcher() for _ in texts]
    for m, text in zip(ms, texts, strict=True):
        for t in tok.encode(text, add_special_tokens=False):  # as far as the backend's separators go
            if not m.accept([t]):
                break
    found = forced_tokens(ms)
    assert found == [m.forced() for m in ms] and any(found)
    ends = [compiled.matcher()]
    for text in ('{"ab": 1, "cd": "x"}', '{"ab":1,"cd":"x"}'):  # whichever separators the backend writes
        m = compiled.matcher()
        if all(m.accept([t]) for t in tok.encode(text, add_special_tokens=False)):
            ends.append(m)
            break
    assert len(ends) == 2
    assert done_flags(ms + ends) == [m.done for m in ms + ends] == [False] * (len(ms) + 1) + [True]
    seqs = [tok.encode(t, add_special_tokens=False) for t in ('{"', 'a "b', "naïve", "")]
    seqs.append(
        tok.encode("\U0001f99c", add_special_tokens=False)[:1]
    )  # part of a character: not retokenized
    assert backend.retokenize_all(seqs) == [backend.retokenize(s) for s in seqs]
    assert backend.retokenize_all(seqs)[-1] is None


ENDLESS = [GrammarSpec("ebnf", 'root ::= "a" root'), GrammarSpec("ebnf", 'root ::= "(" root ")"'),
           GrammarSpec("json_schema", json.dumps({"type": "object", "properties": {"a": {"$ref": "#"}},
                                                  "required": ["a"], "additionalProperties": False})),
           GrammarSpec("json_schema", json.dumps({"type": "array", "items": {"$ref": "#"}, "minItems": 1})),
           GrammarSpec("ebnf", 'root ::= "a" | "b" x\nx ::= "c" x'),
           GrammarSpec("regex", r"[^\s\S]")]  # fmt: skip


@pytest.mark.parametrize("spec", ENDLESS, ids=lambda s: s.text[:24])
def test_a_grammar_that_accepts_no_finite_string_fails_to_compile(setup, spec):
    """Its jump-forward string is endless (xgrammar allocated until the process was killed; llguidance
    gave up with a 500 and its parser's dump); an empty regex left no token to sample (a 500): a 400
    at compile, before any matcher runs."""
    with pytest.raises(GrammarError, match="never ends|accepts no|admits no finite") as e:
        setup[0].compile(spec)
    assert e.value.status_code == 400


def special_ids(model_folder) -> list[int]:
    with open(os.path.join(model_folder, "tokenizer.json"), encoding="utf-8") as f:
        return [t["id"] for t in json.load(f)["added_tokens"] if t["special"]]


def test_special_tokens_are_never_text(setup, model_folder):
    """<|endoftext|>, <|im_start|>, <|im_end|> ... never come as text (xgrammar took them inside JSON
    strings and for a regex's characters; the end token counted as the ten characters of its name),
    and the end token comes only where the grammar may end."""
    backend, tok, mc = setup
    special, eos = special_ids(model_folder), mc.eos_token_ids[0]
    assert eos in special and len(special) > 3
    enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    for spec, start in [(GrammarSpec("regex", "[^0-9]{12,40}"), "\n\n"),
                        (GrammarSpec("regex", ".{13}"), "ab"),
                        (GrammarSpec("json_schema", '{"type": "string"}'), '"x')]:  # fmt: skip
        m = backend.compile(spec).matcher()
        assert m.accept(enc(start)), m.error
        assert not set(allowed(m, mc.vocab_size)) & set(special), spec
        assert not m.accept([eos])
    m = backend.compile(GrammarSpec("regex", "[^0-9]{2,40}")).matcher()
    assert m.accept(enc("\n\n")) and eos in allowed(m, mc.vocab_size) and m.accept([eos]), m.error


@pytest.mark.parametrize(("pattern", "good", "bad"), [
    (r"x.{5}y", "x1234 y", "x\n\nThey"),  # xgrammar's "." took a newline
    (r"a\x00b", "a\x00b", "a\x0b"),  # xgrammar read \x00b as U+000B
    (r"a\sb", "a\tb", "a\u2003b"),  # xgrammar's \s took Unicode blanks
    (r"a[^\s]b", "a\u2003b", "a b"),
    (r"(?P<n>\d{2})-x", "12-x", "1-x"),  # xgrammar refused named groups
])  # fmt: skip
def test_regexes_mean_what_python_re_means(setup, pattern, good, bad):
    backend, tok, _ = setup
    assert re.fullmatch(pattern, good, re.ASCII) and not re.fullmatch(pattern, bad, re.ASCII)
    m = backend.compile(GrammarSpec("regex", pattern)).matcher()
    assert m.accept(tok.encode(good, add_special_tokens=False)) and m.done, m.error
    m = backend.compile(GrammarSpec("regex", pattern)).matcher()
    assert not m.accept(tok.encode(bad, add_special_tokens=False)) or not m.done


def test_json_schema_patterns_mean_what_python_re_means(setup):
    backend, tok, _ = setup
    schema = {"type": "string", "pattern": r"^a\sb$"}
    m = backend.compile(GrammarSpec("json_schema", json.dumps(schema))).matcher()
    assert not m.accept(tok.encode('"a\u2003b"', add_special_tokens=False))
    assert m.accept(tok.encode('"a b"', add_special_tokens=False)) and m.done, m.error


def test_json_schema_true_is_any_value_and_false_a_400(setup):
    backend, tok, _ = setup
    m = backend.compile(GrammarSpec("json_schema", "true")).matcher()
    assert m.accept(tok.encode("[1]", add_special_tokens=False)) and m.done, m.error
    with pytest.raises(GrammarError, match="the schema false admits no value"):
        backend.compile(GrammarSpec("json_schema", "false"))


def test_a_multi_line_alternation_compiles(setup):
    backend, tok, _ = setup
    m = backend.compile(GrammarSpec("ebnf", 'root ::=\n    "a"\n    | "b"\n    | "c"')).matcher()
    assert m.accept(tok.encode("b", add_special_tokens=False)) and m.done, m.error


@pytest.fixture(scope="module")
def xgrammar_setup(model_folder):
    mc = ModelConfig.from_folder(model_folder)
    backend = backend_class("xgrammar")(
        os.path.join(model_folder, "tokenizer.json"), mc.vocab_size, mc.eos_token_ids
    )
    return backend, load_tokenizer(model_folder), mc


def test_xgrammar_honours_schema_keywords_it_used_to_ignore(xgrammar_setup):
    """allOf, keywords beside $ref, and siblings of anyOf were silently dropped: every output now
    follows them (they are merged into one schema xgrammar honours)."""
    backend, tok, mc = xgrammar_setup
    schema = {"$defs": {"s": {"type": "string"}, "n": {"type": "integer"}}, "type": "object",
              "properties": {"a": {"$ref": "#/$defs/s", "maxLength": 3},
                             "b": {"$ref": "#/$defs/n", "minimum": 3, "maximum": 9},
                             "c": {"anyOf": [{"type": "string", "maxLength": 6}, {"type": "null"}],
                                   "minLength": 2}},
              "required": ["a", "b", "c"],
              "allOf": [{"properties": {"d": {"type": "boolean"}}, "required": ["d"]}]}  # fmt: skip
    compiled = backend.compile(GrammarSpec("json_schema", json.dumps(schema)))
    for seed in range(6):
        obj = json.loads(tok.decode(walk(compiled, mc.vocab_size, mc.eos_token_ids, seed, limit=400)))
        assert len(obj["a"]) <= 3 and 3 <= obj["b"] <= 9 and (obj["c"] is None or len(obj["c"]) >= 2), obj
        assert isinstance(obj["d"], bool), obj


@pytest.mark.parametrize(("schema", "where"), [
    ({"type": "object", "properties": {"s": {"type": "string", "pattern": "^a+$", "maxLength": 3}}},
     "maxLength beside pattern at /properties/s"),
    ({"type": "number", "multipleOf": 0.5}, "multipleOf at /"),
    ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": False},
                {"properties": {"b": {"type": "integer"}}}]}, "allOf at /"),
])  # fmt: skip
def test_xgrammar_refuses_schema_keywords_it_cannot_honour(xgrammar_setup, schema, where):
    with pytest.raises(
        GrammarError, match=re.escape(f"json_schema cannot be used: {where} is not supported")
    ):
        xgrammar_setup[0].compile(GrammarSpec("json_schema", json.dumps(schema)))


def test_xgrammar_messages_are_its_own_without_the_log_prefix(xgrammar_setup):
    for spec in (
        GrammarSpec("regex", "(?i)hello"),
        GrammarSpec("regex", "abc\\"),
        GrammarSpec("ebnf", 'root: "a"'),
    ):
        with pytest.raises(GrammarError) as e:
            xgrammar_setup[0].compile(spec)
        message = str(e.value)
        assert message.startswith(f"sampling_params.{spec.kind} is invalid: ") and ".cc:" not in message, (
            message
        )
        assert not re.search(r"\[\d\d:\d\d:\d\d\]", message) and "\n" not in message, message


def test_llguidance_giving_up_on_an_endless_grammar_is_a_short_400(model_folder):
    """A Lark grammar that never ends gets past the finite check (it reads EBNF): llguidance's parser
    gives up on its forced string, and the refusal says so in a line, as the grammar's fault."""
    mc = ModelConfig.from_folder(model_folder)
    backend = backend_class("llguidance")(os.path.join(model_folder, "tokenizer.json"), mc.vocab_size,
                                          mc.eos_token_ids)  # fmt: skip
    m = backend.compile(GrammarSpec("ebnf", '%llguidance {}\nstart: "a" start')).matcher()
    assert not m.accept(m.forced())
    assert m.error_status == 400 and "accepts no finite string" in m.error and "<state>" not in m.error, (
        m.error
    )


def test_a_vocabulary_padded_past_the_tokenizer_is_never_allowed(setup, model_folder):
    """A model whose vocabulary is padded past its tokenizer's tokens (a Llama-3-8B config with this
    tokenizer: 128,256 ids for 49,152 tokens). xgrammar's grammar stops at the tokenizer (its masks are
    that wide: each padding id would be a special token it looks up on every accept); either way the
    drawn logits of the padding ids are -inf and the rest are masked as without the padding."""
    from types import SimpleNamespace

    from services.scheduler.sampling.grammar_mask import GrammarMaskProcessor

    _, _, mc = setup
    padded = mc.vocab_size + 1000
    cls = type(setup[0])
    wide = cls(os.path.join(model_folder, "tokenizer.json"), padded, mc.eos_token_ids)
    spec = GrammarSpec("regex", r"\d{2}[a-z]+")
    narrow_m, wide_m = setup[0].compile(spec).matcher(), wide.compile(spec).matcher()
    if cls.__name__.startswith("XGrammar"):
        assert wide_m.mask_words == narrow_m.mask_words == (mc.vocab_size + 31) // 32
    p = GrammarMaskProcessor(padded, torch.device("cpu"))
    req = SimpleNamespace(uid=0, matcher=wide_m, grammar=spec, pending=0)
    p.admit(req)
    logits = torch.zeros(1, padded)
    p.apply(logits, [req], torch.zeros(1, 1, dtype=torch.int64))
    assert torch.isinf(logits[0, mc.vocab_size :]).all()
    assert (~torch.isinf(logits[0])).nonzero().flatten().tolist() == allowed(narrow_m, mc.vocab_size)
