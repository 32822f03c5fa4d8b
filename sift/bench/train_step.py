"""One full training step (forward, backward, optimizer) of a Llama-architecture model built
from a config, four ways: full AdamW, SIFT with the dense backward (`compact_grads=True`), SIFT
with `sparse_backward=True`, and peft LoRA on the same modules.

Each method runs in its own process, so its peak memory is its own: after two untimed steps
(selection, state allocation), the process's peak resident set over the timed steps (VmHWM,
reset before them) less its resident set before them, i.e. what a steady step allocates on top
of weights and state. glibc is told to map every block of 64 KiB or more on its own
(`MALLOC_MMAP_THRESHOLD_`), so freed tensors leave the resident set and the peak is the step's.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import torch

from sift.bench._harness import reset_peak_rss, rss_kib

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
METHODS = ("full AdamW", "SIFT dense backward", "SIFT sparse backward", "LoRA r=16")
LORA_RANK = 16
COLUMNS = ("method", "density", "trainable", "median s/step", "p20 s", "p80 s", "step peak MiB",
           "x vs dense-backward SIFT", "x vs LoRA")


def model_config(quick: bool) -> dict[str, int]:
    """A small Llama (GQA) that a 2-core CPU steps in a few seconds; `quick`: a toy.

    Hidden 1024 rather than 512, so that the matrix products dominate the step as in the Llama
    sizes users fine-tune (the weight gradient's share is what the sparse backward removes; the
    measurements at 512 are in bench/results/README.md).
    """
    if quick:
        return dict(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, seq=32, batch=2)
    return dict(vocab_size=2048, hidden_size=1024, intermediate_size=2752, num_hidden_layers=4,
                num_attention_heads=16, num_key_value_heads=8, seq=256, batch=2)


def _one_method(method: str, quick: bool, density: float, steps: int, seed: int, threads: int) -> dict[str, object]:
    import transformers

    import sift

    torch.set_num_threads(threads)
    cfg = model_config(quick)
    seq, batch = cfg.pop("seq"), cfg.pop("batch")
    torch.manual_seed(seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).to(device)
    model.train()
    if method == "full AdamW":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
        trainable = sum(p.numel() for p in model.parameters())
    elif method.startswith("SIFT"):
        sparse = method == "SIFT sparse backward"
        opt = sift.SparseAdamW.for_model(model, density=density, lr=1e-4, target_modules=list(TARGETS),
                                         dense_modules=[], compact_grads=True, sparse_backward=sparse,
                                         selection="magnitude")
        trainable = sum(max(1, round(density * p.numel())) for g in opt.param_groups for p in g["params"])
    else:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=LORA_RANK, lora_alpha=2 * LORA_RANK,
                                                           target_modules=list(TARGETS), lora_dropout=0.0))
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-4, foreach=True)
        trainable = sum(p.numel() for p in params)
    gen = torch.Generator().manual_seed(seed)
    batches = [torch.randint(0, cfg["vocab_size"], (batch, seq), generator=gen).to(device) for _ in range(steps + 2)]

    def step(ids):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step(batches[0])  # selection (SIFT) and state allocation: not timed
    step(batches[1])
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        rss_before = rss_kib("VmRSS") or 0
        peak_ok = reset_peak_rss()
    times = []
    for ids in batches[2:]:
        t0 = time.perf_counter()
        step(ids)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    if cuda:  # the caching allocator's own count: what the step allocated on top of weights and state
        peak = (torch.cuda.max_memory_allocated() - before) / 2**20
    else:
        peak = ((rss_kib("VmHWM") or 0) - rss_before) / 1024 if peak_ok else float("nan")
    return {"method": method, "times": times, "peak_mib": peak, "trainable": trainable}


def _run_in_process(args: tuple) -> dict[str, object]:
    return _one_method(*args)


def step_table(quick: bool, density: float = 0.01, steps: int | None = None) -> list[dict[str, object]]:
    """Time each method's training step in its own process; rows for the backward suite's table.

    Args:
        quick: the toy model (seconds).
        density: the SIFT density (LoRA uses rank 16 whatever it is).
        steps: timed steps per method (default 3 quick, 8 full).

    Returns:
        One row per method with the columns of `COLUMNS` (ratios filled in).
    """
    from sift.bench._harness import summary

    steps = steps or (3 if quick else 8)
    threads = torch.get_num_threads()
    ctx = mp.get_context("spawn")
    results = []
    saved = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # read by glibc when the child starts
    try:
        for method in METHODS:
            with ctx.Pool(1) as pool:
                results.append(pool.apply(_run_in_process, ((method, quick, density, steps, 0, threads),)))
    finally:
        if saved is None:
            os.environ.pop("MALLOC_MMAP_THRESHOLD_")
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = saved
    rows = []
    for r in results:
        s = summary([t * 1e3 for t in r["times"]])
        rows.append({"method": r["method"], "density": f"{100 * density:g}%" if r["method"].startswith("SIFT") else "",
                     "trainable": r["trainable"], "median s/step": s["median_ms"] / 1e3, "p20 s": s["p20_ms"] / 1e3,
                     "p80 s": s["p80_ms"] / 1e3, "step peak MiB": r["peak_mib"]})
    by = {r["method"]: r["median s/step"] for r in rows}
    for r in rows:
        r["x vs dense-backward SIFT"] = by["SIFT dense backward"] / r["median s/step"]
        r["x vs LoRA"] = by["LoRA r=16"] / r["median s/step"]
    return rows
