"""The detokenizer behind the bus: one BatchTokenOut in, one BatchTextOut per gateway out."""

from __future__ import annotations

import logging
from typing import Any

import msgspec

from services.detokenizer.detokenizer import Detokenizer
from shared.heartbeat import Heartbeat
from shared.messages import BatchTokenOut, Decoder, encode, encode_split
from shared.transport import Message, Subjects, Subscription, Transport

log = logging.getLogger(__name__)


class DetokenizerService:
    def __init__(self, tokenizer: Any, transport: Transport, subject_prefix: str, worker_id: str) -> None:
        self.detok = Detokenizer(tokenizer)
        self.transport = transport
        self.subjects = Subjects(subject_prefix)
        self.worker_id = worker_id
        self._dec = Decoder(BatchTokenOut)
        self._sub: Subscription | None = None

    async def start(self) -> None:
        self._sub = await self.transport.subscribe(self.subjects.detok(self.worker_id), self._on_tokens)
        self._heartbeat = Heartbeat(
            self.transport, self.subjects.ctl("heartbeat"), "detokenizer", self.worker_id
        )
        self._heartbeat.start()

    async def stop(self) -> None:
        await self._heartbeat.stop()
        if self._sub is not None:
            await self._sub.unsubscribe()

    async def _on_tokens(self, m: Message) -> None:
        try:
            outs, stopped = self.detok.step(self._dec(m.data))
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as e:  # not from a scheduler
            log.warning("ignoring a message on %s that is not a valid step output: %s", m.subject, e)
            return
        for subject, batch in outs.items():
            batch.worker = self.worker_id
            for data in encode_split(batch, self.transport.max_payload):
                await self.transport.publish(subject, data)
        for abort in stopped:
            await self.transport.publish(self.subjects.abort, encode(abort))
