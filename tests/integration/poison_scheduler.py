"""`python tests/integration/poison_scheduler.py <scheduler args>`: the real scheduler service, except
that a forward whose input ids hold `POISON` (two ids in a row) kills its own process with SIGKILL, as a
segfault or a device fault would: a request with them in its prompt crashes its scheduler every time it
runs. For tests/integration/test_crash_quarantine.py only; nothing in the product imports it."""

from __future__ import annotations

import os
import signal

from services.scheduler.__main__ import main
from services.scheduler.model_runner import ModelRunner

POISON = (49150, 49151)  # the last two ids of the default model's vocabulary

_forward = ModelRunner.forward


def _poisoned_forward(self, fb):  # type: ignore[no-untyped-def]
    ids = fb.input_ids
    if ids.numel() > 1 and bool(((ids[:-1] == POISON[0]) & (ids[1:] == POISON[1])).any()):
        os.kill(os.getpid(), signal.SIGKILL)
    return _forward(self, fb)


if __name__ == "__main__":
    ModelRunner.forward = _poisoned_forward
    main()
