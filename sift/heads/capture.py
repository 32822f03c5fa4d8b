"""Where the attention heads of a Hugging Face model live, and capture of their outputs.

The input of an attention block's output projection is exactly the concatenation of the
per-head outputs O_h(x) (attention-weighted values, before mixing):

    BERT / RoBERTa / XLM-R   encoder.layer.{l}.attention.output.dense   (nn.Linear)
    GPT-2                     h.{l}.attn.c_proj                          (Conv1D)
    Llama / Mistral / Qwen2   layers.{l}.self_attn.o_proj                (nn.Linear)

so one forward pre-hook per layer sees [B, S, H * D'] and reshapes it to [B, S, H, D'].
This works with every attention backend (eager, sdpa, flash) and never touches the softmax.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class _Family:
    out_proj: str  # regex on module names, one group: the layer index
    query: str  # names relative to the attention block (parent of the output projection's owner)
    key: str
    value: str
    fused_qkv: bool  # GPT-2's Conv1D c_attn holds Q, K, V side by side as columns
    causal: bool  # decoder (left-to-right attention) or encoder
    out_depth: int  # name parts from the output projection up to the attention block


_FAMILIES: dict[str, _Family] = {
    # <attn>.output.dense
    "bert": _Family(r"(?:^|\.)layer\.(\d+)\.attention\.output\.dense$", "self.query", "self.key", "self.value",
                    False, False, 2),
    # <attn>.c_proj
    "gpt2": _Family(r"(?:^|\.)h\.(\d+)\.attn\.c_proj$", "c_attn", "c_attn", "c_attn", True, True, 1),
    # <attn>.o_proj
    "llama": _Family(r"(?:^|\.)layers\.(\d+)\.self_attn\.o_proj$", "q_proj", "k_proj", "v_proj", False, True, 1),
}

_MODEL_TYPES: dict[str, str] = {
    "bert": "bert",
    "roberta": "bert",
    "xlm-roberta": "bert",
    "gpt2": "gpt2",
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "llama",
}
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(_MODEL_TYPES)


@dataclass(frozen=True)
class HeadLayout:
    """Where the heads of one model live.

    Attributes:
        model_type: the config's `model_type` (e.g. "bert", "gpt2", "qwen2").
        n_layers: attention layers, in forward order.
        n_heads: query heads per layer (H).
        n_kv_heads: key/value heads per layer (< H for grouped-query attention).
        head_dim: D', the width of one head's output.
        out_proj: module name of each layer's output projection, [n_layers].
        attention: module name of each layer's attention block, [n_layers].
        query, key, value: module names of the Q, K, V projections, [n_layers] each (the same
            fused module three times for GPT-2).
        fused_qkv: True when Q, K, V share one GPT-2 `Conv1D` (heads are column blocks).
        causal: True for decoders (GPT-2, Llama family), False for encoders (BERT family).
    """

    model_type: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    out_proj: tuple[str, ...]
    attention: tuple[str, ...]
    query: tuple[str, ...]
    key: tuple[str, ...]
    value: tuple[str, ...]
    fused_qkv: bool
    causal: bool


def attention_layout(model: nn.Module) -> HeadLayout:
    """Locate every attention layer's heads and projections in a Hugging Face model.

    Args:
        model: a BERT/RoBERTa/XLM-R encoder, GPT-2, or Llama/Mistral/Qwen2 decoder, bare or
            wrapped in a task head (`...ForSequenceClassification`, `...ForCausalLM`).

    Returns:
        The model's `HeadLayout`.

    Raises:
        ValueError: the architecture is not supported (the message names those that are), or
            its modules do not have the expected names.

    Example:
        >>> layout = attention_layout(model)  # doctest: +SKIP
        >>> layout.n_layers, layout.n_heads, layout.head_dim  # doctest: +SKIP
        (6, 12, 32)
    """
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in _MODEL_TYPES:
        raise ValueError(
            f"unsupported architecture {model_type or type(model).__name__!r}; "
            f"supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    family = _FAMILIES[_MODEL_TYPES[model_type]]
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    n_heads = int(text.num_attention_heads)
    n_kv_heads = int(getattr(text, "num_key_value_heads", None) or n_heads)
    pattern = re.compile(family.out_proj)
    found: dict[int, str] = {}
    modules = dict(model.named_modules())
    for name in modules:
        match = pattern.search(name)
        if match:
            found[int(match.group(1))] = name
    if not found:
        raise ValueError(f"{model_type} model has no module matching {family.out_proj!r}")
    layers = sorted(found)
    out_proj = tuple(found[i] for i in layers)
    attention = tuple(name.rsplit(".", family.out_depth)[0] for name in out_proj)
    first = modules[out_proj[0]]
    in_features = first.weight.shape[0] if family.fused_qkv else first.in_features
    if in_features % n_heads:
        raise ValueError(f"output projection width {in_features} is not a multiple of {n_heads} heads")
    return HeadLayout(
        model_type=model_type,
        n_layers=len(layers),
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=in_features // n_heads,
        out_proj=out_proj,
        attention=attention,
        query=tuple(f"{a}.{family.query}" for a in attention),
        key=tuple(f"{a}.{family.key}" for a in attention),
        value=tuple(f"{a}.{family.value}" for a in attention),
        fused_qkv=family.fused_qkv,
        causal=family.causal,
    )


@contextlib.contextmanager
def capture_head_outputs(
    model: nn.Module,
    on_heads: Callable[[int, torch.Tensor], None] | None = None,
    layout: HeadLayout | None = None,
) -> Iterator[dict[int, torch.Tensor]]:
    """Context manager capturing every layer's per-head outputs O_h(x) during forward passes.

    Args:
        model: a supported Hugging Face model (see `attention_layout`).
        on_heads: called as `on_heads(layer, heads)` with heads [B, S, n_heads, head_dim] on
            each forward; when given, nothing is stored (streaming, constant memory).
        layout: a precomputed `attention_layout(model)`.

    Yields:
        Without `on_heads`: a dict `{layer: [B, S, n_heads, head_dim]}` holding the last
        forward's head outputs (detached). Padding positions are included: mask them with the
        batch's attention mask.

    Raises:
        ValueError: unsupported architecture.

    Example:
        >>> with capture_head_outputs(model) as heads:  # doctest: +SKIP
        ...     model(**batch)
        >>> heads[0].shape  # [B, S, n_heads, head_dim]  # doctest: +SKIP
        torch.Size([2, 11, 12, 32])
    """
    layout = layout or attention_layout(model)
    store: dict[int, torch.Tensor] = {}
    modules = dict(model.named_modules())
    handles = []

    def make_hook(layer: int):
        def hook(module: nn.Module, args: tuple) -> None:
            hidden = args[0].detach()
            heads = hidden.reshape(*hidden.shape[:-1], layout.n_heads, layout.head_dim)
            if on_heads is None:
                store[layer] = heads
            else:
                on_heads(layer, heads)

        return hook

    try:
        for layer, name in enumerate(layout.out_proj):
            handles.append(modules[name].register_forward_pre_hook(make_hook(layer)))
        yield store
    finally:
        for handle in handles:
            handle.remove()
