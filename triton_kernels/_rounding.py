"""fp32 -> bf16 rounding shared by the kernels that write bf16 weights.

The compiled cast (`cvt.rn.bf16.f32`) rounds to nearest even, but the interpreter that runs
the kernels on CPU tensors in tests (TRITON_INTERPRET=1) truncates. Rounding by hand gives the
same bits on both, so CPU tests check the rounding the GPU does.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to_bf16(x):
    """[...] fp32 -> [...] bf16, round to nearest even; NaN stays NaN, overflow gives inf."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    # A NaN whose payload sits in the low 16 bits would round into the inf pattern.
    rounded = tl.where(x != x, 0x7FC0 | (bits >> 16), rounded)
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
