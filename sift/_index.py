"""Index helpers shared by the optimizer and the sparse deltas: sorted flat positions of one
weight, their dtype, validation, merging, lookup, the one top-k rule with its tie-break, and the
lean state's encoding of the positions (16-bit halves under a window table, see
sift/_ops/sparse_adamw_lean.py)."""

from __future__ import annotations

import math
import zlib

import torch


def index_dtype(numel: int) -> torch.dtype:
    """int32 for weights below 2**31 elements (half the bytes), else int64."""
    return torch.int32 if numel < 2**31 else torch.int64


def check_indices(indices: torch.Tensor, numel: int, what: str, allow_empty: bool = False) -> None:
    """Raise ValueError unless `indices` is a sorted, unique, in-range 1-D integer tensor.

    Args:
        indices: [k] flat positions into a weight of `numel` elements.
        numel: the weight's element count.
        what: the argument's name, for the message.
        allow_empty: accept k == 0.
    """
    if not isinstance(indices, torch.Tensor):
        raise TypeError(f"{what} must be a tensor, got {type(indices).__name__}")
    if indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{what} must be int32 or int64, got {indices.dtype}")
    if indices.is_meta:
        raise ValueError(f"{what} are on the meta device: their values cannot be checked")
    if indices.dim() != 1:
        raise ValueError(f"{what} must be 1-D, got shape {tuple(indices.shape)}")
    if indices.numel() == 0:
        if allow_empty:
            return
        raise ValueError(f"{what} is empty: a sparse weight needs at least one entry")
    lo, hi = int(indices.min()), int(indices.max())
    if lo < 0 or hi >= numel:
        raise ValueError(f"{what} out of range: values span [{lo}, {hi}] for a weight of {numel} elements")
    if indices.numel() > 1 and not bool((indices[1:] > indices[:-1]).all()):
        raise ValueError(f"{what} must be sorted ascending without duplicates")


def entries_for(density: float, numel: int) -> int:
    """ceil(density * numel): how many entries a density keeps (callers apply their own floor or cap)."""
    # round() first: 0.2 * 35 is 7.000000000000001 in binary floating point.
    return math.ceil(round(density * numel, 6))


def merge_disjoint(first: torch.Tensor, second: torch.Tensor,
                   *values: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Merge two disjoint sorted index sets [a], [b] and their per-index values (pairs of [a], [b]):
    the [a + b] sorted indices and each value pair in that order. One sort does it."""
    merged, order = torch.sort(torch.cat([first, second]))
    return merged, [torch.cat([x, y])[order] for x, y in values]


def lookup(sorted_positions: torch.Tensor, queries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Which `queries` are in `sorted_positions`, and where: ([q] bool, [q] int64 positions).

    Positions of queries not found are arbitrary (but in range when `sorted_positions` is not empty).
    """
    haystack, queries = sorted_positions.long(), queries.long()
    if haystack.numel() == 0:
        return torch.zeros_like(queries, dtype=torch.bool), torch.zeros_like(queries)
    pos = torch.searchsorted(haystack, queries).clamp_max(haystack.numel() - 1)
    return haystack[pos] == queries, pos


def top_k_positions(score: torch.Tensor, k: int) -> torch.Tensor:
    """The flat positions of the `k` largest scores, sorted ascending; equal scores go to the
    lower flat position, so every device and torch version chooses the same entries.

    `torch.topk` leaves ties to the implementation: with bf16 gradients thousands of entries
    can share the k-th value. NaN ranks below every number.

    Args:
        score: any shape; flattened.
        k: how many, 0 <= k <= score.numel().

    Returns:
        [k] int64 positions, ascending.

    Example:
        >>> top_k_positions(torch.tensor([1.0, 3.0, 3.0, 2.0, 3.0]), 2)
        tensor([1, 2])
    """
    flat = score.reshape(-1)
    if not 0 <= k <= flat.numel():
        raise ValueError(f"k must be in [0, {flat.numel()}], got {k}")
    if k == 0:
        return torch.empty(0, dtype=torch.long, device=flat.device)
    if flat.is_floating_point():
        flat = torch.where(torch.isnan(flat), float("-inf"), flat)
    threshold = torch.topk(flat, k, sorted=False).values.min()
    above = (flat > threshold).nonzero().reshape(-1)
    # nonzero() lists positions in ascending order: the first ones among the ties win.
    tied = (flat == threshold).nonzero().reshape(-1)[: k - above.numel()]
    return torch.sort(torch.cat([above, tied])).values


def random_generator(seed: int, name: str | None, position: int, device: torch.device) -> torch.Generator:
    """The generator of the "random" selection rule for one weight: keyed by the weight's `name` (e.g.
    "encoder.layer.0.attention.self.query.weight", a 4-bit layer's as its 16-bit weight's), so two weights
    draw apart whichever list holds them, and a run draws the same entries again. `name` None (a param
    given without one): the seed offset by the weight's `position` among the optimizer's sparse weights.

    Example:
        >>> a = torch.rand(4, generator=random_generator(0, "q.weight", 0, torch.device("cpu")))
        >>> b = torch.rand(4, generator=random_generator(0, "k.weight", 0, torch.device("cpu")))
        >>> bool((a != b).any())
        True
    """
    if name is None:
        key = seed * 1_000_003 + position
    else:
        # crc32 is stable across processes and Python versions (hash() of a str is salted per process); 32 bits,
        # since the CPU generator keeps only the low 32 bits of its seed.
        key = zlib.crc32(f"{seed}:{name}".encode())
    return torch.Generator(device=device).manual_seed(key)


LEAN_WINDOW = 65536
LEAN_WINDOW_BITS = 16


def lean_num_windows(numel: int) -> int:
    """Windows of a weight of `numel` elements (the CSR table has one more entry)."""
    return -(-numel // LEAN_WINDOW)


def encode_lean_indices(indices: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted flat positions -> (indices_low [k] int16, window_offsets [windows + 1] int32).

    Example:
        >>> low, off = encode_lean_indices(torch.tensor([3, 65537]), 70000)
        >>> low.tolist(), off.tolist()
        ([3, 1], [0, 1, 2])
    """
    idx = indices.long()
    counts = torch.bincount(idx >> LEAN_WINDOW_BITS, minlength=lean_num_windows(numel))
    offsets = torch.zeros(counts.numel() + 1, dtype=torch.int32, device=idx.device)
    torch.cumsum(counts, 0, out=offsets[1:])
    low = ((idx & 0xFFFF) ^ 0x8000) - 0x8000  # the low 16 bits as a signed int16 value
    return low.to(torch.int16), offsets
