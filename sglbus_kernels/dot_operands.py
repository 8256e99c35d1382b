"""The operand dtype and precision of the attention kernels' tl.dot: the KV dtype on the GPU (fp32
as IEEE, never TF32); float32 under Triton's interpreter, whose dot multiplies bf16 bit patterns as
integers."""

from __future__ import annotations

import torch
import triton.language as tl

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def dot_operands(dtype: torch.dtype, device: torch.device) -> tuple[tl.dtype, str]:
    if device.type == "cpu" or dtype == torch.float32:
        return tl.float32, "ieee"
    return _TL_DTYPES[dtype], "tf32"
