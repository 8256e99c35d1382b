"""shared/watchdog.py: the beats a service writes down its pipe, and how `sglbus serve` judges them."""

import asyncio
import os

from shared.watchdog import ENV, WatchdogBeat, WatchdogPipe


def beats_from_a_service(pipe: WatchdogPipe, stalled: float, beats: int) -> None:
    """A service's beat task, run for about `beats` beats, on the pipe's write end."""

    async def main() -> None:
        beat = WatchdogBeat(os.dup(pipe.write_fd), lambda: stalled)
        beat.start()
        await asyncio.sleep(0.05 + (beats - 1) * 1.0)
        beat.stop()

    asyncio.run(main())


def test_the_last_beat_counts_and_a_silent_service_is_hung_after_the_timeout():
    pipe = WatchdogPipe()
    try:
        assert pipe.hung(100.0, 10.0) is None  # no beat yet: starting, not hung
        beats_from_a_service(pipe, 0.0, 1)
        pipe.read(100.0)
        assert pipe.last_beat == 100.0 and pipe.stalled == 0.0
        assert pipe.hung(109.0, 10.0) is None
        why = pipe.hung(111.0, 10.0)
        assert why is not None and "no watchdog beat for 11 s" in why
    finally:
        pipe.close()


def test_a_service_that_beats_but_reports_no_progress_is_hung():
    """The scheduler's event loop beats while its step thread is stuck: the beat says for how long."""
    pipe = WatchdogPipe()
    try:
        beats_from_a_service(pipe, 8.0, 1)
        pipe.read(50.0)
        assert pipe.stalled == 8.0
        assert pipe.hung(51.0, 10.0) is None
        why = pipe.hung(53.0, 10.0)
        assert why is not None and "made no progress for 11 s" in why
    finally:
        pipe.close()


def test_a_stall_of_serve_itself_judges_nobody():
    pipe = WatchdogPipe()
    try:
        beats_from_a_service(pipe, 0.0, 1)
        pipe.read(0.0)
        pipe.restart_clock(30.0)  # serve did not run from 0 to 30: nothing could be read meanwhile
        assert pipe.hung(35.0, 10.0) is None
    finally:
        pipe.close()


def test_beats_need_serve_to_ask_for_them(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert WatchdogBeat.from_env() is None
    r, w = os.pipe()
    try:
        monkeypatch.setenv(ENV, str(w))
        beat = WatchdogBeat.from_env()
        assert beat is not None and beat.fd == w
        assert ENV not in os.environ  # the service's own children get no pipe
        assert not os.get_inheritable(w) and not os.get_blocking(w)
    finally:
        os.close(r)
        os.close(w)


def test_a_full_pipe_never_blocks_the_service():
    """Serve stopped reading (it was stopped itself): the service's writes fail, its loop goes on."""
    pipe = WatchdogPipe()
    try:
        os.set_blocking(pipe.write_fd, False)
        while True:  # fill the pipe
            try:
                os.write(pipe.write_fd, b"0.0\n" * 1024)
            except BlockingIOError:
                break
        beats_from_a_service(pipe, 0.0, 2)  # returns: neither beat blocked
    finally:
        pipe.close()
