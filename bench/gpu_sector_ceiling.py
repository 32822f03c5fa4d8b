"""How fast can any sparse AdamW step be on this GPU? Random-sector ceilings.

    python bench/gpu_sector_ceiling.py [--quick] [--l2-fetch default,32,64,128]

The SparseAdamW step touches, per selected entry, the gradient and the weight at a random
position (sorted indices, but far apart at low density) and its own compact state
contiguously. This script times the random part alone, with minimal Triton kernels that do
nothing but the memory traffic, on one flat fp32 weight and gradient of 1.07B elements (the
benchmark's 8 x 8192x16384) at 0.1%, 1% and 5%:

    gather g          out[j] = g[idx[j]]                     one random read
    scatter w         w[idx[j]] = v[j]                       one random partial write
    rmw w             w[idx[j]] += 1                         read + write of the same sector
    g -> w            w[idx[j]] = v[j] + g[idx[j]]           the traffic if the compact state
                                                             kept an fp32 copy of the weight
    g + rmw w         w[idx[j]] += g[idx[j]]                 the traffic of today's step
    SparseAdamW       the real fused kernel (sift.triton_kernels.sparse_adamw_) on the same
                      indices, compact fp32 state

next to torch's fused AdamW over the dense 1.07B elements. Each is timed under several bounds
on the L2 fetch granularity (`--l2-fetch`, default: the driver's, 32, 64, 128 bytes; see
`sift/bench/_l2.py`): if a miss fetches 64 bytes where a gather needs 32, a sparse step moves up to
twice the bytes the sector model counts, and a 32-byte bound would show it. "x vs fused" of a pattern is the
best speed-up over fused AdamW that a step with that traffic could reach; if SparseAdamW is
close to "g + rmw w", the kernel is at the memory system's limit for this state layout, and
only a layout that removes random traffic can go faster. "sector GB/s" counts every distinct
32-byte sector touched once per access (the suite's byte model).

Without CUDA the script runs tiny sizes through the Triton interpreter (a plumbing check;
its times mean nothing).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from sift.bench._l2 import (  # noqa: E402
    get_l2_fetch_granularity,
    l2_fetch_granularity,
    l2_fetch_granularity_unavailable,
)
from sift.bench._harness import header_lines  # noqa: E402
from sift.bench.adamw import sparse_step_bytes, transactions_touched  # noqa: E402
from sift.triton_kernels.sparse_adamw import sparse_adamw_  # noqa: E402

BLOCK = 1024
HBM_TB_S = 4.8


@triton.jit
def _pattern_kernel(w_ptr, g_ptr, v_ptr, out_ptr, idx_ptr, k, READ_G: tl.constexpr, READ_W: tl.constexpr,
                    WRITE_W: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < k
    pos = tl.load(idx_ptr + offs, mask=mask, other=0).to(tl.int64)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    if READ_G:
        acc += tl.load(g_ptr + pos, mask=mask, other=0.0)
    if READ_W:
        acc += tl.load(w_ptr + pos, mask=mask, other=0.0) + 1.0
    else:
        acc += tl.load(v_ptr + offs, mask=mask, other=0.0)
    if WRITE_W:
        tl.store(w_ptr + pos, acc, mask=mask)
    else:
        tl.store(out_ptr + offs, acc, mask=mask)


# name -> (READ_G, READ_W, WRITE_W, random reads, random writes)
PATTERNS = {
    "gather g": (True, False, False, 1, 0),
    "scatter w": (False, False, True, 0, 1),
    "rmw w": (False, True, True, 1, 1),
    "g -> w": (True, False, True, 1, 1),
    "g + rmw w": (True, True, True, 2, 1),
}


def _bench(fn, device: torch.device) -> float:
    if device.type == "cuda":
        from triton.testing import do_bench

        ms = do_bench(fn, quantiles=[0.5])
        return ms[0] if isinstance(ms, (list, tuple)) else ms
    fn()
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def random_sorted_indices(numel: int, density: float, device: torch.device, seed: int = 0) -> torch.Tensor:
    """Sorted unique int32 positions, each kept with probability `density` (chunked)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    parts, chunk = [], 1 << 27
    for start in range(0, numel, chunk):
        n = min(chunk, numel - start)
        keep = torch.rand(n, device=device, generator=gen) < density
        parts.append((keep.nonzero().squeeze(1) + start).to(torch.int32))
    return torch.cat(parts)


def _granularity(nbytes: int | None, device: torch.device, available: bool):
    """`l2_fetch_granularity` where the bound can be read; elsewhere a no-op block that reports nothing."""
    return l2_fetch_granularity(nbytes, device) if available else contextlib.nullcontext(None)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--numel", type=int, default=None, help="elements of the flat weight")
    parser.add_argument("--l2-fetch", default="default,32,64,128",
                        help="L2 fetch-granularity bounds to try, comma-separated bytes or 'default'")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    numel = (1 << 20) if args.quick or device.type != "cuda" else 8 * 8192 * 16384
    numel = args.numel or numel
    requested = [None if x.strip() == "default" else int(x) for x in args.l2_fetch.split(",")]
    why_not = l2_fetch_granularity_unavailable(device) if device.type == "cuda" else "no CUDA device"
    default = get_l2_fetch_granularity(device) if why_not is None else None
    # Without the setting: one pass. Otherwise skip a bound equal to the default.
    settings = [None] if why_not is not None else [
        g for i, g in enumerate(requested) if (g is None or g != default) and g not in requested[:i]]
    w = torch.zeros(numel, device=device)
    g = torch.randn(numel, device=device)
    dense_params = [w.clone()]
    dense_params[0].grad = g
    fused = torch.optim.AdamW(dense_params, lr=1e-3, fused=device.type == "cuda")
    fused.step()
    fused_ms = {}
    for setting in settings:
        with _granularity(setting, device, why_not is None) as actual:
            fused_ms[setting] = (_bench(fused.step, device), actual)
    del dense_params, fused
    print("\n".join(header_lines()))
    print(f"\nfp32 weight and gradient of {numel:,} elements; L2 fetch granularity bound by default: "
          f"{f'{default} B' if default is not None else f'n/a ({why_not})'}")
    print("fused AdamW step: " + ", ".join(
        f"{ms:.3f} ms at L2 fetch {_label(s, a)}" for s, (ms, a) in fused_ms.items()) + "\n")
    print("| density | L2 fetch | pattern | ms | sector GB/s | % of 4.8 TB/s | x vs fused (default L2 fetch) |")
    print("|---|---|---|---|---|---|---|")
    base_fused = fused_ms[None][0] if None in fused_ms else next(iter(fused_ms.values()))[0]
    for density in (0.001, 0.01, 0.05):
        idx = random_sorted_indices(numel, density, device)
        k = idx.numel()
        sectors = transactions_touched([idx], 4, 32)
        v = torch.randn(k, device=device)
        out = torch.empty(k, device=device)
        grid = (triton.cdiv(k, BLOCK),)
        # The real kernel: compact fp32 state, dense gradient, fp32 weight (no base).
        m, s2, d = (torch.zeros(k, device=device) for _ in range(3))
        step = torch.ones((), device=device)

        table_cache: dict = {}  # kept across calls, as an optimizer keeps it

        def sparse_step():
            sparse_adamw_([w], [g], [idx], [m], [s2], [d], [], [step], lr=1e-3, beta1=0.9, beta2=0.999,
                          eps=1e-8, weight_decay=0.01, maximize=False, compact_grads=False, table_cache=table_cache)

        sparse_step()
        for setting in settings:
            rows = []
            with _granularity(setting, device, why_not is None) as actual:
                for name, (read_g, read_w, write_w, n_reads, n_writes) in PATTERNS.items():
                    def run(read_g=read_g, read_w=read_w, write_w=write_w):
                        _pattern_kernel[grid](w, g, v, out, idx, k, READ_G=read_g, READ_W=read_w,
                                              WRITE_W=write_w, BLOCK=BLOCK, num_warps=8)

                    # contiguous bytes: the index, plus v or out
                    contiguous = k * 4 + k * 4
                    rows.append((name, _bench(run, device), sectors * 32 * (n_reads + n_writes) + contiguous))
                rows.append(("SparseAdamW", _bench(sparse_step, device), sparse_step_bytes([idx], torch.float32, 32)))
            for name, ms, nbytes in rows:
                gbs = nbytes / ms / 1e6
                print(f"| {density:.1%} | {_label(setting, actual)} | {name} | {ms:.4f} | {gbs:.0f} | "
                      f"{100 * gbs / (HBM_TB_S * 1e3):.0f}% | {base_fused / ms:.1f}x |", flush=True)
        del idx, v, out, m, s2, d


def _label(setting: int | None, actual: int | None) -> str:
    if actual is None:
        return "n/a"
    if setting is None:
        return f"default ({actual} B)"
    return f"{setting} B" if setting == actual else f"{setting} B (driver: {actual} B)"


if __name__ == "__main__":
    main()
