"""Every launch the package's ops make, compiled for sm_80 and sm_90 on a machine without a GPU.

The public launchers of `sift.triton_kernels` are called with the argument kinds `sift._ops`,
the optimizer and `sift.quantized` pass them (weight and gradient dtypes, compact or dense
gradients, with and without bases, float or tensor lr, segment-table and DIRECT launches, the
4-bit layers' lean step and weight gradient, a served model's mixed deltas), on CPU tensors.
A stand-in driver reports the target, and `JITFunction.run` compiles instead of launching, so
each specialization Triton derives from those calls (dtypes, constexprs, 16-byte alignment of
addresses, sizes equal to 1 or divisible by 16) is lowered to cubin by the ptxas the Triton wheel ships.

Addresses: CPU allocations are 64-byte aligned, so every fresh tensor is 16-byte aligned as the
CUDA caching allocator's 256-byte blocks are; a view at an offset is not, as on the GPU. Sizes:
layer widths are multiples of 16, token and entry counts take both classes (divisible by 16 or
not), one per case in turn rather than crossed with every other choice.

Launches made inside `_launch.recording()` (what torch.compile records) are compiled as Inductor
compiles them: backend options other than num_warps and num_stages are dropped.

Run `python tests/triton_compile_cases.py sm_90` for one target's JSON, or
`python tests/triton_compile_cases.py --write bench/results/gpu-compile.md` for the report.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator

import triton.language as tl

TARGETS = {"sm_80": 80, "sm_90": 90}
# Memory-bound kernels: a spill to local memory costs bandwidth.
STREAMING = ("_sparse_adamw_kernel", "_sparse_adamw_lean_kernel", "_sparse_delta_apply_kernel",
             "_sparse_delta_restore_kernel")
# Kernels whose contracts round every fp32 product before it is added.
ROUNDED = ("_sparse_adamw_kernel", "_sparse_adamw_lean_kernel", "_sparse_delta_apply_kernel")
_FMA_32 = re.compile(r"\b(?:fma|mad)\.[a-z.]*(?:f32|f16|bf16|f16x2|bf16x2)\b")
_FMA_64 = re.compile(r"\b(?:fma|mad)\.[a-z.]*f64\b")


def _launches() -> Iterator[tuple[str, Callable[[], None]]]:
    """(label, a call of a public launcher as one of the package's ops makes it)."""
    import torch

    from sift import _ops
    from sift.triton_kernels import _launch
    from sift.triton_kernels._delta_bank import DeltaBank
    from sift.triton_kernels.delta import sparse_delta_apply_, sparse_delta_restore_
    from sift.triton_kernels.mixed_delta_matmul import mixed_delta_matmul_
    from sift.triton_kernels.singular_values import singular_values
    from sift.triton_kernels.sparse_adamw import sparse_adamw_
    from sift.triton_kernels.sparse_adamw_lean import sparse_adamw_lean_
    from sift.triton_kernels.sparse_weight_grad import sparse_weight_grad

    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    names = {f32: "fp32", bf16: "bf16", f16: "fp16", torch.float64: "fp64", torch.int32: "int32",
             torch.int64: "int64"}
    counter = iter(range(10**6))

    def entries() -> int:
        # Entry counts alternate between the two classes Triton specializes on.
        return 4912 if next(counter) % 2 else 4915

    def state(k: int, dtype: torch.dtype, misaligned: bool = False) -> torch.Tensor:
        # A view 4 bytes into a buffer: an address no 16-byte specialization or hint may assume.
        return torch.zeros(k + 1, dtype=dtype)[1:] if misaligned else torch.zeros(k, dtype=dtype)

    def hyper(lr_tensor: bool, maximize: bool) -> dict:
        return dict(lr=torch.tensor([1e-3]) if lr_tensor else 1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                    weight_decay=0.01, maximize=maximize)

    def run(recorded: bool, fn: Callable, *args, **kwargs) -> None:
        with _launch.recording() if recorded else contextlib.nullcontext():
            fn(*args, table_cache=None if recorded else {}, **kwargs)

    def exact(w, base, compact, i_dtype, lr_tensor, maximize, recorded, misaligned=False):
        n, k = 768 * 64, entries()
        grad = torch.zeros(k) if compact else torch.zeros(n, dtype=w)
        lists = ([torch.zeros(n, dtype=w)], [grad], [state(k, i_dtype, misaligned)],
                 *([state(k, f32, misaligned)] for _ in range(3)), [torch.zeros(k, dtype=w)] if base else [],
                 [torch.ones(1)])
        run(recorded, sparse_adamw_, *lists, compact_grads=compact, **hyper(lr_tensor, maximize))

    def lean(w, compact, lr_tensor, maximize, recorded, n=4096 * 1024):
        k = entries()
        low, off = _ops.encode_lean_indices(torch.arange(0, n, n // k)[:k], n)
        grad = torch.zeros(k) if compact else torch.zeros(n, dtype=w)
        lists = ([torch.zeros(n, dtype=w)], [grad], [low], [off], [torch.zeros(k, dtype=bf16)],
                 [torch.zeros(k, dtype=bf16)], [torch.zeros(k, dtype=torch.int8)] if w != f32 else [],
                 [torch.ones(1)])
        run(recorded, sparse_adamw_lean_, *lists, compact_grads=compact, **hyper(lr_tensor, maximize))

    def delta_values(recorded):
        # A 4-bit layer's [k] fp32 values, stepped as a weight whose every entry is chosen
        # (`SparseAdamW._lean_delta_step`): identity indices, the values' own gradient.
        k = entries()
        low, off = _ops.encode_lean_indices(torch.arange(k), k)
        lists = ([torch.zeros(k)], [torch.zeros(k)], [low], [off], [torch.zeros(k, dtype=bf16)],
                 [torch.zeros(k, dtype=bf16)], [], [torch.ones(1)])
        run(recorded, sparse_adamw_lean_, *lists, compact_grads=False, **hyper(False, False))

    for recorded in (False, True):
        how = "recorded" if recorded else "table"
        for w, base in ((f32, False), (f32, True), (bf16, True), (f16, True)):
            for compact in (False, True):
                for i_dtype in (torch.int32, torch.int64):
                    for lr_tensor in (False, True):
                        label = (f"sparse_adamw_ {names[w]}{' base' if base else ''} "
                                 f"{'compact' if compact else 'dense'} {names[i_dtype]} "
                                 f"lr-{'tensor' if lr_tensor else 'float'} {how}")
                        yield label, lambda a=(w, base, compact, i_dtype, lr_tensor): exact(*a, False, recorded)
            yield (f"sparse_adamw_ {names[w]}{' base' if base else ''} maximize {how}",
                   lambda a=(w, base): exact(*a, False, torch.int32, False, True, recorded))
            if not recorded:
                yield (f"sparse_adamw_ {names[w]}{' base' if base else ''} unaligned state {how}",
                       lambda a=(w, base): exact(*a, True, torch.int32, False, False, recorded, True))
        for w in (f32, bf16, f16):
            for compact in (False, True):
                for lr_tensor in (False, True):
                    label = (f"sparse_adamw_lean_ {names[w]} {'compact' if compact else 'dense'} "
                             f"lr-{'tensor' if lr_tensor else 'float'} {how}")
                    yield label, lambda a=(w, compact, lr_tensor): lean(*a, False, recorded)
                yield (f"sparse_adamw_lean_ {names[w]} {'compact' if compact else 'dense'} maximize {how}",
                       lambda a=(w, compact): lean(*a, False, True, recorded))
            yield (f"sparse_adamw_lean_ {names[w]} one window {how}",
                   lambda a=w: lean(a, False, False, False, recorded, n=768 * 64))
        yield f"sparse_adamw_lean_ 4-bit delta values {how}", lambda: delta_values(recorded)

    for w in (f32, bf16, f16):
        for i_dtype in (torch.int32, torch.int64):
            for save in (True, False):
                def apply(a=(w, i_dtype, save)):
                    k = entries()
                    p, idx = torch.zeros(768 * 64, dtype=a[0]), torch.zeros(k, dtype=a[1])
                    sparse_delta_apply_([p], [idx], [torch.zeros(k)], 0.5, [torch.zeros(k, dtype=a[0])] if a[2] else [])
                yield f"sparse_delta_apply_ {names[w]} {names[i_dtype]}{' saving' if save else ''}", apply

            def restore(a=(w, i_dtype)):
                k = entries()
                sparse_delta_restore_([torch.zeros(768 * 64, dtype=a[0])], [torch.zeros(k, dtype=a[1])],
                                      [torch.zeros(k, dtype=a[0])])
            yield f"sparse_delta_restore_ {names[w]} {names[i_dtype]}", restore

    for dtype in (f32, bf16, f16):
        for i_dtype in (torch.int32, torch.int64):
            for tokens in (4096, 4099):
                # The sparse backward and the 4-bit layers: dY [T, R] and X [T, C], rows contiguous.
                def weight_grad(a=(dtype, i_dtype, tokens)):
                    dy, x = torch.zeros(a[2], 768, dtype=a[0]), torch.zeros(a[2], 64, dtype=a[0])
                    sparse_weight_grad(dy, x, torch.zeros(entries(), dtype=a[1]))
                yield f"sparse_weight_grad {names[dtype]} {names[i_dtype]} T={tokens}", weight_grad

    for dtype in (f32, bf16, f16):
        for tokens, recorded, wide in ((8, False, False), (8, True, False), (4096, False, False),
                                       (4096, True, False), (4096, False, True)):
            # A served model's layer: y [T, R] the base product, x [T, C], one delta id per token,
            # a bank of 3 deltas of a [768, 64] weight; a decode step (one token per row) and a prefill.
            # The bank as DeltaBank builds it (int32 row pointers, int16 columns, the layer's dtype's
            # values), and once in the wide forms (int64, int32, fp32: a bank past int32's entries).
            def mixed(a=(dtype, tokens, recorded, wide)):
                k = entries()
                bank = (DeltaBank(torch.zeros(3, 769, dtype=torch.int64), torch.zeros(k, dtype=torch.int32),
                                  torch.zeros(k), 5, 64) if a[3] else
                        DeltaBank(torch.zeros(3, 769, dtype=torch.int32), torch.zeros(k, dtype=torch.int16),
                                  torch.zeros(k, dtype=a[0]), 5, 64))
                with _launch.recording() if a[2] else contextlib.nullcontext():
                    mixed_delta_matmul_(torch.zeros(a[1], 768, dtype=a[0]), torch.zeros(a[1], 64, dtype=a[0]),
                                        torch.zeros(a[1], dtype=torch.int32), bank)
            yield (f"mixed_delta_matmul_ {names[dtype]} T={tokens}{' wide bank' if wide else ''}"
                   f"{' recorded' if recorded else ''}", mixed)

    for dtype in (f16, bf16, f32, torch.float64):
        for k in (16, 32, 64, 128):
            for s, d in ((2 * k + 3, k), (k, 2 * k + 3)):
                def sv(a=(dtype, s, d)):
                    singular_values(torch.zeros(3, a[1], a[2], dtype=a[0]))
                yield f"singular_values {names[dtype]} [{s}, {d}]", sv
    for k in (16, 32, 64, 128):
        yield (f"singular_values fp32 [{2 * k + 3}, {k}] gram by fma",
               lambda k=k: singular_values(torch.zeros(3, 2 * k + 3, k), gram_by_dot=False))


class _CompileOnlyDriver:
    """The active driver as far as `JITFunction.run` asks: the target, a device, a stream."""

    def __init__(self, arch: int) -> None:
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self) -> int:
        return self.target.arch  # one cache per target in each kernel's `device_caches`

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def is_active(self) -> bool:
        return True


def _exp2_fp64(x_ptr):
    """The probe for libdevice's own fp64 FMAs: one exp2, compiled without fp fusion."""
    tl.store(x_ptr, tl.exp2(tl.load(x_ptr)))


_PTXAS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads.*?"
                    r"Used (\d+) registers", re.S)


def _assemble(ptx: str, metadata) -> str:
    """ptxas's verbose log for `ptx`, with the flags Triton's compile passes it."""
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    arch = metadata.target.arch
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        fmad = [] if metadata.enable_fp_fusion else ["--fmad=false"]
        done = subprocess.run([get_ptxas(arch).path, "-lineinfo", *fmad, "-v", "--regAllocOptLevel=2",
                               f"--gpu-name={sm_arch_from_capability(arch)}", src, "-o", os.path.join(tmp, "k.cubin")],
                              capture_output=True, text=True, check=True)
    return done.stdout + done.stderr


def compile_target(target: str) -> list[dict]:
    """Every specialization the launches reach for `target`, compiled once each."""
    import triton
    from triton import knobs
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    from sift.triton_kernels import _launch

    knobs.nvidia.dump_ptxas_log = True  # the register and spill counts, printed by the compile
    driver.set_active(_CompileOnlyDriver(TARGETS[target]))
    options = triton.compiler.make_backend(driver.active.get_current_target()).parse_options({}).__dict__
    with contextlib.redirect_stdout(io.StringIO()):
        probe = triton.compile(triton.compiler.ASTSource(triton.jit(_exp2_fp64), {"x_ptr": "*fp64"}, {}),
                               target=driver.active.get_current_target(), options={"enable_fp_fusion": False})
    exp2_fma = len(_FMA_64.findall(probe.asm["ptx"]))
    compiled: dict[tuple, dict] = {}
    current = [""]
    original = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        if _launch.is_recording():
            kwargs = {k: v for k, v in kwargs.items()
                      if k in self.arg_names or k not in options or k in ("num_warps", "num_stages")}
        binder = self.device_caches[driver.active.get_current_device()][4]
        _, specialization, opts = binder(*args, **kwargs)
        key = (self.fn.__name__, str(specialization), str(opts))
        log = io.StringIO()
        with contextlib.redirect_stdout(log):
            kernel = original(self, *args, grid=grid, warmup=True, **kwargs)
        if key not in compiled:
            ptx = kernel.asm["ptx"]
            # A kernel from Triton's disk cache was not assembled here: assemble its PTX again.
            found = _PTXAS.search(log.getvalue()) or _PTXAS.search(_assemble(ptx, kernel.metadata))
            stack, spill_st, spill_ld, regs = map(int, found.groups())
            compiled[key] = dict(kernel=self.fn.__name__, launch=current[0], registers=regs, spill_stores=spill_st,
                                 spill_loads=spill_ld, stack=stack, shared=int(kernel.metadata.shared),
                                 num_warps=int(kernel.metadata.num_warps), fma_32=len(_FMA_32.findall(ptx)),
                                 fma_64=len(_FMA_64.findall(ptx)), exp2_fp64_fma=exp2_fma, cubin_bytes=len(kernel.asm["cubin"]))
        return kernel

    JITFunction.run = compile_only
    try:
        for label, call in _launches():
            current[0] = label
            call()
    finally:
        JITFunction.run = original
    return list(compiled.values())


def compile_all() -> dict[str, list[dict]]:
    """`compile_target` for every target, each in its own process (in parallel, without the interpreter)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "SIFT_BACKEND")}
    env.update(CUDA_VISIBLE_DEVICES="", TRITON_DEFAULT_FP_FUSION="1")
    procs = {t: subprocess.Popen([sys.executable, __file__, t], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, env=env) for t in TARGETS}
    out = {}
    for target, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=1200)
        if proc.returncode:
            raise RuntimeError(f"compiling for {target} failed:\n{stderr[-4000:]}")
        out[target] = json.loads(stdout.strip().splitlines()[-1])
    return out


def versions() -> dict[str, str]:
    """The toolchain the report depends on: triton, the ptxas it runs per target, torch."""
    import torch
    import triton
    from triton.backends.nvidia.compiler import get_ptxas

    releases = []
    for arch in TARGETS.values():
        text = subprocess.run([get_ptxas(arch).path, "--version"], capture_output=True, text=True).stdout
        release = re.search(r"release ([\d.]+)", text)
        releases.append(release.group(1) if release else "?")
    return {"triton": triton.__version__, "ptxas": " / ".join(dict.fromkeys(releases)),
            "torch": torch.__version__.split("+")[0]}


def report(results: dict[str, list[dict]], tools: dict[str, str]) -> str:
    """bench/results/gpu-compile.md: per kernel and target, its specializations' resources."""
    kernels = sorted({r["kernel"] for rows in results.values() for r in rows})
    lines = ["# Triton kernels compiled for sm_80 and sm_90 (no GPU)", "",
             f"Generated by `python tests/triton_compile_cases.py --write bench/results/gpu-compile.md`; "
             f"triton {tools['triton']}, ptxas {tools['ptxas']}, torch {tools['torch']}. Compile only: no run, no "
             "timing. Each specialization is one the package's launch arguments produce (see the script's "
             "docstring); registers and spills are ptxas's, per thread; shared memory in bytes per program; "
             "f32 FMA counts fused multiply-adds on 32/16-bit floats in the PTX (the rounded kernels must "
             "have none); the step kernels' fp64 FMAs are exactly those of libdevice's exp2, twice (the bias "
             "corrections).", "",
             "| kernel | target | specializations | warps | registers | spill stores / loads (max) | stack (max) "
             "| shared (max) | f32 FMA (max) |", "|---|---|---|---|---|---|---|---|---|"]
    for kernel in kernels:
        for target, rows in results.items():
            rows = [r for r in rows if r["kernel"] == kernel]
            regs = sorted(r["registers"] for r in rows)
            warps = sorted({r["num_warps"] for r in rows})
            lines.append(f"| `{kernel}` | {target} | {len(rows)} | {', '.join(map(str, warps))} | "
                         f"{regs[0]}-{regs[-1]} | {max(r['spill_stores'] for r in rows)} / "
                         f"{max(r['spill_loads'] for r in rows)} | {max(r['stack'] for r in rows)} | "
                         f"{max(r['shared'] for r in rows)} | {max(r['fma_32'] for r in rows)} |")
    for kernel in kernels:
        lines += ["", f"## `{kernel}`", "", "| first launch reaching it | " + " | ".join(
            f"{t} regs / spills / shared" for t in results) + " |", "|---|" + "---|" * len(results)]
        by_target = [[r for r in rows if r["kernel"] == kernel] for rows in results.values()]
        for same in zip(*by_target):
            cells = [f"{r['registers']} / {r['spill_stores'] + r['spill_loads']} / {r['shared']}" for r in same]
            lines.append(f"| {same[0]['launch']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if sys.argv[1:2] == ["--write"]:
        text = report(compile_all(), versions())
        with open(sys.argv[2], "w") as f:
            f.write(text)
    else:
        print(json.dumps(compile_target(sys.argv[1])))
