"""`python -m sift.bench serving`: many fine-tunes in one batch (`mixed_delta_matmul_`, the op
`ServedDeltas` runs in every linear layer) against the layer's dense product, and `switch_to`
(one delta in place of another) against the deltas' size.

Op rows: 4 fp32 layers of [4096, 4096] (256 MB of weights, beyond the last-level cache), 8
deltas per layer at 0.1%, 1% and 5% of the entries; three batches: a decode step of 8 rows with 8
different deltas, one of 8 rows sharing 2 deltas, and a prefill of 4 rows x 128 tokens with 4
deltas. Each row times the deltas' products over the 4 layers from the packed banks a served CPU
model holds and, in the same rotation, from the same deltas' CSR banks and the base layers' dense
products `x W^T`: the ratio to the dense product is what serving adds to the base's own work. Switch
rows: 4 bf16 layers of [4096, 4096], two deltas per density, `switch_to` alternating between them,
and in the same rotation the switch op over the same deltas' CSR banks on a copy of the weights.
Then `sift.bench.serving_llm`: SmolLM2-135M-Instruct served at batch 8 and 32, 1 to 32 fine-tunes per batch,
against the base and peft's mixed LoRA batch, and each fine-tune's memory against its file.
"""

from __future__ import annotations

import os

import torch

from sift.bench._harness import markdown_table, save_results, time_interleaved

COLUMNS = ("batch", "density", "entries per delta and layer", "deltas median ms", "p20 ms", "p80 ms",
           "dense x W^T median ms", "deltas / dense", "CSR bank median ms", "packed / CSR")
SWITCH_COLUMNS = ("density", "entries per delta", "switch_to median ms", "p20 ms", "p80 ms", "ms per million entries",
                  "CSR bank median ms", "packed / CSR")
DENSITIES = (0.001, 0.01, 0.05)


def _batches(quick: bool) -> dict[str, torch.Tensor]:
    """Batch label -> delta id per token."""
    prefill_tokens = 16 if quick else 128
    return {
        "decode, 8 rows, 8 deltas": torch.arange(8, dtype=torch.int32),
        "decode, 8 rows, 2 deltas": torch.arange(8, dtype=torch.int32) % 2,
        f"prefill, 4 rows x {prefill_tokens}, 4 deltas": torch.arange(4, dtype=torch.int32).repeat_interleave(
            prefill_tokens),
    }


def _bank(shape: tuple[int, int], n_deltas: int, density: float, gen: torch.Generator):
    from sift._ops import DeltaBank

    rows, cols = shape
    k = max(1, int(density * rows * cols))
    deltas = []
    for _ in range(n_deltas):
        flat = torch.randperm(rows * cols, generator=gen)[:k]
        deltas.append((flat // cols, flat % cols, torch.randn(k, generator=gen) * 1e-2))
    return DeltaBank.from_rows_and_cols(shape, deltas), k


def bench_op(size: int, layers: int, repeat: int, quick: bool, gen: torch.Generator) -> list[dict[str, object]]:
    """The op rows (see the module docstring)."""
    from sift import _ops

    weights = [torch.randn(size, size, generator=gen) / size**0.5 for _ in range(layers)]
    rows = []
    for density in DENSITIES:
        banks = [_bank((size, size), 8, density, gen) for _ in range(layers)]
        k = banks[0][1]
        packed = [bank.packed() for bank, _ in banks]
        for label, ids in _batches(quick).items():
            x = torch.randn(ids.numel(), size, generator=gen)
            outs = [x @ w.T for w in weights]

            def deltas(x=x, ids=ids, outs=outs, banks=packed):
                for y, bank in zip(outs, banks):
                    _ops.mixed_delta_matmul_(y, x, ids, bank, check_values=False)

            def csr(x=x, ids=ids, outs=outs, banks=banks):
                for y, (bank, _) in zip(outs, banks):
                    _ops.mixed_delta_matmul_(y, x, ids, bank, check_values=False)

            def dense(x=x):
                for w in weights:
                    torch.matmul(x, w.T)

            t = time_interleaved({"deltas": deltas, "csr": csr, "dense": dense}, warmup=1, repeat=repeat)
            rows.append({"batch": label, "density": f"{density:.1%}", "entries per delta and layer": k,
                         "deltas median ms": t["deltas"]["median_ms"], "p20 ms": t["deltas"]["p20_ms"],
                         "p80 ms": t["deltas"]["p80_ms"], "dense x W^T median ms": t["dense"]["median_ms"],
                         "deltas / dense": t["deltas"]["median_ms"] / t["dense"]["median_ms"],
                         "CSR bank median ms": t["csr"]["median_ms"],
                         "packed / CSR": t["deltas"]["median_ms"] / t["csr"]["median_ms"]})
    return rows


def bench_switch(size: int, layers: int, repeat: int, gen: torch.Generator) -> list[dict[str, object]]:
    """The switch rows (see the module docstring)."""
    from sift import ServedDeltas, SparseDelta, _ops
    from sift.delta import BaseFingerprint, DeltaEntry

    model = torch.nn.Sequential(*[torch.nn.Linear(size, size, bias=False) for _ in range(layers)]).bfloat16()
    base = BaseFingerprint.of(model.state_dict())
    rows = []
    for density in DENSITIES:
        k = max(1, int(density * size * size))

        def delta(k: int = k) -> SparseDelta:
            entries = {f"{i}.weight": DeltaEntry((size, size), torch.bfloat16,
                                                 torch.randperm(size * size, generator=gen)[:k].sort().values.int(),
                                                 torch.randn(k, generator=gen) * 1e-2) for i in range(layers)}
            return SparseDelta(entries, base)

        served = ServedDeltas(model)
        served.load_delta("a", delta())
        served.load_delta("b", delta())
        served.switch_to("a")
        names = iter(["b", "a"] * (repeat + 2))
        # The same deltas as CSR banks, switched by the op on a copy of the weights.
        weights = [m.weight.detach().clone() for m in model]
        csr = [served._layers[str(i)].bank.unpacked() for i in range(layers)]
        saved = {d: [torch.empty(k, dtype=torch.bfloat16) for _ in range(layers)] for d in (0, 1)}
        _ops.delta_bank_switch_(weights, csr, -1, 0, [], saved[0])
        state = {"in": 0}

        def csr_switch(weights=weights, csr=csr, saved=saved, state=state):
            off, on = state["in"], 1 - state["in"]
            _ops.delta_bank_switch_(weights, csr, off, on, saved[off], saved[on], trusted_banks=True)
            state["in"] = on

        t = time_interleaved({"switch": lambda served=served, names=names: served.switch_to(next(names)),
                              "csr": csr_switch}, warmup=1, repeat=repeat)
        served.close()
        rows.append({"density": f"{density:.1%}", "entries per delta": k * layers,
                     "switch_to median ms": t["switch"]["median_ms"], "p20 ms": t["switch"]["p20_ms"],
                     "p80 ms": t["switch"]["p80_ms"],
                     "ms per million entries": t["switch"]["median_ms"] / (k * layers / 1e6),
                     "CSR bank median ms": t["csr"]["median_ms"],
                     "packed / CSR": t["switch"]["median_ms"] / t["csr"]["median_ms"]})
    return rows


def run(quick: bool = False) -> str:
    """Time the mixed-delta op against the dense product and `switch_to` against the deltas' size; print and save.

    Args:
        quick: [512, 512] layers, 2 of them, short prefills (seconds; figures not comparable).

    Returns:
        The markdown (machine header, the two tables, notes).

    Example:
        >>> print(run(quick=True))  # doctest: +SKIP
    """
    from sift._ext import load_extension

    if not load_extension():
        return "### serving\n\nthe C++ extension is unavailable; nothing to time (see `python -m sift.env`)\n"
    size, layers, repeat = (512, 2, 3) if quick else (4096, 4, 7)
    gen = torch.Generator().manual_seed(0)
    load_before = os.getloadavg()
    op_rows = bench_op(size, layers, repeat, quick, gen)
    switch_rows = bench_switch(size, layers, repeat, gen)
    load_after = os.getloadavg()
    suffix = " [quick: sizes not comparable]" if quick else ""
    notes = [
        "",
        (f"CPU timing: perf_counter medians with warm-up, the two timed functions in rotation, "
         f"{torch.get_num_threads()} threads; load average {load_before[0]:.2f} before, {load_after[0]:.2f} after "
         f"(the machine is shared: figures move with it)."),
    ]
    markdown = "\n".join([
        markdown_table(f"Mixed deltas in one batch, {layers} fp32 layers of [{size}, {size}], 8 deltas each{suffix}",
                       COLUMNS, op_rows),
        "",
        markdown_table(f"switch_to between two deltas, {layers} bf16 layers of [{size}, {size}]{suffix}",
                       SWITCH_COLUMNS, switch_rows),
        *notes,
    ])
    save_results("serving", op_rows, markdown, extra={"switch": switch_rows, "quick": quick,
                                                      "load_average": [load_before, load_after]}, quick=quick)
    from sift.bench.serving_llm import run_llm

    return markdown + "\n\n" + run_llm(quick)
