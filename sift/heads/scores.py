"""HiFi head importance (Eq. 1-10 of the HiFi paper): information richness, head-to-head
correlation, PageRank, and the Monte-Carlo scoring loop over samples (Alg. 1-2).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from sift import _ops
from sift.heads.capture import HeadLayout, attention_layout, capture_head_outputs

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_META_KEYS = ("n_samples", "xi", "damping", "eps", "personalized", "model_type")


def singular_values(x: torch.Tensor, *, backend: str | None = None, check_finite: bool = True) -> torch.Tensor:
    """Batched singular values, descending.

    Every fast path squares the matrix in fp64 and solves the Gram's eigenvalues. CUDA runs a
    fused Triton kernel (Gram with `tl.dot`, Householder tridiagonalisation, Sturm bisection;
    one program per matrix). CPU runs the C++ kernel (Gram, Householder, QL; 8 matrices per
    SIMD instruction, groups over threads), or without the extension fp64 Gram + LAPACK
    `eigvalsh` over threads. All match fp64 `torch.linalg.svdvals` (the reference) to ~1e-7
    relative on every value above 1e-3 * sigma_max (fp32 output rounding).

    Args:
        x: [..., S, D] floating tensor (fp16, bf16, fp32, fp64).
        backend: force "torch" (Gram + eigvalsh), "cpp" or "triton"; None picks the fastest
            available (`SIFT_BACKEND` also forces one).
        check_finite: refuse NaN/inf input (one host sync). With False, a matrix holding
            NaN/inf gets NaN singular values on every backend, for callers that check once
            after many calls.

    Returns:
        [..., min(S, D)] singular values, descending; fp64 for fp64 input, else fp32.

    Raises:
        ValueError: fewer than 2 dims, or NaN/inf in `x` (with `check_finite`). TypeError:
            not a floating tensor.

    Example:
        >>> x = torch.randn(8, 12, 128, 64)  # [batch, heads, S, D']
        >>> singular_values(x).shape
        torch.Size([8, 12, 64])
    """
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must be a tensor with at least 2 dims [..., S, D], got {shape}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"x must be a floating tensor (fp16, bf16, fp32, fp64), got {x.dtype}")
    *batch, s, d = x.shape
    k = min(s, d)
    if x.numel() == 0:
        out_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        return torch.zeros(*batch, k, dtype=out_dtype, device=x.device)
    if check_finite and not bool(torch.isfinite(x).all()):
        raise ValueError("x holds NaN or inf values: singular values of a non-finite matrix are undefined")
    return _ops.call("singular_values", x, backend=backend)


def information_richness(sigma: torch.Tensor, xi: float = 0.9) -> torch.Tensor:
    """Information richness I_h (Eq. 2): the smallest t whose top-t singular values hold a
    share >= xi of their sum.

    Trailing zeros (the extra singular values of zero padding rows) change nothing. A
    matrix whose singular values are all zero has richness 0.

    Args:
        sigma: [..., T] singular values, descending.
        xi: the share threshold, in (0, 1] (the paper uses 0.9).

    Returns:
        [...] int64 counts in [1, T] (0 for all-zero input).

    Raises:
        ValueError: xi outside (0, 1].

    Example:
        >>> information_richness(torch.tensor([4.0, 3.0, 2.0, 1.0]), xi=0.9)  # 9 of 10 in the top 3
        tensor(3)
        >>> information_richness(torch.tensor([[9.0, 1.0, 0.0], [5.0, 5.0, 0.0]]), xi=0.9)
        tensor([1, 2])
    """
    _check_xi(xi)
    csum = sigma.to(torch.float64).cumsum(-1)
    # Dividing by the last cumulative sum (not a separate sum) makes the last share exactly 1,
    # so xi = 1 stops at the last nonzero value instead of falling off the end by rounding.
    total = csum[..., -1:]
    count = (csum < xi * total).sum(-1) + 1
    return torch.where(total[..., 0] > 0, count.clamp_max(sigma.shape[-1]), torch.zeros_like(count))


def head_correlation(heads: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Head-to-head correlation of one sample per batch row (Eq. 5-6).

    O'_h is the mean of O_h over the (unmasked) sequence; r[h, h'] = |cov(O'_h, O'_h')| with
    the unbiased covariance over the D' entries; r[h, h] = 0.

    Args:
        heads: [B, S, H, D'] per-head outputs.
        mask: [B, S] attention mask (nonzero = real token); None means no padding.

    Returns:
        [B, H, H] float64.

    Raises:
        ValueError: wrong ranks, mask shape mismatch, or D' < 2 (no unbiased covariance).

    Example:
        >>> heads = torch.randn(2, 5, 4, 8)  # [B, S, H, D']
        >>> head_correlation(heads).shape
        torch.Size([2, 4, 4])
    """
    if heads.dim() != 4:
        raise ValueError(f"heads must be [B, S, H, D'], got shape {tuple(heads.shape)}")
    b, s, _, d = heads.shape
    if d < 2:
        raise ValueError(f"the unbiased covariance over D' needs D' >= 2, got D' = {d}")
    if mask is None:
        mean = heads.float().mean(1)
    else:
        if tuple(mask.shape) != (b, s):
            raise ValueError(f"mask must be [B, S] = {[b, s]}, got {list(mask.shape)}")
        keep = mask.bool()[:, :, None, None]
        # where, not a product: whatever a padding position holds (even NaN) must not count.
        total = torch.where(keep, heads.float(), 0.0).sum(1)
        mean = total / keep.sum(1).clamp_min(1).to(torch.float32)
    centred = mean.double()
    centred = centred - centred.mean(-1, keepdim=True)
    corr = (centred @ centred.mT).div_(d - 1).abs_()
    corr.diagonal(dim1=-2, dim2=-1).zero_()
    return corr


def transition_matrix(corr: torch.Tensor) -> torch.Tensor:
    """State transition matrix M (Eq. 9): m[h, h'] = r[h, h'] / sum_{h'' != h} r[h, h''].

    A head with zero correlation to every other head moves uniformly to the others.

    Args:
        corr: [..., H, H] correlation, any diagonal (it is ignored).

    Returns:
        [..., H, H] float64, rows summing to 1, zero diagonal (H = 1: [[1]]).

    Example:
        >>> transition_matrix(torch.tensor([[0.0, 1.0, 3.0], [1.0, 0.0, 1.0], [3.0, 1.0, 0.0]]))[0]
        tensor([0.0000, 0.2500, 0.7500], dtype=torch.float64)
    """
    h = corr.shape[-1]
    if h == 1:
        return torch.ones_like(corr, dtype=torch.float64)
    r = corr.to(torch.float64).clone()
    r.diagonal(dim1=-2, dim2=-1).zero_()
    rows = r.sum(-1, keepdim=True)
    uniform = (1.0 - torch.eye(h, dtype=torch.float64, device=r.device)) / (h - 1)
    return torch.where(rows > 0, r / rows.clamp_min(torch.finfo(torch.float64).tiny), uniform)


def pagerank(
    info: torch.Tensor,
    corr: torch.Tensor,
    damping: float = 0.85,
    eps: float = 1e-6,
    *,
    personalized: bool = False,
    max_iter: int = 1000,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Relative head importance by PageRank over the head graph (Eq. 8-10, Alg. 2).

    P0 = I / sum(I) (Eq. 8), M from Eq. 9, then Alg. 2: P1 = step(P0); while
    ||P1 - P0||_1 > eps: P0 = P1; P1 = step(P1). Default (the paper's uniform teleport):

        step(P) = d * M^T P + (1 - d) / H

    Eq. 10 prints `d * M P`; with m[h, h'] the probability of moving from h to h' (Eq. 9) the
    random walk multiplies by M^T (the literal `M P` has the uniform vector as its fixed point
    for every M, since M's rows sum to 1, so it could not rank anything). The fixed point does
    not depend on P0: information richness then only acts through early stopping.
    `personalized=True` teleports to P0 instead, so information richness shapes the
    stationary distribution:

        step(P) = d * M^T P + (1 - d) * P0

    Both keep sum(P) = 1 at every iteration.

    Args:
        info: [..., H] information richness I_h (any nonnegative scale; all zero -> uniform P0).
        corr: [..., H, H] correlation r[h, h'].
        damping: d in [0, 1).
        eps: L1 tolerance between consecutive iterates, > 0.
        personalized: teleport to P0 instead of uniformly.
        max_iter: cap on iterations (reaching it warns: the ranks are then the last iterate).

    Returns:
        `(rank, iterations)`: rank [..., H] float64 summing to 1, and the number of steps
        taken, [...] int64 (each batch entry stops on its own).

    Raises:
        ValueError: damping outside [0, 1), eps <= 0, or shape mismatch.

    Example:
        >>> info = torch.tensor([3.0, 1.0, 2.0])
        >>> corr = torch.tensor([[0.0, 1.0, 2.0], [1.0, 0.0, 0.5], [2.0, 0.5, 0.0]])
        >>> rank, iters = pagerank(info, corr, damping=0.85)
        >>> rank.argmax().item(), round(float(rank.sum()), 6)
        (0, 1.0)
    """
    if not 0.0 <= damping < 1.0:
        raise ValueError(f"damping must be in [0, 1), got {damping}")
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    h = info.shape[-1]
    if tuple(corr.shape) != (*info.shape, h):
        raise ValueError(f"corr must be [..., H, H] matching info [..., H] = {list(info.shape)}, got {list(corr.shape)}")
    i = info.to(torch.float64)
    total = i.sum(-1, keepdim=True)
    p0 = torch.where(total > 0, i / total.clamp_min(torch.finfo(torch.float64).tiny), torch.full_like(i, 1.0 / h))
    walk = transition_matrix(corr).mT
    teleport = (1.0 - damping) * (p0 if personalized else torch.full_like(p0, 1.0 / h))

    def step(p: torch.Tensor) -> torch.Tensor:
        return damping * (walk @ p[..., None])[..., 0] + teleport

    prev, cur = p0, step(p0)
    iterations = torch.ones(info.shape[:-1], dtype=torch.int64, device=info.device)
    active = (cur - prev).abs().sum(-1) > eps
    # One host sync per iteration is fine here: PageRank runs once, after all samples.
    while bool(active.any()) and int(iterations.max()) < max_iter:
        nxt = step(cur)
        prev = torch.where(active[..., None], cur, prev)
        cur = torch.where(active[..., None], nxt, cur)
        iterations += active.long()
        active = active & ((cur - prev).abs().sum(-1) > eps)
    if bool(active.any()):
        warnings.warn(f"pagerank stopped at max_iter={max_iter} with {int(active.sum())} of {active.numel()} "
                      f"walks not yet within eps={eps:g}; the ranks are the last iterate", RuntimeWarning,
                      stacklevel=2)
    return cur, iterations


@dataclass
class HeadScores:
    """Per-head HiFi scores of one model on one task.

    Attributes:
        info: [n_layers, n_heads] mean information richness (Eq. 3).
        corr: [n_layers, n_heads, n_heads] mean correlation (Eq. 7), zero diagonal.
        rank: [n_layers, n_heads] PageRank value (Eq. 10), each row sums to 1.
        iterations: [n_layers] PageRank iterations per layer.
        n_samples: samples averaged over.
        xi, damping, eps, personalized: the settings used.
        model_type: the model's `config.model_type`.
    """

    info: torch.Tensor
    corr: torch.Tensor
    rank: torch.Tensor
    iterations: torch.Tensor
    n_samples: int
    xi: float = 0.9
    damping: float = 0.85
    eps: float = 1e-6
    personalized: bool = False
    model_type: str = ""

    @property
    def n_layers(self) -> int:
        return self.info.shape[0]

    @property
    def n_heads(self) -> int:
        return self.info.shape[1]

    def save(self, path: str) -> None:
        """Write the scores to a safetensors file (tensors + settings as metadata).

        Example:
            >>> scores.save("heads.safetensors")  # doctest: +SKIP
        """
        from safetensors.torch import save_file

        tensors = {k: getattr(self, k).detach().cpu().contiguous() for k in ("info", "corr", "rank", "iterations")}
        save_file(tensors, path, metadata={k: str(getattr(self, k)) for k in _META_KEYS})

    @classmethod
    def load(cls, path: str) -> HeadScores:
        """Read scores written by `save` (no pickle involved).

        Example:
            >>> scores = HeadScores.load("heads.safetensors")  # doctest: +SKIP
        """
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
            meta = f.metadata() or {}
        return cls(
            **tensors,
            n_samples=int(meta.get("n_samples", 0)),
            xi=float(meta.get("xi", 0.9)),
            damping=float(meta.get("damping", 0.85)),
            eps=float(meta.get("eps", 1e-6)),
            personalized=meta.get("personalized", "False") == "True",
            model_type=meta.get("model_type", ""),
        )

    def plot(self, path: str, max_cols: int = 6) -> None:
        """Save a figure like the paper's Fig. 3 and 4: per layer, I_h against the head index
        (with the PageRank value on a second axis), and the normalised correlation heatmap.

        Args:
            path: image file to write (format from the extension, e.g. ".png", ".pdf").
            max_cols: layers per figure row.

        Raises:
            ImportError: matplotlib is not installed (`pip install sift-kernels[plot]`).

        Example:
            >>> scores.plot("heads.png")  # doctest: +SKIP
        """
        try:
            from matplotlib.figure import Figure
        except ImportError as exc:
            raise ImportError("HeadScores.plot needs matplotlib: pip install 'sift-kernels[plot]'") from exc
        n_layers, n_heads = self.info.shape
        cols = min(n_layers, max_cols)
        rows = math.ceil(n_layers / cols)
        fig = Figure(figsize=(2.6 * cols, 2.4 * 2 * rows), layout="constrained")
        axes = fig.subplots(2 * rows, cols, squeeze=False)
        heads = range(n_heads)
        for layer in range(rows * cols):
            ax_info, ax_corr = axes[layer // cols][layer % cols], axes[rows + layer // cols][layer % cols]
            if layer >= n_layers:
                ax_info.set_axis_off()
                ax_corr.set_axis_off()
                continue
            ax_info.plot(heads, self.info[layer].cpu().numpy(), marker="o", ms=3, label="$I_h$")
            ax_rank = ax_info.twinx()
            ax_rank.plot(heads, self.rank[layer].cpu().numpy(), color="tab:red", lw=1, label="PageRank")
            ax_rank.tick_params(labelsize=6, colors="tab:red")
            ax_info.set_title(f"layer {layer}", fontsize=8)
            ax_info.tick_params(labelsize=6)
            corr = self.corr[layer].cpu()
            # Fig. 4 shows correlation normalised per layer.
            ax_corr.imshow((corr / corr.max().clamp_min(1e-30)).numpy(), cmap="viridis", vmin=0, vmax=1)
            ax_corr.set_title(f"layer {layer} corr", fontsize=8)
            ax_corr.tick_params(labelsize=6)
        fig.suptitle(f"HiFi head scores ({self.model_type or 'model'}, n={self.n_samples}, xi={self.xi})")
        fig.savefig(path, dpi=110)


def _check_xi(xi: float) -> None:
    if not 0.0 < xi <= 1.0:
        raise ValueError(f"xi must be in (0, 1], got {xi}")


def _sample_batches(
    batches: Mapping[str, torch.Tensor] | Iterable[Mapping[str, torch.Tensor]],
    n_samples: int,
    batch_size: int,
    seed: int,
) -> Iterator[Mapping[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    if isinstance(batches, Mapping):
        # A whole tokenised dataset: draw n_samples rows at random (Alg. 1, line 2).
        lengths = {v.shape[0] for v in batches.values() if isinstance(v, torch.Tensor) and v.dim() > 0}
        if len(lengths) != 1:
            raise ValueError("a mapping of tensors must hold equally long tensors, one row per sample")
        n_rows = lengths.pop()
        rows = torch.randperm(n_rows, generator=generator)[:n_samples]
        for chunk in rows.split(batch_size):
            yield {k: v[chunk] if isinstance(v, torch.Tensor) and v.dim() > 0 else v for k, v in batches.items()}
    elif isinstance(batches, Sequence):
        for i in torch.randperm(len(batches), generator=generator).tolist():
            yield batches[i]
    else:
        yield from batches


def score_heads(
    model: nn.Module,
    batches: Mapping[str, torch.Tensor] | Iterable[Mapping[str, torch.Tensor]],
    n_samples: int = 300,
    xi: float = 0.9,
    damping: float = 0.85,
    *,
    eps: float = 1e-6,
    personalized: bool = False,
    seed: int = 0,
    batch_size: int = 32,
    progress: bool = True,
    backend: str | None = None,
) -> HeadScores:
    """Score every attention head of `model` on task data (HiFi, Alg. 1-2).

    For each of n_samples samples and each layer, the per-head outputs O_h(x) (padding rows
    removed) give the information richness (Eq. 2) from their singular values and the
    head-to-head correlation (Eq. 5-6); both are summed on the model's device with no host
    sync per sample and averaged at the end (Eq. 3, 7). PageRank (Eq. 8-10) then ranks the
    heads within each layer. The model runs in eval mode under `torch.no_grad()` and every module's
    train/eval mode is restored afterwards; hooks are removed even if a forward fails.

    Args:
        model: a supported Hugging Face model (see `attention_layout`).
        batches: either one mapping of tensors with one row per sample (a tokenised dataset:
            n_samples rows are drawn at random with `seed`, in chunks of `batch_size`), a
            sequence of batches (visited in a random order drawn with `seed`), or any
            iterable of batches (consumed in order). A batch is a tokenizer output: a mapping
            with `input_ids` [B, S], optionally `attention_mask` [B, S] and any other model
            inputs; a `labels` entry is ignored. Decoders (GPT-2, Llama family) given an
            attention mask but no `position_ids` get positions counted over real tokens, so
            left padding changes nothing.
        n_samples: samples to average over (fewer if `batches` runs out).
        xi: information-richness threshold, in (0, 1].
        damping: PageRank damping factor d, in [0, 1).
        eps: PageRank L1 tolerance.
        personalized: PageRank teleports to P0 (see `pagerank`).
        seed: seed of the sample draw.
        batch_size: rows per forward when `batches` is one mapping.
        progress: show a tqdm progress bar.
        backend: force the `singular_values` backend.

    Returns:
        `HeadScores` with info [n_layers, n_heads], corr [n_layers, n_heads, n_heads] and
        rank [n_layers, n_heads].

    Raises:
        ValueError: unsupported architecture, xi, damping or eps out of range, n_samples or
            batch_size not an integer >= 1, no
            sample in `batches`, a batch without a batch dimension, or non-finite head outputs.

    Example:
        >>> enc = tokenizer(texts, padding=True, return_tensors="pt")  # doctest: +SKIP
        >>> scores = score_heads(model, dict(enc), n_samples=300)  # doctest: +SKIP
        >>> scores.rank.shape  # [n_layers, n_heads]  # doctest: +SKIP
        torch.Size([6, 12])
    """
    _check_xi(xi)
    if not 0.0 <= damping < 1.0:
        raise ValueError(f"damping must be in [0, 1), got {damping}")
    # Checked here, not first in pagerank after every forward pass has run.
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    for name, value in (("n_samples", n_samples), ("batch_size", batch_size)):
        if isinstance(value, bool) or not hasattr(value, "__index__") or value < 1:
            raise ValueError(f"{name} must be >= 1 (an integer), got {value!r}")
    n_samples, batch_size = int(n_samples), int(batch_size)
    layout = attention_layout(model)
    device = next(model.parameters()).device
    h = layout.n_heads
    info_sum = torch.zeros(layout.n_layers, h, dtype=torch.float64, device=device)
    corr_sum = torch.zeros(layout.n_layers, h, h, dtype=torch.float64, device=device)
    current_mask: list[torch.Tensor] = []

    def on_heads(layer: int, heads: torch.Tensor) -> None:
        # A model split over devices (device_map) runs each layer where its weights are: the
        # mask follows the heads there, the sums come back to the first device.
        mask = current_mask[0].to(heads.device, non_blocking=True)
        # Zero padding rows: zero rows add only zero singular values, which Eq. 2 ignores.
        per_head = torch.where(mask[:, :, None, None], heads, 0.0).permute(0, 2, 1, 3)
        sigma = singular_values(per_head, backend=backend, check_finite=False)  # checked once at the end
        info_sum[layer] += information_richness(sigma, xi).sum(0).to(device, torch.float64)
        corr_sum[layer] += head_correlation(heads, mask).sum(0).to(device)

    from tqdm.auto import tqdm

    causal = layout.causal
    # Only the attention blocks matter: run the backbone (no LM or task head: for a 128k-token
    # vocabulary the logits alone are 0.5 MB per token) and keep no KV cache.
    backbone = model.base_model if isinstance(getattr(model, "base_model", None), torch.nn.Module) else model
    extra = {"use_cache": False} if causal else {}
    seen = 0
    # Per module: a model in train mode may hold submodules the caller put in eval mode.
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        with (
            torch.no_grad(),
            capture_head_outputs(model, on_heads, layout),
            tqdm(total=n_samples, desc="HiFi head scores", unit="sample", disable=not progress) as bar,
        ):
            for batch in _sample_batches(batches, n_samples, batch_size, seed):
                inputs = _model_inputs(batch, n_samples - seen, device)
                if not inputs:
                    continue
                rows, length = _rows_of(inputs)
                mask = inputs.get("attention_mask")
                current_mask[:] = [mask.bool() if mask is not None else torch.ones(rows, length, dtype=torch.bool,
                                                                                     device=device)]
                if causal and mask is not None and mask.dim() == 2 and "position_ids" not in inputs:
                    # Decoders number positions from the first column, so left padding would shift
                    # every real token's position; count real tokens instead (as generate() does).
                    inputs["position_ids"] = (mask.long().cumsum(-1) - 1).clamp_min(0)
                backbone(**inputs, **extra)
                seen += rows
                bar.update(rows)
                if seen >= n_samples:
                    break
    finally:
        for module, training in modes:
            module.training = training
    if seen == 0:
        raise ValueError("no samples: `batches` yielded no rows to score")
    # One check after all samples (no sync per sample): a non-finite head output (e.g. fp16
    # overflow) turns its correlation into NaN, and its richness into 0, and PageRank would
    # silently rank that layer uniformly.
    finite = torch.isfinite(corr_sum).flatten(1).all(1).cpu()
    if not finite.all():
        bad = (~finite).nonzero().flatten().tolist()
        raise ValueError(
            f"head outputs of layers {bad} are not finite (NaN or inf), so their scores are meaningless; "
            "check the inputs, or score in fp32/bf16 if the model overflows in fp16"
        )
    info = (info_sum / seen).cpu()
    corr = (corr_sum / seen).cpu()
    rank, iterations = pagerank(info, corr, damping, eps, personalized=personalized)
    return HeadScores(info=info, corr=corr, rank=rank, iterations=iterations, n_samples=seen, xi=xi, damping=damping,
                      eps=eps, personalized=personalized, model_type=layout.model_type)


def _rows_of(inputs: Mapping[str, torch.Tensor]) -> tuple[int, int]:
    key = "input_ids" if "input_ids" in inputs else "inputs_embeds" if "inputs_embeds" in inputs else None
    first = inputs[key] if key else next((v for v in inputs.values() if v.dim() >= 2), None)
    if first is None or first.dim() < 2:
        shapes = {k: list(v.shape) for k, v in inputs.items()}
        raise ValueError(
            f"each batch needs a batch dimension: input_ids [B, S] (inputs_embeds [B, S, D]), got shapes {shapes}; "
            "batch single examples first, e.g. with a DataLoader"
        )
    return first.shape[0], first.shape[1]


def _model_inputs(batch: Mapping[str, torch.Tensor], remaining: int, device: torch.device) -> dict[str, torch.Tensor]:
    if not isinstance(batch, Mapping):
        raise TypeError(f"each batch must be a mapping of tensors (a tokenizer output), got {type(batch).__name__}")
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "label") and isinstance(v, torch.Tensor)}
    if not inputs or all(v.dim() == 0 or v.shape[0] == 0 for v in inputs.values()):
        return {}
    _rows_of(inputs)  # before slicing rows: a batch without a batch dimension must not lose tokens
    return {k: v[:remaining].to(device) if v.dim() > 0 else v.to(device) for k, v in inputs.items()}


__all__ = [
    "HeadLayout",
    "HeadScores",
    "head_correlation",
    "information_richness",
    "pagerank",
    "score_heads",
    "singular_values",
    "transition_matrix",
]
