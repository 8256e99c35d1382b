"""Grammar checks and compiles that would run for minutes, through the served system: each ends its own
request with a 400 soon after its timeout, the other requests are served meanwhile, and the next
grammar is checked and compiled as usual (the stopped worker process was replaced).

The gateway's check: its worker process is stopped (SIGSTOP) to stand for a check that never ends (the
libraries' own limits and ours leave none that takes minutes to build). The scheduler's compile: a
551-character regex that xgrammar takes over a minute to compile (alternatives of `.{0,n}x`)."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from conftest import ServerProcs, start_server
from it_helpers import PROMPT, generate, greedy

CHECK_TIMEOUT_S = 2.0
COMPILE_TIMEOUT_S = 3.0
SLOW_COMPILE = "(" + "|".join(f".{{0,{1000 + i}}}x" for i in range(50)) + ")"


@pytest.fixture(scope="module")
def stack() -> Iterator[ServerProcs]:
    s = start_server(env={"SGLBUS_GRAMMAR_CHECK_TIMEOUT": str(CHECK_TIMEOUT_S),
                          "SGLBUS_GRAMMAR_COMPILE_TIMEOUT": str(COMPILE_TIMEOUT_S)})  # fmt: skip
    yield s
    s.stop()


def grammar_workers(parent: int) -> list[int]:
    """The gateway's grammar-check processes (its children running shared.grammar_sandbox)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent and b"shared.grammar_sandbox" in cmd:
            found.append(int(pid))
    return found


def in_background(client: httpx.Client, body: dict[str, Any]) -> tuple[threading.Thread, list]:
    out: list = []

    def send() -> None:
        t0 = time.monotonic()
        r = client.post("/generate", json=body)
        out.append((r, time.monotonic() - t0))

    t = threading.Thread(target=send)
    t.start()
    return t, out


def plain_requests_are_served(client: httpx.Client, n: int = 3) -> None:
    for _ in range(n):
        assert client.get("/health", timeout=30).status_code == 200
        out = generate(client, {"text": PROMPT, "sampling_params": greedy(4, ignore_eos=True)})
        assert out["meta_info"]["finish_reason"]["type"] == "length"


def test_a_check_that_never_ends_is_a_400_after_the_timeout_and_the_next_check_runs(stack):
    client = stack.http
    digits = {"text": "Digits:", "sampling_params": greedy(8, regex=r"[0-9]{3}")}
    assert re.fullmatch("[0-9]{3}", generate(client, digits)["text"])  # a worker is up now
    workers = grammar_workers(stack.procs["gateway"].pid)
    assert workers, "no grammar-check process under the gateway"
    for pid in workers:
        os.kill(pid, signal.SIGSTOP)  # its next check never ends
    stuck = {"text": "x", "sampling_params": greedy(4, regex=r"[a-z]{2}")}
    t, out = in_background(client, stuck)
    plain_requests_are_served(client)
    t.join(120)
    r, took = out[0]
    assert r.status_code == 400, r.text
    assert f"sampling_params.regex took longer than {CHECK_TIMEOUT_S:g} s to check; simplify it" in r.text
    assert CHECK_TIMEOUT_S <= took < CHECK_TIMEOUT_S + 30
    for pid in workers:  # not left behind: killed, or still stopped only if no check went to it
        if pid in grammar_workers(stack.procs["gateway"].pid):
            os.kill(pid, signal.SIGCONT)
    assert re.fullmatch("[0-9]{3}", generate(client, digits)["text"])


def test_a_compile_that_would_run_for_a_minute_is_a_400_after_the_timeout_and_others_go_on(stack):
    client = stack.http
    slow = {"text": "x", "sampling_params": greedy(4, regex=SLOW_COMPILE)}
    t, out = in_background(client, slow)
    plain_requests_are_served(client)
    t.join(120)
    r, took = out[0]
    assert r.status_code == 400, r.text
    assert f"compiling the regex took longer than {COMPILE_TIMEOUT_S:g} s; simplify it" in r.text
    assert took < 90  # the backend's first start (seconds) plus the timeout, not the minute it would take
    digits = {"text": "Digits:", "sampling_params": greedy(8, regex=r"[0-9]{3}")}
    assert re.fullmatch("[0-9]{3}", generate(client, digits)["text"])
    stack.settle()
