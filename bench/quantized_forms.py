"""How a 4-bit layer adds its sparse delta, timed on this CPU: the form `sift.quantized` ships
against the alternative, for one forward of a bitsandbytes NF4 `Linear4bit` at Llama-7B shapes
with a 1% delta (fp32 compute).

    dequant + matmul            the layer without a delta (the floor both forms pay)
    scatter into the weight     the shipped form: dequantize, add the k values into the transient
                                weight (`index_add_`), one dense matmul
    separate sparse matmul      dequantize, dense matmul, plus x S^T as a CSR sparse matmul

Run: `python bench/quantized_forms.py` (prints a markdown table headed by the machine and saves it
as bench/results/quantized-forms-cpu.md, or under $SIFT_BENCH_DIR). Interleaved rounds, medians.
"""

from __future__ import annotations

import os
import statistics
import time

import torch


def main() -> str:
    import bitsandbytes as bnb
    from bitsandbytes.functional import dequantize_4bit

    from sift.bench._harness import results_dir
    from sift.env import machine_header

    torch.manual_seed(0)
    rows = []
    for out_f, in_f, tokens in [(4096, 4096, 128), (11008, 4096, 128), (4096, 4096, 512)]:
        layer = bnb.nn.Linear4bit(in_f, out_f, bias=False, compute_dtype=torch.float32, quant_type="nf4").to("cpu")
        k = -(-out_f * in_f // 100)
        idx = torch.randperm(out_f * in_f)[:k].sort().values
        values = torch.randn(k) * 1e-3
        x = torch.randn(tokens, in_f)
        coo = torch.sparse_coo_tensor(torch.stack([idx // in_f, idx % in_f]), values, (out_f, in_f))
        csr = coo.coalesce().to_sparse_csr()

        def weight() -> torch.Tensor:
            return dequantize_4bit(layer.weight.data, layer.weight.quant_state).view(out_f, in_f)

        def scatter() -> torch.Tensor:
            w = weight()
            w.view(-1).index_add_(0, idx, values)
            return x @ w.t()

        forms = {"dequant + matmul (no delta)": lambda: x @ weight().t(),
                 "scatter into the transient weight (shipped)": scatter,
                 "separate sparse matmul": lambda: x @ weight().t() + torch.sparse.mm(csr, x.t()).t()}
        torch.testing.assert_close(scatter(), forms["separate sparse matmul"](), rtol=1e-4, atol=1e-4)
        times: dict[str, list[float]] = {name: [] for name in forms}
        for form in forms.values():
            form()
        for _ in range(15):
            for name, form in forms.items():
                start = time.perf_counter()
                form()
                times[name].append(time.perf_counter() - start)
        floor = statistics.median(times["dequant + matmul (no delta)"])
        for name, ts in times.items():
            ts.sort()
            rows.append(f"| [{out_f}, {in_f}], {tokens} tokens | {name} | {statistics.median(ts) * 1e3:.2f} | "
                        f"{ts[3] * 1e3:.2f} | {ts[11] * 1e3:.2f} | {statistics.median(ts) / floor:.2f} |")
    machine = ", ".join(f"{key} {value}" for key, value in machine_header().items())
    table = "\n".join([
        "### A 4-bit layer's sparse delta: scatter into the transient weight vs a separate sparse matmul "
        "(one forward, NF4, fp32 compute, 1% delta; 15 interleaved rounds)", "", f"Machine: {machine}", "",
        "| weight, tokens | form | median ms | p20 ms | p80 ms | x no delta |", "|---|---|---|---|---|---|", *rows])
    out = results_dir()
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "quantized-forms-cpu.md"), "w") as f:
        f.write(table + "\n")
    return table


if __name__ == "__main__":
    print(main())
