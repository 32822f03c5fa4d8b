"""The quantized suite's models and methods: a Llama whose decoder linears are NF4 `Linear4bit`
(`build_quantized`), the bytes of its 4-bit state, the entry counts that match sift, QLoRA and
SHiRA, and one configuration trained on its own copy of the model (`Method`)."""

from __future__ import annotations

import gc
from typing import Any

import torch
from torch import nn

from sift._index import entries_for
from sift.bench import memory
from sift.optim import SparseAdamW

MODULES = memory.LORA_MODULES  # q, k, v, o, gate, up, down: every linear of a decoder layer
LR = 1e-4


def quantize_linears_(model: nn.Module, names: tuple[str, ...] | list[str] = MODULES) -> nn.Module:
    """Replace every `nn.Linear` whose name ends in one of `names` by an NF4 `Linear4bit` of its weight.

    Args:
        model: a model with bf16 linears (e.g. `memory.build_model`); changed in place.
        names: the module name suffixes to quantize.

    Returns:
        `model`, its targets 4-bit (compute dtype bf16, double quantization), everything frozen.
    """
    import bitsandbytes as bnb

    targets = [(name, module) for name, module in model.named_modules()
               if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in names]
    for name, linear in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        # On the meta device: no fp32 [out, in] init weight that would be thrown away at once.
        layer = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                  compute_dtype=torch.bfloat16, compress_statistics=True, quant_type="nf4",
                                  device="meta")
        layer.weight = bnb.nn.Params4bit(linear.weight.data, requires_grad=False, compress_statistics=True,
                                         quant_type="nf4")
        if linear.bias is not None:
            layer.bias = nn.Parameter(linear.bias.data, requires_grad=False)
        setattr(parent, attr, layer.to(linear.weight.device))  # bitsandbytes quantizes on the move
        del linear
    for p in model.parameters():
        p.requires_grad_(False)
    # peft picks its bitsandbytes LoRA layer (the QLoRA path) from this flag, as from_pretrained sets it.
    model.is_loaded_in_4bit = True
    return model


def build_quantized(sizes: dict[str, Any], seed: int = 0) -> nn.Module:
    """A randomly initialised bf16 `LlamaForCausalLM` of `sizes`, its decoder linears then NF4.

    Args:
        sizes: LlamaConfig fields plus "seq" (what `memory.build_model` takes; other keys are ignored).
        seed: the seed of the random weights.

    Example:
        >>> m = build_quantized(dict(QUICK_STEP_MODEL, num_hidden_layers=1))  # doctest: +SKIP
        >>> type(m.model.layers[0].mlp.up_proj).__name__  # doctest: +SKIP
        'Linear4bit'
    """
    torch.manual_seed(seed)
    fields = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
              "num_key_value_heads", "vocab_size", "seq")
    model = memory.build_model({k: sizes[k] for k in fields}, torch.device("cpu"), torch.bfloat16)
    return quantize_linears_(model)


def quant_state_bytes(model: nn.Module) -> int:
    """Bytes of the 4-bit weights' quant state (absmax, code, nested state): tensors that are no param or buffer."""
    seen: set[int] = set()
    return sum(_state_bytes(getattr(getattr(module, "weight", None), "quant_state", None), seen)
               for module in model.modules())


def _state_bytes(state: Any, seen: set[int]) -> int:
    """Bytes of the tensors of a bitsandbytes `QuantState` and its nested `state2`, each storage once."""
    total = 0
    while state is not None:
        for value in vars(state).values():
            if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() not in seen:
                seen.add(value.untyped_storage().data_ptr())
                total += value.untyped_storage().nbytes()
        state = getattr(state, "state2", None)
    return total


def single_quant_state_bytes(model: nn.Module) -> int:
    """What the quant state of `model`'s 4-bit weights would take without double quantization (fp32 absmax).

    Counted on a requantized copy of each weight (`compress_statistics=False`), then dropped.
    """
    from bitsandbytes.functional import dequantize_4bit, quantize_4bit

    total = 0
    for module in model.modules():
        state = getattr(getattr(module, "weight", None), "quant_state", None)
        if state is None:
            continue
        dense = dequantize_4bit(module.weight.data, state)
        _, single = quantize_4bit(dense, blocksize=state.blocksize, compress_statistics=False,
                                  quant_type=state.quant_type)
        total += _state_bytes(single, set())
        del dense, single
    return total


def model_bytes(model: nn.Module) -> tuple[int, int]:
    """(all bytes of params, buffers and quant state; the part outside the decoder layers)."""
    outside = sum(t.numel() * t.element_size() for name, t in [*model.named_parameters(), *model.named_buffers()]
                  if ".layers." not in name)
    return memory._param_bytes(model) + quant_state_bytes(model), outside


def shapes_of(model: nn.Module) -> list[tuple[int, int]]:
    """[out, in] of every 4-bit target of `model`."""
    return [(m.out_features, m.in_features) for name, m in model.named_modules()
            if name.rsplit(".", 1)[-1] in MODULES and isinstance(m, nn.Linear)]


def sift_entries(model: nn.Module, density: float) -> int:
    """The entries `SparseAdamW.for_model(density=...)` trains over the targets: ceil(density * out * in) each."""
    return sum(max(1, entries_for(density, out * inp)) for out, inp in shapes_of(model))


def shira_rank(model: nn.Module, density: float) -> int:
    """SHiRA's r whose r * (out + in) entries per target add up nearest to sift's count at `density`.

    peft's SHiRA takes one r for every target; the count is matched over the targets together.
    """
    return max(1, round(sift_entries(model, density) / sum(out + inp for out, inp in shapes_of(model))))


class Method:
    """One configuration on its own 4-bit model: the (peft) model to run, its optimizer, its trainables.

    Args:
        model: a 4-bit model from `build_quantized` (changed: adapters attached).
        kind: "sift", "sift-lean", "sift-lean-uib", "lora" or "shira".
        arg: the density (sift, and SHiRA's count to match) or the LoRA rank.
    """

    def __init__(self, model: nn.Module, kind: str, arg: float):
        self.model, self.kind, self.peft = model, kind, None
        self.rank: int | None = None
        extra = 0  # tensors an adapter holds that are no param or buffer (SHiRA's index table)
        if kind in ("sift", "sift-lean", "sift-lean-uib"):
            self.opt: torch.optim.Optimizer = SparseAdamW.for_model(
                model, density=arg, lr=LR, target_modules=list(MODULES), dense_modules=[], selection="magnitude",
                state="exact" if kind == "sift" else "lean", update_in_backward=kind == "sift-lean-uib")
            self.params = [p for p in model.parameters() if p.requires_grad]
        else:
            from peft import LoraConfig, ShiraConfig, get_peft_model

            if kind == "lora":
                self.rank = int(arg)
                config = LoraConfig(r=self.rank, lora_alpha=2 * self.rank, lora_dropout=0.0,
                                    target_modules=list(MODULES))
            elif kind == "shira":
                self.rank = shira_rank(model, arg)
                config = ShiraConfig(r=self.rank, target_modules=list(MODULES), random_seed=0)
            else:
                raise ValueError(f"unknown method {kind!r}")
            self.peft = get_peft_model(model, config)
            self.params = [p for p in self.peft.parameters() if p.requires_grad]
            self.opt = torch.optim.AdamW(self.params, lr=LR, fused=True)
            extra = sum(t.numel() * t.element_size() for m in self.peft.modules()
                        for t in getattr(m, "shira_indices", {}).values())
        self.entries = sum(p.numel() for p in self.params)
        self.adapter_bytes = sum(p.numel() * p.element_size() for p in self.params) + extra

    @property
    def forward_model(self) -> nn.Module:
        return self.peft if self.peft is not None else self.model

    def step(self, batch: torch.Tensor) -> None:
        """One training step: forward (causal LM loss), backward, `optimizer.step()`, `zero_grad`."""
        memory._train_step(self.forward_model, self.opt, batch)

    def release(self) -> None:
        """Drop the optimizer and gradients (the model copy is thrown away by the caller)."""
        for p in self.params:
            p.grad = None
        self.opt = None
        if self.kind == "shira":
            # peft's SHiRA warns once per layer through an lru_cache keyed by the layer: it would keep
            # every SHiRA copy of the model (and its 4-bit weights) alive.
            from peft.tuners.shira import layer

            cached = getattr(layer, "_warn_once_about_module_hooks", None)
            if hasattr(cached, "cache_clear"):
                cached.cache_clear()
        gc.collect()
