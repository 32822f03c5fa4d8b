"""`python -m sift.bench memory`: memory of one Llama training step, dense AdamW, peft LoRA and SIFT.

Configurations (each with and without gradient checkpointing), density 5% on every attention
and MLP weight (LoRA: r=16 on the same modules), everything else (embeddings, norms, lm_head)
frozen so that no optimizer trains it:

    SparseAdamW(state, compact_grads=True)   gradient-hook mode (SIFT Fig. 4): dense grads freed at once
      + update in backward                    each weight stepped in its hook; one shared [max k] scratch
      sparse backward                         no dense weight gradient at all (`sift.sparse_backward`)
      sparse backward + update in backward
    (each for state="exact" and state="lean")
    SparseAdamW                               plain mode: dense grads live until the step
    AdamW(fused=True)                         dense baseline
    peft LoRA r=16 + AdamW(fused=True)        run last: it wraps the model's layers

One warm-up step runs first (SparseAdamW selects on it, the other optimizers allocate their
state), then the measured step: forward, backward, `optimizer.step()`.

CUDA (Llama-7B in bf16, seq 2048, batch 1, like SIFT's Table 1): `torch.cuda` allocator
statistics per phase.
    Params      allocated after the model is built
    Grad        gradient bytes held after backward (dense `.grad`s + compact buffers or scratch)
    Optim       optimizer state bytes
    Activation  peak during forward minus what was allocated before it
    Sum         Params + Grad + Optim + Activation (how the paper's Total adds up)
    Peak        `max_memory_allocated` over the whole measured step
CPU: Llama-7B's layer shapes (hidden 4096, intermediate 11008, 32 heads, vocab 32000) built for
real in bf16 with a few layers and a short sequence; Params, Grad and Optim are counted from
live tensors, Activation is the bytes autograd saved for backward (saved-tensor hooks,
deduplicated by storage), and the process's peak RSS rise over the step (reset through
/proc/self/clear_refs) is a rough total. A second table projects each row to the full model
(32 layers, seq 2048): see `project` for how.
"""

from __future__ import annotations

import gc
import os
import resource
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from sift.bench._harness import markdown_table, reset_peak_rss, rss_kib, save_results
from sift.optim import SparseAdamW

DENSITY = 0.05
GIB = 2**30
MIB = 2**20

# SIFT Table 1 (Llama 7B, bf16 weights, fp32 AdamW states, seq 2048, batch 1, 5%), in GiB.
PAPER_TABLE_1 = {
    ("Full", False): {"Params": 12.55, "Grad": 12.55, "Optim": 50.21, "Activation": 35.72, "Total": 111.03},
    ("Full", True): {"Params": 12.55, "Grad": 12.55, "Optim": 50.21, "Activation": 0.81, "Total": 76.12},
    ("SIFT", False): {"Params": 12.55, "Grad": 0.626, "Optim": 2.51, "Activation": 35.72, "Total": 51.41},
    ("SIFT", True): {"Params": 12.55, "Grad": 0.626, "Optim": 2.51, "Activation": 0.81, "Total": 16.50},
}

# (label, optimizer kind, SparseAdamW state layout, paper row it corresponds to); LoRA last, it wraps the layers.
CONFIGS = (
    ("SparseAdamW exact, hook", "hook", "exact", "SIFT"),
    ("SparseAdamW exact, hook, update in backward", "hook_uib", "exact", ""),
    ("SparseAdamW exact, sparse backward", "sparse_backward", "exact", ""),
    ("SparseAdamW exact, sparse backward, update in backward", "sparse_backward_uib", "exact", ""),
    ("SparseAdamW lean, hook", "hook", "lean", ""),
    ("SparseAdamW lean, hook, update in backward", "hook_uib", "lean", ""),
    ("SparseAdamW lean, sparse backward", "sparse_backward", "lean", ""),
    ("SparseAdamW lean, sparse backward, update in backward", "sparse_backward_uib", "lean", ""),
    ("SparseAdamW exact, plain", "plain", "exact", ""),
    ("AdamW(fused=True)", "dense", "", "Full"),
    ("peft LoRA r=16, AdamW(fused=True)", "lora", "", ""),
)
LORA_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_RANK = 16

PAPER_COLUMNS = ("paper Params", "paper Grad", "paper Optim", "paper Activation", "paper Total")
COLUMNS = ("optimizer", "GC", "Params", "Grad", "Optim", "Activation", "Sum", "Peak", "step s", *PAPER_COLUMNS)
CPU_COLUMNS = ("optimizer", "GC", "Params", "Grad", "Optim", "Activation", "Sum", "RSS rise", "peak RSS", "step s")
PROJECTED_COLUMNS = ("optimizer", "GC", "Params", "Grad", "Optim", "Activation", "Total", *PAPER_COLUMNS)


class _Trainer:
    """One configuration's optimizer on `model` (and the peft wrapper or sparse-backward patch it needs)."""

    def __init__(self, model: torch.nn.Module, kind: str, state: str):
        self.model, self.kind, self.handle, self.peft = model, kind, None, None
        self.adapter_bytes = 0  # LoRA's A and B: weights the model did not have
        if kind == "lora":
            from peft import LoraConfig, get_peft_model

            config = LoraConfig(r=LORA_RANK, lora_alpha=2 * LORA_RANK, lora_dropout=0.0, target_modules=LORA_MODULES)
            self.peft = get_peft_model(model, config)
            self.params = [p for p in self.peft.parameters() if p.requires_grad]
            self.adapter_bytes = sum(p.numel() * p.element_size() for p in self.params)
            self.opt: torch.optim.Optimizer = torch.optim.AdamW(self.params, lr=1e-5, fused=True)
            return
        self.params = _trainable(model)
        if kind == "dense":
            self.opt = torch.optim.AdamW(self.params, lr=1e-5, fused=True)
            return
        self.opt = SparseAdamW(self.params, lr=1e-5, density=DENSITY, state=state, compact_grads=kind != "plain",
                               update_in_backward=kind.endswith("_uib"))
        if kind.startswith("sparse_backward"):
            from sift.sparse_backward import enable_sparse_backward

            self.handle = enable_sparse_backward(model, self.opt)

    @property
    def forward_model(self) -> torch.nn.Module:
        return self.peft if self.peft is not None else self.model

    def release(self) -> None:
        """Undo what this configuration did to the model and drop its optimizer and gradients."""
        if isinstance(self.opt, SparseAdamW):
            self.opt.remove_hooks()
        if self.handle is not None:
            self.handle.remove()
        if self.peft is not None:
            self.peft.unload()
            _freeze_all_but_layers(self.model)
        for p in self.model.parameters():
            p.grad = None
        self.opt = None
        gc.collect()


def _chosen_configs() -> tuple[tuple[str, str, str, str], ...]:
    """`CONFIGS`, or those whose label is one of `SIFT_BENCH_MEMORY_ONLY` (labels joined by ";"):
    the 7B-shaped CPU run takes minutes per configuration.

    Raises:
        ValueError: a label that is not in `CONFIGS`.
    """
    only = os.environ.get("SIFT_BENCH_MEMORY_ONLY", "").strip()
    if not only:
        return CONFIGS
    wanted = [label.strip() for label in only.split(";") if label.strip()]
    known = {c[0]: c for c in CONFIGS}
    unknown = [label for label in wanted if label not in known]
    if unknown:
        raise ValueError(f"SIFT_BENCH_MEMORY_ONLY names unknown configurations {unknown}; choose from {list(known)}")
    return tuple(known[label] for label in wanted)


def llama_config(kind: str, quick: bool) -> dict[str, Any]:
    """Model and batch sizes, and the full model the figures are projected to.

    CUDA: Llama-7B itself. CPU: a small Llama (hidden 256, 2 layers, seq 128), projected to twice
    its layers and sequence; with `SIFT_BENCH_MEMORY_7B=1`, Llama-7B's layer shapes, 1 layer, seq 16,
    projected to 32 layers and seq 2048 (about 45 minutes on a 2-core CPU without bf16 GEMM).
    `quick`: a tiny Llama, projected to twice its layers and sequence.
    """
    if quick:
        return dict(hidden_size=64, num_hidden_layers=2, intermediate_size=176, num_attention_heads=4,
                    num_key_value_heads=4, vocab_size=256, seq=32, target_layers=4, target_seq=64)
    llama_7b = dict(hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_key_value_heads=32,
                    vocab_size=32000, target_layers=32, target_seq=2048)
    if kind == "cuda":
        return dict(llama_7b, num_hidden_layers=32, seq=2048)
    if os.environ.get("SIFT_BENCH_MEMORY_7B", "0") == "1":
        # bf16 matmuls at this width take about a minute per layer's backward on a CPU without
        # bf16 GEMM: one layer, 16 tokens, measured; the rest projected.
        return dict(llama_7b, num_hidden_layers=1, seq=16)
    # The main job must finish in minutes: a small Llama by default.
    return dict(hidden_size=256, num_hidden_layers=2, intermediate_size=688, num_attention_heads=4,
                num_key_value_heads=4, vocab_size=8000, seq=128, target_layers=4, target_seq=256)


def _freeze_all_but_layers(model: torch.nn.Module) -> None:
    """Only attention and MLP weights keep `requires_grad`, as in SIFT's Table 1 comparison."""
    for name, p in model.named_parameters():
        p.requires_grad_(p.dim() == 2 and (".self_attn." in name or ".mlp." in name))


def build_model(sizes: dict[str, Any], device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """A randomly initialised `LlamaForCausalLM`, built directly on `device` in `dtype`.

    Only attention and MLP weights keep `requires_grad`, as in SIFT's Table 1 comparison.

    Example:
        >>> m = build_model(llama_config("cpu", quick=True), torch.device("cpu"), torch.bfloat16)
        >>> sum(p.requires_grad for p in m.parameters())
        14
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{k: v for k, v in sizes.items() if k not in ("seq", "target_layers", "target_seq")},
                         max_position_embeddings=sizes["seq"],
                         use_cache=False, tie_word_embeddings=False)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # allocate in bf16 from the start: no fp32 copy of 7B weights
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model.train()
    _freeze_all_but_layers(model)
    return model


def _trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _state_bytes(opt: torch.optim.Optimizer) -> tuple[int, int]:
    """(optimizer state bytes, compact gradient buffer bytes)."""
    if isinstance(opt, SparseAdamW):
        sb = opt.state_bytes()
        return int(sb["state_bytes"]), int(sb["compact_grad_bytes"])
    total = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                if isinstance(t, torch.Tensor))
    return total, 0


def _grad_bytes(params: list[torch.nn.Parameter]) -> int:
    return sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)


def _param_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


# ------------------------------------------------------------------ CPU accounting


def _peak_rss_bytes() -> int:
    hwm = rss_kib("VmHWM")
    if hwm is not None:
        return hwm * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


@contextmanager
def _count_saved_tensors(exclude: set[int]) -> Iterator[dict[int, int]]:
    """Count the bytes autograd saves for backward, once per storage, skipping `exclude`d storages."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in exclude:
            seen[ptr] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield seen


# ------------------------------------------------------------------- one config


def _set_checkpointing(model: torch.nn.Module, enabled: bool) -> None:
    """Turn activation checkpointing on (non-reentrant: frozen embeddings give inputs without grad) or off."""
    # transformers 5.x renamed gradient_checkpointing_* to activation_checkpointing_*; older ones lack the new name.
    prefix = "activation" if hasattr(model, "activation_checkpointing_enable") else "gradient"
    if enabled:
        getattr(model, f"{prefix}_checkpointing_enable")(**{f"{prefix}_checkpointing_kwargs": {"use_reentrant": False}})
    else:
        getattr(model, f"{prefix}_checkpointing_disable")()


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: torch.Tensor,
                on_forward_done: Callable[[], None] = lambda: None,
                on_backward_done: Callable[[], None] = lambda: None) -> None:
    loss = model(input_ids=batch, labels=batch).loss
    on_forward_done()
    loss.backward()
    del loss
    on_backward_done()
    opt.step()
    opt.zero_grad(set_to_none=True)


def measure_cuda(trainer: _Trainer, batch: torch.Tensor, params_bytes: int) -> dict[str, float]:
    """Allocator statistics of one steady-state training step (after a warm-up step)."""
    model, opt, trainable = trainer.forward_model, trainer.opt, trainer.params
    _train_step(model, opt, batch)  # warm-up: selection / state allocation
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    marks: dict[str, int] = {}

    def forward_done() -> None:
        marks["forward_peak"] = torch.cuda.max_memory_allocated()

    def backward_done() -> None:
        marks["after_backward"] = torch.cuda.memory_allocated()
        marks["grad"] = _grad_bytes(trainable)

    t0 = time.perf_counter()
    _train_step(model, opt, batch, forward_done, backward_done)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    state, compact = _state_bytes(opt)
    out = {
        "params": params_bytes + trainer.adapter_bytes,
        "grad": marks["grad"] + compact,
        "optim": state,
        "activation": marks["forward_peak"] - before,
        "after_backward": marks["after_backward"],
        "after_step": torch.cuda.memory_allocated(),
        "peak": torch.cuda.max_memory_allocated(),
        "seconds": seconds,
    }
    trainer.release()
    torch.cuda.empty_cache()
    return out


def measure_cpu(trainer: _Trainer, batch: torch.Tensor, params_bytes: int) -> dict[str, float]:
    """Counted tensor bytes of one steady-state training step, plus the process's peak RSS rise."""
    model, opt, trainable = trainer.forward_model, trainer.opt, trainer.params
    _train_step(model, opt, batch)  # warm-up: selection / state allocation
    gc.collect()
    exclude = {p.untyped_storage().data_ptr() for p in model.parameters()}
    marks: dict[str, int] = {}

    def backward_done() -> None:
        marks["grad"] = _grad_bytes(trainable)

    rss_reset = reset_peak_rss()
    rss_before = (rss_kib("VmRSS") or 0) * 1024
    t0 = time.perf_counter()
    with _count_saved_tensors(exclude) as saved:
        _train_step(model, opt, batch, on_backward_done=backward_done)
    seconds = time.perf_counter() - t0
    peak_rss = _peak_rss_bytes()
    state, compact = _state_bytes(opt)
    out = {
        "params": params_bytes + trainer.adapter_bytes,
        "grad": marks["grad"] + compact,
        "optim": state,
        "activation": sum(saved.values()),
        "rss_rise": peak_rss - rss_before if rss_reset else float("nan"),
        "peak_rss": peak_rss,
        "peak_rss_scope": "this step" if rss_reset else "process lifetime (clear_refs unavailable)",
        "seconds": seconds,
    }
    trainer.release()
    return out


# ------------------------------------------------------------------------ run


def project(m: dict[str, float], sizes: dict[str, Any], layer_param_bytes: float, outside_param_bytes: float,
            saved_no_gc: float, saved_gc: float) -> dict[str, float]:
    """One configuration's measured bytes scaled to the full model (`target_layers`, `target_seq`).

    Params: the measured non-layer bytes plus `target_layers` times the measured per-layer bytes (plus
    LoRA's adapters per layer). Grad and Optim: per-layer quantities times target_layers / layers,
    except update-in-backward's scratch, one [max k] buffer whatever the depth (kept as measured).
    Activation, linear in the sequence (the CPU sdpa attention saves [T] statistics, no [T, T]
    matrix): without checkpointing, the measured saved bytes with the layers' part scaled to
    target_layers; with it, what is saved outside the layers, one layer's saved bytes (recomputed in
    backward), and each layer's [T, hidden] bf16 input that the checkpoint keeps.
    """
    layers, ratio = sizes["num_hidden_layers"], sizes["target_seq"] / sizes["seq"]
    depth = sizes["target_layers"] / layers
    per_layer_saved = max(saved_no_gc - saved_gc, 0.0) / layers
    adapters = m["params"] - (layer_param_bytes * layers + outside_param_bytes)
    grad = m["grad"] if m.get("scratch_only") else m["grad"] * depth
    if m["checkpointing"]:
        inputs = sizes["target_layers"] * sizes["target_seq"] * sizes["hidden_size"] * 2
        activation = (saved_gc + per_layer_saved) * ratio + inputs
    else:
        activation = (saved_gc + per_layer_saved * sizes["target_layers"]) * ratio
    params = outside_param_bytes + layer_param_bytes * sizes["target_layers"] + adapters * depth
    return {"params": params, "grad": grad, "optim": m["optim"] * depth, "activation": activation,
            "total": params + grad + m["optim"] * depth + activation}


def _paper(paper: str, checkpointing: bool) -> dict[str, float]:
    if not paper:
        return {}
    ref = PAPER_TABLE_1[(paper, checkpointing)]
    return {"paper Params": ref["Params"], "paper Grad": ref["Grad"], "paper Optim": ref["Optim"],
            "paper Activation": ref["Activation"], "paper Total": ref["Total"]}


def run(quick: bool = False) -> str:
    """Measure the memory of one training step for each configuration, with and without GC.

    Args:
        quick: a tiny model (seconds; figures not comparable).

    Returns:
        The markdown table(s) (headed by the machine): GiB on CUDA; on CPU the measured MiB and
        the GiB projected to the full model.

    Example:
        >>> print(run(quick=True))  # doctest: +SKIP
    """
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    on_cuda = device.type == "cuda"
    sizes = llama_config(device.type, quick)
    dtype = torch.bfloat16
    t_build = time.perf_counter()
    model = build_model(sizes, device, dtype)
    build_seconds = time.perf_counter() - t_build
    params_bytes = torch.cuda.memory_allocated() if on_cuda else _param_bytes(model)
    outside_bytes = sum(t.numel() * t.element_size() for name, t in [*model.named_parameters(),
                                                                      *model.named_buffers()] if ".layers." not in name)
    layer_bytes = (_param_bytes(model) - outside_bytes) / sizes["num_hidden_layers"]
    gen = torch.Generator(device=device).manual_seed(0)
    batch = torch.randint(0, sizes["vocab_size"], (1, sizes["seq"]), device=device, generator=gen)
    measure = measure_cuda if on_cuda else measure_cpu
    unit, unit_name = (GIB, "GiB") if on_cuda else (MIB, "MiB")
    rows: list[dict[str, object]] = []
    projected: list[dict[str, object]] = []
    for label, kind, state, paper in _chosen_configs():
        measured = {}
        for checkpointing in (False, True):
            _set_checkpointing(model, checkpointing)
            trainer = _Trainer(model, kind, state)
            m = measure(trainer, batch, params_bytes)
            m["checkpointing"] = checkpointing
            m["scratch_only"] = kind.endswith("_uib")
            measured[checkpointing] = m
            row: dict[str, object] = {"optimizer": label, "GC": "yes" if checkpointing else "no"}
            for key, col in (("params", "Params"), ("grad", "Grad"), ("optim", "Optim"), ("activation", "Activation")):
                row[col] = m[key] / unit
            row["Sum"] = (m["params"] + m["grad"] + m["optim"] + m["activation"]) / unit
            if on_cuda:
                row["Peak"] = m["peak"] / unit
                row.update(_paper(paper, checkpointing))
            else:
                row["RSS rise"] = m["rss_rise"] / unit
                row["peak RSS"] = m["peak_rss"] / unit
            row["step s"] = m["seconds"]
            row["raw_bytes"] = {k: v for k, v in m.items() if k != "seconds"}
            rows.append(row)
        if on_cuda:
            continue
        for checkpointing in (False, True):
            p = project(measured[checkpointing], sizes, layer_bytes, outside_bytes,
                        measured[False]["activation"], measured[True]["activation"])
            projected.append({"optimizer": label, "GC": "yes" if checkpointing else "no",
                              "Params": p["params"] / GIB, "Grad": p["grad"] / GIB, "Optim": p["optim"] / GIB,
                              "Activation": p["activation"] / GIB, "Total": p["total"] / GIB,
                              **_paper(paper, checkpointing), "projected_bytes": p})
    _set_checkpointing(model, False)
    trainable = sum(p.numel() for p in _trainable(model))
    total = sum(p.numel() for p in model.parameters())
    shape = (f"Llama hidden {sizes['hidden_size']}, {sizes['num_hidden_layers']} layers, intermediate "
             f"{sizes['intermediate_size']}, vocab {sizes['vocab_size']}; bf16 weights; seq {sizes['seq']}, batch 1; "
             f"{trainable / 1e6:.1f}M of {total / 1e6:.1f}M params trainable (attention + MLP), density {DENSITY:g}")
    paper_note = ("Paper: SIFT Table 1 (Llama 7B, bf16 model, fp32 AdamW states, seq 2048, batch 1, 5%), GiB, quoted "
                  "as printed; Params 12.55 there counts all 6.74B params, and its Grad, Optim, Activation are "
                  "printed once per method (the same with and without GC). Its Full row trains every weight "
                  "(embeddings and lm_head too) with fp32 AdamW states; here embeddings, norms and lm_head are "
                  "frozen for every optimizer, and torch.optim.AdamW keeps its states in the param dtype (bf16). "
                  "SparseAdamW exact keeps 18 B per trainable entry for bf16 weights, lean at most 8.")
    if on_cuda:
        title = (f"Peak memory of one training step ({unit_name}, torch.cuda allocator statistics): {shape}"
                 + (" [quick]" if quick else ""))
        markdown = markdown_table(title, COLUMNS, rows) + "\n" + "\n".join([
            "",
            "Params: allocated after building the model (plus LoRA's adapters). Grad: gradient bytes held after "
            "backward (dense .grad plus SparseAdamW's fp32 compact buffers, or update in backward's one scratch "
            "buffer). Optim: optimizer state bytes. Activation: peak during the forward minus allocated before it. "
            "Sum: the four added, as the paper's Total. Peak: max_memory_allocated over forward, backward, step.",
            paper_note, f"Model built in {build_seconds:.1f} s; attention: transformers default (sdpa)."])
    else:
        peak_scope = rows[0]["raw_bytes"]["peak_rss_scope"] if rows else ""
        title = (f"Memory of one training step ({unit_name}; Params, Grad, Optim counted from live tensors, "
                 f"Activation = bytes saved for backward, RSS from /proc ({peak_scope})), measured: {shape}"
                 + (" [quick]" if quick else ""))
        target = f"{sizes['target_layers']} layers, seq {sizes['target_seq']}"
        markdown = "\n".join([
            markdown_table(title, CPU_COLUMNS, rows), "",
            "Grad: gradient bytes held after backward (dense .grad plus SparseAdamW's fp32 compact buffers, or "
            "update in backward's one scratch buffer). Optim: state_bytes() for SparseAdamW, the state tensors for "
            "AdamW. Activation: bytes autograd saved for backward, counted once per storage through saved-tensor "
            "hooks (with gradient checkpointing the checkpointed layers save through their own hooks, so only "
            "what is saved outside them is seen). RSS rise: peak RSS during the step minus RSS before it (rough: "
            "the allocator reuses and keeps freed memory).", "",
            markdown_table(f"PROJECTED to {target} (GiB) from the measured rows above: {shape}"
                           + (" [quick]" if quick else ""), PROJECTED_COLUMNS, projected), "",
            "Every figure in this table is projected, not measured: " + " ".join(project.__doc__.split("\n\n")[1]
                                                                           .split()),
            paper_note, f"Model built in {build_seconds:.1f} s; attention: transformers default (sdpa)."])
    save_results("memory", rows, markdown, extra={"projected": projected, "config": {
        **sizes, "density": DENSITY, "dtype": "bfloat16", "quick": quick, "unit": unit_name,
        "lora_rank": LORA_RANK}}, quick=quick)
    return markdown
