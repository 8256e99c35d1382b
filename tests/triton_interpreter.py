"""Triton's interpreter (TRITON_INTERPRET=1, how sglbus_kernels/ runs in CI), made to compute as the GPU
does. Two faults of Triton 3.6's interpreter are patched here, once, for the whole session:

- a scalar becomes an index through int() of a 1-element array, which numpy >= 2.4 refuses, so every
  loop with runtime bounds fails (triton-lang/triton#9171; its fix, #9172, is the same .item());
- fp32 -> bf16 casts truncate where the GPU rounds to nearest even.

(It also multiplies bf16 operands of tl.dot as raw bit patterns: the kernels compute their dots in
fp32 on CPU instead.)
"""

from __future__ import annotations

import numpy as np
import torch


def patch() -> None:
    import triton.language as tl
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    interpreter._patch_lang_tensor = patched
    real = interpreter._convert_float

    def convert(data, src, dst, rounding_mode):
        if src != tl.float32 or dst != tl.bfloat16:
            return real(data, src, dst, rounding_mode)
        x = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32))
        return x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16).reshape(np.shape(data))

    interpreter._convert_float = convert
