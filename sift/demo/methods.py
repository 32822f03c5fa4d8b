"""The demo's methods: the table of rows (`METHODS`: a learning rate and a description each), the
run defaults, and how each method freezes or wraps the model and builds its optimizer (`_setup`,
`lora_rank`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from sift.demo.data import Encoded


# Steps and batch of the default run, chosen to fit 15 minutes on the shared 2-core CPU. The learning
# rates were tuned once with one seed: the frozen-body probe needs a large one to leave the majority class.
DEFAULT_STEPS = 50
QUICK_STEPS = 16
DEFAULT_BATCH = 32
DEFAULT_SEEDS = (0, 1, 2)
TARGETS = ["query", "key", "value", "attention.output.dense"]


@dataclass(frozen=True)
class Method:
    """One row of the demo: how to train and at which learning rate."""

    name: str
    lr: float
    description: str


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("probe", 1e-1, "linear probe: head only (AdamW)"),
    Method("full", 1e-4, "full fine-tuning (AdamW)"),
    Method("sift-1%", 1e-2, "SIFT, top-|grad| 1% of Q/K/V/O + head"),
    Method("sift-1% lean", 1e-2, "SIFT 1% as above, lean optimizer state (<= 8 B/entry)"),
    Method("sift-5%", 5e-3, "SIFT, top-|grad| 5% of Q/K/V/O + head"),
    Method("saliency-1%", 1e-2, "SIFT, saliency 1% of Q/K/V/O + head"),
    Method("random-1%", 1e-2, "random 1% of Q/K/V/O + head"),
    Method("hifi", 2e-3, "HiFi: Q/K/V rows of the top-1 head per layer + head"),
    Method("lora", 3e-3, "LoRA (peft) on Q/K/V/O, same parameter count as SIFT 1% + head"),
    Method("sift-1% 4-bit", 1e-2, "SIFT 1% as a sparse delta over the NF4-quantized model + head"),
    Method("qlora", 3e-3, "QLoRA: LoRA as above over the NF4-quantized model + head"),
)}
QUANTIZED = ("sift-1% 4-bit", "qlora")  # the methods that train over the 4-bit model


def _head_params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return list(model.classifier.parameters())


def _setup(method: str, model: torch.nn.Module, train: Encoded, seed: int, steps: int
           ) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Freeze / wrap `model` for `method`; the model to call and its optimizer."""
    import sift

    lr = METHODS[method].lr
    if method == "probe":
        model.requires_grad_(False)
        model.classifier.requires_grad_(True)
        return model, torch.optim.AdamW(_head_params(model), lr=lr)
    if method == "full":
        return model, torch.optim.AdamW(model.parameters(), lr=lr)
    if method in ("sift-1%", "sift-1% lean", "sift-5%", "saliency-1%", "random-1%", "sift-1% 4-bit"):
        density = 0.05 if method == "sift-5%" else 0.01
        selection = {"saliency-1%": "saliency", "random-1%": "random"}.get(method, "magnitude")
        state = "lean" if method == "sift-1% lean" else "exact"
        return model, sift.SparseAdamW.for_model(model, density=density, lr=lr, selection=selection, seed=seed,
                                                 state=state)
    if method == "hifi":
        gen = torch.Generator().manual_seed(seed)
        order = torch.randperm(train.labels.numel(), generator=gen)[:256]
        batches = [train.batch(order[i:i + 32], labels=False) for i in range(0, order.numel(), 32)]
        scores = sift.heads.score_heads(model, batches, n_samples=256, seed=seed, progress=False)
        chosen = sift.heads.select_heads(scores, k=1, strategy="layer-wise")
        indices = sift.heads.trainable_indices(model, chosen)
        params = dict(model.named_parameters())
        model.requires_grad_(False)
        for name in indices:
            params[name].requires_grad_(True)
        model.classifier.requires_grad_(True)
        # Any density below 1 makes the group sparse; set_indices replaces its own choice.
        opt = sift.SparseAdamW([{"params": [params[n] for n in indices], "density": 0.5},
                                {"params": _head_params(model), "density": 1.0}], lr=lr)
        for name, idx in indices.items():
            opt.set_indices(params[name], idx)
        return model, opt
    if method in ("lora", "qlora"):
        import peft

        lora = peft.get_peft_model(model, peft.LoraConfig(
            r=lora_rank(model), lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS,
            modules_to_save=["classifier"], task_type="SEQ_CLS"))
        return lora, torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad], lr=lr)
    raise ValueError(f"unknown method {method!r}; choose from {sorted(METHODS)}")


def lora_rank(model: torch.nn.Module, density: float = 0.01) -> int:
    """The LoRA rank whose adapters on `TARGETS` have about as many parameters as SIFT trains at `density`."""
    from sift.targets import plan_targets

    plan = plan_targets(model, target_modules=TARGETS)
    modules = dict(model.named_modules())
    # From the layers' shapes: a 4-bit layer's packed weight has neither the shape nor the element count.
    shapes = [(modules[name].out_features, modules[name].in_features) for name in plan.target_modules]
    sift_entries = sum(math.ceil(density * rows * cols) for rows, cols in shapes)
    per_rank = sum(rows + cols for rows, cols in shapes)  # r * (in + out) per adapter
    return max(1, round(sift_entries / per_rank))
