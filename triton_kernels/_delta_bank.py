"""`DeltaBank`: the serving layout of several sparse deltas of one linear weight, the operand
structure of `mixed_delta_matmul_`, built once when the deltas are loaded.

For a weight W [R, C] (R = out_features, C = in_features) and n deltas, delta d holds the
entries (i, j, v) meaning W[i, j] += v. The bank stores them as one CSR matrix per delta,
concatenated, each field in the narrowest integer or float type that holds it exactly:

    row_ptr      [n, R + 1] int32   delta d's row i is entries [row_ptr[d, i], row_ptr[d, i + 1])
                            (int64 when the bank holds 2**31 entries or more)
    col_indices  [nnz] int16        the entries' columns j, ascending within a row
                            (int32 when C > 32768)
    values       [nnz] fp32, bf16 or fp16: the deltas' own dtype (one for the bank: the widest
                            of its deltas'; bf16 next to fp16 is fp32, which holds both)
    max_row_entries  int            max over d, i of row_ptr[d, i + 1] - row_ptr[d, i]

An entry costs 4 bytes with 16-bit values, 6 with fp32 ones, against 8 for int32 columns and fp32
values: a loaded fine-tune's memory is what serving pays per delta. Every backend reads the values
as fp32 (exact for 16-bit ones), so the products are those of the same values held in fp32.
Delta d's entries are one block, [row_ptr[d, 0], row_ptr[d, R]); the blocks follow each other.
`max_row_entries` is kept on the host: the Triton kernel's entry loop runs that many steps, and
reading it from the device would cost a sync in every forward. Imports torch only (no triton),
so the plain-torch reference uses it on machines without Triton.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

VALUE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Columns below this bound fit int16; row pointers below INT32_ENTRIES fit int32.
INT16_COLUMNS = 1 << 15
INT32_ENTRIES = 1 << 31


def col_dtype_for(in_features: int) -> torch.dtype:
    """int16 for columns of a weight at most 32768 wide, else int32."""
    return torch.int16 if in_features <= INT16_COLUMNS else torch.int32


def row_ptr_dtype_for(nnz: int) -> torch.dtype:
    """int32 for a bank of fewer than 2**31 entries, else int64."""
    return torch.int32 if nnz < INT32_ENTRIES else torch.int64


def widest_values_dtype(dtypes: Iterable[torch.dtype]) -> torch.dtype:
    """The narrowest of fp32, bf16, fp16 holding every value of each dtype exactly (fp32 for none).

    Example:
        >>> widest_values_dtype([torch.bfloat16, torch.bfloat16]), widest_values_dtype([torch.bfloat16, torch.float16])
        (torch.bfloat16, torch.float32)
    """
    found = set(dtypes)
    return found.pop() if len(found) == 1 and next(iter(found)) in VALUE_DTYPES else torch.float32


def _values_dtype_of(vals: torch.Tensor) -> torch.dtype:
    # A delta's own dtype where the bank can hold it; any other float (fp64) as fp32, as before.
    return vals.dtype if vals.dtype in VALUE_DTYPES else torch.float32


@dataclass(frozen=True)
class DeltaBank:
    """N sparse deltas of one [R, C] weight in CSR form (see the module docstring).

    Attributes:
        row_ptr: `[n_deltas, R + 1]` int32 (int64 from 2**31 entries), non-decreasing, global offsets
            into the entries.
        col_indices: `[nnz]` int16 (int32 when C > 32768) columns in `[0, C)`.
        values: `[nnz]` fp32, bf16 or fp16 (read as fp32).
        max_row_entries: the longest row of any delta (0 when no delta has an entry).
        in_features: C.
    """

    row_ptr: torch.Tensor
    col_indices: torch.Tensor
    values: torch.Tensor
    max_row_entries: int
    in_features: int

    @property
    def n_deltas(self) -> int:
        return int(self.row_ptr.shape[0])

    @property
    def out_features(self) -> int:
        return int(self.row_ptr.shape[1]) - 1

    @property
    def device(self) -> torch.device:
        return self.values.device

    def to(self, device: torch.device | str) -> DeltaBank:
        """The bank with its tensors on `device`."""
        return DeltaBank(self.row_ptr.to(device), self.col_indices.to(device), self.values.to(device),
                         self.max_row_entries, self.in_features)

    def delta_bytes(self, delta: int) -> int:
        """Bytes delta number `delta` holds in the bank: its entries' columns and values, its row pointers.

        Example:
            >>> DeltaBank.from_rows_and_cols((2, 3), [(torch.tensor([1]), torch.tensor([2]),
            ...                                        torch.tensor([5.0], dtype=torch.bfloat16))]).delta_bytes(0)
            16
        """
        start, end = (int(v) for v in self.row_ptr[delta, [0, -1]].tolist())
        per_entry = self.col_indices.element_size() + self.values.element_size()
        return (end - start) * per_entry + self.row_ptr.shape[1] * self.row_ptr.element_size()

    def narrowed(self, dtype: torch.dtype) -> DeltaBank:
        """This bank with its values in `dtype` (bf16 or fp16) if each of them is exact there, else itself.

        Example:
            >>> bank = DeltaBank.from_rows_and_cols((1, 2), [(torch.tensor([0]), torch.tensor([1]), torch.ones(1))])
            >>> bank.narrowed(torch.bfloat16).values.dtype, bank.appended(torch.tensor([0]), torch.tensor([0]),
            ...     torch.tensor([0.1])).narrowed(torch.bfloat16).values.dtype
            (torch.bfloat16, torch.float32)
        """
        if dtype not in VALUE_DTYPES:
            raise ValueError(f"a bank's values are float32, bfloat16 or float16, got {dtype}")
        if dtype == self.values.dtype or self.values.element_size() < torch.empty(0, dtype=dtype).element_size():
            return self
        narrow = self.values.to(dtype)
        if not torch.equal(narrow.to(self.values.dtype), self.values):
            return self
        return DeltaBank(self.row_ptr, self.col_indices, narrow, self.max_row_entries, self.in_features)

    @classmethod
    def from_rows_and_cols(cls, shape: tuple[int, int],
                           deltas: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                           device: torch.device | str | None = None) -> DeltaBank:
        """A bank of `[R, C]` deltas given as `(rows, cols, values)` triples (any order; unique positions).

        Args:
            shape: `(R, C)` of the weight.
            deltas: per delta, `rows [k]`, `cols [k]` (integer tensors) and `values [k]` (fp32, bf16 or
                fp16, kept in that dtype; another float type is read as fp32).
            device: where the bank lives (default: the first delta's values' device, else CPU).

        Returns:
            The bank; each delta's entries sorted by (row, column); values in the widest of the dtypes
            of the deltas that have entries (`widest_values_dtype`; fp32 when none has).

        Raises:
            ValueError: a position outside `[R, C]`, a repeated position, or mismatched lengths.

        Example:
            >>> bank = DeltaBank.from_rows_and_cols((2, 3), [(torch.tensor([1, 0]), torch.tensor([2, 1]),
            ...                                                torch.tensor([5.0, 7.0]))])
            >>> bank.row_ptr, bank.col_indices, bank.values
            (tensor([[0, 1, 2]], dtype=torch.int32), tensor([1, 2], dtype=torch.int16), tensor([7., 5.]))
        """
        cols_out, vals_out, ptrs = [], [], []
        n_rows, n_cols = (int(s) for s in shape)
        offset, longest = 0, 0
        for d, (rows, cols, vals) in enumerate(deltas):
            if not (rows.numel() == cols.numel() == vals.numel()):
                raise ValueError(f"delta {d}: rows, cols and values must have one length, got {rows.numel()}, "
                                 f"{cols.numel()}, {vals.numel()}")
            rows, cols = rows.reshape(-1).long().cpu(), cols.reshape(-1).long().cpu()
            vals = vals.reshape(-1).cpu()
            vals = vals.to(_values_dtype_of(vals))
            if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= n_rows or int(cols.min()) < 0
                                 or int(cols.max()) >= n_cols):
                raise ValueError(f"delta {d}: a position lies outside the [{n_rows}, {n_cols}] weight")
            flat, order = (rows * n_cols + cols).sort()
            if flat.numel() > 1 and bool((flat[1:] == flat[:-1]).any()):
                raise ValueError(f"delta {d}: a position is repeated")
            rows, cols, vals = rows[order], cols[order], vals[order]
            counts = torch.bincount(rows, minlength=n_rows)
            ptr = torch.zeros(n_rows + 1, dtype=torch.int64)
            ptr[1:] = counts.cumsum(0)
            ptrs.append(ptr + offset)
            offset += rows.numel()
            longest = max(longest, int(counts.max()) if counts.numel() else 0)
            cols_out.append(cols)
            vals_out.append(vals)
        if device is None:
            device = deltas[0][2].device if len(deltas) else "cpu"
        values_dtype = widest_values_dtype(v.dtype for v in vals_out if v.numel())
        row_ptr = torch.stack(ptrs) if ptrs else torch.zeros(0, n_rows + 1, dtype=torch.int64)
        col = torch.cat(cols_out) if cols_out else torch.zeros(0, dtype=torch.int64)
        val = torch.cat([v.to(values_dtype) for v in vals_out]) if vals_out else torch.zeros(0)
        return cls(row_ptr.to(device=device, dtype=row_ptr_dtype_for(offset)),
                   col.to(device=device, dtype=col_dtype_for(n_cols)), val.to(device=device, dtype=values_dtype),
                   longest, n_cols)

    def appended(self, rows: torch.Tensor, cols: torch.Tensor, values: torch.Tensor) -> DeltaBank:
        """This bank with one more delta, given as `(rows, cols, values)` (any order), as the last one.

        The values keep their dtype; the bank's become the wider of the two where they differ (the
        bank's own when either side has no entries).

        Example:
            >>> empty = DeltaBank.from_rows_and_cols((2, 3), [])
            >>> empty.appended(torch.tensor([1]), torch.tensor([0]), torch.tensor([2.0])).row_ptr
            tensor([[0, 0, 1]], dtype=torch.int32)
        """
        one = DeltaBank.from_rows_and_cols((self.out_features, self.in_features), [(rows, cols, values)],
                                           device=self.device)
        nnz = self.values.numel()
        dtype = widest_values_dtype(b.values.dtype for b in (self, one) if b.values.numel())
        if not nnz and not one.values.numel():
            dtype = self.values.dtype
        ptr_dtype = row_ptr_dtype_for(nnz + one.values.numel())
        row_ptr = torch.cat([self.row_ptr.to(ptr_dtype), one.row_ptr.to(ptr_dtype) + nnz])
        return DeltaBank(row_ptr, torch.cat([self.col_indices, one.col_indices]),
                         torch.cat([self.values.to(dtype), one.values.to(dtype)]),
                         max(self.max_row_entries, one.max_row_entries), self.in_features)

    def without(self, delta: int) -> DeltaBank:
        """This bank with delta number `delta` taken out (the later ones move up by one).

        Example:
            >>> bank = DeltaBank.from_rows_and_cols((1, 2), [(torch.tensor([0]), torch.tensor([1]), torch.ones(1))] * 2)
            >>> bank.without(0).row_ptr
            tensor([[0, 1]], dtype=torch.int32)
        """
        start, end = (int(v) for v in self.row_ptr[delta, [0, -1]].tolist())
        row_ptr = torch.cat([self.row_ptr[:delta], self.row_ptr[delta + 1 :] - (end - start)])
        lengths = row_ptr[:, 1:] - row_ptr[:, :-1]
        nnz = self.values.numel() - (end - start)
        return DeltaBank(row_ptr.to(row_ptr_dtype_for(nnz)), torch.cat([self.col_indices[:start],
                                                                        self.col_indices[end:]]),
                         torch.cat([self.values[:start], self.values[end:]]),
                         int(lengths.max()) if lengths.numel() else 0, self.in_features)
