"""How each method of the chat board (`sift.bench.chat_board.METHODS`) takes the model: what it freezes or
wraps, and its optimizer; shared by the board's runs (`sift.bench.llm`) and its timing (`sift.bench.llm_timing`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from sift.bench.chat_board import ATTENTION, METHODS, Method


def target_shapes(model: torch.nn.Module, targets: Sequence[str]) -> list[tuple[int, int]]:
    """(out, in) of every linear layer whose name ends in one of `targets`."""
    return [(m.out_features, m.in_features) for name, m in model.named_modules()
            if name.rsplit(".", 1)[-1] in targets and hasattr(m, "out_features")]


def matched_rank(model: torch.nn.Module, targets: Sequence[str] = ATTENTION, density: float = 0.01) -> int:
    """The LoRA/SHiRA rank r whose r * (in + out) entries over `targets` is nearest sift's count at `density`."""
    shapes = target_shapes(model, targets)
    entries = sum(math.ceil(density * rows * cols) for rows, cols in shapes)
    return max(1, round(entries / sum(rows + cols for rows, cols in shapes)))


def setup(method: Method, model: torch.nn.Module, lr: float, seed: int
          ) -> tuple[torch.nn.Module, torch.optim.Optimizer | None]:
    """Freeze / wrap `model` for `method`; the model to call and its optimizer (None: zero-shot)."""
    import sift

    torch.manual_seed(seed)
    if method.kind == "zero-shot":
        return model, None
    if method.kind == "full":
        return model, torch.optim.AdamW(model.parameters(), lr=lr)
    if method.kind == "frozen":
        # The training step's floor: the same forward and the backward through the activations, nothing trained.
        model.requires_grad_(False)
        model.enable_input_require_grads()
        return model, torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0)
    if method.kind == "sift":
        # Column-normalized entries are handed over before the first step (`choose_column_normalized`), which
        # needs the dense gradients plain mode keeps.
        own = method.selection == "column-normalized"
        return model, sift.SparseAdamW.for_model(
            model, density=method.density, lr=lr, target_modules=list(method.targets),
            selection="magnitude" if own else method.selection, memory="plain" if own else "low",
            select_steps=method.select_steps, seed=seed, reselect_every=method.reselect_every)
    import peft

    targets = method.targets if isinstance(method.targets, str) else list(method.targets)
    rank = method.rank or matched_rank(model, ATTENTION, METHODS["sift attn 1%"].density)
    if method.kind == "lora":
        config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=targets)
    elif method.kind == "shira":
        config = peft.ShiraConfig(r=rank, mask_type="random", random_seed=seed, target_modules=targets)
    else:
        raise ValueError(f"unknown method kind {method.kind!r}")
    net = peft.get_peft_model(model, config)
    return net, torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=lr)


def choose_column_normalized(opt: torch.optim.Optimizer) -> None:
    """Choose each sparse weight's entries by |grad| divided by the RMS of its input column's |grad|, the top
    `ceil(density * numel)` (sift's count; ties to the lower flat index), with `set_indices`; after the first
    backward, before the first step, as `select_steps=1` chooses.

    Every input feature then competes on equal terms. By plain |grad| (= |sum over tokens of delta_i * x_j|)
    the few input columns that carry massive activations take the budget: in SmolLM2 about a third of q/k's
    and 60% of v's top-1% entries sit in 1% of the columns, whose input RMS is about 15x the median column's,
    so every step moves every token's projections by that much more than an entry elsewhere.
    """
    from sift._rules import top_k

    for group in opt.param_groups:
        if group["density"] >= 1:
            continue
        for p in group["params"]:
            if p.grad is None or p.dim() != 2:
                continue
            g = p.grad.detach().float().abs()
            score = g / g.pow(2).mean(0, keepdim=True).sqrt().clamp_min(torch.finfo(torch.float32).tiny)
            opt.set_indices(p, top_k(score, max(1, math.ceil(round(group["density"] * p.numel(), 6)))))
