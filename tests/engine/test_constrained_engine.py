"""Constrained decoding through the engine on the default model: regex, JSON schema and EBNF outputs
follow their grammar, greedy and sampled, mixed with unconstrained requests in one batch; a grammar
that does not compile ends only its own request with a 400."""

from __future__ import annotations

import json
import re
import threading
import time

import pytest
from bus_probe import BusProbe

from shared.finish import as_dict
from shared.messages import GenerateReq
from shared.sampling_params import SamplingParams

pytest.importorskip("llguidance")

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
          "age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name", "age"],
          "additionalProperties": False}  # fmt: skip
PHONE = r"\(\d{3}\) \d{3}-\d{4}"


def test_grammars_hold_in_a_mixed_batch(engine):
    prompts = ["Call me at", "A person as JSON:", "Is the sky blue? Answer:", "Once upon a time"]
    params = [
        {"temperature": 0, "max_new_tokens": 24, "regex": PHONE},
        {"temperature": 0.9, "max_new_tokens": 64, "json_schema": json.dumps(SCHEMA), "sampling_seed": 1},
        {"temperature": 0, "max_new_tokens": 8, "ebnf": 'root ::= "yes" | "no"'},
        {"temperature": 0, "max_new_tokens": 8},
    ]
    phone, person, answer, free = engine.generate(prompts, params)
    assert re.fullmatch(PHONE, phone["text"]), phone["text"]
    obj = json.loads(person["text"])
    assert set(obj) == {"name", "age"} and 0 <= obj["age"] <= 120 and len(obj["name"]) <= 10
    assert answer["text"] in ("yes", "no")
    for o in (phone, person, answer):
        assert o["meta_info"]["finish_reason"]["type"] == "stop"
    assert free["meta_info"]["finish_reason"] == {"type": "length", "length": 8}


def test_a_bad_grammar_is_a_400_and_ends_only_its_request(engine):
    with pytest.raises(ValueError, match=r"sampling_params.regex is invalid: .*unclosed group"):
        engine.generate("x", {"max_new_tokens": 4, "regex": "(unclosed"})  # the gateway's check
    # straight to the scheduler (the gateway skipped): it fails to compile there, alone
    bad = GenerateReq(rid="bad-grammar", input_ids=[1, 2], out_subject="sglbus.out.grammar-test",
                      sampling=SamplingParams(max_new_tokens=4, ebnf="root ::= missing"))  # fmt: skip
    with BusProbe(engine, bad.out_subject) as probe:
        probe.send(bad)
        good = engine.generate("y", {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True})
        out = probe.final()
    assert good["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    reason = as_dict(out.finish)
    assert reason["type"] == "abort" and reason["status_code"] == 400 and out.output_ids == []
    assert "sampling_params.ebnf" in reason["message"] and "missing" in reason["message"]


def test_grammars_under_overlap_scheduling_match_the_synchronous_loop(engine, make_engine):
    """The GPU's default loop on CPU: a step with a constrained request decoding the token in flight
    completes that step between its forward and its sampling (the mask needs the token), every step
    still overlaps, a jump's forced tokens run as one-token rows (the CUDA-graph layout), and the
    tokens are the synchronous loop's (the module engine's: CPU's default), jump-forward included."""
    phone = [{"temperature": 0.7, "max_new_tokens": 24, "regex": PHONE, "sampling_seed": s} for s in range(3)]
    person = {"temperature": 0, "max_new_tokens": 48, "json_schema": json.dumps(PERSON)}
    free = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    prompts = ["Call me at"] * 3 + ["Bob is 45 and lives in Berlin. As JSON:", "Tell me"]
    outs = {False: engine.generate(prompts, [*phone, person, free])}
    overlapped = make_engine(disable_overlap_schedule=False)
    overlapped._on_scheduler(lambda s: setattr(s.runner, "rows_max_tokens", 64))
    outs[True] = overlapped.generate(prompts, [*phone, person, free])
    stats = overlapped.get_stats()
    assert [o["output_ids"] for o in outs[True]] == [o["output_ids"] for o in outs[False]]
    for o in outs[True][:3]:
        assert re.fullmatch(PHONE, o["text"]), o["text"]
    assert set(json.loads(outs[True][3]["text"])) == {"name", "age", "city"}
    assert outs[True][4]["meta_info"]["completion_tokens"] == 12
    assert stats["overlapped_steps"] >= stats["steps"] - 2 and stats["jump_forward_tokens"] > 0
    assert stats["row_steps"] > 0


PEOPLE = [("Alice", 31, "Paris"), ("Bob", 45, "Berlin"), ("Chen", 22, "Shanghai")]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
          "age": {"type": "integer", "minimum": 0, "maximum": 120}, "city": {"type": "string",
          "maxLength": 20}}, "required": ["name", "age", "city"], "additionalProperties": False}  # fmt: skip


def test_jump_forward_saves_steps_and_streams_right_text(make_engine):
    prompts = [f"Passage: {n} is {a} years old and lives in {c}.\nThe person as JSON:" for n, a, c in PEOPLE]
    params = {"temperature": 0, "max_new_tokens": 64, "json_schema": json.dumps(PERSON)}
    steps = {}
    for jump in (False, True):
        engine = make_engine(disable_jump_forward=not jump)
        if jump:  # streamed: every chunk's text is a prefix of its request's final one
            chunks = list(engine.generate(prompts, [params] * len(prompts), stream=True))
            streams = [[c for c in chunks if c["index"] == i] for i in range(len(prompts))]
            outs = [stream[-1] for stream in streams]
            for stream, final in zip(streams, outs, strict=True):
                assert all(final["text"].startswith(c["text"]) for c in stream)
                assert all(c["meta_info"]["finish_reason"] is None for c in stream[:-1])
        else:
            outs = engine.generate(prompts, [params] * len(prompts))
        for o in outs:  # ids and text agree, streamed or not
            obj = json.loads(o["text"])
            assert set(obj) == {"name", "age", "city"} and o["meta_info"]["finish_reason"]["type"] == "stop"
            assert engine.tokenizer.decode(o["output_ids"], skip_special_tokens=True) == o["text"]
        stats = engine.get_stats()
        steps[jump] = stats["steps"]
        assert (stats["jump_forward_tokens"] > 0) == jump
    # 0.9: under overlap scheduling (the GPU's default loop) each jump also costs the step launched
    # before its token was known (24 against 29 steps on the H200; fewer on the CPU's synchronous loop)
    assert steps[True] < 0.9 * steps[False]


def _gate_compiles(engine) -> threading.Event:
    """Every grammar compile on `engine` waits for the returned event (then compiles for real)."""
    gate = threading.Event()

    def hold(s) -> None:
        s.grammars.backend()  # started: the compile timeout runs from here
        cache = s.grammars._grammars()
        real = cache._compile
        cache._compile = lambda spec: gate.wait(60) and real(spec)

    engine._on_scheduler(hold)
    return gate


def test_a_compiling_grammar_holds_only_its_request_and_times_out_or_aborts(make_engine):
    engine = make_engine(grammar_compile_timeout=1.0)
    gate = _gate_compiles(engine)
    results: dict[str, dict] = {}
    calls = {"slow": {"regex": "[a-z]{3}"}, "aborted": {"regex": "[0-9]{3}"}}
    threads = [threading.Thread(target=lambda k=k: results.setdefault(k, engine.generate(
        "x", {**calls[k], "max_new_tokens": 8}, rid=k))) for k in calls]  # fmt: skip
    for t in threads:
        t.start()
    while engine.get_stats()["waiting"] < 2:
        time.sleep(0.01)
    engine._on_scheduler(lambda s: s.abort(["aborted"]))
    free = engine.generate("y", {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True})
    assert free["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    for t in threads:
        t.join(timeout=30)
    gate.set()
    assert results["aborted"]["meta_info"]["finish_reason"]["type"] == "abort"
    slow = results["slow"]["meta_info"]["finish_reason"]
    assert slow["status_code"] == 400 and "took longer than 1 s" in slow["message"]


def test_grammars_with_n_samples_chunked_prefill_and_retraction(make_engine):
    # a pool of 200 slots and 64-token chunks: the 108-token prompt prefills in chunks, and 6 samples
    # of 20-24 digits (a token each) outgrow the pool and retract one another
    engine = make_engine(max_total_tokens=200, chunked_prefill_size=64, new_token_ratio=0.0)
    long = "Passage: " + "the quick brown fox jumps over the lazy dog; " * 10 + "\nA number:"
    params = {"temperature": 1.0, "max_new_tokens": 24, "regex": "[0-9]{20,24}", "n": 3}
    outs = engine.generate([long, "A person as JSON:"], params)
    assert len(outs) == 6
    for o in outs:
        assert re.fullmatch("[0-9]{20,24}", o["text"]), o["text"]
    assert engine.get_stats()["retractions"] > 0


def test_a_grammar_backend_that_cannot_start_fails_its_requests_alone(make_engine):
    engine = make_engine()

    def broken(s) -> None:
        s.grammars._tokenizer_path = "/nonexistent"

    engine._on_scheduler(broken)
    for _ in range(2):  # the second fails at once, from the recorded reason
        free = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
        bad, good = engine.generate(["x", "y"], [{"regex": "[a-z]+", "max_new_tokens": 4}, free])
        reason = bad["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and reason["status_code"] == 500
        assert "constrained decoding is unavailable" in reason["message"]
        assert good["meta_info"]["finish_reason"] == {"type": "length", "length": 4}


def test_an_eos_the_tokenizer_lacks_falls_back_to_its_own(model_folder):
    from services.scheduler.constrained.llguidance_backend import LLGuidanceBackend

    backend = LLGuidanceBackend(f"{model_folder}/tokenizer.json", 128256, (128001,))  # a borrowed tokenizer
    assert backend.tokenizer.eos_token < 49152


# a nested schema whose greedy output retokenizes inside a jump-forward extend on the default model
NESTED = json.loads(
    '{"type": "object", "properties": {"ks": {"type": "array", "items": {"type": "string", "maxLength": 5},'
    ' "maxItems": 2}, "a_xcw": {"type": "boolean"}, "mjtre": {"type": "object", "properties": {"mxb": '
    '{"type": "object", "properties": {"stream": {"type": "boolean"}, "ctd": {"type": "object", "properties":'
    ' {"xgetsm": {"type": "integer", "minimum": -16, "maximum": 8}}, "required": ["xgetsm"], '
    '"additionalProperties": false}}, "required": ["ctd", "stream"], "additionalProperties": false}, '
    '"clqdwp": {"type": "object", "properties": {"mh": {"enum": ["vhluxd", "geplpu"]}}, "required": ["mh"], '
    '"additionalProperties": false}, "s": {"type": "integer", "minimum": 1, "maximum": 63}}, "required": '
    '["clqdwp", "mxb", "s"], "additionalProperties": false}}, "required": ["a_xcw", "ks", "mjtre"], '
    '"additionalProperties": false}'
)


def test_a_retokenized_extend_caches_only_the_kv_it_kept(engine):
    """A jump-forward extend whose completion retokenizes (and frees the KV of) its own last tokens
    shares only the kept tokens with the radix cache: a freed slot cached too was a KV leak that the
    integrity check (free list and cache disjoint) catches."""
    before = engine.get_stats()["retokenized"]
    params = {"temperature": 0, "max_new_tokens": 160, "json_schema": json.dumps(NESTED)}
    # several prompts, so that one retokenizes whatever the numerics (on CUDA the first alone did not)
    prompts = ["Some data as JSON (ks, a_xcw, mjtre):", "Fill in this record:", "JSON, please:"]
    for out in engine.generate(prompts, [params] * len(prompts)):
        assert json.loads(out["text"]).keys() == NESTED["properties"].keys()
    assert engine.get_stats()["retokenized"] > before
    engine.check_integrity()


def test_a_slow_backend_start_does_not_count_as_compile_time(make_engine, monkeypatch):
    """The grammar library is imported and set up on the compile threads (seconds for xgrammar), not
    on the step loop, and the compile timeout starts once it is up: a backend that takes longer than
    the timeout to start still serves the first grammar, and the request beside it finishes."""
    import time as _time

    import services.scheduler.constrained.admission as admission

    real = admission.backend_class

    def slow(name):
        cls = real(name)

        def build(*args):
            _time.sleep(2.0)
            return cls(*args)

        return build

    monkeypatch.setattr(admission, "backend_class", slow)
    engine = make_engine(grammar_compile_timeout=0.5)
    t0 = _time.monotonic()
    free = engine.generate("y", {"temperature": 0, "max_new_tokens": 2, "ignore_eos": True})
    assert _time.monotonic() - t0 < 60 and free["meta_info"]["finish_reason"]["type"] == "length"
    params = [{"temperature": 0, "max_new_tokens": 8, "regex": "[0-9]{3}"},
              {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}]  # fmt: skip
    constrained, other = engine.generate(["Digits:", "z"], params)
    assert re.fullmatch("[0-9]{3}", constrained["text"]), constrained
    assert other["meta_info"]["finish_reason"] == {"type": "length", "length": 4}


RECURSIVE = {
    "type": "object",
    "properties": {"a": {"$ref": "#"}},
    "required": ["a"],
    "additionalProperties": False,
}
ENDLESS = [{"ebnf": 'root ::= "a" root'}, {"ebnf": 'root ::= "(" root ")"'},
           {"json_schema": json.dumps(RECURSIVE)},
           {"json_schema": json.dumps({"type": "array", "items": {"$ref": "#"}, "minItems": 1})},
           {"ebnf": 'root ::= "a" | "b" x\nx ::= "c" x'}, {"regex": r"[^\s\S]"}]  # fmt: skip


def test_a_grammar_that_accepts_no_finite_string_is_a_400_before_any_matcher(engine):
    """Jump-forward on such a grammar looped forever (xgrammar allocated until the process was killed);
    an empty regex left no token to sample (a 500). The gateway refuses them, and a scheduler given
    one straight refuses it at compile. (return_logprob turns jump-forward off: without the check the
    first four would decode "aaaa", not take the machine down.)"""
    for grammar in ENDLESS:
        with pytest.raises(ValueError, match="never ends|accepts no|admits no finite"):
            engine.generate("x", {"max_new_tokens": 4, **grammar}, return_logprob=True)
    bad = GenerateReq(rid="endless", input_ids=[1, 2], out_subject="sglbus.out.endless-test",
                      sampling=SamplingParams(max_new_tokens=4, regex=r"[^\s\S]"))  # fmt: skip
    with BusProbe(engine, bad.out_subject) as probe:
        probe.send(bad)
        out = probe.final()
    reason = as_dict(out.finish)
    assert reason["status_code"] == 400 and "the regex accepts no string" in reason["message"], reason


def test_special_tokens_are_never_text_and_end_only_a_finished_grammar(engine):
    """The end token <|im_end|> (2) was taken as ten characters of a regex, <|im_start|> (1) inside a
    JSON string, <|endoftext|> (0) for a regex's characters: with a bias that makes each the likeliest
    token, the outputs still follow their grammar and hold no special token."""
    string = {"type": "object", "properties": {"s": {"type": "string", "minLength": 5, "maxLength": 20}},
              "required": ["s"], "additionalProperties": False}  # fmt: skip
    params = [{"regex": "[^0-9]{12,40}", "logit_bias": {"2": 30.0}},
              {"json_schema": json.dumps(string), "logit_bias": {"1": 30.0}},
              {"regex": ".{13}", "logit_bias": {"0": 30.0}}]  # fmt: skip
    outs = engine.generate(["Answer:"] * 3, [{"temperature": 0, "max_new_tokens": 64, **p} for p in params])
    assert re.fullmatch("[^0-9]{12,40}", outs[0]["text"]), outs[0]
    assert 5 <= len(json.loads(outs[1]["text"])["s"]) <= 20, outs[1]
    assert re.fullmatch(".{13}", outs[2]["text"]), outs[2]
    for o in outs:
        assert not {0, 1} & set(o["output_ids"]) and o["meta_info"]["finish_reason"]["type"] == "stop", o


def test_regexes_and_schemas_hold_as_a_client_validates_them(engine):
    """Greedy outputs that broke their grammar as Python's `re` and a JSON-schema validator read it:
    `.` took newlines, `\\x00` was read as U+000B, allOf and a $ref's siblings were ignored."""
    both = {
        "allOf": [
            {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
            {"type": "object", "properties": {"b": {"type": "string", "maxLength": 4}}, "required": ["b"]},
        ]
    }
    ref = {"$defs": {"s": {"type": "string"}}, "type": "object", "properties": {"a": {"$ref": "#/$defs/s",
           "maxLength": 3}}, "required": ["a"], "additionalProperties": False}  # fmt: skip
    grammars = [{"regex": r"x.{5}y"}, {"regex": r".{0,20}end"}, {"regex": r"a\x00b"},
                {"json_schema": json.dumps(both)}, {"json_schema": json.dumps(ref)}]  # fmt: skip
    outs = engine.generate(["Answer:"] * 3 + ["Here is the JSON object:\n"] * 2,
                           [{"temperature": 0, "max_new_tokens": 64, **g} for g in grammars])  # fmt: skip
    for g, o in zip(grammars[:3], outs, strict=False):
        assert re.fullmatch(g["regex"], o["text"], re.ASCII), (g, o["text"])
    obj = json.loads(outs[3]["text"])
    assert isinstance(obj["a"], int) and len(obj["b"]) <= 4, obj
    assert len(json.loads(outs[4]["text"])["a"]) <= 3, outs[4]["text"]


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_every_constrained_output_token_has_its_logprob(make_engine, backend):
    """A request that wants logprobs draws the EOS its finished grammar allows (a forward, a logprob)
    instead of getting it appended; min_new_tokens unmet or ignore_eos still append it."""
    pytest.importorskip(backend)
    engine = make_engine(grammar_backend=backend)
    prompts = ["A person as JSON:", "Is the sky blue? Answer:", "Is water wet? Answer:"]
    params = [
        {"temperature": 0, "max_new_tokens": 64, "json_schema": json.dumps(SCHEMA)},
        {"temperature": 0.8, "max_new_tokens": 8, "ebnf": 'root ::= "yes" | "no"', "sampling_seed": 3},
        {"temperature": 0, "max_new_tokens": 8, "ebnf": 'root ::= "yes" | "no"', "min_new_tokens": 8},
    ]
    outs = engine.generate(prompts, params, return_logprob=True)
    for o in outs:
        meta = o["meta_info"]
        assert meta["finish_reason"]["type"] == "stop", meta["finish_reason"]
    person, answer, short = (o["meta_info"] for o in outs)
    for meta in (person, answer):
        assert len(meta["output_token_logprobs"]) == meta["completion_tokens"]
        assert meta["output_token_logprobs"][-1][0] > -1e9  # the drawn EOS has a real logprob
    assert len(short["output_token_logprobs"]) == short["completion_tokens"] - 1  # EOS appended, no forward
    json.loads(outs[0]["text"])
