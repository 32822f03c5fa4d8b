"""Choosing heads from their scores (HiFi Sec. 4.1, Table 3) and turning the choice into
per-parameter index sets for `SparseAdamW.set_indices`.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping

import torch
from torch import nn

from sift.heads.capture import HeadLayout, attention_layout
from sift.heads.scores import HeadScores

STRATEGIES = ("layer-wise", "mid-top")
CRITERIA = ("pagerank", "pagerank-inverse", "info", "info-inverse", "corr", "random")
"""Selection criteria: HiFi itself and the Table 3 ablations.

    pagerank          top-k PageRank value (HiFi)
    pagerank-inverse  lowest-k PageRank value ("page inv")
    info              top-k information richness ("w/o corr")
    info-inverse      lowest-k information richness ("w/o corr + inv")
    corr              top-k total correlation sum_h' r[h, h'] ("w/o info")
    random            k heads drawn uniformly per layer ("random")
"""


def select_heads(
    scores: HeadScores,
    k: int = 3,
    strategy: str = "layer-wise",
    criterion: str = "pagerank",
    seed: int = 0,
) -> torch.Tensor:
    """Choose k heads per layer.

    Ties go to the lower head index. "mid-top" selects only in the upper half of the layers
    (layers n_layers // 2 and above), keeping the lower layers frozen; "layer-wise" selects in
    every layer.

    Args:
        scores: the model's `HeadScores`.
        k: heads per selected layer, 1 <= k <= n_heads.
        strategy: "layer-wise" or "mid-top".
        criterion: one of `CRITERIA` (HiFi, or a Table 3 ablation).
        seed: seed of the "random" criterion.

    Returns:
        [n_layers, n_heads] bool mask of the chosen heads.

    Raises:
        TypeError: k is not an int.
        ValueError: k out of range, unknown strategy or criterion.

    Example:
        >>> chosen = select_heads(scores, k=3, strategy="mid-top")  # doctest: +SKIP
        >>> chosen.sum(1)  # heads per layer  # doctest: +SKIP
        tensor([0, 0, 0, 3, 3, 3])
    """
    n_layers, n_heads = scores.rank.shape
    if isinstance(k, bool) or not hasattr(k, "__index__"):
        raise TypeError(f"k must be an int (heads per layer), got {k!r}")
    k = operator.index(k)
    if not 1 <= k <= n_heads:
        raise ValueError(f"k must be between 1 and the number of heads per layer ({n_heads}), got k={k}")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if criterion not in CRITERIA:
        raise ValueError(f"criterion must be one of {CRITERIA}, got {criterion!r}")
    if criterion == "random":
        generator = torch.Generator().manual_seed(seed)
        value = torch.rand(n_layers, n_heads, generator=generator, dtype=torch.float64)
    elif criterion.startswith("pagerank"):
        value = scores.rank.double()
    elif criterion.startswith("info"):
        value = scores.info.double()
    else:
        value = scores.corr.double().sum(-1)
    if criterion.endswith("-inverse"):
        value = -value
    order = torch.sort(value.cpu(), dim=1, descending=True, stable=True).indices[:, :k]
    chosen = torch.zeros(n_layers, n_heads, dtype=torch.bool)
    chosen.scatter_(1, order, True)
    if strategy == "mid-top":
        chosen[: n_layers // 2] = False
    return chosen


def _as_head_lists(selection: torch.Tensor | Mapping[int, Iterable[int]], layout: HeadLayout) -> dict[int, list[int]]:
    if isinstance(selection, torch.Tensor):
        if selection.dtype != torch.bool:
            # A score tensor (e.g. scores.rank) passed by mistake would select every nonzero head.
            raise TypeError(
                f"selection must be a bool mask [n_layers, n_heads] (from select_heads), got dtype {selection.dtype}"
            )
        if tuple(selection.shape) != (layout.n_layers, layout.n_heads):
            raise ValueError(
                f"selection mask must be [n_layers, n_heads] = {[layout.n_layers, layout.n_heads]}, "
                f"got {list(selection.shape)}"
            )
        mask = selection.cpu()
        return {layer: mask[layer].nonzero().flatten().tolist() for layer in range(layout.n_layers)}
    heads = {}
    for layer, chosen in selection.items():
        if not 0 <= int(layer) < layout.n_layers:
            raise ValueError(f"layer {layer} out of range [0, {layout.n_layers})")
        chosen = sorted({int(h) for h in chosen})
        if chosen and not (0 <= chosen[0] and chosen[-1] < layout.n_heads):
            raise ValueError(f"head indices of layer {layer} must be in [0, {layout.n_heads}), got {chosen}")
        heads[int(layer)] = chosen
    return heads


def _block_positions(heads: list[int], head_dim: int, offset: int = 0) -> torch.Tensor:
    # Positions along the output axis covered by `heads` (each a block of head_dim).
    starts = torch.tensor(heads, dtype=torch.int64) * head_dim + offset
    return (starts[:, None] + torch.arange(head_dim)).flatten()


def trainable_indices(
    model: nn.Module,
    selection: torch.Tensor | Mapping[int, Iterable[int]],
) -> dict[str, torch.Tensor]:
    """Flat positions of the W_Q, W_K, W_V entries (and biases) of the chosen heads.

    For nn.Linear projections a head owns rows of the weight ([out, in] layout); for GPT-2's
    fused `c_attn` Conv1D ([hidden, 3 * hidden]) it owns columns of the Q, K and V thirds. With
    grouped-query attention a chosen query head also makes its shared K/V head trainable.

    Args:
        model: a supported Hugging Face model (see `attention_layout`).
        selection: [n_layers, n_heads] bool mask (from `select_heads`) or `{layer: heads}`.

    Returns:
        `{parameter name: sorted unique int64 flat positions [n]}` (names as in
        `model.named_parameters()`), ready for `SparseAdamW.set_indices(param, indices)`.

    Raises:
        TypeError: a selection tensor that is not a bool mask.
        ValueError: unsupported architecture, or a selection that does not fit the model.

    Example:
        >>> chosen = select_heads(score_heads(model, data), k=3)  # doctest: +SKIP
        >>> indices = trainable_indices(model, chosen)  # doctest: +SKIP
        >>> params = dict(model.named_parameters())  # doctest: +SKIP
        >>> opt = sift.SparseAdamW([params[n] for n in indices], lr=2e-4)  # doctest: +SKIP
        >>> for name, idx in indices.items():  # doctest: +SKIP
        ...     opt.set_indices(params[name], idx)
    """
    layout = attention_layout(model)
    heads_of = _as_head_lists(selection, layout)
    params = dict(model.named_parameters())
    group = layout.n_heads // layout.n_kv_heads
    d = layout.head_dim
    out: dict[str, torch.Tensor] = {}

    def add(name: str, positions: torch.Tensor) -> None:
        if name not in params:
            return  # e.g. projections without bias
        out[name] = torch.unique(positions)  # sorted, and merges GQA duplicates

    for layer in range(layout.n_layers):
        heads = heads_of.get(layer, [])
        if not heads:
            continue
        kv_heads = sorted({h // group for h in heads})
        if layout.fused_qkv:
            name = layout.query[layer]
            weight = params[f"{name}.weight"]
            hidden = layout.n_heads * d
            cols = torch.cat([
                _block_positions(heads, d),
                _block_positions(kv_heads, d, hidden),
                _block_positions(kv_heads, d, 2 * hidden),
            ])
            add(f"{name}.weight", (torch.arange(weight.shape[0])[:, None] * weight.shape[1] + cols).flatten())
            add(f"{name}.bias", cols)
            continue
        for name, chosen in ((layout.query[layer], heads), (layout.key[layer], kv_heads), (layout.value[layer], kv_heads)):
            weight = params[f"{name}.weight"]
            rows = _block_positions(chosen, d)
            add(f"{name}.weight", (rows[:, None] * weight.shape[1] + torch.arange(weight.shape[1])).flatten())
            add(f"{name}.bias", rows)
    return out


__all__ = ["CRITERIA", "STRATEGIES", "select_heads", "trainable_indices"]
