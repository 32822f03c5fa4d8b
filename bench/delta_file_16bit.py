"""What a saved fine-tune costs per entry: the real all-MiniLM-L6-v2 in bf16 and fp32 (fp16 without
loss scaling overflows on this model) fine-tuned by `SparseAdamW.for_model` at 1% on AFINN word
sentiment (the demo's task, 50 steps of 32 words, lr 1e-2 and 2e-3), then `SparseDelta.from_optimizer`
saved.

The file (format 5) keeps positions in Elias-Fano form and a 16-bit weight's increments as one 16-bit
word each (2 more bytes for one its dtype cannot give exactly). The table gives the bytes per entry of
the sparse part (positions, values), of the whole file (with the head, its header and metadata), the
share of increments that needed more than 16 bits, and whether the delta applied to a freshly loaded
model reproduces the tuned weights bit for bit.

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
    opt = SparseAdamW.for_model(model, density=0.01, lr=lr, selection="magnitude")  # as the committed file
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
                file_bytes = os.path.getsize(path)
                reloaded = SparseDelta.load(path)
            size = {k: t.numel() * t.element_size() for k, t in sparse.items()}
            positions = size["positions.low"] + size["positions.high"]
            values = sum(size.values()) - positions
            wider = sparse["values.rest16"].numel()
            fresh, _ = load_model()
            fresh = fresh.to(dtype)
            fresh.load_state_dict(base)
            reloaded.apply_(fresh)
            exact = all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
            n = delta.nnz
            rows.append((str(dtype).removeprefix("torch."), lr, n, positions / n, values / n, (positions + values) / n,
                         file_bytes / n, 100 * wider / n, exact))
    lines = ["### Saved fine-tune, bytes per sparse entry: all-MiniLM-L6-v2 at 1%, 50 steps on AFINN", "",
             *header_lines(), "",
             "| weight dtype | lr | entries | positions B/entry | values B/entry | sparse part B/entry | "
             "whole file B/entry | increments wider than 16 bits % | reload bit-exact |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {d} | {lr:g} | {n} | {p:.2f} | {v:.2f} | {t:.2f} | {w:.2f} | {e:.2f} | {'yes' if x else 'NO'} |"
              for d, lr, n, p, v, t, w, e, x in rows]
    lines += ["", "Whole file: the safetensors file with the dense head (the classifier), its header and metadata "
              "(shapes, counts, the base fingerprint), divided by the sparse entries.",
              "Wider than 16 bits: increments for which no 16-bit value gives the tuned weight (the weight shrank "
              "to under half its move, or crossed zero); each keeps the low half of its fp32 bits too (2 B more)."]
    markdown = "\n".join(lines)
    out = os.path.join(results_dir(), "delta-files-16bit-cpu.md")
    with open(out, "w") as f:
        f.write(markdown + "\n")
    return markdown


if __name__ == "__main__":
    print(main())
