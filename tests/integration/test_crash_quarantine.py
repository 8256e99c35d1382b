"""A request that crashes its scheduler every time it runs, on a real stack: its scheduler
(tests/integration/poison_scheduler.py) kills itself with SIGKILL whenever a forward holds the request's
poison ids, and the test restarts it, as `sglbus serve` or compose would. The request ends with a 500
after MAX_CRASHES crashes while it ran alone (services/scheduler/quarantine.py); the requests in flight
with it, in its crashed batch or held by the crashed scheduler, complete with the right output."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import ServerProcs
from it_helpers import greedy
from poison_scheduler import POISON
from test_resilience import check_all_complete, load, post_json, wait_until

from shared.messages import MAX_CRASHES
from shared.model_files import cache_root

pytestmark = pytest.mark.slow

HERE = os.path.dirname(os.path.abspath(__file__))
ACK_WAIT_S = 3.0  # what a dead scheduler held comes back this soon


class PoisonedServer(ServerProcs):
    """The stack with the poisoned scheduler, restarted whenever it dies (`exits`: its exit codes)."""

    def __init__(self, env: dict[str, str]) -> None:
        super().__init__(env)
        self.exits: list[int] = []
        self._watching = threading.Event()
        self._watcher = threading.Thread(target=self._restart_scheduler, daemon=True)

    def command(self, name: str) -> list[str]:
        cmd = super().command(name)
        if name == "scheduler":  # [python, -m, services.scheduler, args...]
            return [sys.executable, os.path.join(HERE, "poison_scheduler.py"), *cmd[3:]]
        return cmd

    def watch(self) -> None:
        self._watching.set()
        self._watcher.start()

    def _restart_scheduler(self) -> None:
        while self._watching.is_set():
            proc = self.procs["scheduler"]
            if proc.poll() is not None:
                self.exits.append(proc.returncode)
                self.start("scheduler")
            time.sleep(0.2)

    def stop(self) -> None:
        self._watching.clear()
        if self._watcher.is_alive():
            self._watcher.join()
        super().stop()


@pytest.fixture(scope="module")
def poisoned(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PoisonedServer]:
    # a crash record of its own (it lives in the cache folder), the converted model shared
    cache = tmp_path_factory.mktemp("sglbus-cache")
    os.symlink(os.path.join(cache_root(), "gguf"), cache / "gguf")
    s = PoisonedServer({"SGLBUS_REQUEST_ACK_WAIT": str(ACK_WAIT_S), "SGLBUS_CACHE_DIR": str(cache)})
    try:
        s.start_all()
        s.watch()
        yield s
    finally:
        s.stop()


def test_a_request_that_crashes_every_run_ends_with_an_error_and_the_others_complete(poisoned):
    s = poisoned
    bodies = load(4, 48)
    poison = {"input_ids": [504, 3458, 314, 4649, *POISON, 314, 3458],
              "sampling_params": greedy(16), "rid": "poison"}  # fmt: skip
    with ThreadPoolExecutor(len(bodies) + 1) as pool:
        futs = [pool.submit(post_json, s.url, b) for b in bodies]
        wait_until(lambda: s.info()["num_running_reqs"] > 0, 60, "requests running", poll=0.05)
        poisoned_fut = pool.submit(post_json, s.url, poison)  # its prefill joins their decodes
        r = poisoned_fut.result(timeout=600)
        results = [f.result(timeout=300) for f in futs]
    assert r.status_code == 500, r.text
    assert f"this request crashed the scheduler {MAX_CRASHES} times; not retried" in r.text
    # its first run in a shared batch (nobody is charged for that), then MAX_CRASHES runs alone
    assert s.exits == [-9] * (1 + MAX_CRASHES), s.exits
    check_all_complete(s, bodies, results)
    s.settle(30)
