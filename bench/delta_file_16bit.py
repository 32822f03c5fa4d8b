"""What a saved fine-tune of 16-bit weights costs per entry: the real all-MiniLM-L6-v2 in bf16 (and
fp32 for comparison; fp16 without loss scaling overflows on this model) fine-tuned by `SparseAdamW.for_model` at 1% on AFINN word sentiment
(the demo's task, 50 steps of 32 words, lr 1e-2 and 2e-3), then `SparseDelta.from_optimizer` saved.

A 16-bit weight's increment (tuned minus base) is stored in the weight's dtype wherever that dtype
holds it exactly, and in fp32 (with its position) where it does not; the table gives the bytes per
entry of the sparse part (indices, values, exceptions; not the head nor the metadata), the share of
exceptions, and whether the delta applied to a freshly loaded model reproduces the tuned weights bit
for bit.

Run: `python bench/delta_file_16bit.py` (prints a markdown table headed by the machine and saves it as
bench/results/delta-files-16bit-cpu.md, or under $SIFT_BENCH_DIR).
"""

from __future__ import annotations

import os
import tempfile

import torch


def _fine_tune(dtype: torch.dtype, lr: float, steps: int = 50, batch: int = 32):
    from sift import SparseAdamW
    from sift.demo import Encoded, load_afinn, load_model, split

    model, tokenizer = load_model()
    model = model.to(dtype)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    train_rows, _ = split(load_afinn())
    train = Encoded.of(train_rows, tokenizer)
    torch.manual_seed(0)
    opt = SparseAdamW.for_model(model, density=0.01, lr=lr)
    order = torch.randperm(train.labels.numel(), generator=torch.Generator().manual_seed(0))
    for step in range(steps):
        rows = order[(step * batch) % len(order):][:batch]
        model(**train.batch(rows)).loss.backward()
        opt.step()
        opt.zero_grad()
    return model, opt, base


def main() -> str:
    from safetensors import safe_open

    from sift import SparseDelta
    from sift.bench._harness import header_lines, results_dir
    from sift.demo import load_model

    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for lr in (1e-2, 2e-3):
            model, opt, base = _fine_tune(dtype, lr)
            delta = SparseDelta.from_optimizer(opt, model)
            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, "delta.safetensors")
                delta.save(path)
                with safe_open(path, framework="pt") as f:
                    sparse = {k: f.get_tensor(k) for k in f.keys() if not k.endswith(".dense")}
                reloaded = SparseDelta.load(path)
            nbytes = sum(t.numel() * t.element_size() for t in sparse.values())
            exceptions = sum(t.numel() for k, t in sparse.items() if k.endswith(".exact_positions"))
            fresh, _ = load_model()
            fresh = fresh.to(dtype)
            fresh.load_state_dict(base)
            reloaded.apply_(fresh)
            exact = all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
            rows.append((str(dtype).removeprefix("torch."), lr, delta.nnz, nbytes / delta.nnz,
                         100 * exceptions / delta.nnz, exact))
    lines = ["### Saved fine-tune, bytes per sparse entry: all-MiniLM-L6-v2 at 1%, 50 steps on AFINN", "",
             *header_lines(), "",
             "| weight dtype | lr | entries | bytes / entry (indices, values, exceptions) | exceptions % | "
             "reload bit-exact |", "|---|---|---|---|---|---|"]
    lines += [f"| {d} | {lr:g} | {n} | {b:.2f} | {e:.2f} | {'yes' if x else 'NO'} |" for d, lr, n, b, e, x in rows]
    lines += ["", "Exceptions: increments the weight's 16-bit dtype cannot hold exactly (a weight that moved by more "
              "than half its size, or crossed zero), stored as an int32 position and an fp32 value (8 B)."]
    markdown = "\n".join(lines)
    out = os.path.join(results_dir(), "delta-files-16bit-cpu.md")
    with open(out, "w") as f:
        f.write(markdown + "\n")
    return markdown


if __name__ == "__main__":
    print(main())
