"""Small host data to the device without a host sync. On CUDA a copy from pageable memory makes the
host wait for the stream (which would stall overlap scheduling), and pinning a fresh buffer per copy
costs far more than the copy; so every copy goes through one pinned ring, reused in segments: before
the ring comes back to a segment, the copies that read it last time are waited for (long done by
then: a lap is many steps). On CPU the values become a plain tensor.

    to_device([3, 1, 2], torch.int64, device)      a list or a CPU tensor; returns a device tensor
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

_SEGMENTS = 8
_SEGMENT_BYTES = 8 << 20  # larger copies pin a buffer of their own
_ALIGN = 64


class _PinnedRing:
    def __init__(self) -> None:
        self.buf = torch.empty(_SEGMENTS * _SEGMENT_BYTES, dtype=torch.uint8, pin_memory=True)
        self.segment, self.at = 0, 0  # the segment in use and the next free byte in it
        self.left: list[torch.cuda.Event | None] = [None] * _SEGMENTS  # recorded when we last left it
        self.lock = threading.Lock()

    def copy(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        n = host.numel() * host.element_size()
        if n > _SEGMENT_BYTES:
            return host.pin_memory().to(device, non_blocking=True)
        with self.lock:
            if self.at + n > _SEGMENT_BYTES:
                self._next_segment()
            start = self.segment * _SEGMENT_BYTES + self.at
            self.at += (n + _ALIGN - 1) // _ALIGN * _ALIGN
            staged = self.buf[start : start + n].view(host.dtype).view(host.shape)
            staged.copy_(host)
            return staged.to(device, non_blocking=True)

    def _next_segment(self) -> None:
        event = torch.cuda.Event()
        event.record()
        self.left[self.segment] = event
        self.segment, self.at = (self.segment + 1) % _SEGMENTS, 0
        waiting = self.left[self.segment]
        if waiting is not None:
            waiting.synchronize()


_ring: _PinnedRing | None = None


def to_device(
    values: Sequence | torch.Tensor, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    global _ring
    host = values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    device = torch.device(device)
    if device.type != "cuda":
        return host
    if _ring is None:
        _ring = _PinnedRing()
    return _ring.copy(host.contiguous(), device)
