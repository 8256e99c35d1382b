"""`sglbus serve --tp-size 2` on CPU (gloo): the worker's second rank is a process of its own; killing
it (kill -9) takes the whole worker down, the supervisor starts it again with a new second rank, and
every request it had accepted completes with the output it would have had."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
from test_serve import API_KEY, Served, private_cache, wait_until

FOLLOWER = "services.scheduler.parallel.followers"
BODY = {"sampling_params": {"temperature": 0, "max_new_tokens": 48, "ignore_eos": True}}
PROMPTS = ["The capital of France is", "List three colours:", "def add(a, b):"]

pytestmark = pytest.mark.slow


def follower(served: Served) -> psutil.Process:
    ranks = [p for p in served.child("scheduler").children() if FOLLOWER in " ".join(p.cmdline())]
    if len(ranks) != 1:
        raise LookupError(f"{len(ranks)} second ranks")
    return ranks[0]


def test_a_killed_rank_restarts_the_worker_and_its_requests_complete():
    env = {"SGLBUS_API_KEY": API_KEY, "SGLBUS_REQUEST_ACK_WAIT": "4"}
    served = Served(private_cache(), args=["--tp-size", "2", "--tokenizer-worker-num", "1"], env=env)
    try:
        served.wait_serving()
        assert served.http.get("/get_server_info").json()["tp_size"] == 2
        refs = [served.http.post("/generate", json={**BODY, "text": p}).json() for p in PROMPTS]
        old = follower(served)
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            futures = [pool.submit(served.http.post, "/generate", json={**BODY, "text": p}) for p in PROMPTS]
            wait_until(lambda: served.http.get("/get_server_info").json()["num_running_reqs"] > 0, 60,
                       "requests running")  # fmt: skip
            old.kill()
            results = [f.result() for f in futures]
        assert [r.status_code for r in results] == [200] * len(PROMPTS), [r.text for r in results]
        for got, ref in zip(results, refs, strict=True):
            assert got.json()["output_ids"] == ref["output_ids"]
        err = served.err()
        assert re.search(r"tensor-parallel rank 1 exited \(-9\): stopping this worker", err), err[-3000:]
        assert re.search(r"scheduler exited \(exit code 1\) after \d+ s; restarting it", err), err[-3000:]
        wait_until(lambda: follower(served).pid != old.pid, 60, "a new second rank")
    finally:
        served.stop()
