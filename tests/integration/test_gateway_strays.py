"""Requests whose clients are gone are not run again in full after a scheduler restart: the gateway
aborts the new attempt at its first output and settles it, so the work queue forgets it."""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import ServerProcs, start_server
from it_helpers import PROMPT
from test_resilience import read_stream, wait_until

pytestmark = pytest.mark.slow
MAX_NEW_TOKENS = 1000


@pytest.fixture(scope="module")
def fast_faults() -> Iterator[ServerProcs]:
    """Workers judged dead after 2 s; what a dead scheduler held is delivered again after 4 s."""
    s = start_server(env={"SGLBUS_WORKER_TIMEOUT": "2", "SGLBUS_REQUEST_ACK_WAIT": "4"})
    try:
        yield s
    finally:
        s.stop()


def test_streams_failed_while_the_scheduler_was_stopped_do_not_run_again(fast_faults):
    """The scheduler is stopped under 4 streams: the gateway ends them with an error and sends an
    abort that the stopped scheduler never reads; it is then killed and restarted (as serve's
    watchdog does). The new one gets the 4 deliveries again, for nobody: they stop at once instead
    of generating 4 x 1000 tokens (before the fix: `#running-req: 4` until all were done)."""
    s = fast_faults
    sched = s.procs["scheduler"]
    sampling = {"temperature": 0, "max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True}
    started = [threading.Event() for _ in range(4)]
    with ThreadPoolExecutor(4) as pool:
        futs = [pool.submit(read_stream, s.url, {"text": f"{PROMPT} {i}", "sampling_params": sampling,
                                                 "rid": f"gone-{i}"}, started[i])
                for i in range(4)]  # fmt: skip
        assert all(e.wait(60) for e in started), "the streams never started"
        sched.send_signal(signal.SIGSTOP)
        try:
            ends = [f.result(timeout=60) for f in futs]
        finally:
            s.kill("scheduler")  # SIGKILL ends a stopped process too
    for payloads, _ in ends:
        err = json.loads(payloads[-2])
        assert "scheduler" in err["error"]["message"], err
    s.start("scheduler")
    s.wait_healthy()
    # the deliveries come back once their ack_wait ran out since the stopped scheduler's last keep-alive
    wait_until(lambda: s.info()["stats"]["prompt_tokens"] > 0, 30, "the requests delivered again")
    info = s.wait_idle(timeout=30)
    s.integrity()
    assert info["stats"]["generated_tokens"] < MAX_NEW_TOKENS // 4, info["stats"]
