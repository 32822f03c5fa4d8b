"""Launch-configuration sweep of the Triton SparseAdamW kernel on a CUDA device.

    python bench/adamw_gpu_sweep.py [--quick]

Times the kernel alone (no Python step overhead) for each (BLOCK, num_warps, L2 fetch
granularity bound: the driver's default or 32 bytes, see `sift/bench/_l2.py`) on 8 weights of
8192x16384 (1.07B elements), fp32 and bf16, at 0.1%, 1% and 5%, next to torch's fused AdamW
on the same weights, and prints one markdown table. For fp32 it also times the layout with
an fp32 base in the state ("+base": the weight is rebuilt as base + delta and only written,
as for bf16), which removes the random read of the weight. The defaults in
`triton_kernels/sparse_adamw.py` are chosen from its output.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools

import torch
from triton.testing import do_bench

from sift import SparseAdamW
from sift.bench._l2 import l2_fetch_granularity, l2_fetch_granularity_unavailable
from sift.bench._harness import header_lines
from sift.bench.adamw import dense_step_bytes, make_params, sparse_step_bytes
from sift.triton_kernels.sparse_adamw import sparse_adamw_


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    device = torch.device("cuda")
    shapes = [(512, 1024)] * 2 if args.quick else [(8192, 16384)] * 8
    why_not = l2_fetch_granularity_unavailable(device)
    if why_not:
        print(f"L2 fetch granularity cannot be set here ({why_not}): default only")
    configs = list(itertools.product((512, 1024, 2048), (4, 8), (None,) if why_not else (None, 32)))
    print("\n".join(header_lines()))
    print("\n| dtype | density | BLOCK | warps | L2 fetch | kernel ms | x vs fused | model GB/s | % of 4.8 TB/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        params = make_params(shapes, dtype, device)
        dense = torch.optim.AdamW(params, lr=1e-3, fused=True)
        dense.step()
        fused_ms = do_bench(dense.step, quantiles=[0.5])
        fused_ms = fused_ms[0] if isinstance(fused_ms, (list, tuple)) else fused_ms
        print(f"| {dtype} | AdamW(fused) | | | | {fused_ms:.3f} | 1.00 | "
              f"{dense_step_bytes(params) / fused_ms / 1e6:.0f} | |")
        del dense
        torch.cuda.empty_cache()
        for density in (0.001, 0.01, 0.05):
            opt = SparseAdamW(params, lr=1e-3, density=density)
            opt.step()
            states = [opt.state[p] for p in params]
            lists = (
                [p.detach() for p in params], [p.grad for p in params], [s["indices"] for s in states],
                [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states], [s["delta"] for s in states],
                [s["base"] for s in states], [s["step"] for s in states],
            )
            layouts = [("", lists, sparse_step_bytes(lists[2], dtype, 32))]
            for (tag, args, nbytes), (block, warps, fetch) in itertools.product(layouts, configs):
                # One table cache per configuration, as an optimizer keeps: the timed calls reuse its tables.
                def step(args=args, block=block, warps=warps, cache={}):
                    sparse_adamw_(*args, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                                  maximize=False, compact_grads=False, block=block, num_warps=warps, table_cache=cache)
                with (l2_fetch_granularity(fetch, device) if not why_not else contextlib.nullcontext("?")) as actual:
                    ms = do_bench(step, quantiles=[0.5])
                ms = ms[0] if isinstance(ms, (list, tuple)) else ms
                label = f"default ({actual} B)" if fetch is None else f"{fetch} B (driver: {actual} B)"
                gbps = nbytes / ms / 1e6
                print(f"| {dtype}{tag} | {100 * density:g}% | {block} | {warps} | {label} | {ms:.4f} | "
                      f"{fused_ms / ms:.1f} | {gbps:.0f} | {100 * gbps / 4800:.0f} |", flush=True)
            del opt, states, lists
            torch.cuda.empty_cache()
        del params
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
