"""Request bodies parsed off the event loop. A small body is parsed in place; a large one in a child
process, because JSON parsing holds the GIL: a thread would not help, orjson builds the ~5.6 M ints of
a 32 MiB `input_ids` body in one call of ~0.2 s, and `/health` would wait that long.

The child is `python -m services.gateway.body_parser` on a pipe (multiprocessing would re-import the
gateway's main module in it). Each message on the pipe is its length and its bytes. In: the body. Out:
the pickled result with every prompt's token ids taken out, then those ids as one int32 block, which
the gateway reads and turns into lists a slice at a time, yielding to the event loop between slices.
The child also checks the ids against the vocabulary (an id that does not fit int32 is outside any).
A child that died, or that has not answered in time (stopped, swapped out), is killed and the body parses
on a thread instead; the next large body starts a new child."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pickle
import struct
import sys
from array import array
from typing import Any

from services.gateway.generate_input import GenerateInput, check_vocabulary, decode_json, parse_generate_input

log = logging.getLogger(__name__)
Parsed = tuple[bool, GenerateInput | ValueError]  # whether it asked for a stream; the request or why not
_CHILD_BYTES = 1 << 20  # bodies from this size on go to the child
_SLICE = 1 << 16  # token ids read and turned into a list between two yields to the event loop
_LEN = struct.Struct("<Q")
# how long the child may take for a body: far more than parsing needs (~0.2 s for 32 MiB of ids),
# so only a child that is stuck runs out of it
TIMEOUT_S = 10.0
TIMEOUT_S_PER_MIB = 1.0


class BodyParser:
    def __init__(
        self,
        vocab_size: int,
        max_states: int | None = None,
        child_bytes: int = _CHILD_BYTES,
        timeout_s: float = TIMEOUT_S,
        timeout_s_per_mib: float = TIMEOUT_S_PER_MIB,
    ) -> None:
        self.vocab_size, self.child_bytes = vocab_size, child_bytes
        self.max_states = max_states  # prompts x n: a larger request is refused before it is built
        self.timeout_s, self.timeout_s_per_mib = timeout_s, timeout_s_per_mib
        self._child: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()  # one body at a time through the pipe

    async def start(self) -> None:
        """Starts the child now (an interpreter start), not on the first large request."""
        async with self._lock:
            await self._started()

    async def stop(self) -> None:
        child, self._child = self._child, None
        if child is not None:
            with contextlib.suppress(ProcessLookupError):
                child.kill()
            await child.wait()

    async def parse(self, body: bytes) -> Parsed:
        """The body: whether it asked for a stream (a rejected stream is still ended as one), and the
        parsed request or why it is invalid."""
        if len(body) < self.child_bytes:
            return parse(body, self.max_states)
        timeout = self.timeout_s + self.timeout_s_per_mib * len(body) / (1 << 20)
        async with self._lock:
            try:
                return await asyncio.wait_for(self._ask(body), timeout)
            except TimeoutError:  # (an OSError too: caught first) the child is stuck
                log.warning("the body-parsing child process did not answer within %.1f s (a %d-byte body): "
                            "it is killed and the body parses on a thread", timeout, len(body))  # fmt: skip
            except (OSError, EOFError, asyncio.IncompleteReadError):  # the child died
                log.warning("the body-parsing child process died; the body parses on a thread")
            except asyncio.CancelledError:  # the pipe is mid-body: no later body may read this answer
                self._kill()
                raise
            await self.stop()  # a new child starts with the next large body
        return await asyncio.to_thread(parse, body, self.max_states)

    def _kill(self) -> None:
        if self._child is not None:
            with contextlib.suppress(ProcessLookupError):
                self._child.kill()
            self._child = None  # asyncio reaps it

    async def _started(self) -> asyncio.subprocess.Process:
        if self._child is None or self._child.returncode is not None:
            self._child = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "services.gateway.body_parser", str(self.vocab_size),
                str(self.max_states or 0), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            )  # fmt: skip
        return self._child

    async def _ask(self, body: bytes) -> Parsed:
        child = await self._started()
        w, r = child.stdin, child.stdout
        assert w is not None and r is not None
        w.write(_LEN.pack(len(body)))
        view = memoryview(body)
        for i in range(0, len(body), 4 * _SLICE):  # a large write would copy the whole body at once
            w.write(view[i : i + 4 * _SLICE])
            await w.drain()
        (n,) = _LEN.unpack(await r.readexactly(_LEN.size))
        stream, parsed, lengths = pickle.loads(await r.readexactly(n))
        if isinstance(parsed, GenerateInput):
            for p, length in zip(parsed.prompts, lengths, strict=True):
                if length:
                    p.input_ids = await _read_ids(r, length)
        return stream, parsed


async def _read_ids(r: asyncio.StreamReader, length: int) -> list[int]:
    ids: list[int] = []
    for i in range(0, length, _SLICE):
        ids += memoryview(await r.readexactly(4 * min(_SLICE, length - i))).cast("i").tolist()
        await asyncio.sleep(0)
    return ids


def parse(body: bytes, max_states: int | None = None) -> Parsed:
    try:
        obj = decode_json(body)
    except ValueError as e:
        return False, e
    stream = isinstance(obj, dict) and obj.get("stream") is True
    try:
        return stream, parse_generate_input(obj, max_states)
    except ValueError as e:
        return stream, e


def _serve(vocab_size: int, max_states: int | None, stdin: Any, stdout: Any) -> None:
    """(child process) bodies in, results out, until the pipe closes."""
    while header := stdin.read(_LEN.size):
        (n,) = _LEN.unpack(header)
        stream, parsed = parse(stdin.read(n), max_states)
        blocks: list[bytes] = []
        lengths: list[int] = []  # per prompt (0: a text)
        if isinstance(parsed, GenerateInput):
            try:
                for p in parsed.prompts:
                    ids, p.input_ids = p.input_ids, None
                    if ids is not None:
                        check_vocabulary(ids, vocab_size)
                        blocks.append(array("i", ids).tobytes())
                    lengths.append(0 if ids is None else len(ids))
            except ValueError as e:
                parsed, blocks = e, []
        out = pickle.dumps((stream, parsed, lengths), protocol=pickle.HIGHEST_PROTOCOL)
        stdout.write(_LEN.pack(len(out)))
        stdout.write(out)
        for b in blocks:
            stdout.write(b)
        stdout.flush()


if __name__ == "__main__":
    _serve(int(sys.argv[1]), int(sys.argv[2]) or None, sys.stdin.buffer, sys.stdout.buffer)
