"""The rounding the kernels' contracts spell out, written in the kernels themselves.

`round_to_bf16`: fp32 -> bf16 round to nearest even. The compiled cast (`cvt.rn.bf16.f32`)
does that, but the interpreter that runs the kernels on CPU tensors in tests
(TRITON_INTERPRET=1) truncates. Rounding by hand gives the same bits on both, so CPU tests
check the rounding the GPU does.

`mul_rn`: a product (fp32, or fp64) rounded on its own, never contracted with the add or
subtract that consumes it into one fused multiply-add. Where a contract (a plain-torch
reference) rounds `a * b` before adding, the kernel multiplies through `mul_rn`. A launch option
(`enable_fp_fusion=False`) cannot promise that: torch.compile's wrapper drops backend launch
options, and a caller can override them. On the GPU it is `mul.rn`, an explicitly rounded
instruction that neither LLVM (an opaque asm block) nor ptxas (`.rn` turns off its contraction)
fuses. `add_rn` is the same for a sum whose operand is a product the kernel does not write
itself (the last multiply inside an inlined libdevice function such as exp2).

The interpreter cannot run inline PTX and computes with numpy, which never fuses, so there both
are the plain operation: the switch is taken once, when the kernels are defined, by the same
setting that makes `triton.jit` build interpreted kernels.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton import knobs

INTERPRETED = bool(knobs.runtime.interpret)
"""Whether `triton.jit` builds interpreted kernels in this process (TRITON_INTERPRET=1)."""


@triton.jit
def round_to_bf16(x):
    """[...] fp32 -> [...] bf16, round to nearest even; NaN stays NaN, overflow gives inf."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    # A NaN whose payload sits in the low 16 bits would round into the inf pattern.
    rounded = tl.where(x != x, 0x7FC0 | (bits >> 16), rounded)
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


if INTERPRETED:

    @triton.jit
    def mul_rn(x, y):
        """x * y (fp32 or fp64), rounded to nearest even before any add (numpy: a plain product)."""
        return x * y

    @triton.jit
    def add_rn(x, y):
        """x + y (fp32 or fp64), rounded to nearest even (numpy: a plain sum)."""
        return x + y

else:

    @triton.jit
    def mul_rn(x, y):
        """x * y (fp32, or fp64 if either is), rounded to nearest even before any add (`mul.rn`, never contracted)."""
        if x.dtype == tl.float64 or y.dtype == tl.float64:
            out = tl.inline_asm_elementwise("mul.rn.f64 $0, $1, $2;", "=d,d,d", [x.to(tl.float64), y.to(tl.float64)],
                                            dtype=tl.float64, is_pure=True, pack=1)
        else:
            out = tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [x.to(tl.float32), y.to(tl.float32)],
                                            dtype=tl.float32, is_pure=True, pack=1)
        return out

    @triton.jit
    def add_rn(x, y):
        """x + y (fp32, or fp64 if either is), rounded to nearest even (`add.rn`: no product fuses into it)."""
        if x.dtype == tl.float64 or y.dtype == tl.float64:
            out = tl.inline_asm_elementwise("add.rn.f64 $0, $1, $2;", "=d,d,d", [x.to(tl.float64), y.to(tl.float64)],
                                            dtype=tl.float64, is_pure=True, pack=1)
        else:
            out = tl.inline_asm_elementwise("add.rn.f32 $0, $1, $2;", "=f,f,f", [x.to(tl.float32), y.to(tl.float32)],
                                            dtype=tl.float32, is_pure=True, pack=1)
        return out
