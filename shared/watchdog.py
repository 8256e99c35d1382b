"""`sglbus serve`'s watchdog: each service it starts writes a beat down a pipe every second, and serve
kills (SIGKILL) and restarts one that stopped making progress, as it restarts one that died.

A process can be alive and still do nothing: stopped (SIGSTOP, a debugger), its event loop blocked,
or (the scheduler) its step thread stuck in a step that never returns (a device hang), while the
event loop still answers the bus and keeps the step thread's work-queue deliveries held. So a beat
is written by the event loop (a blocked loop, or a stopped process, writes none) and carries how long
the service has gone without progress of its own: for the scheduler, the time its step thread has
been inside one turn of its loop (a long prefill counts, up to the timeout; an idle thread turns
every second); 0 for the others. Serve judges `silence + stalled` against `--watchdog-timeout`.

The pipe, not NATS: a bus outage must not look like a hung service, and serve needs no bus client.
The beat is one line, `<seconds stalled>\n`, shorter than PIPE_BUF, so each write is atomic.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable

ENV = "SGLBUS_WATCHDOG_FD"  # the pipe's write end in a service `sglbus serve` started
INTERVAL_S = 1.0


class WatchdogBeat:
    """The service's side: a task on its event loop that writes a beat every INTERVAL_S."""

    def __init__(self, fd: int, stalled_for: Callable[[], float] = lambda: 0.0) -> None:
        self.fd, self.stalled_for = fd, stalled_for
        self._task: asyncio.Task | None = None

    @classmethod
    def from_env(cls, stalled_for: Callable[[], float] | None = None) -> WatchdogBeat | None:
        """The beat serve asked for (None when this process was not started by it with a watchdog).
        The variable is taken out of the environment: the service's own children have no pipe."""
        raw = os.environ.pop(ENV, None)
        if raw is None or not raw.isdigit():
            return None
        fd = int(raw)
        try:
            os.set_blocking(fd, False)  # a supervisor that does not read must never block the loop
            os.set_inheritable(fd, False)
        except OSError:
            return None
        return cls(fd, stalled_for or (lambda: 0.0))

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        with contextlib.suppress(OSError):
            os.close(self.fd)

    async def _run(self) -> None:
        while True:
            try:
                os.write(self.fd, b"%.1f\n" % max(0.0, self.stalled_for()))
            except BlockingIOError:  # the pipe is full: serve is not reading (stopped); nothing to do
                pass
            except OSError:  # serve is gone (EPIPE): nobody watches any more
                return
            await asyncio.sleep(INTERVAL_S)


def start_watchdog(stalled_for: Callable[[], float] | None = None) -> WatchdogBeat | None:
    """Start beating if serve asked for it (call once the service is up: serve watches from the
    first beat on, so loading a model never counts as a hang)."""
    beat = WatchdogBeat.from_env(stalled_for)
    if beat is not None:
        beat.start()
    return beat


class WatchdogPipe:
    """Serve's side, for one child process: the read end of its pipe, and what its beats said."""

    def __init__(self) -> None:
        self.read_fd: int | None
        self.write_fd: int | None
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        self.started = time.monotonic()
        self.last_beat: float | None = None  # when the last beat was read; None before the first
        self.stalled = 0.0  # what the last beat said
        self._partial = b""

    def child_started(self) -> None:
        """The child has its copy of the write end: close ours, so the pipe ends when the child does."""
        if self.write_fd is not None:
            os.close(self.write_fd)
            self.write_fd = None

    def read(self, now: float) -> None:
        """Take every beat waiting in the pipe; the last one counts."""
        if self.read_fd is None:
            return
        data = self._partial
        while True:
            try:
                chunk = os.read(self.read_fd, 4096)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                return
            if not chunk:  # the child closed it (it is exiting)
                break
            data += chunk
        *lines, self._partial = data.split(b"\n")
        for line in reversed(lines):
            try:
                self.stalled = float(line)
            except ValueError:
                continue
            self.last_beat = now
            break

    def restart_clock(self, now: float) -> None:
        """Serve itself was stopped or starved: nothing could be read meanwhile, so no child is judged
        on that time (as the scheduler restarts the gateways' clocks after a stall of its own)."""
        if self.last_beat is not None:
            self.last_beat, self.stalled = now, 0.0

    def hung(self, now: float, timeout: float) -> str | None:
        """Why the child counts as hung (no progress for longer than `timeout`), or None."""
        if self.last_beat is None:
            return None  # still starting: the start-up limits decide
        silent = now - self.last_beat
        if self.stalled + silent <= timeout:
            return None
        if silent >= self.stalled:
            return f"sent no watchdog beat for {silent:.0f} s (stopped, or its event loop is blocked)"
        return f"made no progress for {self.stalled + silent:.0f} s (one turn of its work loop never ended)"

    def close(self) -> None:
        for fd in (self.read_fd, self.write_fd):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.read_fd = self.write_fd = None
