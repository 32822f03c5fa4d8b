"""Where a sift step's time goes over the frozen floor on SmolLM2 (batch 8 sentiment chats, fp32, 2 threads): self
CPU time by op over 6 steps after the selection step and one warm-up, a method (default "sparta 1%", the package's
default recipe) against the frozen model.

Usage: `python bench/profile_llm_step.py ["<method>"]` (needs the SmolLM2 folder, `sift.demo.llm.smollm2_dir`).
"""
import collections, random, sys
import torch
from torch.profiler import profile, ProfilerActivity
from sift.demo.llm import load_smollm2, smollm2_dir
from sift.bench.chat_board import TASKS, encode_example, batch_loss, end_id, METHODS
from sift.bench.llm_methods import setup
torch.set_num_threads(2)
folder = smollm2_dir()
task = TASKS["sentiment"]
train = task.splits(300, 200)["train"]
def run(method, steps=6):
    model, tok = load_smollm2(folder)
    model.train()
    net, opt = setup(METHODS[method], model, 3e-3 if method != "frozen" else 0.0, 0)
    rng = random.Random(0)
    batches = [[encode_example(tok, task, w, a) for w, a in rng.sample(train, 8)] for _ in range(steps + 2)]
    for b in batches[:2]:  # selection step and warm-up
        loss, _ = batch_loss(net, b, end_id(tok)); loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for b in batches[2:]:
            loss, _ = batch_loss(net, b, end_id(tok)); loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
    out = collections.Counter()
    for e in prof.key_averages():
        out[e.key] += e.self_cpu_time_total / steps / 1e3
    return out
method = sys.argv[1] if len(sys.argv) > 1 else "sparta 1%"
f = run("frozen"); s = run(method)
tf, ts = sum(f.values()), sum(s.values())
print(f"self CPU ms per step: frozen {tf:.0f}, {method} {ts:.0f} ({ts/tf:.3f}x)")
diff = sorted(((s[k] - f.get(k, 0), k) for k in set(s) | set(f)), reverse=True)
print("ops adding the most to sift's step (ms per step, sift - frozen):")
for d, k in diff[:15]:
    print(f"  {d:8.1f}  {k}  (sift {s.get(k,0):.1f}, frozen {f.get(k,0):.1f})")
print("ops sift spends less on:")
for d, k in diff[-5:]:
    print(f"  {d:8.1f}  {k}")
