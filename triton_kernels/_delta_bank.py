"""`DeltaBank`: the serving layout of several sparse deltas of one linear weight, the operand
structure of `mixed_delta_matmul_`, built once when the deltas are loaded.

For a weight W [R, C] (R = out_features, C = in_features) and n deltas, delta d holds the
entries (i, j, v) meaning W[i, j] += v. The bank stores them as one CSR matrix per delta,
concatenated:

    row_ptr      [n, R + 1] int64   delta d's row i is entries [row_ptr[d, i], row_ptr[d, i + 1])
    col_indices  [nnz] int32        the entries' columns j, ascending within a row
    values       [nnz] fp32         the entries' values v
    max_row_entries  int            max over d, i of row_ptr[d, i + 1] - row_ptr[d, i]

Delta d's entries are one block, [row_ptr[d, 0], row_ptr[d, R]); the blocks follow each other.
`max_row_entries` is kept on the host: the Triton kernel's entry loop runs that many steps, and
reading it from the device would cost a sync in every forward. Imports torch only (no triton),
so the plain-torch reference uses it on machines without Triton.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DeltaBank:
    """N sparse deltas of one [R, C] weight in CSR form (see the module docstring).

    Attributes:
        row_ptr: `[n_deltas, R + 1]` int64, non-decreasing, global offsets into the entries.
        col_indices: `[nnz]` int32 columns in `[0, C)`.
        values: `[nnz]` fp32.
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

    @classmethod
    def from_rows_and_cols(cls, shape: tuple[int, int],
                           deltas: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                           device: torch.device | str | None = None) -> DeltaBank:
        """A bank of `[R, C]` deltas given as `(rows, cols, values)` triples (any order; unique positions).

        Args:
            shape: `(R, C)` of the weight.
            deltas: per delta, `rows [k]`, `cols [k]` (integer tensors) and `values [k]` (float).
            device: where the bank lives (default: the first delta's values' device, else CPU).

        Returns:
            The bank; each delta's entries sorted by (row, column).

        Raises:
            ValueError: a position outside `[R, C]`, a repeated position, or mismatched lengths.

        Example:
            >>> bank = DeltaBank.from_rows_and_cols((2, 3), [(torch.tensor([1, 0]), torch.tensor([2, 1]),
            ...                                                torch.tensor([5.0, 7.0]))])
            >>> bank.row_ptr, bank.col_indices, bank.values
            (tensor([[0, 1, 2]]), tensor([1, 2], dtype=torch.int32), tensor([7., 5.]))
        """
        cols_out, vals_out, ptrs = [], [], []
        n_rows, n_cols = (int(s) for s in shape)
        offset, longest = 0, 0
        for d, (rows, cols, vals) in enumerate(deltas):
            if not (rows.numel() == cols.numel() == vals.numel()):
                raise ValueError(f"delta {d}: rows, cols and values must have one length, got {rows.numel()}, "
                                 f"{cols.numel()}, {vals.numel()}")
            rows, cols = rows.reshape(-1).long().cpu(), cols.reshape(-1).long().cpu()
            vals = vals.reshape(-1).float().cpu()
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
            cols_out.append(cols.to(torch.int32))
            vals_out.append(vals)
        if device is None:
            device = deltas[0][2].device if len(deltas) else "cpu"
        row_ptr = torch.stack(ptrs) if ptrs else torch.zeros(0, n_rows + 1, dtype=torch.int64)
        col = torch.cat(cols_out) if cols_out else torch.zeros(0, dtype=torch.int32)
        val = torch.cat(vals_out) if vals_out else torch.zeros(0, dtype=torch.float32)
        return cls(row_ptr.to(device), col.to(device), val.to(device), longest, n_cols)

    def appended(self, rows: torch.Tensor, cols: torch.Tensor, values: torch.Tensor) -> DeltaBank:
        """This bank with one more delta, given as `(rows, cols, values)` (any order), as the last one.

        Example:
            >>> empty = DeltaBank.from_rows_and_cols((2, 3), [])
            >>> empty.appended(torch.tensor([1]), torch.tensor([0]), torch.tensor([2.0])).row_ptr
            tensor([[0, 0, 1]])
        """
        one = DeltaBank.from_rows_and_cols((self.out_features, self.in_features), [(rows, cols, values)],
                                           device=self.device)
        return DeltaBank(torch.cat([self.row_ptr, one.row_ptr + self.values.numel()]),
                         torch.cat([self.col_indices, one.col_indices]), torch.cat([self.values, one.values]),
                         max(self.max_row_entries, one.max_row_entries), self.in_features)

    def without(self, delta: int) -> DeltaBank:
        """This bank with delta number `delta` taken out (the later ones move up by one).

        Example:
            >>> bank = DeltaBank.from_rows_and_cols((1, 2), [(torch.tensor([0]), torch.tensor([1]), torch.ones(1))] * 2)
            >>> bank.without(0).row_ptr
            tensor([[0, 1]])
        """
        start, end = (int(v) for v in self.row_ptr[delta, [0, -1]].tolist())
        row_ptr = torch.cat([self.row_ptr[:delta], self.row_ptr[delta + 1 :] - (end - start)])
        lengths = row_ptr[:, 1:] - row_ptr[:, :-1]
        return DeltaBank(row_ptr, torch.cat([self.col_indices[:start], self.col_indices[end:]]),
                         torch.cat([self.values[:start], self.values[end:]]),
                         int(lengths.max()) if lengths.numel() else 0, self.in_features)
