"""Serving many fine-tunes of SmolLM2-135M-Instruct in one batch: `ServedDeltas` against the base model
alone and against peft's mixed LoRA batch (`adapter_names=`), and what each loaded fine-tune costs in
memory against its file. Part of `python -m sift.bench serving` (`sift.bench.serving.run`).

Deltas: 8 random sparse fine-tunes at sift's default density (1%) of the default targets (q, k, v, o
of every layer). LoRA: 8 adapters (B not zero, so the products are real) of rank r on the same
modules, r matching the deltas' entries (`r (in + out)` summed over the modules); 32 of each. Batches of 8
rows spread over 1, 2 or 8 fine-tunes and of 32 rows over 1, 2, 8 or 32; decode: one token per row on a
16-token cache, each step timed; prefill: the batch's rows of 32 tokens; then `switch_to` between two of
the fine-tunes. Every configuration runs in one rotation with the others, so load
from other work falls on all alike. `--quick`: a tiny random Llama instead (figures not comparable).
"""

from __future__ import annotations

import copy
import os
import sys
import tempfile
import time

import torch

from sift.bench._harness import summary

COLUMNS = ("phase", "fine-tunes in the batch", "base ms", "sift ms", "sift / base", "peft LoRA ms", "peft / base",
           "sift / peft")
MEMORY_COLUMNS = ("fine-tune", "entries", "bytes held", "file bytes", "held / file", "LoRA rank (matched)",
                  "LoRA adapter bytes")
SWITCH_COLUMNS = ("entries per fine-tune", "switch_to median ms", "p20 ms", "p80 ms", "ms per million entries")
SPREADS = (1, 2, 8, 32)
BATCHES = (8, 32)
DENSITY = 0.01  # sift's default (SparseAdamW, for_model)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")  # for_model's default for the Llama family


def _model(quick: bool) -> torch.nn.Module:
    import transformers

    if quick:
        torch.manual_seed(0)
        config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
        return transformers.LlamaForCausalLM(config).eval()
    from sift.demo.llm import smollm2_dir

    return transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir(download=False),
                                                             torch_dtype=torch.float32).eval()


def _targets(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.split(".")[-1] in TARGETS}


def _delta(model: torch.nn.Module, seed: int):
    from sift import SparseDelta
    from sift.delta import BaseFingerprint, DeltaEntry

    gen = torch.Generator().manual_seed(seed)
    entries = {}
    for name, m in _targets(model).items():
        numel = m.weight.numel()
        k = max(1, int(DENSITY * numel))
        idx = torch.randperm(numel, generator=gen)[:k].sort().values.int()
        entries[f"{name}.weight"] = DeltaEntry(tuple(m.weight.shape), m.weight.dtype, idx,
                                               torch.randn(k, generator=gen) * 1e-2)
    return SparseDelta(entries, BaseFingerprint.of(model.state_dict()))


def _lora(model: torch.nn.Module, entries: int, n: int):
    """peft LoRA with `n` adapters of the rank matching `entries` per fine-tune, B drawn so it is not zero."""
    import peft

    sizes = sum(m.in_features + m.out_features for m in _targets(model).values())
    rank = max(1, round(entries / sizes))
    config = peft.LoraConfig(r=rank, lora_alpha=rank, target_modules=list(TARGETS), lora_dropout=0.0)
    lora = peft.get_peft_model(copy.deepcopy(model), config, adapter_name="a0")
    for i in range(1, n):
        lora.add_adapter(f"a{i}", config)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 1e-2)
    return lora.eval(), rank


def _names(prefix: str, spread: int, rows: int) -> list[str]:
    return [f"{prefix}{r % spread}" for r in range(rows)]


def bench_llm(quick: bool = False, repeat: int = 5) -> tuple[list[dict], list[dict], list[dict]]:
    """The speed rows (decode, prefill), the memory rows and the switch row (see the module docstring)."""
    from sift import ServedDeltas

    model = _model(quick)
    batches = BATCHES[:1] if quick else BATCHES
    deltas = [_delta(model, seed) for seed in range(max(s for s in SPREADS if s <= max(batches)))]
    served = ServedDeltas(model)
    for i, d in enumerate(deltas):
        served.load_delta(f"d{i}", d)
    entries = sum(e.nnz for e in deltas[0].entries.values())
    lora, rank = _lora(model, entries, len(deltas))
    rows = [row for batch in batches for row in _speed_rows(served, lora, model, batch, quick, repeat)]
    memory = _memory_rows(served, deltas, model, rank)
    served.switch_to("d0")
    switches = []
    for i in range(2 * repeat + 1):
        t0 = time.perf_counter()
        served.switch_to(f"d{(i + 1) % 2}")
        switches.append((time.perf_counter() - t0) * 1e3)
    t = summary(switches[1:])
    switch = [{"entries per fine-tune": entries, "switch_to median ms": t["median_ms"], "p20 ms": t["p20_ms"],
               "p80 ms": t["p80_ms"], "ms per million entries": t["median_ms"] / (entries / 1e6)}]
    served.close()
    return rows, memory, switch


def _speed_rows(served, lora, model, batch: int, quick: bool, repeat: int) -> list[dict]:
    """Decode and prefill rows at `batch` rows, spread over each of `SPREADS` up to `batch` fine-tunes."""
    spreads = [s for s in SPREADS if s <= batch]
    gen = torch.Generator().manual_seed(2)
    vocab = model.config.vocab_size
    prompt = torch.randint(3, vocab, (batch, 16), generator=gen)
    prefill_ids = torch.randint(3, vocab, (batch, 8 if quick else 32), generator=gen)
    step_ids = torch.randint(3, vocab, (batch, 1), generator=gen)

    runs = {"base": lambda ids, **kw: served(ids, **kw)}
    for s in spreads:
        runs[f"sift {s}"] = lambda ids, s=s, **kw: served(ids, delta_names=_names("d", s, batch), **kw)
        runs[f"peft {s}"] = lambda ids, s=s, **kw: lora(input_ids=ids, adapter_names=_names("a", s, batch), **kw)
    samples: dict[str, list[float]] = {f"{phase} {name}": [] for phase in ("decode", "prefill") for name in runs}
    with torch.no_grad():
        caches = {name: run(prompt, use_cache=True).past_key_values for name, run in runs.items()}
        steps = 4 if quick else 3 * repeat
        for _ in range(steps):  # decode: each configuration's cache grows by one token a step
            for name, run in runs.items():
                t0 = time.perf_counter()
                caches[name] = run(step_ids, past_key_values=caches[name], use_cache=True).past_key_values
                samples[f"decode {name}"].append((time.perf_counter() - t0) * 1e3)
        for _ in range(repeat):
            for name, run in runs.items():
                t0 = time.perf_counter()
                run(prefill_ids, use_cache=False)
                samples[f"prefill {name}"].append((time.perf_counter() - t0) * 1e3)
    times = {k: summary(v[1:] if len(v) > 2 else v)["median_ms"] for k, v in samples.items()}
    rows = []
    for phase in ("decode", "prefill"):
        base = times[f"{phase} base"]
        for s in spreads:
            sift_ms, peft_ms = times[f"{phase} sift {s}"], times[f"{phase} peft {s}"]
            rows.append({"phase": f"{phase}, batch {batch}", "fine-tunes in the batch": s, "base ms": base,
                         "sift ms": sift_ms, "sift / base": sift_ms / base, "peft LoRA ms": peft_ms,
                         "peft / base": peft_ms / base, "sift / peft": sift_ms / peft_ms})
    return rows


def _memory_rows(served, deltas, model, rank: int) -> list[dict]:
    """Bytes each loaded fine-tune holds (`ServedDeltas.held_bytes`) against its safetensors file."""
    lora_bytes = rank * sum(m.in_features + m.out_features for m in _targets(model).values()) * 4
    rows = []
    for i, d in enumerate(deltas[:2]):
        held = served.held_bytes(f"d{i}")
        with tempfile.TemporaryDirectory() as folder:
            d.save_pretrained(folder, model)
            file_bytes = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)
                             if f.endswith(".safetensors"))
        entries = sum(e.nnz for e in d.entries.values())
        rows.append({"fine-tune": f"d{i}", "entries": entries, "bytes held": held, "file bytes": file_bytes,
                     "held / file": held / file_bytes, "LoRA rank (matched)": rank, "LoRA adapter bytes": lora_bytes})
    return rows


def run_llm(quick: bool = False) -> str:
    """Time and save the SmolLM2 serving table and the memory table (`serving-llm-<device>.md`).

    Args:
        quick: a tiny random Llama, short runs (seconds; figures not comparable).

    Returns:
        The markdown (machine header, the two tables, the load average while timed).

    Example:
        >>> print(run_llm(quick=True))  # doctest: +SKIP
    """
    import importlib.util

    from sift.bench._harness import markdown_table, save_results

    if importlib.util.find_spec("peft") is None:
        return "### serving against peft\n\npeft is not installed; nothing to compare\n"
    if not quick:
        from sift.demo.llm import smollm2_dir

        try:
            smollm2_dir(download=False)
        except (ImportError, FileNotFoundError) as error:  # the base install has no GGUF reader: say so, go on
            note = f"### serving against peft on SmolLM2\n\nnot run: {error}\n"
            print(f"sift.bench serving: the SmolLM2 table is not run: {error}", file=sys.stderr)
            return note
    load_before = os.getloadavg()
    rows, memory, switch = bench_llm(quick)
    load_after = os.getloadavg()
    suffix = " [quick: a tiny random Llama, not comparable]" if quick else ""
    model = "a tiny random Llama" if quick else "SmolLM2-135M-Instruct (fp32)"
    markdown = "\n".join([
        markdown_table(f"Mixed fine-tunes in one batch on {model}: sift deltas at 1% of q, k, v, o against the base "
                       f"and peft LoRA at the matched entry count{suffix}", COLUMNS, rows),
        "",
        markdown_table(f"Memory per loaded fine-tune on {model}{suffix}", MEMORY_COLUMNS, memory),
        "",
        markdown_table(f"switch_to between two fine-tunes on {model}{suffix}", SWITCH_COLUMNS, switch),
        "",
        (f"CPU timing: medians, every configuration in one rotation, {torch.get_num_threads()} threads; load average "
         f"{load_before[0]:.1f} before, {load_after[0]:.1f} after on 2 cores shared with other work (figures move "
         "with it; ratios taken within one rotation hold better than the absolute times)."),
    ])
    save_results("serving-llm", rows, markdown, extra={"memory": memory, "switch": switch, "quick": quick,
                                                      "load_average": [load_before, load_after]}, quick=quick)
    return markdown
