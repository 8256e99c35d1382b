"""Grammar work in child processes, where a timeout really stops it. A grammar library's check or
compile runs in native code that no thread can interrupt (and xgrammar's compile holds the GIL: the
caller's other threads crawl meanwhile), and its cost is not known from the grammar's size: a
551-character regex took xgrammar 74 s. So the work runs in a small pool of worker processes; a run past its
timeout kills its worker, which is replaced at once (it warms up while nobody waits), and a worker
that dies fails only the run it had.

    sandbox = GrammarSandbox(workers=2, init=warm_up, init_args=(...,))   nothing starts yet
    sandbox.run(5.0, fn, *args)     fn(*args) in a worker: its result, or its exception raised here;
                                    GrammarTimeout past 5 s, WorkerDied when the worker died

A worker is `python -m shared.grammar_sandbox` on two pipes (as the gateway's body parser: multiprocessing
would import the parent's main module in it); each message is its length and a pickle. `init` runs
once in each worker before its first run (imports, a tokenizer), so a run's timeout counts only the
run. fn and init are module-level functions (pickled by reference); results must pickle. A worker
runs as the same user as its parent: this bounds time, it is no security boundary.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

_LEN = struct.Struct("<Q")
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # where `shared` is importable from
START_TIMEOUT_S = 120.0  # a worker's start and its init (importing a grammar library, reading a tokenizer)
_spawner: ThreadPoolExecutor | None = None
_spawner_lock = threading.Lock()


class GrammarTimeout(TimeoutError):
    """The run took longer than its timeout; its worker was killed."""


class WorkerDied(RuntimeError):
    """The worker died during the run (killed for memory, a crash in native code), or could not start."""


class _Worker:
    """One child process and its pipes; used by one caller at a time."""

    def __init__(self, init: Callable | None, init_args: tuple) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH")) if p)
        try:
            self.proc = _popen(
                [sys.executable, "-m", "shared.grammar_sandbox"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, start_new_session=True,
            )  # fmt: skip
        except OSError as e:
            raise WorkerDied(f"a grammar worker cannot start: {e}") from None
        self.ready = False
        with contextlib.suppress(OSError):  # a child that died at once: wait_ready says so
            _send(self.proc.stdin, (init, init_args))

    def call(self, timeout: float, fn: Callable, args: tuple) -> tuple[str, Any]:
        """("ok", fn(*args)) or ("error", what it raised), from the child; GrammarTimeout or WorkerDied."""
        self.wait_ready(START_TIMEOUT_S)
        try:
            _send(self.proc.stdin, (fn, args))
        except OSError:
            raise WorkerDied(self._died()) from None
        return self._receive(timeout, "run")

    def wait_ready(self, timeout: float) -> None:
        """Until the child has run init; WorkerDied when it could not (or not within timeout)."""
        if self.ready:
            return
        try:
            tag, value = self._receive(timeout, "start")
        except GrammarTimeout as e:
            raise WorkerDied(str(e)) from None
        if tag != "ready":
            raise WorkerDied(f"the grammar worker could not start: {value}")
        self.ready = True

    def _receive(self, timeout: float, what: str) -> tuple[str, Any]:
        out = self.proc.stdout
        assert out is not None
        readable, _, _ = select.select([out], [], [], max(0.0, timeout))
        if not readable:
            raise GrammarTimeout(f"the grammar worker's {what} took longer than {timeout:g} s")
        try:
            head = _read(out, _LEN.size)
            return pickle.loads(_read(out, _LEN.unpack(head)[0]))
        except (EOFError, OSError, pickle.UnpicklingError):
            raise WorkerDied(self._died()) from None

    def _died(self) -> str:
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return "the grammar worker stopped answering"
        why = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        return f"the grammar worker died ({why}{': out of memory?' if code == -9 else ''})"

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        for f in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                f.close()  # type: ignore[union-attr]


class GrammarSandbox:
    """At most `workers` child processes, started on first use; thread-safe (a caller waits for a
    free worker)."""

    def __init__(self, workers: int = 1, init: Callable | None = None, init_args: tuple = ()) -> None:
        if workers < 1:
            raise ValueError("workers must be >= 1")
        self.workers, self._init, self._init_args = workers, init, init_args
        self._slots = threading.Semaphore(workers)
        self._idle: list[_Worker] = []
        self._lock = threading.Lock()
        self._closed = False
        self.kills = 0  # runs stopped by their timeout

    def spawn(self) -> None:
        """Start every worker now, before any run, without waiting for them (`start` waits)."""
        with self._lock:
            self._idle += [
                _Worker(self._init, self._init_args) for _ in range(self.workers - len(self._idle))
            ]

    def start(self, timeout: float = START_TIMEOUT_S) -> None:
        """Start every worker now and wait (up to timeout) until they have run init; WorkerDied when
        one cannot. They start side by side, so this takes about one worker's start."""
        self.spawn()
        with self._lock:
            idle = list(self._idle)
        deadline = time.monotonic() + timeout
        for w in idle:
            w.wait_ready(deadline - time.monotonic())

    def run(self, timeout: float, fn: Callable, *args: Any) -> Any:
        """fn(*args) in a worker within timeout seconds (counted from when a started worker takes it)."""
        with self._slots:
            with self._lock:
                if self._closed:
                    raise WorkerDied("the grammar sandbox is closed")
                ready = [w for w in self._idle if w.ready]
                w = (ready or self._idle or [None])[0]
                if w is not None:
                    self._idle.remove(w)
            if w is None:
                w = _Worker(self._init, self._init_args)
            try:
                tag, value = w.call(timeout, fn, args)
            except BaseException as e:  # a timeout, a death, or the caller interrupted mid-run
                w.kill()
                self.kills += isinstance(e, GrammarTimeout)
                self._replace()
                raise
            self._give_back(w)  # fn's own exception too: the worker is fine
            if tag == "error":
                raise value
            return value

    def _give_back(self, w: _Worker) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(w)
                return
        w.kill()

    def _replace(self) -> None:
        """A new worker for the one killed, warming up before anyone needs it."""
        with self._lock:
            if not self._closed:
                try:
                    self._idle.append(_Worker(self._init, self._init_args))
                except WorkerDied:  # no process now: the next run tries again
                    pass

    def close(self) -> None:
        """Kill the idle workers; a busy one is killed when its run ends."""
        with self._lock:
            self._closed, idle, self._idle = True, self._idle, []
        for w in idle:
            w.kill()


def _popen(*args: Any, **kwargs: Any) -> subprocess.Popen:
    """Popen on one long-lived thread: a child's PR_SET_PDEATHSIG (below) fires when the thread that
    started it ends, and the thread that asks for a worker may be a short-lived one."""
    global _spawner
    with _spawner_lock:
        if _spawner is None:
            _spawner = ThreadPoolExecutor(1, thread_name_prefix="grammar-spawn")
    return _spawner.submit(subprocess.Popen, *args, **kwargs).result()


def _send(f, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    f.write(_LEN.pack(len(data)) + data)
    f.flush()


def _read(f, n: int) -> bytes:
    data = f.read(n)
    if len(data) < n:
        raise EOFError
    return data


def _serve() -> None:
    """The child: init, then runs until its parent closes the pipe. Its stdout is the pipe back, so
    whatever a library prints goes to stderr instead."""
    reply = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is for the parent, which ends this one
    _die_with_parent()
    source = sys.stdin.buffer
    try:
        init, init_args = pickle.loads(_read(source, _LEN.unpack(_read(source, _LEN.size))[0]))
        if init is not None:
            init(*init_args)
    except EOFError:
        return
    except BaseException as e:
        _send(reply, ("failed", f"{type(e).__name__}: {e}"))
        return
    _send(reply, ("ready", None))
    while True:
        try:
            fn, args = pickle.loads(_read(source, _LEN.unpack(_read(source, _LEN.size))[0]))
        except EOFError:
            return
        try:
            out: tuple[str, Any] = ("ok", fn(*args))
        except Exception as e:
            out = ("error", e if _travels(e) else RuntimeError(f"{type(e).__name__}: {e}"))
        try:
            _send(reply, out)
        except (pickle.PicklingError, TypeError, AttributeError) as e:  # an unpicklable result
            _send(reply, ("error", RuntimeError(f"{type(out[1]).__name__} cannot leave the worker: {e}")))


def _travels(e: Exception) -> bool:
    """Whether the exception comes out of pickle as it went in (one whose __init__ takes other
    arguments than its args does not)."""
    try:
        return type(pickle.loads(pickle.dumps(e))) is type(e)
    except Exception:
        return False


def _die_with_parent() -> None:
    """SIGKILL when the parent dies (Linux), so a worker busy with a grammar never outlives it (an idle
    one reads the end of its pipe and returns)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:  # the parent died before prctl
            os._exit(0)


if __name__ == "__main__":
    _serve()
