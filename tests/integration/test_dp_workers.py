"""Data-parallel workers behind cache-aware routing, real parts: an embedded nats-server, scheduler +
detokenizer pairs with their own worker ids and gateways as processes, the default model.

The tests run in order on one deployment (two workers, two gateways): routing by shared prefix, two
gateways deciding alike, a gateway that joins late catching up from snapshots, then a worker killed
while traffic runs (its requests go to the live one: none lost) and a worker added at run time."""

from __future__ import annotations

import concurrent.futures as cf
import random
import signal
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from conftest import ServerProcs

from shared.nats_server import free_port

pytestmark = pytest.mark.slow

# each worker's KV pool: room for every test here (at most ~6k tokens on one worker), and small, since
# three schedulers run beside the rest of the suite on a 24 GiB machine (16,384 tokens are 0.75 GB)
DEP_POOL_TOKENS = 8192
ACK_WAIT_S = 6  # a delivery its scheduler stopped keeping alive goes to the queue again after this
# tokens of each group's shared system prompt (30 blocks): a hit saves far more than the load of the
# few requests in flight here weighs (router_balance_weight: 32 tokens a request), so affinity holds
SYSTEM_LEN = 480


class Deployment(ServerProcs):
    """ServerProcs with several workers (`scheduler-<id>`, `detokenizer-<id>`) and gateways
    (`gateway-<i>`, each on its own port)."""

    def __init__(self, workers: int, gateways: int, env: dict[str, str]) -> None:
        super().__init__(env=env)
        self.workers, self.ports = workers, [self.port] + [free_port() for _ in range(gateways - 1)]

    def command(self, name: str) -> list[str]:
        kind, _, n = name.partition("-")
        bus = ["--nats-url", self.nats_url]
        args = {
            "scheduler": [*bus, "--worker-id", n, "--max-total-tokens", str(DEP_POOL_TOKENS)],
            "detokenizer": [*bus, "--worker-id", n],
            "gateway": [*bus, "--host", "127.0.0.1", "--port", str(self.ports[int(n or 0)])],
        }[kind]
        return [sys.executable, "-m", f"services.{kind}", *args]

    def start_worker(self, n: int) -> None:
        self.start(f"scheduler-{n}")
        self.start(f"detokenizer-{n}")

    def start_all(self) -> Deployment:
        for n in range(self.workers):
            self.start_worker(n)
        for i in range(len(self.ports)):
            self.start(f"gateway-{i}")
        self.wait_healthy()
        for i in range(1, len(self.ports)):
            self.wait_until(lambda i=i: healthy(self.gw(i)))
        self.wait_until(lambda: len(self.info()["router"]["workers"]) >= self.workers)
        return self

    def gw(self, i: int) -> httpx.Client:
        return httpx.Client(base_url=f"http://127.0.0.1:{self.ports[i]}", timeout=120)

    def wait_until(self, ok: Any, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not ok():
            assert time.monotonic() < deadline, f"not within {timeout} s\n{self.tails()}"
            time.sleep(0.2)

    def live_workers(self) -> list[str]:
        return [str(st["worker_id"]) for st in self.info()["internal_states"] if st.get("detokenizer_alive")]

    def worker_stats(self, worker: str) -> dict[str, Any]:
        return next(st["stats"] for st in self.info()["internal_states"] if str(st["worker_id"]) == worker)

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        self.procs = {n: p for n, p in self.procs.items() if n.startswith("gateway")} | self.procs
        super().stop()


@pytest.fixture(scope="module")
def dep() -> Iterator[Deployment]:
    # a dead worker's requests move to a live one once its heartbeats stopped for worker_timeout: 15 s,
    # so that a worker whose beats come late on a loaded machine is not taken for dead meanwhile
    env = {"SGLBUS_WORKER_TIMEOUT": "15", "SGLBUS_WORKER_RECOVERY_TIMEOUT": "3",
           "SGLBUS_REQUEST_ACK_WAIT": str(ACK_WAIT_S)}  # fmt: skip
    d = Deployment(2, 2, env)
    try:
        yield d.start_all()
    finally:
        d.stop()


def healthy(client: httpx.Client) -> bool:
    try:
        return client.get("/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def synced(info: dict[str, Any]) -> bool:
    """The gateway sees both workers live, and its index holds both workers' blocks."""
    workers = info["router"]["workers"].values()
    live = [st for st in info["internal_states"] if st.get("detokenizer_alive")]
    return (
        len(live) >= 2
        and len(workers) >= 2
        and all(w["cached_blocks"] > 0 and not w["syncing"] for w in workers)
    )


rng = random.Random(5)
SYSTEMS = [[rng.randrange(100, 49000) for _ in range(SYSTEM_LEN)] for _ in range(12)]


def ask(client: httpx.Client, group: int, question: int, max_new: int = 4) -> dict[str, Any]:
    ids = SYSTEMS[group] + [1000 + question, 2000 + group, 3000 + question]
    r = client.post("/generate", json={"input_ids": ids, "sampling_params": {
        "max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}})  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()["meta_info"]


def run_all(jobs: list[tuple[httpx.Client, int, int]], max_new: int = 4) -> list[dict[str, Any]]:
    with cf.ThreadPoolExecutor(8) as ex:
        return list(ex.map(lambda j: ask(*j, max_new=max_new), jobs))


def test_each_group_runs_on_one_worker_and_hits_its_cache(dep: Deployment) -> None:
    client = dep.gw(0)
    for g in range(4):  # first requests one by one: each new prefix goes to the emptier worker
        ask(client, g, 0)
    metas = run_all([(client, g, q) for q in range(1, 4) for g in range(4)])
    by_group: dict[int, set[str]] = {}
    for i, m in enumerate(metas):
        by_group.setdefault(i % 4, set()).add(m["worker_id"])
        assert m["cached_tokens"] >= SYSTEM_LEN - 16, m  # the system prompt came from the cache
    assert all(len(w) == 1 for w in by_group.values()), by_group
    assert {w for ws in by_group.values() for w in ws} == {"0", "1"}  # the groups spread
    router = dep.info()["router"]
    assert router["policy"] == "cache_aware" and router["decisions"]["hit"] >= 12
    metrics = client.get("/metrics").text
    hits = [line for line in metrics.splitlines()
            if line.startswith("sglbus:router_requests_total{") and 'outcome="hit"' in line]  # fmt: skip
    assert sum(float(line.rsplit(" ", 1)[1]) for line in hits) >= 12, hits
    assert all(w["cached_blocks"] >= 2 * SYSTEM_LEN // 16 for w in router["workers"].values())


def test_two_gateways_send_a_prefix_to_the_same_worker(dep: Deployment) -> None:
    first = {g: ask(dep.gw(0), g, 10)["worker_id"] for g in range(4, 8)}
    second = {g: ask(dep.gw(1), g, 11) for g in range(4, 8)}
    assert {g: m["worker_id"] for g, m in second.items()} == first
    assert all(m["cached_tokens"] >= SYSTEM_LEN - 16 for m in second.values())


def test_a_gateway_that_joins_late_catches_up_from_snapshots(dep: Deployment) -> None:
    where = {g: ask(dep.gw(0), g, 20)["worker_id"] for g in range(4)}
    dep.ports.append(free_port())
    dep.start("gateway-2")
    late = dep.gw(2)
    dep.wait_until(lambda: healthy(late))
    # its index comes from the workers' snapshots: both ran many steps before it started
    dep.wait_until(lambda: synced(late.get("/get_server_info").json()))
    assert late.get("/get_server_info").json()["router"]["kv_snapshots"] >= 2
    for g in range(4):
        m = ask(late, g, 21)
        router = late.get("/get_server_info").json()["router"]
        assert m["worker_id"] == where[g] and m["cached_tokens"] >= SYSTEM_LEN - 16, (g, where, m, router)
    dep.kill("gateway-2", signal.SIGTERM)  # done with it: the suite shares the machine's memory


def test_data_parallel_rank_pins_a_worker(dep: Deployment) -> None:
    client = dep.gw(0)
    body = {"text": "Pinned.", "sampling_params": {"max_new_tokens": 2}}
    for rank in (1, 0, 1):
        r = client.post("/generate", json={**body, "data_parallel_rank": rank})
        assert r.status_code == 200 and r.json()["meta_info"]["worker_id"] == str(rank), r.text
    r = client.post("/generate", json={**body, "data_parallel_rank": 9})
    assert r.status_code == 400 and "data_parallel_rank 9" in r.text and "0, 1" in r.text


def test_a_killed_worker_loses_no_request_and_a_new_one_takes_work(dep: Deployment) -> None:
    client = dep.gw(0)
    where = {g: ask(client, g, 30)["worker_id"] for g in range(8)}
    victim = "1"
    jobs = [(client, g, 31 + q) for q in range(3) for g in range(8)]
    with cf.ThreadPoolExecutor(24) as ex:
        futures = [ex.submit(ask, *j, max_new=48) for j in jobs]
        dep.wait_until(lambda: dep.info()["num_running_reqs"] > 0, 60)
        dep.kill(f"scheduler-{victim}")
        dep.kill(f"detokenizer-{victim}")
        metas = [f.result(timeout=300) for f in futures]  # every one answered: none lost
    assert all(m["completion_tokens"] == 48 and m["finish_reason"]["type"] == "length" for m in metas)
    moved = [m for (_, g, _), m in zip(jobs, metas, strict=True) if where[g] == victim]
    assert moved and all(m["worker_id"] == "0" for m in moved)
    # the killed worker comes back (no gateway restarted); the requests taken back from its queue are
    # not run there again (past ack_wait, the queue would have delivered them)
    dep.start_worker(1)
    dep.wait_until(lambda: "1" in dep.live_workers())
    time.sleep(ACK_WAIT_S + 2)
    assert dep.worker_stats("1")["prompt_tokens"] == 0
    # it leaves on purpose and a worker never seen before joins (two schedulers at most at a time: the
    # suite's other servers share the machine's memory); new prefixes go to its empty cache
    dep.kill("scheduler-1", signal.SIGTERM)
    dep.kill("detokenizer-1", signal.SIGTERM)
    dep.start_worker(2)
    dep.wait_until(lambda: set(dep.live_workers()) == {"0", "2"})
    new = {ask(client, g, 40)["worker_id"] for g in range(8, 12)}
    assert "2" in new, new
