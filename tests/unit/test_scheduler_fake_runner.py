"""The scheduler with a fake model (no weights, milliseconds): requests off the bus are checked, a
request failing alone ends alone, a long output never holds the queue, batch statistics are logged."""

from __future__ import annotations

import logging
import math
from types import SimpleNamespace

import msgspec
import numpy as np
import pytest
import torch

import services.scheduler.batch_log as batch_log
import services.scheduler.logprobs as logprobs_module
import services.scheduler.scheduler as scheduler_module
from services.scheduler.forward_batch import LogitsOutput
from services.scheduler.memory import KVPool, ReqToTokenPool
from services.scheduler.sampling.sampler import sample
from services.scheduler.scheduler import Scheduler
from shared.config import EngineConfig
from shared.finish import as_dict
from shared.messages import MAX_CRASHES, GenerateReq, LogprobReq
from shared.sampling_params import SamplingParams

V, EOS, POISON = 64, 2, 63  # POISON: the fake model answers it with NaN logits


class FakeRunner:
    """Next token = last input token + 1 (mod V - 1: never POISON); NaN logits after POISON."""

    overlap_schedule = False
    rows_max_tokens = 0  # no CUDA graphs: extends stay extends
    vision = None  # a text model

    def __init__(self, pool: int = 256, context: int = 64, rows: int = 8) -> None:
        self.device = torch.device("cpu")
        self.context_len = context
        self.max_running_requests = rows
        self.model_config = SimpleNamespace(eos_token_ids=(EOS,), vocab_size=V)
        shape = SimpleNamespace(num_layers=1, num_kv_heads=1, head_dim=1)
        self.kv = KVPool(shape, pool, torch.float32, "cpu")
        self.req_to_token = ReqToTokenPool(rows + 8, context + 1, "cpu")
        self.chunked_prefill_size = 2048
        self.model = SimpleNamespace(logits=lambda hidden: hidden * 10.0)

    def forward(self, fb) -> LogitsOutput:
        lp_hidden = None
        if fb.lp_idx is not None:
            lp_hidden = torch.nn.functional.one_hot(fb.input_ids[fb.lp_idx], V).float()
        last = fb.input_ids if fb.logits_idx is None else fb.input_ids[fb.logits_idx]
        logits = torch.nn.functional.one_hot((last + 1) % (V - 1), V).float() * 10.0
        logits[last == POISON] = float("nan")
        return LogitsOutput(logits, lp_hidden)

    def sample(self, logits, info, output_lens, check=True):
        return sample(logits, info, output_lens, check)


@pytest.fixture(autouse=True, params=[False, True], ids=["sync", "overlap"])
def overlap(request, monkeypatch):
    """Every test here runs twice: steps completed at once, and with overlap scheduling (the next step
    launched before the previous one's tokens are processed)."""
    monkeypatch.setattr(FakeRunner, "overlap_schedule", request.param)
    return request.param


def make(pool: int = 256, context: int = 64, **cfg) -> Scheduler:
    return Scheduler(EngineConfig(**cfg), FakeRunner(pool, context))


def msg(rid: str, prompt: list[int], logprob: LogprobReq | None = None, **params) -> GenerateReq:
    sp = SamplingParams(**{"temperature": 0.0, "max_new_tokens": 4, **params})
    return GenerateReq(rid=rid, input_ids=prompt, sampling=sp, out_subject="out", logprob=logprob)


def run(
    sched: Scheduler, max_steps: int = 500, early: bool = True, logprobs: dict[str, list] | None = None
) -> dict[str, dict]:
    """Step until idle; per rid: its tokens and finish reason. early: output also comes through
    `send_early`, as the service steps (it matters under overlap scheduling only). logprobs: filled
    with each rid's LogprobOut messages."""
    got: dict[str, dict] = {}

    def collect(out) -> None:
        for rid, toks, fin in zip(out.rids, out.token_ids, out.finish_reasons, strict=True):
            entry = got.setdefault(rid, {"tokens": [], "finish": None})
            entry["tokens"] += toks
            entry["finish"] = as_dict(fin) or entry["finish"]  # as /generate shows it
        for rid, lp in zip(out.rids, out.logprobs, strict=False):  # [] when none asked
            if logprobs is not None and lp is not None:
                logprobs.setdefault(rid, []).append(lp)

    if (out := sched.take_output()) is not None:
        collect(out)
    for _ in range(max_steps):
        if not sched.has_work:
            break
        if (out := sched.step(collect if early else None)) is not None:
            collect(out)
    assert not sched.has_work
    sched.check_integrity()
    return got


def expected(prompt: list[int], n: int = 4) -> list[int]:
    return [(prompt[-1] + 1 + i) % (V - 1) for i in range(n)]


BAD_PARAMS = {
    "temperature": {"temperature": math.nan},
    "top_p": {"top_p": math.nan},
    "min_p": {"min_p": math.nan},
    "frequency_penalty": {"frequency_penalty": math.nan},
    "presence_penalty": {"presence_penalty": math.inf},
    "repetition_penalty": {"repetition_penalty": math.nan},
    "sampling_seed": {"sampling_seed": 1 << 64},
    "max_new_tokens": {"max_new_tokens": 1 << 63},
    "logit_bias": {"logit_bias": {"abc": 1.0}},
    "stop_token_ids": {"stop_token_ids": [V]},
    "structural_tag": {"structural_tag": "{}"},  # not honoured yet
    "regex": {"regex": "a", "ebnf": 'root ::= "a"'},  # two grammars
    "stop_regex": {"stop_regex": ["("]},
}


@pytest.mark.parametrize("field", list(BAD_PARAMS))
def test_bad_requests_straight_from_the_bus_are_refused_alone(field):
    sched = make()
    sched.add_request(msg("good", [5, 6, 7]))
    sched.add_request(msg("bad", [5, 6, 7], **BAD_PARAMS[field]))
    got = run(sched)
    assert got["good"] == {"tokens": expected([5, 6, 7]), "finish": {"type": "length", "length": 4}}
    finish = got["bad"]["finish"]
    assert got["bad"]["tokens"] == [] and finish["type"] == "abort" and finish["status_code"] == 400
    assert field in finish["message"]


def test_prompt_and_context_checks_from_the_bus():
    sched = make(context=32)
    sched.add_request(msg("vocab", [5, V]))
    sched.add_request(msg("too_long", list(range(3, 35))))
    sched.add_request(msg("no_room", list(range(3, 23)), max_new_tokens=13))
    sched.add_request(msg("fits", list(range(3, 23)), max_new_tokens=12, ignore_eos=True))
    sched.add_request(msg("default", list(range(3, 23)), max_new_tokens=None, ignore_eos=True))
    got = run(sched)
    assert "[0, 64)" in got["vocab"]["finish"]["message"]
    assert "32 tokens" in got["too_long"]["finish"]["message"]
    no_room = got["no_room"]["finish"]["message"]
    assert "context length of 32" in no_room and "20 tokens" in no_room and "13 tokens" in no_room
    assert len(got["fits"]["tokens"]) == 12
    assert len(got["default"]["tokens"]) == 12  # the default 128 is cut to the room left


def test_values_of_the_wrong_type_are_refused_not_raised():
    sched = make()
    bad = msg("typed", [5, 6])
    bad.sampling = msgspec.structs.replace(bad.sampling, temperature="hot")  # no decoder checked it
    sched.add_request(bad)
    sched.add_request(msg("good", [5, 6]))
    got = run(sched)
    assert got["typed"]["finish"]["status_code"] == 400
    assert got["good"]["tokens"] == expected([5, 6])


def test_a_request_whose_sampling_raises_ends_alone():
    sched = make()
    for rid in ("a", "bad", "c"):
        sched.add_request(msg(rid, [5, 6, 7 + len(rid)], temperature=1.0, top_k=1, sampling_seed=1))
    bad = sched.waiting[1]
    # as if a check had missed it: NaN probabilities make the batched multinomial raise
    bad.sampling = msgspec.structs.replace(bad.sampling, temperature=math.nan, top_k=-1)
    got = run(sched)
    assert got["a"]["tokens"] == expected([5, 6, 8]) and got["c"]["tokens"] == expected([5, 6, 8])
    assert got["bad"]["tokens"] == []
    assert got["bad"]["finish"]["type"] == "abort" and got["bad"]["finish"]["status_code"] == 500
    assert "sampling" in got["bad"]["finish"]["message"]
    assert sched.stats["request_failures"] == 1


def test_a_row_without_finite_logits_ends_that_request_alone():
    sched = make()
    sched.add_request(msg("nan", [5, POISON], temperature=1.0))
    sched.add_request(msg("greedy_nan", [7, POISON]))
    sched.add_request(msg("good", [5, 6], temperature=1.0, top_k=1))
    got = run(sched)
    assert got["good"]["tokens"] == expected([5, 6])
    for rid in ("nan", "greedy_nan"):
        assert got[rid]["tokens"] == []
        assert got[rid]["finish"]["status_code"] == 500
        assert "no finite logit" in got[rid]["finish"]["message"]


def test_penalties_that_raise_for_one_request_end_that_request_alone(monkeypatch):
    sched = make()
    real = sched.sampling.penalties.apply

    def apply(logits, reqs, lens):
        if any(r.rid == "bad" for r in reqs):
            raise RuntimeError("boom")
        real(logits, reqs, lens)

    monkeypatch.setattr(sched.sampling.penalties, "apply", apply)
    sched.add_request(msg("pen", [5, 6], presence_penalty=1.0))
    sched.add_request(msg("bad", [8, 9]))
    sched.add_request(msg("plain", [10, 11]))
    got = run(sched)
    assert got["pen"]["tokens"] == expected([5, 6]) and got["plain"]["tokens"] == expected([10, 11])
    assert got["bad"]["finish"]["status_code"] == 500 and "boom" in got["bad"]["finish"]["message"]


def _output_rows_raise_for_top_k_7(monkeypatch) -> None:
    real = logprobs_module.output_rows

    def output_rows(lp, sampled, top_ks, token_ids):
        if 7 in top_ks:
            raise IndexError("bad top_k")
        return real(lp, sampled, top_ks, token_ids)

    monkeypatch.setattr(logprobs_module, "output_rows", output_rows)


def test_output_logprobs_that_raise_for_one_request_end_that_request_alone(monkeypatch):
    sched = make()
    _output_rows_raise_for_top_k_7(monkeypatch)
    sched.add_request(msg("lp", [5, 6], LogprobReq(top_k=2)))
    sched.add_request(msg("bad", [8, 9], LogprobReq(top_k=7)))
    sched.add_request(msg("plain", [10, 11]))
    got = run(sched)
    assert got["lp"]["tokens"] == expected([5, 6]) and got["plain"]["tokens"] == expected([10, 11])
    assert got["bad"]["finish"]["status_code"] == 500 and "logprobs" in got["bad"]["finish"]["message"]


def test_a_rid_used_again_gets_its_own_sampling_parameters():
    sched = make()
    sched.add_request(msg("same", [5, 6]))
    first = run(sched)["same"]["tokens"]
    sched.add_request(msg("same", [5, 6], logit_bias={"40": 100.0}))
    assert first == expected([5, 6]) and run(sched)["same"]["tokens"] == [40] * 4


def long_and_short(max_queue_wait: float) -> tuple[Scheduler, list[str]]:
    """A long request whose reserve leaves no room for a short one that arrives while it runs."""
    sched = make(pool=64, context=64, new_token_ratio=1.0, max_queue_wait=max_queue_wait)
    sched.add_request(msg("long", [3, 4, 5, 6], max_new_tokens=56, ignore_eos=True))
    sched.step()
    sched.add_request(msg("short", [20, 21, 22], max_new_tokens=2))
    sched.waiting[0].arrival -= 1.0  # it has waited a second
    done = []
    while sched.has_work:
        out = sched.step()
        if out is not None:
            done += [rid for rid, fin in zip(out.rids, out.finish_reasons, strict=True) if fin]
    sched.check_integrity()
    return sched, done


def test_a_long_output_never_holds_the_queue_past_max_queue_wait():
    _, done = long_and_short(max_queue_wait=0.5)
    assert done == ["short", "long"]  # admitted once it waited max_queue_wait, beside the long one
    _, done = long_and_short(max_queue_wait=3600.0)
    assert done == ["long", "short"]  # the reserve alone keeps it waiting for the long one


def test_batch_statistics_are_logged_like_sglang(monkeypatch, caplog, overlap):
    caplog.set_level(logging.INFO, logger=scheduler_module.__name__)
    monkeypatch.setattr(batch_log, "PREFILL_LOG_INTERVAL_S", 3600.0)
    sched = make(context=128)
    sched.add_request(msg("a", [5, 6, 7], max_new_tokens=90, ignore_eos=True))
    for i in range(10):  # a stream of arrivals logs one prefill line, not one per step
        sched.add_request(msg(f"b{i}", [8, 9], max_new_tokens=2))
        sched.step()
    run(sched)
    lines = [r.getMessage() for r in caplog.records if r.name == scheduler_module.__name__]
    prefill = [line for line in lines if line.startswith("Prefill batch.")]
    assert prefill == [
        "Prefill batch. #new-seq: 2, #new-token: 5, #cached-token: 0, token usage: 0.02, "
        "#running-req: 0, #queue-req: 0"
    ]
    decode = [line for line in lines if line.startswith("Decode batch.")]
    assert len(decode) == 90 // batch_log.DECODE_LOG_INTERVAL
    assert decode[0].startswith("Decode batch. #running-req: ")
    assert "gen throughput (token/s): " in decode[0] and "#queue-req: 0" in decode[0]
    monkeypatch.setattr(batch_log, "PREFILL_LOG_INTERVAL_S", 0.0)
    sched.add_request(msg("c", [5, 6]))
    run(sched)
    last = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Prefill batch.")][-1]
    # b1..b9 and c, added up; each finds its first token in the cache (under overlap one of them is
    # admitted while the prefill that caches it is still in flight)
    hits = 9 if overlap else 10
    assert last.startswith(f"Prefill batch. #new-seq: 10, #new-token: {20 - hits}, #cached-token: {hits},")


def group(lead: str, members: list[str], prompt: list[int], token: str = "tok", **params) -> GenerateReq:
    """An n > 1 group as the gateway sends it: a prefill (max_new_tokens=0), its samples after it."""
    head = msg(lead, prompt, max_new_tokens=0, **params)
    head.then = [msg(rid, prompt, **params) for rid in members]
    return head


def test_a_group_runs_its_members_after_the_lead_on_its_cached_prompt():
    sched = make()
    prompt = list(range(3, 20))
    sched.add_request(group("warm", ["s0", "s1"], prompt), SimpleNamespace(token="tok", deliveries=1))
    assert [r.rid for r in sched.waiting] == ["warm"] and sched.known_rids(["s0", "s1"]) == ["s0", "s1"]
    order, cached = [], {}
    for _ in range(50):
        if not sched.has_work:
            break
        out = sched.step()
        for rid, toks, fin, c in zip(out.rids, out.token_ids, out.finish_reasons, out.cached_tokens,
                                     strict=True) if out else ():  # fmt: skip
            order += [rid] * (len(toks) or fin is not None)
            cached[rid] = c
    assert order.index("warm") < min(order.index("s0"), order.index("s1"))
    assert order.count("s0") == order.count("s1") == 4
    assert cached["s0"] >= 16 and cached["s1"] >= 16  # the lead's prompt, from the prefix cache
    sched.check_integrity()


def test_a_refused_or_aborted_lead_ends_its_members_with_it():
    sched = make()
    sched.add_request(group("bad", ["b0", "b1"], [5, V]))  # an id outside the vocabulary
    got = run(sched)
    assert {rid: got[rid]["finish"]["status_code"] for rid in ("bad", "b0", "b1")} == dict.fromkeys(
        ("bad", "b0", "b1"), 400
    )
    sched.add_request(group("warm", ["s0", "s1"], [5, 6, 7]))
    sched.abort(["warm"])
    got = run(sched)
    assert all(got[rid]["finish"] == {"type": "abort", "message": "aborted"} for rid in ("warm", "s0", "s1"))
    assert not sched.held


def test_a_member_aborted_while_held_ends_alone():
    sched = make()
    sched.add_request(group("warm", ["s0", "s1"], [5, 6, 7]))
    sched.abort(["s0"])
    got = run(sched)
    assert got["s0"]["finish"]["type"] == "abort" and got["s0"]["tokens"] == []
    assert got["s1"]["tokens"] == expected([5, 6, 7])


def test_dropping_a_member_drops_its_whole_delivery_once():
    sched = make()
    sched.add_request(group("warm", ["s0", "s1"], [5, 6, 7]), SimpleNamespace(token="tok", deliveries=1))
    sched.add_request(msg("other", [5, 6]), SimpleNamespace(token="other-tok", deliveries=1))
    assert sched.drop(["s1"]) == ["tok"]
    assert sched.known_rids(["warm", "s0", "s1", "other"]) == ["other"]
    got = run(sched)
    assert set(got) == {"other"}


def test_a_full_pool_evicts_once_per_step_for_all_its_decodes(monkeypatch):
    """Decodes that need more slots than are free take them from the cache in one eviction per step
    (per request, a full pool paid one eviction, each heapifying every cache leaf), and every output
    and the KV invariant stay right."""
    sched = make(pool=200, context=64)
    for i in range(8):  # 8 finished requests leave ~20 tokens each in the cache
        sched.add_request(msg(f"warm{i}", [10 + i] * 16, max_new_tokens=4))
    run(sched)
    assert sched.kv.free_count < 60 and sched.tree.evictable_size() > 140
    calls: list[int] = []
    evict = sched.tree.evict

    def counted(n: int) -> int:
        calls.append(sched.stats["steps"])
        return evict(n)

    monkeypatch.setattr(sched.tree, "evict", counted)
    prompts = {f"r{i}": [30 + i, 31 + i, 32 + i] for i in range(8)}
    for rid, p in prompts.items():
        sched.add_request(msg(rid, p, max_new_tokens=12))
    got = run(sched)
    assert all(got[rid]["tokens"] == expected(p, 12) for rid, p in prompts.items())
    assert calls and max(calls.count(s) for s in set(calls)) == 1  # at most one eviction a step


def test_ready_output_goes_out_after_the_next_launch_and_nothing_changes(overlap):
    """send_early: under overlap a step's completion is held until the next step is launched (the
    consumers then run while the scheduler waits for the device); the tokens are the same."""
    results = []
    for early in (True, False):
        sched = make()
        sched.add_request(msg("a", [5, 6], max_new_tokens=6))
        sched.add_request(msg("b", [9], max_new_tokens=3, stop_token_ids=[11]))
        results.append(run(sched, early=early))
    assert (
        results[0]
        == results[1]
        == {
            "a": {"tokens": expected([5, 6], 6), "finish": {"type": "length", "length": 6}},
            "b": {"tokens": [10, 11], "finish": {"type": "stop", "matched": 11}},
        }
    )
    sched = make()
    sched.add_request(msg("a", [5, 6], max_new_tokens=6))
    sent: list[list[int]] = []
    returned = sched.step(lambda out: sent.extend(out.token_ids))
    if not overlap:  # completed at once and returned; nothing goes early
        assert sent == [] and returned is not None and returned.token_ids == [[7]]
        return
    assert sent == [] and returned is None  # launched; nothing completed yet
    assert sched.step(lambda out: sent.extend(out.token_ids)) is None
    assert sent == []  # the first token is held past this step's completion...
    sched.step(lambda out: sent.extend(out.token_ids))
    assert sent == [[7]]  # ...and goes out once the third step is launched


def test_a_late_redelivery_of_a_running_request_is_not_taken_for_a_poison_request():
    """A request that crashed schedulers MAX_CRASHES times is refused when delivered again, unless it
    runs here: then a keep-alive came late on a busy machine, and it keeps going."""
    sched = make()
    delivery = lambda n: SimpleNamespace(token="tok", deliveries=n)  # noqa: E731
    sched.add_request(msg("here", [5, 6], max_new_tokens=4), delivery(1))
    outs = []
    if (out := sched.step(outs.append)) is not None:
        outs.append(out)
    first = [
        t for o in outs for rid, toks in zip(o.rids, o.token_ids, strict=True) if rid == "here" for t in toks
    ]
    for rid in ("here", "crashed"):
        for _ in range(MAX_CRASHES):
            sched.quarantine.record.charge(rid)
    sched.add_request(msg("here", [5, 6], max_new_tokens=4), delivery(4))
    sched.add_request(msg("crashed", [8, 9]), delivery(4))
    got = run(sched)
    assert first + got["here"]["tokens"] == expected([5, 6])
    assert got["here"]["finish"] == {"type": "length", "length": 4}
    assert got["crashed"]["tokens"] == [] and got["crashed"]["finish"]["status_code"] == 500
    assert f"crashed the scheduler {MAX_CRASHES} times" in got["crashed"]["finish"]["message"]


def output_side(parts: list) -> dict[str, np.ndarray]:
    dtypes = {"token": "<f4", "top_val": "<f4", "top_idx": "<i4", "ids_val": "<f4"}
    return {
        k: np.concatenate([np.frombuffer(getattr(p, f"output_{k}"), dtype=d) for p in parts])
        for k, d in dtypes.items()
    }


def test_a_zero_token_request_reads_the_next_token_logprobs_and_draws_nothing():
    """max_new_tokens=0 with top or listed logprobs (SGLang's frontend reads `output_top_logprobs[0]`
    of such a gen): one output row for the position after the prompt, no token, no KV past the prompt,
    beside requests that sample, whose logits rows it must not take."""
    sched = make()
    y, z = [5, 6, 7, 8], [20, 21, 22, 23]
    sched.add_request(msg("warm_y", y, max_new_tokens=1))
    sched.add_request(msg("warm_z", z, max_new_tokens=1))
    run(sched)
    # both prompts cached: each request below extends by its last token only, a step of one-token rows
    # in which the reader comes first (its logits row is the last one: not in token order)
    sched.add_request(msg("peek", y, LogprobReq(top_k=3, token_ids=[1, 40]), max_new_tokens=0))
    sched.add_request(msg("draw", z, max_new_tokens=2))
    lps: dict[str, list] = {}
    got = run(sched, logprobs=lps)
    assert got["draw"]["tokens"] == expected(z, 2)
    sched.add_request(msg("fresh", [30, 31, 32], LogprobReq(top_k=2), max_new_tokens=0))  # a prefill
    sched.add_request(msg("plain", [40, 41], max_new_tokens=0))
    sched.add_request(msg("no_top", [44, 45], LogprobReq(), max_new_tokens=0))
    sched.add_request(msg("beside", [50, 51], max_new_tokens=1))
    got.update(run(sched, logprobs=lps))
    assert got["beside"]["tokens"] == expected([50, 51], 1)
    for rid in ("peek", "fresh", "plain", "no_top"):
        assert got[rid] == {"tokens": [], "finish": {"type": "length", "length": 0}}, rid
    peek, fresh = output_side(lps["peek"]), output_side(lps["fresh"])
    assert len(peek["token"]) == len(fresh["token"]) == 0  # no token, so no token logprob
    assert peek["top_idx"].tolist()[0] == 9 and len(peek["top_idx"]) == 3  # the fake model's next: 8 + 1
    assert peek["top_val"][0] > peek["top_val"][1] and len(peek["ids_val"]) == 2
    assert fresh["top_idx"].tolist()[0] == 33 and len(fresh["top_idx"]) == 2
    assert "no_top" not in lps or len(output_side(lps["no_top"])["top_idx"]) == 0
    assert "plain" not in lps
    assert sched.stats["generated_tokens"] == 2 + 2 + 1  # none for the readers


def test_next_token_logprobs_that_raise_for_one_request_end_that_request_alone(monkeypatch):
    sched = make()
    _output_rows_raise_for_top_k_7(monkeypatch)
    sched.add_request(msg("lp", [5, 6], LogprobReq(top_k=2), max_new_tokens=0))
    sched.add_request(msg("bad", [8, 9], LogprobReq(top_k=7), max_new_tokens=0))
    sched.add_request(msg("plain", [10, 11]))
    lps: dict[str, list] = {}
    got = run(sched, logprobs=lps)
    assert got["lp"]["finish"] == {"type": "length", "length": 0}
    assert output_side(lps["lp"])["top_idx"].tolist()[0] == 7
    assert got["plain"]["tokens"] == expected([10, 11])
    assert got["bad"]["finish"]["status_code"] == 500 and "logprobs" in got["bad"]["finish"]["message"]
