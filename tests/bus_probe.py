"""A request put straight on the scheduler, as any client on the bus could publish it (the gateway's
checks skipped), and its outputs caught on its out subject."""

from __future__ import annotations

import queue

from shared.messages import BatchTextOut, Decoder, GenerateReq, TextOut, encode


class BusProbe:
    def __init__(self, engine, subject: str) -> None:
        self.engine, self.subject = engine, subject
        self._got: queue.Queue[TextOut] = queue.Queue()
        dec = Decoder(BatchTextOut)

        async def on_text(m) -> None:
            for out in dec(m.data).outs:
                self._got.put(out)

        self._sub = engine._run(engine.transport.subscribe(subject, on_text))

    def send(self, msg: GenerateReq) -> None:
        wire = Decoder(GenerateReq)(encode(msg))  # what NATS would deliver (NaN survives msgpack)
        self.engine._on_scheduler(lambda s: s.add_request(wire))

    def final(self, timeout: float = 60) -> TextOut:
        while not (out := self._got.get(timeout=timeout)).finished:
            pass
        return out

    def close(self) -> None:
        self.engine._run(self._sub.unsubscribe())

    def __enter__(self) -> BusProbe:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
