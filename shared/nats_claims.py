"""`Transport.claim` on NATS: a JetStream key-value bucket per deployment, in memory, whose entries
expire after CLAIM_TTL_S. The first `create` of a key wins (JetStream stores a key's first message
only when none is there: one answer for every client, in any order of arrival); the others read the
winner's value."""

from __future__ import annotations

import asyncio

from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from shared.transport import CLAIM_TTL_S

CLAIMS_MAX_BYTES = 64 << 20  # claims are ~100 bytes each: ~600k in flight at most (discard new past it)


class NatsClaims:
    def __init__(self, js: JetStreamContext, replicas: int = 1) -> None:
        self.js, self.replicas = js, replicas
        self._buckets: dict[str, asyncio.Task[KeyValue]] = {}

    async def claim(self, bucket: str, key: str, value: str) -> str:
        kv = await self._bucket(bucket)
        for _ in range(3):  # a claim may expire between our create and our read: try again
            try:
                await kv.create(key, value.encode())
                return value
            except KeyWrongLastSequenceError:
                try:
                    return (await kv.get(key)).value.decode()
                except KeyNotFoundError:
                    continue
        return value

    async def _bucket(self, name: str) -> KeyValue:
        task = self._buckets.get(name)
        if task is None or (task.done() and task.exception() is not None):
            config = KeyValueConfig(bucket=name, ttl=CLAIM_TTL_S, history=1, storage=StorageType.MEMORY,
                                    max_bytes=CLAIMS_MAX_BYTES, replicas=self.replicas)  # fmt: skip
            task = self._buckets[name] = asyncio.ensure_future(self.js.create_key_value(config))
        return await asyncio.shield(task)
