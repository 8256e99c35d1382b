"""Crash accounting (services/scheduler/quarantine.py, crash_record.py) with a fake model and a fake work
queue: a request that crashes the scheduler on every run ends with an error after MAX_CRASHES crashes
while it ran alone; the requests merely in a crashed batch, or held by a crashed scheduler, complete;
give-backs never count. A "death" is a scheduler object abandoned mid-step (as SIGKILL leaves it); a
new one (the restarted process) reads the crash record from the same file."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from services.scheduler.crash_record import CrashRecord
from services.scheduler.forward_batch import LogitsOutput
from services.scheduler.memory import KVPool, ReqToTokenPool
from services.scheduler.quarantine import WINDOW_TOKENS
from services.scheduler.sampling.sampler import sample
from services.scheduler.scheduler import Scheduler
from shared.config import EngineConfig
from shared.finish import as_dict
from shared.messages import MAX_CRASHES, MAX_DELIVERIES, GenerateReq
from shared.sampling_params import SamplingParams

V, EOS = 64, 2
POISON = 60  # a forward with this token among its inputs crashes the scheduler


class Died(BaseException):
    """The process died in the forward (SIGKILL, a segfault): nothing after it runs."""


class CrashingRunner:
    """Next token = last input token + 1 (mod V - 1); a forward that has POISON among its inputs raises
    `crash` (RuntimeError: the step fails and the service stops; Died: the process is gone). Records
    the rows (token lists) of each forward batch."""

    overlap_schedule = False
    rows_max_tokens = 0
    vision = None  # a text model

    def __init__(self, crash: type[BaseException], batches: list[list[int]], pool: int = 512) -> None:
        self.crash, self.batches = crash, batches
        self.device = torch.device("cpu")
        self.context_len = 64
        self.max_running_requests = 8
        self.model_config = SimpleNamespace(eos_token_ids=(EOS,), vocab_size=V)
        shape = SimpleNamespace(num_layers=1, num_kv_heads=1, head_dim=1)
        self.kv = KVPool(shape, pool, torch.float32, "cpu")
        self.req_to_token = ReqToTokenPool(16, 65, "cpu")
        self.chunked_prefill_size = 2048
        self.model = SimpleNamespace(logits=lambda hidden: hidden * 10.0)

    def forward(self, fb) -> LogitsOutput:
        ids = fb.input_ids.tolist()
        self.batches.append(ids)
        if POISON in ids:
            raise self.crash("poisoned forward")
        last = fb.input_ids if fb.logits_idx is None else fb.input_ids[fb.logits_idx]
        return LogitsOutput(torch.nn.functional.one_hot((last + 1) % (V - 1), V).float() * 10.0, None)

    def sample(self, logits, info, output_lens, check=True):
        return sample(logits, info, output_lens, check)


@pytest.fixture(autouse=True, params=[False, True], ids=["sync", "overlap"])
def overlap(request, monkeypatch):
    monkeypatch.setattr(CrashingRunner, "overlap_schedule", request.param)
    return request.param


def msg(rid: str, prompt: list[int], n: int = 6) -> GenerateReq:
    sp = SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)
    return GenerateReq(rid=rid, input_ids=prompt, sampling=sp, out_subject="out")


def expected(prompt: list[int], n: int = 6) -> list[int]:
    return [(prompt[-1] + 1 + i) % (V - 1) for i in range(n)]


class WorkQueue:
    """One worker and its work queue: requests are delivered with their delivery count and a token;
    when the scheduler dies, a new one (the restart, same crash record file) gets again every request
    that did not end, with the next count. Outputs are kept per rid, from the latest delivery."""

    def __init__(self, path: str | None, crash: type[BaseException] = Died, pool: int = 512) -> None:
        self.path, self.crash, self.pool = path, crash, pool
        self.msgs: dict[str, GenerateReq] = {}
        self.count: dict[str, int] = {}
        self.got: dict[str, dict] = {}
        self.batches: list[list[int]] = []
        self.crashes = 0
        self.sched = self._boot()

    def _boot(self) -> Scheduler:
        record = CrashRecord(self.path)
        record.load()
        return Scheduler(EngineConfig(), CrashingRunner(self.crash, self.batches, self.pool), record)

    def send(self, m: GenerateReq) -> None:
        self.msgs[m.rid] = m
        self.count[m.rid] = n = self.count.get(m.rid, 0) + 1
        self.got[m.rid] = {"tokens": [], "finish": None}
        self.sched.add_request(m, SimpleNamespace(token=f"{m.rid}#{n}", deliveries=n))

    def collect(self, out) -> None:
        for rid, toks, fin in zip(out.rids, out.token_ids, out.finish_reasons, strict=True):
            self.got[rid]["tokens"] += toks
            self.got[rid]["finish"] = as_dict(fin) or self.got[rid]["finish"]

    def step(self) -> None:
        if (out := self.sched.step(self.collect)) is not None:
            self.collect(out)

    def run(self, max_steps: int = 2000, max_crashes: int = 20) -> dict[str, dict]:
        """Step until idle, restarting the scheduler after each crash."""
        for _ in range(max_steps):
            if (out := self.sched.take_output()) is not None:
                self.collect(out)
            if not self.sched.has_work:
                return self.got
            try:
                self.step()
            except Died:  # nothing settled: what it held comes back after ack_wait
                again = [rid for rid, g in self.got.items() if g["finish"] is None]
                self._restart(again)
            except RuntimeError:  # what the service does when a step raises
                out, tokens = self.sched.fail_running("scheduler 0 failed: RuntimeError")
                if out is not None:
                    self.collect(out)
                self._restart([t.split("#")[0] for t in tokens])
            assert self.crashes <= max_crashes, "crashes without end"
        raise AssertionError("not idle")

    def _restart(self, rids: list[str]) -> None:
        self.crashes += 1
        self.sched = self._boot()
        for rid in rids:
            self.send(self.msgs[rid])


@pytest.mark.parametrize("crash", [Died, RuntimeError], ids=["killed", "raised"])
def test_a_request_that_crashes_every_run_ends_after_max_crashes_and_the_others_complete(tmp_path, crash):
    q = WorkQueue(str(tmp_path / "record.json"), crash)
    others = {f"r{i}": [5 + i, 6 + i, 7 + i] for i in range(4)}
    for rid, prompt in others.items():
        q.send(msg(rid, prompt))
    q.send(msg("poison", [30, POISON, 31]))
    got = q.run()
    # the first crash is in a shared batch (nobody charged), then MAX_CRASHES while it ran alone
    assert q.crashes == 1 + MAX_CRASHES
    assert got["poison"]["tokens"] == []
    finish = got["poison"]["finish"]
    assert finish["type"] == "abort" and finish["status_code"] == 500
    assert finish["message"] == f"this request crashed the scheduler {MAX_CRASHES} times; not retried"
    for rid, prompt in others.items():
        assert got[rid] == {"tokens": expected(prompt), "finish": {"type": "length", "length": 6}}, rid
    # after the first crash the poison was only ever in batches of its own
    poisoned = [b for b in q.batches if POISON in b]
    assert len(poisoned) == 1 + MAX_CRASHES
    assert all(b == [30, POISON, 31] for b in poisoned[1:])


def test_a_suspect_runs_alone_for_its_window_between_the_others_steps(tmp_path):
    """A request delivered again after a crash: its prefill and first decode step run in batches of
    their own, alternating with the other requests' steps; then it joins the batch."""
    q = WorkQueue(str(tmp_path / "record.json"))
    q.send(msg("a", [5, 6], n=12))
    q.step()
    q.step()
    q.count["s"] = 1  # as if its first delivery went down with a scheduler
    q.send(msg("s", [20, 21, 22], n=6))
    got = q.run()
    assert got["s"]["tokens"] == expected([20, 21, 22]) and got["a"]["tokens"] == expected([5, 6], 12)
    with_s = [i for i, b in enumerate(q.batches) if 22 in b or 23 in b or 24 in b]  # its prefill, its decodes
    alone = with_s[:WINDOW_TOKENS]
    assert [q.batches[i] for i in alone] == [[20, 21, 22], [23]]
    assert all(any(t < 20 for t in q.batches[i + 1]) for i in alone)  # "a" stepped in between
    assert any(len(b) > 1 and 24 in b for b in q.batches[alone[-1] + 1 :])  # then in the batch with "a"
    assert q.sched.quarantine.steps_alone == WINDOW_TOKENS and not q.sched.quarantine.suspects


def test_a_request_that_crashes_late_in_its_decode_is_still_bounded(tmp_path):
    """It passes its window alone, crashes a shared batch later, comes back and then runs alone until
    it ends: each later crash is charged. The others complete."""
    q = WorkQueue(str(tmp_path / "record.json"))
    q.send(msg("a", [5, 6, 7], n=30))
    q.send(msg("late", [POISON - 5], n=10))  # its 5th output token is POISON: the crash is in the decode
    got = q.run()
    assert q.crashes == 2 + MAX_CRASHES  # the first run and the run after its window, then alone
    assert got["late"]["finish"]["status_code"] == 500
    assert got["a"]["tokens"] == expected([5, 6, 7], 30)


def test_a_suspect_alone_until_it_ends_shares_a_full_pool_without_harm(tmp_path):
    """The others hold most of a small pool: the suspect takes what room there is on its turns and steps
    aside between them, so nobody is taken for a request that outgrew the whole pool."""
    path = str(tmp_path / "record.json")
    CrashRecord(path).passed("s")  # it passed its window before: alone until it ends
    q = WorkQueue(path, pool=32)
    prompts = {f"r{i}": [5 + i] * 4 for i in range(2)}
    for rid, prompt in prompts.items():
        q.send(msg(rid, prompt, n=12))
    q.step()
    q.count["s"] = 1
    q.send(msg("s", [30, 31, 32, 33], n=12))
    got = q.run()
    assert got["s"] == {"tokens": expected([30, 31, 32, 33], 12), "finish": {"type": "length", "length": 12}}
    for rid, prompt in prompts.items():
        assert got[rid] == {"tokens": expected(prompt, 12), "finish": {"type": "length", "length": 12}}, rid
    with_s = [b for b in q.batches if any(t >= 30 for t in b)]
    assert with_s and all(t >= 30 for b in with_s for t in b)  # always alone


def test_give_backs_and_a_high_delivery_count_never_fail_a_request(tmp_path):
    """Deliveries the scheduler gave back on purpose (output lost, gateway gone, full) are no fault:
    a request given back again and again runs as any other, and a delivery count far past
    MAX_DELIVERIES with no crash charged is only a suspect, never refused."""
    q = WorkQueue(str(tmp_path / "record.json"))
    q.send(msg("busy", [5, 6]))
    for _ in range(3 * MAX_DELIVERIES):
        q.step()
        q.sched.quarantine.gave_back(["busy"])
        assert q.sched.drop(["busy"]) == [f"busy#{q.count['busy']}"]
        q.step()  # it leaves the batch before its next delivery arrives
        q.send(msg("busy", [5, 6]))
        assert not q.sched.quarantine.suspects
    q.count["far"] = 5 * MAX_DELIVERIES
    q.send(msg("far", [9, 10]))
    got = q.run()
    assert got["busy"]["tokens"] == expected([5, 6]) and got["far"]["tokens"] == expected([9, 10])
    assert q.sched.quarantine.steps_alone == WINDOW_TOKENS  # "far" only


def test_a_clean_stop_leaves_its_requests_innocent_and_a_death_alone_clears_the_bystanders(tmp_path):
    path = str(tmp_path / "record.json")
    q = WorkQueue(path)
    q.send(msg("held", [5, 6]))
    q.sched.quarantine.stopping(q.sched)
    record = CrashRecord(path)
    record.load()
    assert record.take_innocent(["held"]) and not record.take_innocent(["held"])  # counted once
    record.mark("suspect", ["bystander"])  # the process dies in the suspect's step
    again = CrashRecord(path)
    again.load()
    assert again.charged == "suspect" and again.crashes("suspect") == 1
    assert again.take_innocent(["bystander"]) and not again.take_innocent(["suspect"])
    after = CrashRecord(path)
    after.load()
    assert after.charged is None and after.crashes("suspect") == 1  # charged once


def test_an_unreadable_record_starts_afresh_and_an_unwritable_one_counts_deliveries(tmp_path):
    path = tmp_path / "record.json"
    path.write_bytes(b"{not json")
    record = CrashRecord(str(path))
    record.load()
    assert record.durable and record.requests == {}
    blocked = tmp_path / "file"
    blocked.write_text("")
    q = WorkQueue(str(blocked / "record.json"))  # its folder is a file: nothing can be written
    assert not q.sched.quarantine.record.durable
    q.count["old"] = MAX_DELIVERIES
    q.send(msg("old", [5, 6]))
    got = q.run()
    assert got["old"]["finish"]["status_code"] == 500 and "delivered" in got["old"]["finish"]["message"]


def test_in_process_a_failed_step_ends_the_running_requests_with_the_reason():
    """No work queue: nothing would run them again, so they end with the step's error (as before)."""
    sched = Scheduler(EngineConfig(), CrashingRunner(RuntimeError, []))
    sched.add_request(msg("a", [5, 6]))
    sched.add_request(msg("b", [POISON]))
    with pytest.raises(RuntimeError):
        for _ in range(5):
            sched.step()
    out, tokens = sched.fail_running("scheduler 0 failed: RuntimeError: boom")
    assert tokens == [] and not sched.running
    assert {as_dict(f)["message"] for f in out.finish_reasons} == {"scheduler 0 failed: RuntimeError: boom"}
