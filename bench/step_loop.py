"""ms per optimizer step and per training step of SparseAdamW (hook mode, 1%, re-selection off) and the bytes of its
state_dict's tensors, one process.

Usage: `PYTHONPATH=<tree> python -P bench/step_loop.py <label>`; run two trees in turn to compare them.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

import sift


def main(label: str) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(6)])
    opt = sift.SparseAdamW(model.parameters(), lr=1e-3, density=0.01, compact_grads=True, backend="cpp")
    x = torch.randn(32, 1024)
    steps, whole = [], []
    for i in range(160):
        t0 = time.perf_counter()
        model(x).square().mean().backward()
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        t2 = time.perf_counter()
        if i >= 10:  # the selecting step and the warm-up left out
            steps.append(t2 - t1)
            whole.append(t2 - t0)
    state = opt.state_dict()["state"]
    state_bytes = sum(t.numel() * t.element_size() for s in state.values() for t in s.values()
                      if isinstance(t, torch.Tensor))
    print(f"{label} step_ms {1e3 * statistics.median(steps):.3f} train_ms {1e3 * statistics.median(whole):.3f} "
          f"state_bytes {state_bytes}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "run")
