"""Huge lists in one request: the caps on stop strings and patterns, logit_bias, stop ids,
token_ids_logprob and top_logprobs_num (a ValueError / OpenAIError naming the field, the limit and the
size given); the detokenizer's stop search over the tail only, matching what a whole-text search finds;
cumulative logprob meta built incrementally, equal to a build from scratch."""

from __future__ import annotations

import random

import numpy as np
import pytest

from services.detokenizer.detokenizer import Detokenizer, _stop_prefix_len
from services.gateway.logprob_meta import LogprobAccumulator
from services.gateway.logprob_options import (
    MAX_TOKEN_IDS_LOGPROB,
    MAX_TOP_LOGPROBS,
    LogprobOptions,
    parse_logprob_options,
)
from services.gateway.openai_errors import OpenAIError
from services.gateway.openai_requests import parse_chat
from services.scheduler.logprobs import Rows, pack
from shared.finish import Length, Stop
from shared.messages import BatchTokenOut, NewReqInfo
from shared.sampling_params import (
    MAX_LOGIT_BIAS,
    MAX_STOP,
    MAX_STOP_CHARS,
    MAX_STOP_REGEX,
    MAX_STOP_REGEX_CHARS,
    MAX_STOP_REGEX_SIZE,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
)

VOCAB = 1000


def refused(**params) -> str:
    with pytest.raises(ValueError) as e:
        SamplingParams.from_dict(params).verify(VOCAB)
    return str(e.value)


# -- sampling parameters ---------------------------------------------------------------------------
def test_100000_stop_strings_are_refused_naming_the_limit_and_the_count():
    msg = refused(stop=[f"s{i}" for i in range(100_000)])
    assert msg == (f"sampling_params.stop: at most {MAX_STOP} strings of at most {MAX_STOP_CHARS} "
                   "characters, got 100000 strings")  # fmt: skip


def test_a_stop_string_too_long_is_refused():
    msg = refused(stop=["end", "x" * (MAX_STOP_CHARS + 1)])
    assert msg.startswith("sampling_params.stop: at most")
    assert msg.endswith(f"got one of {MAX_STOP_CHARS + 1} characters")


def test_stop_regex_count_length_and_compile_size_are_capped():
    assert f"got {MAX_STOP_REGEX + 1} patterns" in refused(stop_regex=["a"] * (MAX_STOP_REGEX + 1))
    assert f"got one of {MAX_STOP_REGEX_CHARS + 1}" in refused(stop_regex=["a" * (MAX_STOP_REGEX_CHARS + 1)])
    # 10 and 29 characters that `regex` would unroll into 10^6 and 10^8 nodes (seconds, gigabytes)
    for pattern, size in (("a{1000000}", 10**6), ("((((a{100}){100}){100}){100})", 10**8)):
        msg = refused(stop_regex=[pattern])
        assert f"size at most {MAX_STOP_REGEX_SIZE}" in msg and f"of size {size}" in msg


def test_caps_leave_ordinary_requests_alone():
    sp = SamplingParams.from_dict({
        "stop": ["x" * MAX_STOP_CHARS] + [f"s{i}" for i in range(MAX_STOP - 1)],
        "stop_regex": [r"\d{4}-\d{2}", r"\n\n+", "(a{1,1000}){1,1000}"] * 5,
        "stop_token_ids": list(range(MAX_STOP_TOKEN_IDS)),
        "logit_bias": {str(t): -1.0 for t in range(MAX_LOGIT_BIAS)},
    })  # fmt: skip
    sp.verify(VOCAB * 2)


def test_huge_logit_bias_and_stop_token_ids_are_refused():
    msg = refused(logit_bias={str(t): 1.0 for t in range(100_000)})
    assert msg == f"sampling_params.logit_bias: at most {MAX_LOGIT_BIAS} entries, got 100000"
    msg = refused(stop_token_ids=list(range(50_000)))
    assert msg == f"sampling_params.stop_token_ids: at most {MAX_STOP_TOKEN_IDS} token ids, got 50000"


def test_regex_only_syntax_is_refused_as_sglang_matches_with_re():
    assert "not a regular expression" in refused(stop_regex=[r"\p{L}+"])


# -- logprob options -------------------------------------------------------------------------------
def logprob_refused(**fields) -> str:
    with pytest.raises(ValueError) as e:
        parse_logprob_options({"return_logprob": True, **fields}, 1)
    return str(e.value)


def test_50000_token_ids_logprob_are_refused():
    msg = logprob_refused(token_ids_logprob=list(range(50_000)))
    assert msg == f"token_ids_logprob: at most {MAX_TOKEN_IDS_LOGPROB} token ids per prompt, got 50000"
    batch = {"return_logprob": True, "token_ids_logprob": [[1], list(range(50_000))]}
    with pytest.raises(ValueError, match="got 50000"):
        parse_logprob_options(batch, 2)


def test_duplicate_token_ids_logprob_are_refused():
    assert logprob_refused(token_ids_logprob=[5, 7, 5]) == (
        "token_ids_logprob: each token id at most once, got 5 more than once"
    )
    (o,) = parse_logprob_options({"return_logprob": True, "token_ids_logprob": [5, 7]}, 1)
    assert o is not None and o.token_ids == [5, 7]


def test_top_logprobs_num_above_the_cap_is_refused():
    msg = logprob_refused(top_logprobs_num=MAX_TOP_LOGPROBS + 1)
    assert "top_logprobs_num" in msg and str(MAX_TOP_LOGPROBS) in msg and str(MAX_TOP_LOGPROBS + 1) in msg


# -- the OpenAI API --------------------------------------------------------------------------------
def chat(**fields):
    return parse_chat({"messages": [{"role": "user", "content": "hi"}], **fields}, ("m",), lambda m: [1, 2])


def test_openai_caps_name_the_openai_field():
    with pytest.raises(OpenAIError) as e:
        chat(logit_bias={str(t): 1 for t in range(100_000)})
    assert e.value.param == "logit_bias" and f"at most {MAX_LOGIT_BIAS} entries, got 100000" in str(e.value)
    with pytest.raises(OpenAIError) as e:
        chat(stop=[f"s{i}" for i in range(100_000)])
    assert e.value.param == "stop" and "100000" in str(e.value)
    with pytest.raises(OpenAIError) as e:
        chat(logprobs=True, top_logprobs=21)
    assert e.value.param == "top_logprobs" and "[0, 20]" in str(e.value)


def test_openai_stop_regex_reaches_the_sampling_caps():
    req = chat(stop_regex=["a"] * 100)
    with pytest.raises(ValueError, match=f"sampling_params.stop_regex: at most {MAX_STOP_REGEX}"):
        SamplingParams.from_dict(req.generate["sampling_params"]).verify(VOCAB)


# -- the detokenizer's stop search -----------------------------------------------------------------
class Letters:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(97 + i) for i in ids)


def run(text: str, per_step: int = 1, **stops) -> tuple[str, object]:
    """Feed text (letters a-z) a few tokens per step; the text sent and the finish reason."""
    d = Detokenizer(Letters())
    ids = [ord(c) - 97 for c in text]
    info = NewReqInfo(rid="r", out_subject="gw", **stops)
    sent, finish = "", None
    for i in range(0, len(ids), per_step):
        finish = Length(len(ids)) if i + per_step >= len(ids) else None
        msg = BatchTokenOut(new_reqs=[info] if i == 0 else [], rids=["r"], token_ids=[ids[i : i + per_step]],
                            cached_tokens=[0], offsets=[i], finish_reasons=[finish])  # fmt: skip
        outs, stopped = d.step(msg)
        (out,) = outs["gw"].outs
        sent = sent[: out.text_offset] + out.text
        if out.finish is not None:
            return sent, out.finish
    return sent, finish


@pytest.mark.parametrize("per_step", [1, 3])
def test_stop_strings_and_patterns_spanning_steps_are_found_as_a_whole_text_search_would(per_step):
    text = "xyzabcabdqqqrstuvw"  # "tu": a later stop, where a search that missed the first one ends
    assert run(text, per_step, stop=["abd", "tu"]) == ("xyzabc", Stop("abd"))
    assert run(text, per_step, stop=["tu"], stop_regex=["q{3}r"]) == ("xyzabcabd", Stop("qqqr"))
    assert run(text, per_step, stop=["tu"], stop_regex=["ab[cd]q"]) == ("xyzabc", Stop("abdq"))
    # a lookbehind sees text before the searched tail; ^ matches at the start of the text only
    assert run(text, per_step, stop=["tu"], stop_regex=["(?<=xyzabcabdqqq)r"]) == ("xyzabcabdqqq", Stop("r"))
    assert run(text, per_step, stop_regex=["^q"]) == (text, Length(len(text)))
    assert run(text, per_step, stop_regex=["^xyz"]) == ("", Stop("xyz"))
    # unbounded: from the start every step
    assert run(text, per_step, stop_regex=["z.*d"]) == ("xy", Stop("zabcabd"))


def test_held_back_text_is_the_longest_stop_prefix():
    def reference(text: str, stops: list[str]) -> int:
        return max([n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])], default=0)

    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(rng.choice("ab") for _ in range(rng.randrange(0, 12)))
        stops = ["".join(rng.choice("abc") for _ in range(rng.randrange(1, 8))) for _ in range(3)]
        assert _stop_prefix_len(text, stops) == reference(text, stops), (text, stops)


# -- cumulative logprobs, built incrementally --------------------------------------------------------
def chunk_rows(m: int, k: int, n_ids: int, seed: int) -> Rows:
    g = np.random.default_rng(seed)
    vals = g.standard_normal((m, 1 + k + n_ids)).astype(np.float32)
    return Rows(vals[:, 0].copy(), vals[:, 1 : 1 + k].copy(), g.integers(0, 50, (m, k)).astype(np.int32),
                vals[:, 1 + k :].copy())  # fmt: skip


@pytest.mark.parametrize("form", ["nested", "text", "flat", "b64"])
def test_cumulative_meta_built_chunk_by_chunk_equals_a_build_from_scratch(form):
    kw = {"text": form == "text", "output_flat": form in ("flat", "b64"), "output_b64": form == "b64"}
    opts = LogprobOptions(start_len=0, top_k=3, token_ids=[4, 9], flat=False, flat_b64=False, **kw)
    prompt, names = [1, 2, 3, 4], lambda ids: [f"t{i}" for i in ids]
    live = LogprobAccumulator(opts, prompt, names)
    chunks = [pack([chunk_rows(3, 3, 2, 0)], [chunk_rows(1, 3, 2, 1)])]
    chunks += [pack([], [chunk_rows(m, 3, 2, 10 + i)]) for i, m in enumerate([1, 2, 1, 4])]
    out_ids: list[int] = []
    seen = []
    for i, c in enumerate(chunks):
        live.add(c)
        out_ids += list(range(10 * i, 10 * i + live.output_rows - len(out_ids)))
        got = live.meta(out_ids)
        scratch = LogprobAccumulator(opts, prompt, names)
        for earlier in chunks[: i + 1]:
            scratch.add(earlier)
        assert got == scratch.meta(out_ids)
        assert len(got["output_token_logprobs"]) == len(out_ids)
        seen.append((got, scratch.meta(out_ids)))
    for got, want in seen:  # what was returned earlier did not grow with later chunks
        assert got == want
    # a retokenization changed ids already built: those rows follow
    out_ids[2] = 42
    assert live.meta(out_ids)["output_token_logprobs"][2][1] == 42


def test_delta_meta_reads_only_the_new_rows():
    opts = LogprobOptions(start_len=-1, top_k=2, token_ids=None, text=False, flat=False, flat_b64=False,
                          output_b64=False)  # fmt: skip
    acc = LogprobAccumulator(opts, [1, 2], lambda ids: [])
    for i in range(5):
        acc.add(pack([], [chunk_rows(2, 2, 0, i)]))
    ids = list(range(10))
    full = acc.meta(ids)
    for start in (1, 2, 5, 9, 10):
        delta = acc.meta(ids, start, input_side=False)
        assert delta["output_token_logprobs"] == full["output_token_logprobs"][start:]
        assert delta["output_top_logprobs"] == full["output_top_logprobs"][start:]
