"""benchmarks/proc_cpu.py: naming a served run's processes and sampling their CPU use."""

import subprocess
import sys
import time

from benchmarks.proc_cpu import ProcessCpu, label


def test_label_names_the_services_by_their_module():
    assert label(["/usr/bin/python3", "-m", "services.scheduler", "--nats-url", "x"]) == "scheduler"
    assert label(["python", "-m", "services.gateway"]) == "gateway"
    assert label(["/site/bin/nats-server", "-p", "4222"]) == "nats-server"
    assert label(["/usr/bin/python3", "-m", "sglbus.cli", "serve"]) == "serve"
    assert label(["/usr/bin/sleep", "5"]) == "sleep"
    assert label([]) == "?"


def test_samples_this_process_and_a_child_that_burns_cpu():
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        with ProcessCpu(child.pid, interval=0.05) as cpu:
            time.sleep(0.5)
    finally:
        child.kill()
        child.wait()
    assert any(name.startswith("client (") for name in cpu.samples)
    busy = next(xs for name, xs in cpu.samples.items() if name.endswith(f"({child.pid})"))
    assert max(busy) > 20  # a spinning loop: well above idle, even on a shared 2-core machine
    report = cpu.report()
    assert report.splitlines()[0].split() == ["process", "mean", "CPU", "%", "peak", "CPU", "%"]
    assert f"({child.pid})" in report
