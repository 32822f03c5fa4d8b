"""ms per optimizer step and per training step of SparseAdamW (hook mode, 1%, re-selection off), one process.

Usage: `PYTHONPATH=<tree> python -P bench/step_loop.py <label>`; run two trees in turn to compare them.
"""
import statistics, sys, time, torch
import sift
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
    opt.step(); opt.zero_grad()
    t2 = time.perf_counter()
    if i >= 10:
        steps.append(t2 - t1); whole.append(t2 - t0)
print(f"{sys.argv[1]} step_ms {1e3*statistics.median(steps):.3f} train_ms {1e3*statistics.median(whole):.3f}", flush=True)
