"""The `mixed_delta_matmul_` op: a linear layer's output gains, token by token, the product of
that token's input with the sparse delta its row of the batch is served with (one batch, many
fine-tunes over one base); its argument checks, reference and the checked entry."""

from __future__ import annotations

import math

import torch

from sift._ops.registry import _no_output, call, define, define_schema, register
from sift.triton_kernels._delta_bank import (INT16_COLUMNS, INT32_ENTRIES, DeltaBank, PackedDeltaBank,
                                            packed_block_count)

# ---------------------------------------------------------------------------------------
# mixed_delta_matmul_(y, x, delta_ids, bank): for y = x W^T over T tokens, W [R, C], and a bank
# of n sparse deltas of W (`DeltaBank`: CSR per delta, concatenated), with d = delta_ids[t]:
#   d == -1:  y[t] is left as it is, bit for bit
#   d >= 0:   y[t, i] = dtype(fp32(y[t, i]) + sum_{e in row i of delta d} fp32(values[e]) * fp32(x[t, col[e]]))
# y [T, R] and x [T, C] share one dtype (fp32, bf16 or fp16) and their leading dims (flattened
# into T); delta_ids [T] int32/int64 in [-1, n). The bank's fields come in the forms `DeltaBank`
# builds: row_ptr int32 or int64, col_indices int16 (C <= 32768) or int32, values fp32, bf16 or
# fp16, each read as fp32 (exact), so a bank gives the bits its values give held in fp32. Products
# and sums are fp32 (summation order is the backend's); a row with no entries keeps its value
# exactly (a 16-bit value survives fp32).
#
# Layout: one delta id per token, not tokens sorted into segments. Serving computes the base
# product first and adds every row's delta into it in place; sorting the tokens by delta would
# cost a gather of x and a scatter of y (two more passes over activations as large as the
# product itself) for each layer, and the decode steps of generation, one token per row, have
# nothing to sort. Segments are implicit: the tokens of a row all carry its id.
#   "torch"  per delta: its tokens gathered, products summed into rows with index_add (chunked)
#   "cpp"    csrc/mixed_delta_matmul.cpp: threads over (token, block of output rows), CSR rows
#   "triton" triton_kernels/mixed_delta_matmul.py: [BLOCK_T, BLOCK_R] tiles, max_row_entries steps
# Every backend starts with check_mixed_delta_matmul_args, so bad arguments raise the same
# ValueError on each.
# ---------------------------------------------------------------------------------------

MIXED_DELTA_MATMUL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The forms of a bank's fields every backend takes (`DeltaBank` picks the narrowest that holds them).
BANK_ROW_PTR_DTYPES = (torch.int32, torch.int64)
BANK_COL_DTYPES = (torch.int16, torch.int32)
BANK_VALUE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Temporaries of the reference per chunk of tokens: a [tokens, entries] fp32 product.
_MIXED_DELTA_REF_BYTES = 64 << 20


def check_mixed_delta_matmul_args(y: torch.Tensor, x: torch.Tensor, delta_ids: torch.Tensor, bank: DeltaBank,
                                  check_values: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate mixed_delta_matmul_'s arguments; flatten the token dims.

    Args:
        check_values: also read the values of `delta_ids` and of the bank (one host sync);
            callers whose ids and bank are already validated (a served model's forward) skip it.

    Returns:
        `(y2 [T, R], x2 [T, C], ids [T] int32)`: y2 a view of y (written in place), x2 a view or copy.

    Raises:
        ValueError: naming the bad argument.
    """
    for name, t in (("y", y), ("x", x), ("delta_ids", delta_ids)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if not isinstance(bank, DeltaBank):
        raise ValueError(f"bank must be a DeltaBank, got {type(bank).__name__}")
    if y.dim() < 1 or x.dim() < 1:
        raise ValueError("y and x must have at least one dim (features last)")
    if y.shape[:-1] != x.shape[:-1]:
        raise ValueError(f"y and x must have the same token dims, got y {tuple(y.shape)} and x {tuple(x.shape)}")
    if y.dtype not in MIXED_DELTA_MATMUL_DTYPES:
        raise ValueError(f"y must be float32, bfloat16 or float16, got {y.dtype}")
    if x.dtype != y.dtype:
        raise ValueError(f"x must have y's dtype {y.dtype}, got {x.dtype}")
    device = y.device
    for name, t in (("x", x), ("delta_ids", delta_ids), ("bank.row_ptr", bank.row_ptr),
                    ("bank.col_indices", bank.col_indices), ("bank.values", bank.values)):
        if t.device != device:
            raise ValueError(f"{name} must be on y's device {device}, got {t.device}")
    n_rows, n_cols = y.shape[-1], x.shape[-1]
    if bank.row_ptr.dim() != 2 or bank.row_ptr.dtype not in BANK_ROW_PTR_DTYPES \
            or bank.row_ptr.shape[1] != n_rows + 1 or not bank.row_ptr.is_contiguous():
        raise ValueError(f"bank.row_ptr must be a contiguous int32 or int64 [n_deltas, {n_rows + 1}] tensor (R + 1, "
                         f"R = y.shape[-1]), got {bank.row_ptr.dtype} {tuple(bank.row_ptr.shape)}")
    _check_bank_fields(bank, "bank.")
    if bank.in_features != n_cols:
        raise ValueError(f"bank.in_features is {bank.in_features}, x has {n_cols} features")
    if not isinstance(bank.max_row_entries, int) or bank.max_row_entries < 0:
        raise ValueError(f"bank.max_row_entries must be an int >= 0, got {bank.max_row_entries!r}")
    n_tokens = math.prod(y.shape[:-1])
    if delta_ids.dim() != 1 or delta_ids.dtype not in (torch.int32, torch.int64) or delta_ids.numel() != n_tokens:
        raise ValueError(f"delta_ids must be a 1-D int32 or int64 tensor of {n_tokens} ids (one per token), got "
                         f"{delta_ids.dtype} {tuple(delta_ids.shape)}")
    try:
        y2 = y.view(-1, n_rows)
    except RuntimeError:
        raise ValueError(f"y must be viewable as [T, R] (it is written in place), got strides {y.stride()}") from None
    if check_values:
        _check_values(delta_ids, bank, n_cols)
    return y2, x.reshape(-1, n_cols), delta_ids.to(torch.int32)


def _check_bank_fields(bank: DeltaBank, name: str) -> None:
    """The columns' and values' forms, and what int32 row pointers and int16 columns can address."""
    nnz = bank.col_indices.numel()
    col = bank.col_indices
    if col.dim() != 1 or col.dtype not in BANK_COL_DTYPES or not col.is_contiguous():
        raise ValueError(f"{name}col_indices must be a contiguous 1-D int16 or int32 tensor, got {col.dtype} "
                         f"{tuple(col.shape)}")
    if col.dtype == torch.int16 and bank.in_features > INT16_COLUMNS:
        raise ValueError(f"{name}col_indices is int16, which cannot address {bank.in_features} columns "
                         f"(int32 beyond {INT16_COLUMNS})")
    if bank.row_ptr.dtype == torch.int32 and nnz >= INT32_ENTRIES:
        raise ValueError(f"{name}row_ptr is int32, which cannot address {nnz} entries (int64 from {INT32_ENTRIES})")
    if bank.values.shape != (nnz,) or bank.values.dtype not in BANK_VALUE_DTYPES or not bank.values.is_contiguous():
        raise ValueError(f"{name}values must be a contiguous float32, bfloat16 or float16 [{nnz}] tensor (one per "
                         f"column index), got {bank.values.dtype} {tuple(bank.values.shape)}")


def _check_values(delta_ids: torch.Tensor, bank: DeltaBank, n_cols: int) -> None:
    n, nnz = bank.n_deltas, bank.col_indices.numel()
    if delta_ids.numel():
        lo, hi = (int(v) for v in torch.stack([delta_ids.min(), delta_ids.max()]).tolist())
        if lo < -1 or hi >= n:
            bad = int(((delta_ids < -1) | (delta_ids >= n)).nonzero()[0, 0])
            raise ValueError(f"delta_ids has {int(delta_ids[bad])} at position {bad}, outside [-1, {n}) "
                             f"(-1: no delta; the bank holds {n})")
    ptr = bank.row_ptr
    if ptr.numel():
        steps = ptr[:, 1:] < ptr[:, :-1]
        if bool(steps.any()) or int(ptr.min()) < 0 or int(ptr.max()) > nnz:
            raise ValueError(f"bank.row_ptr must be non-decreasing per delta within [0, {nnz}] (nnz)")
        longest = int((ptr[:, 1:] - ptr[:, :-1]).max()) if ptr.shape[1] > 1 else 0
        if longest > bank.max_row_entries:
            raise ValueError(f"bank.max_row_entries is {bank.max_row_entries}, but a row holds {longest} entries")
    if nnz and (int(bank.col_indices.min()) < 0 or int(bank.col_indices.max()) >= n_cols):
        raise ValueError(f"bank.col_indices must lie in [0, {n_cols}) (x's features)")


def mixed_delta_matmul_ref(y: torch.Tensor, x: torch.Tensor, delta_ids: torch.Tensor, bank: DeltaBank,
                           check_values: bool = True) -> torch.Tensor:
    """Plain-torch reference (see the contract above); fp32 math. Returns `y`."""
    y2, x2, ids = check_mixed_delta_matmul_args(y, x, delta_ids, bank, check_values)
    n_rows = y2.shape[1]
    if not ids.numel():
        return y
    for d in ids.unique().tolist():
        if d < 0:
            continue
        ptr = bank.row_ptr[d]
        start, end = int(ptr[0]), int(ptr[-1])
        if start == end:  # fp32(y) rounds back to y: nothing to write
            continue
        tokens = (ids == d).nonzero().view(-1)
        cols = bank.col_indices[start:end].long()
        vals = bank.values[start:end].float()
        rows = torch.repeat_interleave(torch.arange(n_rows, device=y2.device), ptr.diff().long())
        chunk = max(1, _MIXED_DELTA_REF_BYTES // (4 * (end - start)))
        for s in range(0, tokens.numel(), chunk):
            part = tokens[s : s + chunk]
            contrib = x2[part][:, cols].float() * vals
            acc = torch.zeros(part.numel(), n_rows, device=y2.device).index_add_(1, rows, contrib)
            y2[part] = (y2[part].float() + acc).to(y2.dtype)
    return y


define("mixed_delta_matmul_", mixed_delta_matmul_ref)


@register("mixed_delta_matmul_", "cpp")
def _mixed_delta_matmul_cpp(y, x, delta_ids, bank, check_values=True):
    y2, x2, ids = check_mixed_delta_matmul_args(y, x, delta_ids, bank, check_values)
    # The kernel reads rows with unit stride; any row stride is fine.
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    if y2.shape[1] > 1 and y2.stride(1) != 1:
        raise ValueError(f"y's features must be contiguous for the C++ kernel, got strides {y.stride()}")
    torch.ops.sift.mixed_delta_matmul_(y2, x2, ids, bank.row_ptr, bank.col_indices, bank.values,
                                       bank.max_row_entries)
    return y


@register("mixed_delta_matmul_", "triton")
def _mixed_delta_matmul_triton(y, x, delta_ids, bank, check_values=True):
    from sift.triton_kernels.mixed_delta_matmul import mixed_delta_matmul_ as launch

    y2, x2, ids = check_mixed_delta_matmul_args(y, x, delta_ids, bank, check_values)
    launch(y2, x2, ids, bank)
    return y


def _unpacked(y, x, delta_ids, row_ptr, col_indices, values, max_row_entries):
    return y, x, delta_ids, DeltaBank(row_ptr, col_indices, values, max_row_entries, x.shape[-1])


def _mixed_delta_matmul_traced(y, x, delta_ids, row_ptr, col_indices, values, max_row_entries) -> None:
    # Values are not read in a trace (a host sync in the graph); the eager op checks them.
    _mixed_delta_matmul_triton(*_unpacked(y, x, delta_ids, row_ptr, col_indices, values, max_row_entries),
                               check_values=False)


# The raw kernel op: 2-D y and x, the bank's fields flat (mixed_delta_matmul_ below is the checked entry).
define_schema("mixed_delta_matmul_", "mixed_delta_matmul_(Tensor(a!) y, Tensor x, Tensor delta_ids, Tensor row_ptr, "
              "Tensor col_indices, Tensor values, int max_row_entries) -> ()", _no_output,
              lambda *args: call("mixed_delta_matmul_", *_unpacked(*args)),
              traced=_mixed_delta_matmul_traced)


def mixed_delta_matmul_(
    y: torch.Tensor,
    x: torch.Tensor,
    delta_ids: torch.Tensor,
    bank: DeltaBank,
    *,
    check_values: bool = True,
    backend: str | None = None,
) -> torch.Tensor:
    """Adds to each token's output the product of its input with the sparse delta it is served with.

    `y[t, i] += sum_{(i, j, v) in delta d(t)} v * x[t, j]` with `d(t) = delta_ids[t]`, in fp32,
    rounded once to y's dtype; tokens with id -1 keep y exactly.

    Args:
        y: `[..., R]` the base layer's output `x W^T` (fp32, bf16 or fp16), updated in place.
        x: `[..., C]` the layer's input, y's dtype, device and token dims.
        delta_ids: `[T]` int32/int64, T the number of tokens (y's leading dims flattened), each
            in `[-1, bank.n_deltas)`; -1 serves the base.
        bank: the deltas of W `[R, C]` on y's device: a `DeltaBank`, or on the CPU a `PackedDeltaBank`
            (the same entries in fewer bytes; backends "torch" and "cpp").
        check_values: read the ids' and the bank's values to check them (one host sync).
        backend: force "torch", "cpp" or "triton" (default: the automatic choice).

    Returns:
        `y`.

    Raises:
        ValueError: a bad argument, named (see `check_mixed_delta_matmul_args`).

    Example:
        >>> w, x = torch.randn(3, 4), torch.randn(2, 4)
        >>> bank = DeltaBank.from_rows_and_cols((3, 4), [(torch.tensor([1]), torch.tensor([2]), torch.tensor([0.5]))])
        >>> y = mixed_delta_matmul_(x @ w.T, x, torch.tensor([0, -1]), bank)
        >>> torch.allclose(y[0, 1], x[0] @ w[1] + 0.5 * x[0, 2]) and torch.equal(y[1], x[1] @ w.T)
        True
    """
    if isinstance(bank, PackedDeltaBank):
        return call("mixed_delta_matmul_packed_", y, x, delta_ids, bank, check_values=check_values, backend=backend)
    return call("mixed_delta_matmul_", y, x, delta_ids, bank, check_values=check_values, backend=backend)


# ---------------------------------------------------------------------------------------
# delta_bank_switch_(weights, banks, off, on, originals_off, originals_on): one delta of the
# banks out of the weights and another in, in place. For each layer l, W = weights[l] [R, C] (any
# strides: a Conv1D weight is passed transposed), bank = banks[l], over the entries (i, j, v) of:
#   delta off (>= 0):  W[i, j] = originals_off[l][e]          (e: the entry's place in its delta)
#   then delta on (>= 0): originals_on[l][e] = W[i, j];  W[i, j] = dtype(fp32(W[i, j]) + fp32(v))
# originals_* are [k] tensors in W's dtype (k: that delta's entries in the layer), lists empty
# for a delta of -1. The banks' fields take the forms mixed_delta_matmul_ takes (int32/int64 row
# pointers, int16/int32 columns, fp32/bf16/fp16 values read as fp32). The apply is
# `sparse_delta_apply_`'s arithmetic, so the weights are what `SparseDelta.apply_` of the same
# values gives, bit for bit; the restore writes saved bits back.
# "cpp" fuses both per block of rows; "torch" is the reference on any device.
# ---------------------------------------------------------------------------------------


def _entries_of(bank: DeltaBank, delta: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Delta `delta`'s `(rows, cols, values)` in the bank, in its CSR order."""
    ptr = bank.row_ptr[delta]
    start, end = int(ptr[0]), int(ptr[-1])
    rows = torch.repeat_interleave(torch.arange(bank.out_features, device=ptr.device), ptr.diff().long())
    return rows, bank.col_indices[start:end].long(), bank.values[start:end].float()


def _check_switch_lists(weights: list[torch.Tensor], banks: list, off: int, on: int,
                        originals_off: list[torch.Tensor], originals_on: list[torch.Tensor],
                        kind: type = DeltaBank) -> None:
    if len(banks) != len(weights):
        raise ValueError(f"banks must have one bank per weight, got {len(banks)} for {len(weights)}")
    for name, d, saved in (("off", off, originals_off), ("on", on, originals_on)):
        if not isinstance(d, int) or d < -1:
            raise ValueError(f"{name} must be a delta number or -1, got {d!r}")
        if len(saved) != (len(weights) if d >= 0 else 0):
            raise ValueError(f"originals_{name} must have one tensor per weight when {name} >= 0, else none; got "
                             f"{len(saved)}")
    if off == on and off >= 0:
        raise ValueError(f"off and on must differ, got {off} for both")
    for layer, bank in enumerate(banks):
        if not isinstance(bank, kind):
            raise ValueError(f"banks[{layer}] must be a {kind.__name__}, got {type(bank).__name__}")


def check_delta_bank_switch_args(weights: list[torch.Tensor], banks: list[DeltaBank], off: int, on: int,
                                 originals_off: list[torch.Tensor], originals_on: list[torch.Tensor]) -> None:
    """Validate delta_bank_switch_'s arguments (shapes, dtypes, devices; not the banks' values).

    Raises:
        ValueError: naming the bad argument.
    """
    _check_switch_lists(weights, banks, off, on, originals_off, originals_on)
    for layer, (w, bank) in enumerate(zip(weights, banks)):
        if not isinstance(bank, DeltaBank):
            raise ValueError(f"banks[{layer}] must be a DeltaBank, got {type(bank).__name__}")
        if w.dim() != 2 or tuple(w.shape) != (bank.out_features, bank.in_features):
            raise ValueError(f"weights[{layer}] must be [{bank.out_features}, {bank.in_features}] (its bank's), got "
                             f"{tuple(w.shape)}")
        if w.dtype not in MIXED_DELTA_MATMUL_DTYPES or w.device != bank.device:
            raise ValueError(f"weights[{layer}] must be float32, bfloat16 or float16 on its bank's device "
                             f"{bank.device}, got {w.dtype} on {w.device}")
        ptr = bank.row_ptr
        if ptr.dim() != 2 or ptr.dtype not in BANK_ROW_PTR_DTYPES or not ptr.is_contiguous():
            raise ValueError(f"banks[{layer}].row_ptr must be a contiguous int32 or int64 [n_deltas, R + 1] tensor, "
                             f"got {ptr.dtype} {tuple(ptr.shape)}")
        _check_bank_fields(bank, f"banks[{layer}].")
        for name, d, saved in (("off", off, originals_off), ("on", on, originals_on)):
            if d < 0:
                continue
            if d >= bank.n_deltas:
                raise ValueError(f"{name} is {d}, but banks[{layer}] holds {bank.n_deltas} deltas")
            start, end = bank.row_ptr[d, [0, -1]].tolist()
            k = end - start
            s = saved[layer]
            if s.shape != (k,) or s.dtype != w.dtype or s.device != w.device or not s.is_contiguous():
                raise ValueError(f"originals_{name}[{layer}] must be a contiguous {w.dtype} [{k}] tensor on "
                                 f"{w.device} (one per entry of delta {d}), got {s.dtype} {tuple(s.shape)}")


def delta_bank_switch_ref(weights: list[torch.Tensor], banks: list[DeltaBank], off: int, on: int,
                          originals_off: list[torch.Tensor], originals_on: list[torch.Tensor],
                          trusted_banks: bool = False) -> None:
    """Plain-torch reference of the switch (see the contract above)."""
    if trusted_banks:  # the per-layer checks read each bank's bounds (a device sync per layer on a GPU)
        _check_switch_lists(weights, banks, off, on, originals_off, originals_on)
    else:
        check_delta_bank_switch_args(weights, banks, off, on, originals_off, originals_on)
    with torch.no_grad():
        for layer, (w, bank) in enumerate(zip(weights, banks)):
            if off >= 0:
                rows, cols, _ = _entries_of(bank, off)
                w[rows, cols] = originals_off[layer]
            if on >= 0:
                rows, cols, vals = _entries_of(bank, on)
                old = w[rows, cols]
                originals_on[layer].copy_(old)
                w[rows, cols] = (old.float() + vals).to(w.dtype)


define("delta_bank_switch_", delta_bank_switch_ref)


@register("delta_bank_switch_", "cpp")
def _delta_bank_switch_cpp(weights, banks, off, on, originals_off, originals_on, trusted_banks=False):
    # The kernel checks every tensor before it writes (a model's hundred layers checked here cost more
    # than the switch); here only what it cannot see: the lists' lengths and each bank's columns, unless
    # the caller built the banks for these weights (a served model).
    if not trusted_banks:
        _check_switch_lists(weights, banks, off, on, originals_off, originals_on)
        for layer, (w, bank) in enumerate(zip(weights, banks)):
            if w.dim() != 2 or w.shape[1] != bank.in_features:
                raise ValueError(f"weights[{layer}] must be [R, {bank.in_features}] (its bank's), got "
                                 f"{tuple(w.shape)}")
    try:
        torch.ops.sift.delta_bank_switch_(weights, [b.row_ptr for b in banks], [b.col_indices for b in banks],
                                          [b.values for b in banks], off, on, originals_off, originals_on)
    except RuntimeError as exc:  # a bad argument, found before anything was written
        raise ValueError(str(exc).split("\n")[0]) from None


def _delta_bank_switch_flat(weights, row_ptrs, col_indices, values, off, on, originals_off, originals_on):
    banks = [DeltaBank(p, c, v, 0, w.shape[1]) for w, p, c, v in zip(weights, row_ptrs, col_indices, values)]
    delta_bank_switch_ref(list(weights), banks, off, on, list(originals_off), list(originals_on))


# The raw kernel op: the banks' fields as lists (delta_bank_switch_ below is the checked entry).
define_schema("delta_bank_switch_", "delta_bank_switch_(Tensor(a!)[] weights, Tensor[] row_ptrs, "
              "Tensor[] col_indices, Tensor[] values, int off, int on, Tensor[] originals_off, "
              "Tensor(b!)[] originals_on) -> ()", _no_output, _delta_bank_switch_flat)


def delta_bank_switch_(weights: list[torch.Tensor], banks: list[DeltaBank], off: int, on: int,
                       originals_off: list[torch.Tensor], originals_on: list[torch.Tensor], *,
                       backend: str | None = None, trusted_banks: bool = False) -> None:
    """Takes delta `off` of the banks out of the weights and puts delta `on` in, in place.

    Args:
        weights: `[R, C]` per layer (fp32, bf16 or fp16; any strides), written in place.
        banks: each weight's `DeltaBank`, on its device; or each one's `PackedDeltaBank` (CPU weights; backends
            "torch" and "cpp").
        off: the delta in the weights now (-1: none): its entries get `originals_off` back.
        on: the delta to put in (-1: none): `W[i, j] = dtype(fp32(W[i, j]) + v)`.
        originals_off: `[k]` per layer, W's dtype: the values `off`'s entries had before it went in.
        originals_on: `[k]` per layer, W's dtype: written with the values `on`'s entries have now.
        backend: force "torch" or "cpp" (default: the automatic choice).
        trusted_banks: the banks were built (`DeltaBank`) for these weights and checked then, as a served
            model's are: the Python checks of each bank against its weight are skipped. The C++ kernel
            still checks every tensor, row pointer and column it reads through before it writes.

    Raises:
        ValueError: a bad argument, named (nothing is written).

    Example:
        >>> w = torch.zeros(2, 3)
        >>> bank = DeltaBank.from_rows_and_cols((2, 3), [(torch.tensor([1]), torch.tensor([2]), torch.tensor([0.5]))])
        >>> saved = [torch.empty(1)]
        >>> delta_bank_switch_([w], [bank], -1, 0, [], saved)
        >>> w[1, 2].item(), saved[0].item()
        (0.5, 0.0)
        >>> delta_bank_switch_([w], [bank], 0, -1, saved, [])
        >>> w.abs().sum().item()
        0.0
    """
    packed = [isinstance(b, PackedDeltaBank) for b in banks]
    if any(packed) and not all(packed):
        raise ValueError("banks must be all DeltaBank or all PackedDeltaBank, got a mix")
    call("delta_bank_switch_packed_" if banks and all(packed) else "delta_bank_switch_", weights, banks, off, on,
         originals_off, originals_on, backend=backend, device=weights[0].device if weights else torch.device("cpu"),
         trusted_banks=trusted_banks)


# ---------------------------------------------------------------------------------------
# The same two ops over `PackedDeltaBank` (the CPU serving form: Elias-Fano positions with byte
# lows, an entry offset per block of 32 rows). Same contracts, same results: the C++ kernels
# (csrc/packed_delta.cpp) decode the entries in CSR order and do the CSR kernels' arithmetic in
# that order, so they give the CSR kernels' bits; the references unpack and run the CSR ones.
# No Triton form: a CUDA bank stays a DeltaBank.
# ---------------------------------------------------------------------------------------

def _check_packed_fields(bank: PackedDeltaBank, name: str, device: torch.device) -> None:
    """The packed bank's fields' forms (not their values) and device."""
    if not isinstance(bank, PackedDeltaBank):
        raise ValueError(f"{name} must be a PackedDeltaBank, got {type(bank).__name__}")
    nnz = bank.low.numel()
    blocks = packed_block_count(bank.out_features)
    forms = (("block_ptr", bank.block_ptr, bank.block_ptr.dim() == 2 and bank.block_ptr.dtype in
              BANK_ROW_PTR_DTYPES and bank.block_ptr.shape[1] == blocks + 1,
              f"int32 or int64 [n_deltas, {blocks + 1}]"),
             ("low", bank.low, bank.low.dim() == 1 and bank.low.dtype == torch.uint8, "1-D uint8"),
             ("high", bank.high, bank.high.dim() == 1 and bank.high.dtype == torch.int64, "1-D int64"),
             ("high_start", bank.high_start, bank.high_start.shape == (bank.n_deltas + 1,)
              and bank.high_start.dtype == torch.int64, f"int64 [{bank.n_deltas + 1}]"),
             ("values", bank.values, bank.values.shape == (nnz,) and bank.values.dtype in BANK_VALUE_DTYPES,
              f"float32, bfloat16 or float16 [{nnz}]"))
    for field, t, ok, want in forms:
        if not ok or not t.is_contiguous():
            raise ValueError(f"{name}.{field} must be a contiguous {want} tensor, got {t.dtype} {tuple(t.shape)}")
        if t.device != device:
            raise ValueError(f"{name}.{field} must be on {device}, got {t.device}")
    if device.type != "cpu":
        raise ValueError(f"{name} is a PackedDeltaBank, a CPU form; on {device.type} use a DeltaBank")


def check_mixed_delta_matmul_packed_args(y: torch.Tensor, x: torch.Tensor, delta_ids: torch.Tensor,
                                         bank: PackedDeltaBank, check_values: bool = True
                                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`check_mixed_delta_matmul_args` for a `PackedDeltaBank` (its values: decoded and checked whole).

    Raises:
        ValueError: naming the bad argument.
    """
    for name, t in (("y", y), ("x", x), ("delta_ids", delta_ids)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if y.dim() < 1 or x.dim() < 1 or y.shape[:-1] != x.shape[:-1]:
        raise ValueError(f"y and x must have the same token dims (features last), got y {tuple(y.shape)} and x "
                         f"{tuple(x.shape)}")
    if y.dtype not in MIXED_DELTA_MATMUL_DTYPES or x.dtype != y.dtype:
        raise ValueError(f"y and x must be one of float32, bfloat16, float16, got {y.dtype} and {x.dtype}")
    _check_packed_fields(bank, "bank", y.device)
    if (bank.out_features, bank.in_features) != (y.shape[-1], x.shape[-1]):
        raise ValueError(f"bank is for a [{bank.out_features}, {bank.in_features}] weight; y and x have "
                         f"{y.shape[-1]} and {x.shape[-1]} features")
    n_tokens = math.prod(y.shape[:-1])
    if delta_ids.dim() != 1 or delta_ids.dtype not in (torch.int32, torch.int64) or delta_ids.numel() != n_tokens \
            or delta_ids.device != y.device:
        raise ValueError(f"delta_ids must be a 1-D int32 or int64 tensor of {n_tokens} ids (one per token) on "
                         f"{y.device}, got {delta_ids.dtype} {tuple(delta_ids.shape)}")
    try:
        y2 = y.view(-1, y.shape[-1])
    except RuntimeError:
        raise ValueError(f"y must be viewable as [T, R] (it is written in place), got strides {y.stride()}") from None
    if check_values:
        unpacked = _checked_unpacked(bank, "bank")
        _check_values(delta_ids, unpacked, x.shape[-1])
    return y2, x.reshape(-1, x.shape[-1]), delta_ids.to(torch.int32)


def _checked_unpacked(bank: PackedDeltaBank, name: str) -> DeltaBank:
    try:
        return bank.unpacked()
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None


def mixed_delta_matmul_packed_ref(y: torch.Tensor, x: torch.Tensor, delta_ids: torch.Tensor, bank: PackedDeltaBank,
                                  check_values: bool = True) -> torch.Tensor:
    """Plain-torch reference over a packed bank: the CSR reference of the unpacked bank. Returns `y`."""
    # The bank is decoded once: its CSR form is both what the values are checked on and what is multiplied.
    y2, x2, ids = check_mixed_delta_matmul_packed_args(y, x, delta_ids, bank, check_values=False)
    unpacked = _checked_unpacked(bank, "bank")
    if check_values:
        _check_values(ids, unpacked, x2.shape[1])
    mixed_delta_matmul_ref(y2, x2, ids, unpacked, check_values=False)
    return y


define("mixed_delta_matmul_packed_", mixed_delta_matmul_packed_ref)


def _packed_fields(bank: PackedDeltaBank) -> tuple[torch.Tensor, ...]:
    return bank.block_ptr, bank.low, bank.high, bank.high_start, bank.values


@register("mixed_delta_matmul_packed_", "cpp")
def _mixed_delta_matmul_packed_cpp(y, x, delta_ids, bank, check_values=True):
    y2, x2, ids = check_mixed_delta_matmul_packed_args(y, x, delta_ids, bank, check_values)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    if y2.shape[1] > 1 and y2.stride(1) != 1:
        raise ValueError(f"y's features must be contiguous for the C++ kernel, got strides {y.stride()}")
    # Unchecked values (a served model's banks, built by PackedDeltaBank.pack): the kernel skips its decoding
    # pass and still keeps every read inside its row.
    torch.ops.sift.mixed_delta_matmul_packed_(y2, x2, ids, *_packed_fields(bank), check_values)
    return y


def _packed_on_cuda(*args, **kwargs):
    raise ValueError("a PackedDeltaBank is a CPU form; on CUDA serve with a DeltaBank")


define_schema("mixed_delta_matmul_packed_", "mixed_delta_matmul_packed_(Tensor(a!) y, Tensor x, Tensor delta_ids, "
              "Tensor block_ptr, Tensor low, Tensor high, Tensor high_start, Tensor values, "
              "bool check_positions=True) -> ()", _no_output, _packed_on_cuda)


def delta_bank_switch_packed_ref(weights: list[torch.Tensor], banks: list[PackedDeltaBank], off: int, on: int,
                                 originals_off: list[torch.Tensor], originals_on: list[torch.Tensor],
                                 trusted_banks: bool = False) -> None:
    """Plain-torch reference of the switch over packed banks: the CSR reference of the unpacked banks."""
    _check_switch_lists(weights, banks, off, on, originals_off, originals_on, PackedDeltaBank)
    delta_bank_switch_ref(weights, [_checked_unpacked(b, f"banks[{i}]") for i, b in enumerate(banks)], off, on,
                          originals_off, originals_on, trusted_banks=trusted_banks)


define("delta_bank_switch_packed_", delta_bank_switch_packed_ref)


@register("delta_bank_switch_packed_", "cpp")
def _delta_bank_switch_packed_cpp(weights, banks, off, on, originals_off, originals_on, trusted_banks=False):
    # The kernel checks every tensor, and decodes every position before it writes unless the caller built
    # the banks (trusted_banks): then each position is still checked as it is written.
    _check_switch_lists(weights, banks, off, on, originals_off, originals_on, PackedDeltaBank)
    for layer, (w, bank) in enumerate(zip(weights, banks)):
        if w.dim() != 2 or tuple(w.shape) != (bank.out_features, bank.in_features):
            raise ValueError(f"weights[{layer}] must be [{bank.out_features}, {bank.in_features}] (its bank's), got "
                             f"{tuple(w.shape)}")
    fields = list(zip(*(_packed_fields(b) for b in banks))) if banks else [[]] * 5
    try:
        torch.ops.sift.delta_bank_switch_packed_(weights, *[list(f) for f in fields], off, on, originals_off,
                                                 originals_on, not trusted_banks)
    except RuntimeError as exc:  # a bad argument, found before anything was written
        raise ValueError(str(exc).split("\n")[0]) from None


define_schema("delta_bank_switch_packed_", "delta_bank_switch_packed_(Tensor(a!)[] weights, Tensor[] block_ptrs, "
              "Tensor[] lows, Tensor[] highs, Tensor[] high_starts, Tensor[] values, int off, int on, "
              "Tensor[] originals_off, Tensor(b!)[] originals_on, bool check_positions=True) -> ()", _no_output,
              _packed_on_cuda)
