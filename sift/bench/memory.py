"""`python -m sift.bench memory`: peak memory of one Llama training step, dense vs SIFT.

Configurations (each with and without gradient checkpointing), density 5% on every
attention and MLP weight, everything else (embeddings, norms, lm_head) frozen so that no
optimizer trains it:

    SparseAdamW(compact_grads=True)   gradient-hook mode (SIFT Fig. 4): dense grads freed at once
    SparseAdamW                       plain mode: dense grads live until the step
    AdamW(fused=True)                 dense baseline (run last: it needs the most memory)

One warm-up step runs first (SparseAdamW selects on it, the dense optimizer allocates its
state), then the measured step: forward, backward, `optimizer.step()`.

CUDA (Llama-7B in bf16, seq 2048, batch 1, like SIFT's Table 1): `torch.cuda` allocator
statistics per phase.
    Params      allocated after the model is built
    Grad        gradient bytes held after backward (dense `.grad`s + compact buffers)
    Optim       optimizer state bytes
    Activation  peak during forward minus what was allocated before it
    Sum         Params + Grad + Optim + Activation (how the paper's Total adds up)
    Peak        `max_memory_allocated` over the whole measured step
CPU (a small Llama): Params, Grad and Optim are counted from live tensors, Activation is the
bytes autograd saved for backward (counted through saved-tensor hooks, deduplicated by
storage; with checkpointing the layer inputs the checkpoint holds are not seen), and the
process's peak RSS rise over the step (reset through /proc/self/clear_refs) is a rough total.
"""

from __future__ import annotations

import gc
import resource
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from sift.bench._harness import markdown_table, save_results
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

# (label, optimizer kind, paper row it corresponds to); the dense one last, it needs the most.
CONFIGS = (
    ("SparseAdamW(compact_grads=True)", "sparse_compact", "SIFT"),
    ("SparseAdamW", "sparse_plain", ""),
    ("AdamW(fused=True)", "dense", "Full"),
)

COLUMNS = ("optimizer", "GC", "Params", "Grad", "Optim", "Activation", "Sum", "Peak", "step s",
           "paper Grad", "paper Optim", "paper Activation", "paper Total")
CPU_COLUMNS = ("optimizer", "GC", "Params", "Grad", "Optim", "Activation", "Sum", "RSS rise", "peak RSS", "step s")



def _release(model: torch.nn.Module, opt: Any) -> None:
    """Drop one configuration's optimizer, hooks and gradients before measuring the next."""
    if isinstance(opt, SparseAdamW):
        opt.remove_hooks()
    for p in model.parameters():
        p.grad = None
    gc.collect()

def llama_config(kind: str, quick: bool) -> dict[str, Any]:
    """Model and batch sizes: Llama-7B on CUDA, a small Llama on CPU, a tiny one for `quick`."""
    if quick:
        return dict(hidden_size=64, num_hidden_layers=2, intermediate_size=176, num_attention_heads=4,
                    num_key_value_heads=4, vocab_size=256, seq=32)
    if kind == "cuda":
        return dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=11008, num_attention_heads=32,
                    num_key_value_heads=32, vocab_size=32000, seq=2048)
    return dict(hidden_size=512, num_hidden_layers=4, intermediate_size=1376, num_attention_heads=8,
                num_key_value_heads=8, vocab_size=32000, seq=256)


def build_model(sizes: dict[str, Any], device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """A randomly initialised `LlamaForCausalLM`, built directly on `device` in `dtype`.

    Only attention and MLP weights keep `requires_grad`, as in SIFT's Table 1 comparison.

    Example:
        >>> m = build_model(llama_config("cpu", quick=True), torch.device("cpu"), torch.bfloat16)
        >>> sum(p.requires_grad for p in m.parameters())
        14
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{k: v for k, v in sizes.items() if k != "seq"}, max_position_embeddings=sizes["seq"],
                         use_cache=False, tie_word_embeddings=False)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # allocate in bf16 from the start: no fp32 copy of 7B weights
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model.train()
    for name, p in model.named_parameters():
        p.requires_grad_(p.dim() == 2 and (".self_attn." in name or ".mlp." in name))
    return model


def _trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _make_optimizer(kind: str, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if kind == "dense":
        return torch.optim.AdamW(params, lr=1e-5, fused=True)
    return SparseAdamW(params, lr=1e-5, density=DENSITY, compact_grads=kind == "sparse_compact")


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


def _rss_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark to the current RSS (Linux >= 4.0); False if not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss_bytes() -> int:
    hwm = _rss_kib("VmHWM")
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


def measure_cuda(model: torch.nn.Module, kind: str, batch: torch.Tensor, params_bytes: int) -> dict[str, float]:
    """Allocator statistics of one steady-state training step (after a warm-up step)."""
    trainable = _trainable(model)
    opt = _make_optimizer(kind, trainable)
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
        "params": params_bytes,
        "grad": marks["grad"] + compact,
        "optim": state,
        "activation": marks["forward_peak"] - before,
        "after_backward": marks["after_backward"],
        "after_step": torch.cuda.memory_allocated(),
        "peak": torch.cuda.max_memory_allocated(),
        "seconds": seconds,
    }
    _release(model, opt)
    torch.cuda.empty_cache()
    return out


def measure_cpu(model: torch.nn.Module, kind: str, batch: torch.Tensor, params_bytes: int) -> dict[str, float]:
    """Counted tensor bytes of one steady-state training step, plus the process's peak RSS rise."""
    trainable = _trainable(model)
    opt = _make_optimizer(kind, trainable)
    _train_step(model, opt, batch)  # warm-up: selection / state allocation
    gc.collect()
    exclude = {p.untyped_storage().data_ptr() for p in model.parameters()}
    marks: dict[str, int] = {}

    def backward_done() -> None:
        marks["grad"] = _grad_bytes(trainable)

    rss_reset = _reset_peak_rss()
    rss_before = (_rss_kib("VmRSS") or 0) * 1024
    t0 = time.perf_counter()
    with _count_saved_tensors(exclude) as saved:
        _train_step(model, opt, batch, on_backward_done=backward_done)
    seconds = time.perf_counter() - t0
    peak_rss = _peak_rss_bytes()
    state, compact = _state_bytes(opt)
    out = {
        "params": params_bytes,
        "grad": marks["grad"] + compact,
        "optim": state,
        "activation": sum(saved.values()),
        "rss_rise": peak_rss - rss_before if rss_reset else float("nan"),
        "peak_rss": peak_rss,
        "peak_rss_scope": "this step" if rss_reset else "process lifetime (clear_refs unavailable)",
        "seconds": seconds,
    }
    _release(model, opt)
    return out


# ------------------------------------------------------------------------ run


def run(quick: bool = False) -> str:
    """Measure the memory of one training step for each optimizer, with and without GC.

    Args:
        quick: a tiny model (seconds; figures not comparable).

    Returns:
        The markdown table (headed by the machine), GiB on CUDA and MiB on CPU.

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
    gen = torch.Generator(device=device).manual_seed(0)
    batch = torch.randint(0, sizes["vocab_size"], (1, sizes["seq"]), device=device, generator=gen)
    measure = measure_cuda if on_cuda else measure_cpu
    unit, unit_name = (GIB, "GiB") if on_cuda else (MIB, "MiB")
    rows: list[dict[str, object]] = []
    for label, kind, paper in CONFIGS:
        for checkpointing in (False, True):
            _set_checkpointing(model, checkpointing)
            m = measure(model, kind, batch, params_bytes)
            row: dict[str, object] = {"optimizer": label, "GC": "yes" if checkpointing else "no"}
            for key, col in (("params", "Params"), ("grad", "Grad"), ("optim", "Optim"), ("activation", "Activation")):
                row[col] = m[key] / unit
            row["Sum"] = (m["params"] + m["grad"] + m["optim"] + m["activation"]) / unit
            if on_cuda:
                row["Peak"] = m["peak"] / unit
                if paper:
                    ref = PAPER_TABLE_1[(paper, checkpointing)]
                    row.update({"paper Grad": ref["Grad"], "paper Optim": ref["Optim"],
                                "paper Activation": ref["Activation"], "paper Total": ref["Total"]})
            else:
                row["RSS rise"] = m["rss_rise"] / unit
                row["peak RSS"] = m["peak_rss"] / unit
            row["step s"] = m["seconds"]
            row["raw_bytes"] = {k: v for k, v in m.items() if k != "seconds"}
            rows.append(row)
    _set_checkpointing(model, False)
    trainable = sum(p.numel() for p in _trainable(model))
    total = sum(p.numel() for p in model.parameters())
    shape = (f"Llama hidden {sizes['hidden_size']}, {sizes['num_hidden_layers']} layers, intermediate "
             f"{sizes['intermediate_size']}, vocab {sizes['vocab_size']}; bf16 weights; seq {sizes['seq']}, batch 1; "
             f"{trainable / 1e6:.1f}M of {total / 1e6:.1f}M params trainable (attention + MLP), density {DENSITY:g}")
    if on_cuda:
        title = (f"Peak memory of one training step ({unit_name}, torch.cuda allocator statistics): {shape}"
                 + (" [quick]" if quick else ""))
        columns = COLUMNS
        notes = [
            "",
            "Params: allocated after building the model. Grad: gradient bytes held after backward (dense .grad "
            "plus SparseAdamW's fp32 compact buffers). Optim: optimizer state bytes. Activation: peak during the "
            "forward minus allocated before it. Sum: the four added, as the paper's Total. Peak: "
            "max_memory_allocated over forward, backward and step.",
            "Paper: SIFT Table 1 (Llama 7B, 5%), GiB; Params 12.55 there counts all 6.74B params. Its Full row trains "
            "every weight (embeddings and lm_head too) with fp32 AdamW states (8 B/param); here embeddings, norms "
            "and lm_head are frozen for every optimizer, and torch.optim.AdamW keeps its states in the param dtype "
            "(bf16: 4 B/param). SparseAdamW keeps int32 index + fp32 m, v, delta + bf16 base = 18 B per trainable "
            "entry, and fp32 compact grads (the paper's 0.626 GiB is bf16).",
            f"Model built in {build_seconds:.1f} s; attention: transformers default (sdpa).",
        ]
    else:
        peak_scope = rows[0]["raw_bytes"]["peak_rss_scope"] if rows else ""
        title = (f"Memory of one training step ({unit_name}; Params, Grad, Optim counted from live tensors, "
                 f"Activation = bytes saved for backward, RSS from /proc ({peak_scope})): {shape}"
                 + (" [quick]" if quick else ""))
        columns = CPU_COLUMNS
        notes = [
            "",
            "Grad: gradient bytes held after backward (dense .grad plus SparseAdamW's fp32 compact buffers). Optim: "
            "state_bytes() for SparseAdamW, the state tensors for AdamW (bf16 states for bf16 weights). "
            "Activation: bytes autograd saved for backward, counted once per storage through saved-tensor hooks "
            "(with gradient checkpointing the checkpointed layers save through their own hooks, so only what is "
            "saved outside them is seen). RSS rise: peak RSS during the step minus RSS before it (rough: the "
            "allocator reuses and keeps freed memory).",
        ]
    markdown = markdown_table(title, columns, rows) + "\n" + "\n".join(notes)
    save_results("memory", rows, markdown, extra={"config": {**sizes, "density": DENSITY, "dtype": "bfloat16",
                                                             "quick": quick, "unit": unit_name}}, quick=quick)
    return markdown
