"""`python -m sift.bench quantized`: SIFT over a frozen 4-bit base against QLoRA and SHiRA.

Every base is bitsandbytes NF4 with double quantization (`Linear4bit`, compute dtype bf16: QLoRA's
setting, `BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
bnb_4bit_compute_dtype=bf16)`), quantized from random bf16 weights; the 7 linears of every decoder layer (q, k, v, o,
gate, up, down) are the targets; embeddings, norms and the untied lm_head stay bf16 and frozen.

    sift 1% exact, sift 5% exact   `SparseAdamW.for_model(model, density, target_modules=the 7)`: a [k] fp32
                                   delta per 4-bit linear (`sift.quantized`), fp32 moments, int32 indices
    sift 1% lean                   the same with `state="lean"`: bf16 moments, 16-bit index halves
    sift 1% lean, UIB              lean with `update_in_backward=True`: each layer's [k] values stepped as
                                   its backward ends, so no layer keeps a gradient after backward
    QLoRA r=16, r=64               peft `LoraConfig(r, lora_alpha=2r, lora_dropout=0)` on the 4-bit linears
                                   (peft's bitsandbytes LoRA layer, fp32 adapters), `torch.optim.AdamW`
    SHiRA                          peft `ShiraConfig(r)` (random mask) on the same linears, `torch.optim.AdamW`;
                                   one r for all targets (peft's SHiRA has no per-module r), the integer
                                   nearest to (sift 1%'s entries) / sum(out + in) over the targets, so that its
                                   r * (out + in) entries add up to about sift 1%'s count

Part 1, memory. A 1-layer `LlamaForCausalLM` at Llama-7B's real shapes (hidden 4096, intermediate
11008, 32 heads, 32 KV heads, vocab 32000) and another at Llama-2-70B's (hidden 8192, intermediate
28672, 64 heads, 8 KV heads, vocab 32000), each measured for real: per configuration a fresh copy
of the 4-bit model, one warm-up step (SIFT selects its entries on it), then one measured training
step (seq 16, batch 1), once without and once with gradient checkpointing. The accounting is the
memory suite's (`sift.bench.memory.measure_cpu`; here sparse saved tensors count too): Params are
the bytes of all params and buffers (packed 4-bit weights), the 4-bit quant state (neither a param
nor a buffer), and the adapters (sift's [k]
values, LoRA's A and B, SHiRA's values and its int32 index table); Grad, the gradient bytes held
after backward; Optim, the optimizer state bytes (`state_bytes()` for SparseAdamW, which counts
the 4-bit deltas' fp32 moments and their int32 `delta_indices`; the state tensors for AdamW);
Activation, the bytes autograd saved for backward, deduplicated by storage (saved-tensor hooks);
RSS rise, the process's peak RSS over the step minus RSS before it (rough: transient dequantized
weights show there, not in the four columns).

Each configuration's checkpointed row is then PROJECTED to the full model (32 layers for 7B, 80 for
70B; seq 2048, batch 1; `project`): Params, Grad and Optim by `sift.bench.memory.project` (the
layer's bytes times the depth, the non-layer bytes, bf16 embeddings, lm_head and final norm, as
measured); Activation as that projection counts it (what is saved outside the layers, one layer's
saved bytes, recomputed in its backward, and every layer's [seq, hidden] bf16 input kept by the
checkpoint), but with each part fitted as a + b * seq from forward passes at seq 16 and 32, since
not everything saved grows with the sequence (SHiRA saves a dense weight per linear). The targets
(7B at 1% within 6.0 GiB and within QLoRA r=16 + 0.25 GiB; 70B at 1% within 46 GiB) are printed
with pass or miss.

Part 2, speed. One training step (forward, backward, `optimizer.step()`, `zero_grad`) of a 4-layer
Llama (hidden 1024, intermediate 2752, 16 heads, vocab 32000, NF4 base, seq 128, batch 4) for sift
1% (exact, and lean with the update in backward), QLoRA r=16 and SHiRA at sift 1%'s count, each on its own copy of the model: two warm-up steps
each, then rounds of one step per method, the order rotated every round, timed with
`time.perf_counter`; median, p20 and p80 per method and the ratios sift / QLoRA and SHiRA / sift of
the medians.

`--quick`: tiny shapes (hidden 64), one round; the figures are not comparable.
"""

from __future__ import annotations

import copy
import gc
import importlib.util
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from sift.bench import memory
from sift.bench._harness import markdown_table, reset_peak_rss, rss_kib, save_results, summary
from sift.bench._quantized_model import (LR, MODULES, Method, build_quantized, model_bytes, quant_state_bytes,
                                        single_quant_state_bytes)
# Also sift.bench.quantized's own names, as tests and callers reach them.
from sift.bench._quantized_model import quantize_linears_, shapes_of, shira_rank, sift_entries  # noqa: F401

GIB = 2**30
MIB = 2**20

# (label, method, argument): density for sift, r for QLoRA; SHiRA's r is matched to sift 1%'s count.
CONFIGS = (
    ("sift 1% exact", "sift", 0.01),
    ("sift 1% lean", "sift-lean", 0.01),
    ("sift 1% lean, UIB", "sift-lean-uib", 0.01),
    ("sift 5% exact", "sift", 0.05),
    ("QLoRA r=16", "lora", 16),
    ("QLoRA r=64", "lora", 64),
    ("SHiRA (sift 1% count)", "shira", 0.01),
)
TIMED = ("sift 1% exact", "sift 1% lean, UIB", "QLoRA r=16", "SHiRA (sift 1% count)")

# The full models each 1-layer measurement is projected to.
LLAMA_7B = dict(name="Llama-7B", hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
                num_key_value_heads=32, vocab_size=32000, target_layers=32)
LLAMA_70B = dict(name="Llama-2-70B", hidden_size=8192, intermediate_size=28672, num_attention_heads=64,
                 num_key_value_heads=8, vocab_size=32000, target_layers=80)
QUICK_7B = dict(name="tiny (7B-like)", hidden_size=64, intermediate_size=176, num_attention_heads=4,
                num_key_value_heads=4, vocab_size=256, target_layers=32)
QUICK_70B = dict(name="tiny (70B-like, GQA)", hidden_size=128, intermediate_size=448, num_attention_heads=8,
                 num_key_value_heads=2, vocab_size=256, target_layers=80)
MEASURED_SEQ, TARGET_SEQ = 16, 2048

STEP_MODEL = dict(hidden_size=1024, num_hidden_layers=4, intermediate_size=2752, num_attention_heads=16,
                  num_key_value_heads=16, vocab_size=32000, seq=128, batch=4)
QUICK_STEP_MODEL = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=176, num_attention_heads=4,
                        num_key_value_heads=4, vocab_size=256, seq=32, batch=2)
ROUNDS, QUICK_ROUNDS = 20, 1
WARMUP_STEPS = 2

# Targets: 7B at 1% (GiB, and GiB over QLoRA r=16), 70B at 1% (GiB); step time ratios.
TARGET_7B_GIB = 6.0
TARGET_7B_OVER_QLORA_GIB = 0.25
TARGET_70B_GIB = 46.0
TARGET_SIFT_OVER_QLORA = 1.1
TARGET_SHIRA_OVER_SIFT = 1.5

MEASURED_COLUMNS = ("config", "layer shape", "GC", "trainable entries", "Params", "Grad", "Optim", "Activation",
                    "Total", "RSS rise", "step s")
PROJECTED_COLUMNS = ("config", "model", "projected Params", "projected Grad", "projected Optim",
                     "projected Activation", "projected Total")
TIMING_COLUMNS = ("config", "trainable entries", "median ms", "p20 ms", "p80 ms", "x vs QLoRA r=16", "x vs sift 1%",
                  "CPU/wall")


# ------------------------------------------------------------------ part 1: memory


def _storages(t: torch.Tensor) -> list[tuple[int, int]]:
    """(data pointer, bytes) of the storages behind `t`; a sparse COO tensor (SHiRA's delta) has two."""
    if t.layout == torch.sparse_coo:
        return [*_storages(t._indices()), *_storages(t._values())]
    storage = t.untyped_storage()
    return [(storage.data_ptr(), storage.nbytes())]


@contextmanager
def _count_saved_tensors(exclude: set[int], keep: bool = True) -> Iterator[dict[int, int]]:
    """`memory._count_saved_tensors` that also counts sparse tensors (their indices and values).

    `keep=False` (a forward that no backward follows) leaves nothing in the graph: a pack hook that
    returns a node's own output ties it to its grad_fn in a cycle that only a backward breaks. The
    tensors are held here instead until the block ends, so that no storage is freed and its address
    reused (and miscounted as the same storage) during the forward.
    """
    seen: dict[int, int] = {}
    held: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor | None:
        for ptr, nbytes in _storages(t):
            if ptr not in exclude:
                seen[ptr] = nbytes
        if keep:
            return t
        held.append(t)
        return None

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield seen
    finally:
        held.clear()


def measure_step(method: Method, batch: torch.Tensor, base_bytes: int) -> dict[str, float]:
    """`memory.measure_cpu` for one configuration: a warm-up step, then the measured one, counted.

    After it, forward passes alone at the batch's sequence length T and at 2T count what they save,
    for the affine fit of `project` (a forward saves what the step's backward reads: the counts at T
    agree with the step's).

    Returns:
        Bytes of params (`base_bytes` plus the adapters), grad (held after backward), optim and
        activation (saved for backward), the RSS rise over the step, its seconds, and under
        "saved_forward" {T: bytes, 2T: bytes} of the forward passes.
    """
    model, opt = method.forward_model, method.opt
    method.step(batch)  # warm-up: sift selects, AdamW allocates its state
    gc.collect()
    exclude = {p.untyped_storage().data_ptr() for p in model.parameters()}
    marks: dict[str, int] = {}

    def backward_done() -> None:
        marks["grad"] = memory._grad_bytes(method.params)

    rss_reset = reset_peak_rss()
    rss_before = (rss_kib("VmRSS") or 0) * 1024
    t0 = time.perf_counter()
    with _count_saved_tensors(exclude) as saved:
        memory._train_step(model, opt, batch, on_backward_done=backward_done)
    seconds = time.perf_counter() - t0
    peak_rss = memory._peak_rss_bytes()
    state, compact = memory._state_bytes(opt)
    out = {"params": base_bytes + method.adapter_bytes, "grad": marks["grad"] + compact, "optim": state,
           "activation": sum(saved.values()), "rss_rise": peak_rss - rss_before if rss_reset else float("nan"),
           "peak_rss": peak_rss, "seconds": seconds, "saved_forward": {}}
    for tokens in (batch.shape[1], 2 * batch.shape[1]):
        longer = batch.repeat(1, tokens // batch.shape[1])
        with _count_saved_tensors(exclude, keep=False) as saved:
            loss = model(input_ids=longer, labels=longer).loss
            del loss
        out["saved_forward"][tokens] = sum(saved.values())
    method.release()
    return out


def project(no_gc: dict[str, Any], with_gc: dict[str, Any], sizes: dict[str, Any], layer_bytes: float,
            outside_bytes: float) -> dict[str, float]:
    """One configuration's measured 1-layer bytes scaled to the full model, with gradient checkpointing.

    Params, Grad, Optim: `memory.project`. Activation: what is saved outside the layers, plus one
    layer's saved bytes (recomputed in its backward), plus each layer's [T, hidden] bf16 input that the
    checkpoint keeps, as `memory.project` counts it, but each part fitted as a + b * T from the forward
    passes at T and 2T rather than scaled as b * T alone: SHiRA saves a dense [out, in] weight per
    linear, which does not grow with the sequence.

    Args:
        no_gc: the `measure_step` result without checkpointing; with_gc: with it.
        sizes: `layer_sizes` of the full model.
        layer_bytes: the measured layer's param, buffer and quant-state bytes (no adapters).
        outside_bytes: the bytes outside the decoder layers (embeddings, final norm, lm_head).
    """
    p = memory.project(with_gc, sizes, layer_bytes, outside_bytes, no_gc["activation"], with_gc["activation"])

    def fit(counts: dict[int, int]) -> tuple[float, float]:
        (t1, s1), (t2, s2) = sorted(counts.items())
        slope = (s2 - s1) / (t2 - t1)
        return s1 - slope * t1, slope

    (a_no, b_no), (a_gc, b_gc) = fit(no_gc["saved_forward"]), fit(with_gc["saved_forward"])
    seq = sizes["target_seq"]
    outside = a_gc + b_gc * seq
    layer = max((a_no - a_gc) + (b_no - b_gc) * seq, 0.0) / sizes["num_hidden_layers"]
    inputs = sizes["target_layers"] * seq * sizes["hidden_size"] * 2
    p["activation"] = outside + layer + inputs
    p["activation_parts"] = {"outside": outside, "one_layer": layer, "checkpoint_inputs": inputs}
    p["total"] = p["params"] + p["grad"] + p["optim"] + p["activation"]
    return p


def layer_sizes(full: dict[str, Any]) -> dict[str, Any]:
    """The 1-layer measurement of `full` and what `memory.project` needs to scale it."""
    return {**{k: v for k, v in full.items() if k != "name"}, "num_hidden_layers": 1, "seq": MEASURED_SEQ,
            "target_seq": TARGET_SEQ}


def measure_memory(full: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Measured rows (per configuration, GC off and on) of one layer of `full`, and their projection.

    Returns:
        (measured rows, projected rows); byte counts under "raw_bytes" / "projected_bytes".
    """
    sizes = layer_sizes(full)
    template = build_quantized(dict(sizes, seq=2 * MEASURED_SEQ))  # room for the forward at 2T
    base_bytes, outside_bytes = model_bytes(template)
    layer_bytes = base_bytes - outside_bytes  # one layer
    shape = (f"hidden {sizes['hidden_size']}, intermediate {sizes['intermediate_size']}, "
             f"{sizes['num_attention_heads']}/{sizes['num_key_value_heads']} heads")
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(0, sizes["vocab_size"], (1, MEASURED_SEQ), generator=gen)
    rows, projected = [], []
    for label, kind, arg in CONFIGS:
        measured = {}
        for checkpointing in (False, True):
            model = copy.deepcopy(template)
            memory._set_checkpointing(model, checkpointing)
            method = Method(model, kind, arg)
            entries, rank = method.entries, method.rank
            m = measure_step(method, batch, base_bytes)
            m["checkpointing"] = checkpointing
            measured[checkpointing] = m
            total = m["params"] + m["grad"] + m["optim"] + m["activation"]
            rows.append({"config": _label(label, kind, rank), "layer shape": shape, "model": full["name"],
                         "GC": "yes" if checkpointing else "no", "trainable entries": entries,
                         "Params": m["params"] / MIB, "Grad": m["grad"] / MIB, "Optim": m["optim"] / MIB,
                         "Activation": m["activation"] / MIB, "Total": total / MIB, "RSS rise": m["rss_rise"] / MIB,
                         "step s": m["seconds"], "raw_bytes": {k: v for k, v in m.items() if k != "seconds"}})
            del method, model
            gc.collect()
        p = project(measured[False], measured[True], sizes, layer_bytes, outside_bytes)
        projected.append({"config": _label(label, kind, rank), "model": f"{full['name']} ({sizes['target_layers']} "
                          f"layers, seq {TARGET_SEQ}, GC)", "key": (label, full["name"]),
                          "projected Params": p["params"] / GIB, "projected Grad": p["grad"] / GIB,
                          "projected Optim": p["optim"] / GIB, "projected Activation": p["activation"] / GIB,
                          "projected Total": p["total"] / GIB, "projected_bytes": p})
    single = single_quant_state_bytes(template)
    quant_state = quant_state_bytes(template)
    del template
    gc.collect()
    return rows, projected, {"model": full["name"], "quant_state": quant_state,
                             "single_quant_state": single}


def _label(label: str, kind: str, rank: int | None) -> str:
    return f"SHiRA r={rank} (sift 1% count)" if kind == "shira" else label


# ------------------------------------------------------------------ part 2: speed


def time_steps(sizes: dict[str, Any], rounds: int) -> list[dict[str, Any]]:
    """Round-robin step times of the `TIMED` configurations on copies of one 4-bit Llama of `sizes`.

    Each step's process CPU time is kept next to its wall time: CPU / wall well under torch's thread
    count means the step waited for the cores (another process ran), which the median alone hides.
    """
    template = build_quantized(sizes)
    gen = torch.Generator().manual_seed(1)
    batch = torch.randint(0, sizes["vocab_size"], (sizes["batch"], sizes["seq"]), generator=gen)
    methods = {}
    for label, kind, arg in CONFIGS:
        if label in TIMED:
            methods[label] = Method(copy.deepcopy(template), kind, arg)
    del template
    for method in methods.values():
        for _ in range(WARMUP_STEPS):  # sift selects on the first
            method.step(batch)
    samples: dict[str, list[float]] = {label: [] for label in methods}
    cpu: dict[str, list[float]] = {label: [] for label in methods}
    order = list(methods)
    for r in range(rounds):
        # Rotated each round: no method always follows the same one.
        for label in order[r % len(order):] + order[: r % len(order)]:
            c0, t0 = time.process_time(), time.perf_counter()
            methods[label].step(batch)
            wall = time.perf_counter() - t0
            samples[label].append(wall * 1e3)
            cpu[label].append((time.process_time() - c0) / wall)
    rows = []
    for label, kind, _ in CONFIGS:
        if label in methods:
            rows.append({"config": _label(label, kind, methods[label].rank), "key": label,
                         "trainable entries": methods[label].entries, **summary(samples[label]),
                         "CPU/wall": sorted(cpu[label])[len(cpu[label]) // 2], "samples_ms": samples[label],
                         "cpu_per_wall": cpu[label]})
    median = {row["key"]: row["median_ms"] for row in rows}
    for row in rows:
        row["median ms"], row["p20 ms"], row["p80 ms"] = row["median_ms"], row["p20_ms"], row["p80_ms"]
        row["x vs QLoRA r=16"] = row["median_ms"] / median["QLoRA r=16"]
        row["x vs sift 1%"] = row["median_ms"] / median["sift 1% exact"]
    return rows


# ------------------------------------------------------------------ targets


def targets(projected: list[dict[str, Any]], timing: list[dict[str, Any]], big: str,
            small: str) -> list[dict[str, Any]]:
    """Each target with its figure and whether it is met (figures projected for memory, measured for time),
    for every sift 1% configuration measured (lowest-memory first)."""
    gib = {row["key"]: row["projected Total"] for row in projected}
    ms = {row["key"]: row["median_ms"] for row in timing}
    lora7 = gib[("QLoRA r=16", small)]
    over = TARGET_7B_OVER_QLORA_GIB
    checks = []
    for label in ("sift 1% lean, UIB", "sift 1% lean", "sift 1% exact"):
        if (label, small) not in gib:
            continue
        sift7, sift70 = gib[(label, small)], gib[(label, big)]
        checks += [
            {"target": f"{small} {label} projected Total <= {TARGET_7B_GIB:g} GiB",
             "figure": f"{sift7:.2f} GiB (projected)", "met": sift7 <= TARGET_7B_GIB},
            {"target": f"{small} {label} projected Total <= QLoRA r=16's projected Total + {over:g} GiB",
             "figure": f"{sift7:.2f} vs {lora7:.2f} + {over:g} = {lora7 + over:.2f} GiB (projected)",
             "met": sift7 <= lora7 + over},
            {"target": f"{big} {label} projected Total <= {TARGET_70B_GIB:g} GiB",
             "figure": f"{sift70:.2f} GiB (projected)", "met": sift70 <= TARGET_70B_GIB},
        ]
    for label in ("sift 1% lean, UIB", "sift 1% exact"):
        if label not in ms:
            continue
        ratio_lora = ms[label] / ms["QLoRA r=16"]
        ratio_shira = ms["SHiRA (sift 1% count)"] / ms[label]
        checks += [
            {"target": f"{label} step <= {TARGET_SIFT_OVER_QLORA:g}x QLoRA r=16's (medians)",
             "figure": f"{ratio_lora:.3f}x (measured)", "met": ratio_lora <= TARGET_SIFT_OVER_QLORA},
            {"target": f"SHiRA step >= {TARGET_SHIRA_OVER_SIFT:g}x {label}'s (medians)",
             "figure": f"{ratio_shira:.3f}x (measured)", "met": ratio_shira >= TARGET_SHIRA_OVER_SIFT},
        ]
    return checks


# ------------------------------------------------------------------ run


def run(quick: bool = False) -> str:
    """Measure and project the memory of each configuration, time their steps, report against the targets.

    Without bitsandbytes (the `[quant]` extra) or peft the suite says so and measures nothing.

    Args:
        quick: tiny shapes and one timing round (seconds; figures not comparable).

    Returns:
        The markdown: measured per-layer MiB, projected GiB, step times, the targets.

    Example:
        >>> print(run(quick=True))  # doctest: +SKIP
    """
    missing = [name for name in ("bitsandbytes", "peft") if importlib.util.find_spec(name) is None]
    if missing:
        return (f"### quantized\n\nskipped: {' and '.join(missing)} not installed "
                "(pip install 'sift-kernels[quant]')\n")
    torch.manual_seed(0)
    small, big = (QUICK_7B, QUICK_70B) if quick else (LLAMA_7B, LLAMA_70B)
    t0 = time.perf_counter()
    rows, projected, quant_states = [], [], []
    for full in (small, big):
        measured, proj, states = measure_memory(full)
        rows += measured
        projected += proj
        quant_states.append(states)
    memory_seconds = time.perf_counter() - t0
    step_sizes = QUICK_STEP_MODEL if quick else STEP_MODEL
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    timing = time_steps(step_sizes, QUICK_ROUNDS if quick else ROUNDS)
    timing_seconds = time.perf_counter() - t0
    load_after = os.getloadavg()[0]
    checks = targets(projected, timing, big["name"], small["name"])
    tag = " [quick]" if quick else ""
    base = ("NF4 Linear4bit base (compute bf16, double quantization) on q, k, v, o, gate, up, down; bf16 "
            "embeddings, norms, lm_head, frozen")
    measured_title = (f"Memory of one training step, one decoder layer measured for real (MiB; seq {MEASURED_SEQ}, "
                      f"batch 1, vocab {small['vocab_size']}): {base}{tag}")
    projected_title = (f"PROJECTED to the full models (GiB, every figure projected, not measured; seq {TARGET_SEQ}, "
                       f"batch 1, gradient checkpointing) from each configuration's measured GC row: "
                       f"{small['name']} from its measured layer, {big['name']} from its own measured layer "
                       f"(not extrapolated from {small['name']}){tag}")
    s = step_sizes
    timing_title = (f"One training step (forward + backward + step), measured: Llama hidden {s['hidden_size']}, "
                    f"{s['num_hidden_layers']} layers, intermediate {s['intermediate_size']}, "
                    f"{s['num_attention_heads']} heads, vocab {s['vocab_size']}, NF4 base, seq {s['seq']}, "
                    f"batch {s['batch']}; "
                    f"{WARMUP_STEPS} warm-up steps each, {QUICK_ROUNDS if quick else ROUNDS} round-robin rounds{tag}")
    shira_rows = [r for r in rows if r["config"].startswith("SHiRA")]
    match = "; ".join(
        f"{r['model']}: {r['config'].split(' (')[0]}, {r['trainable entries']} entries against sift 1%'s "
        f"{next(x['trainable entries'] for x in rows if x['model'] == r['model'] and x['config'] == 'sift 1% exact')}"
        for r in shira_rows if r["GC"] == "no")
    lines = [
        markdown_table(measured_title, MEASURED_COLUMNS, rows), "",
        "Params: bytes of every param and buffer (packed 4-bit weights, bf16 embeddings, norms, lm_head), the 4-bit "
        "quant state (absmax, code) and the adapters: sift's [k] fp32 values, LoRA's fp32 A and B, SHiRA's fp32 values "
        "and its int32 [2, n] index table. Grad: gradient bytes held after backward. Optim: SparseAdamW.state_bytes() "
        "(fp32 exp_avg and exp_avg_sq, the int32 delta_indices, the step), the state tensors of torch AdamW(fused). "
        "Activation: bytes saved for backward, once per storage (with GC only what is saved outside the checkpointed "
        "layer is seen). Total: the four added. RSS rise: peak RSS over the measured step minus RSS before it (rough; "
        "the transient dequantized weights and sift's selection show here only). Each row ran on a fresh copy of the "
        "4-bit model: one warm-up step (sift selects), then the measured step.",
        f"SHiRA's r matched to sift 1%'s entry count over the 7 targets together (one r for all: peft's SHiRA takes no "
        f"per-module r): {match}.", "",
        markdown_table(projected_title, PROJECTED_COLUMNS, projected), "",
        "How: " + " ".join(project.__doc__.split("\n\n")[1].split()) + " The Params, Grad and Optim rule of "
        "memory.project: " + " ".join(memory.project.__doc__.split("\n\n")[1].split()).split(" Activation,")[0],
        "Quant state (8-bit absmax, its fp32 second-level absmax, code) counted in Params, per measured layer, with "
        "double quantization, and what it would hold without (bnb_4bit_use_double_quant=False, counted on a "
        "requantized copy; not used above): " + "; ".join(
            f"{q['model']}: {q['quant_state'] / MIB:.2f} MiB, without {q['single_quant_state'] / MIB:.2f} MiB"
            for q in quant_states) + ".", "",
        markdown_table(timing_title, TIMING_COLUMNS, timing), "",
        "Each method on its own copy of the 4-bit model; x columns are ratios of the medians. CPU/wall: the median "
        f"step's process CPU seconds per wall second (torch threads {torch.get_num_threads()}: well below that, the "
        f"step waited for the cores). Load average (1 min) {load_before:.2f} before the timing, {load_after:.2f} "
        "after.", "",
        "Targets (memory figures projected, step ratios measured):", "",
        *[f"- {c['target']}: {c['figure']}: {'met' if c['met'] else 'MISSED'}" for c in checks], "",
        f"Memory part took {memory_seconds:.0f} s, timing part {timing_seconds:.0f} s.",
    ]
    markdown = "\n".join(lines)
    save_results("quantized", rows, markdown, quick=quick, extra={
        "projected": [{k: v for k, v in row.items() if k != "key"} for row in projected],
        "timing": [{k: v for k, v in row.items() if k != "key"} for row in timing],
        "targets": checks, "quant_state": quant_states,
        "config": {"measured_seq": MEASURED_SEQ, "target_seq": TARGET_SEQ, "models": [small, big],
                   "step_model": step_sizes, "rounds": QUICK_ROUNDS if quick else ROUNDS, "warmup": WARMUP_STEPS,
                   "lr": LR, "quick": quick, "quant_type": "nf4", "compute_dtype": "bfloat16",
                   "double_quant": True, "targets": list(MODULES)}})
    return markdown
