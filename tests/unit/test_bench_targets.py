"""The latency benchmarks hand the server they measure (benchmarks.launch.Target) to their runs: its
URL, NATS URL and token, whatever else a Target carries (a launched server's pid)."""

from __future__ import annotations

import contextlib

import pytest

from benchmarks import bus_latency, health_latency
from benchmarks.launch import Target

TARGET = Target("http://127.0.0.1:1", "nats://127.0.0.1:2", "tok", pid=1234)


@pytest.fixture
def fake_target(monkeypatch):
    @contextlib.contextmanager
    def target(args):
        yield TARGET

    for mod in (bus_latency, health_latency):
        monkeypatch.setattr(mod, "target", target)
        monkeypatch.setattr(mod, "print_block", lambda *a, **k: None)


def test_bus_latency_runs_against_the_target(fake_target, monkeypatch):
    seen = []

    async def measure(args, base, nats_url, token):
        seen.append((base, nats_url, token))
        return {}

    monkeypatch.setattr(bus_latency, "measure", measure)
    assert bus_latency.main([]) == 0
    assert seen == [(TARGET.base, TARGET.nats_url, TARGET.nats_token)]


def test_health_latency_runs_against_the_target(fake_target, monkeypatch):
    seen = []
    monkeypatch.setattr(
        health_latency, "run", lambda args, base, nats_url, token: seen.append((base, nats_url, token))
    )
    assert health_latency.main([]) == 0
    assert seen == [(TARGET.base, TARGET.nats_url, TARGET.nats_token)]
