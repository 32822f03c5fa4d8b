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
import dataclasses
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


def _narrowed_values(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`values` in `dtype` (bf16 or fp16) if each of them is exact there, else `values` itself."""
    if dtype not in VALUE_DTYPES:
        raise ValueError(f"a bank's values are float32, bfloat16 or float16, got {dtype}")
    if dtype == values.dtype or values.element_size() < torch.empty(0, dtype=dtype).element_size():
        return values
    narrow = values.to(dtype)
    return narrow if torch.equal(narrow.to(values.dtype), values) else values


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
        narrow = _narrowed_values(self.values, dtype)
        return self if narrow is self.values else dataclasses.replace(self, values=narrow)

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

    def entry_counts(self) -> list[int]:
        """Each delta's entry count, on the host.

        Example:
            >>> DeltaBank.from_rows_and_cols((1, 2), [(torch.tensor([0]), torch.tensor([1]), torch.ones(1))]).entry_counts()
            [1]
        """
        return (self.row_ptr[:, -1] - self.row_ptr[:, 0]).tolist()

    def packed(self) -> PackedDeltaBank:
        """This bank in the packed form CPU serving holds (`PackedDeltaBank`): the same entries, fewer bytes."""
        return PackedDeltaBank.pack(self)


# ------------------------------------------------------------------------------------- packed form
#
# CSR spends 2 bytes on an entry's column and, at 1% of a 576-wide row, 0.7 more on its row's
# pointer: 6.7 bytes an fp32 entry against the 5.3 of its file (Elias-Fano positions). The packed
# form keeps each delta's sorted flat positions p = i * C + j (unique, below R * C) as Elias-Fano
# with 8 low bits, byte-aligned so a kernel reads them without bit planes:
#
#     low         [nnz] uint8    p & 255
#     high        [words] int64  per delta, bucket h = p >> 8 in unary: its e-th entry (from 0) is the
#                                set bit e + h of the delta's bits (one clear bit closes each of the
#                                ceil(R * C / 256) buckets); little-endian words, bit 0 first
#     high_start  [n + 1] int64  delta d's words are high[high_start[d]:high_start[d + 1]]
#     block_ptr   [n, ceil(R / 32) + 1] int32 (int64 from 2**31 entries): global entry offsets at each
#                                block of 32 rows and at R: where a thread's rows start
#     values      [nnz]          as in DeltaBank
#
# A block's first entry e sits at bit (e - first entry of the delta) + (r0 * C >> 8): the clear
# bits before it are the buckets before its rows. At density f an entry's position costs
# 1 + (1 + 1 / (256 f)) / 8 bytes: 1.17 at 1% (the file's Elias-Fano split, tuned to the density,
# 1.1), so an fp32 entry holds about 5.2 bytes with its value. Below 0.4% or above 3% the file's
# split is tighter by more than a few percent. Decoding reads the words sequentially from a
# block's start (a count-trailing-zeros per entry): random access is per block of rows.
# ---------------------------------------------------------------------------------------------

PACK_ROWS = 32
PACK_LOW_BITS = 8
_BYTE_BITS = torch.arange(8, dtype=torch.uint8)


def _words_of(bits: torch.Tensor) -> torch.Tensor:
    """[64 m] bool -> [m] int64, bit i of the stream as bit i % 64 of word i // 64 (little-endian)."""
    octets = (bits.view(-1, 8).to(torch.uint8) << _BYTE_BITS).sum(-1, dtype=torch.uint8)
    return octets.view(torch.int64)


def _bits_of(words: torch.Tensor) -> torch.Tensor:
    """`_words_of` undone: [m] int64 -> [64 m] bool."""
    return ((words.contiguous().view(torch.uint8).view(-1, 1) >> _BYTE_BITS) & 1).view(-1).bool()


def packed_block_count(out_features: int) -> int:
    """Blocks of PACK_ROWS rows a packed bank points into: ceil(R / 32)."""
    return -(-out_features // PACK_ROWS)


@dataclass(frozen=True)
class PackedDeltaBank:
    """N sparse deltas of one [R, C] weight in the packed serving form (see the comment above).

    Attributes:
        block_ptr: `[n_deltas, ceil(R / 32) + 1]` int32 (int64 from 2**31 entries), global entry offsets.
        low: `[nnz]` uint8, each entry's flat position's low byte.
        high: `[words]` int64, the deltas' unary buckets one after another.
        high_start: `[n_deltas + 1]` int64 word offsets into `high`.
        values: `[nnz]` fp32, bf16 or fp16 (read as fp32).
        max_row_entries: the longest row of any delta (0 when no delta has an entry).
        in_features: C.
        out_features: R.
    """

    block_ptr: torch.Tensor
    low: torch.Tensor
    high: torch.Tensor
    high_start: torch.Tensor
    values: torch.Tensor
    max_row_entries: int
    in_features: int
    out_features: int

    @property
    def n_deltas(self) -> int:
        return int(self.block_ptr.shape[0])

    @property
    def device(self) -> torch.device:
        return self.values.device

    def to(self, device: torch.device | str) -> PackedDeltaBank:
        """The bank with its tensors on `device`."""
        return PackedDeltaBank(self.block_ptr.to(device), self.low.to(device), self.high.to(device),
                               self.high_start.to(device), self.values.to(device), self.max_row_entries,
                               self.in_features, self.out_features)

    def entry_counts(self) -> list[int]:
        """Each delta's entry count, on the host."""
        return (self.block_ptr[:, -1] - self.block_ptr[:, 0]).tolist()

    def delta_bytes(self, delta: int) -> int:
        """Bytes delta number `delta` holds: its entries' low bytes and values, its unary words, its block
        pointers.

        Example:
            >>> bank = DeltaBank.from_rows_and_cols((64, 64), [(torch.arange(40), torch.arange(40), torch.ones(40))])
            >>> bank.packed().delta_bytes(0), bank.delta_bytes(0)
            (220, 500)
        """
        start, end = (int(v) for v in self.block_ptr[delta, [0, -1]].tolist())
        words = int(self.high_start[delta + 1] - self.high_start[delta])
        return ((end - start) * (1 + self.values.element_size()) + 8 * words
                + self.block_ptr.shape[1] * self.block_ptr.element_size())

    @classmethod
    def pack(cls, bank: DeltaBank) -> PackedDeltaBank:
        """`bank`'s deltas in the packed form (the same entries and values, in the same order)."""
        n_rows, n_cols = bank.out_features, bank.in_features
        device = bank.device
        ptr = bank.row_ptr.long().cpu()
        cols = bank.col_indices.long().cpu()
        buckets = (n_rows * n_cols + (1 << PACK_LOW_BITS) - 1) >> PACK_LOW_BITS
        marks = list(range(0, n_rows, PACK_ROWS)) + [n_rows]
        lows, words, starts = [], [], [0]
        for d in range(bank.n_deltas):
            start, end = int(ptr[d, 0]), int(ptr[d, -1])
            k = end - start
            rows = torch.repeat_interleave(torch.arange(n_rows), ptr[d].diff())
            pos = rows * n_cols + cols[start:end]
            bits = torch.zeros(-(-(k + buckets) // 64) * 64, dtype=torch.bool)
            bits[(pos >> PACK_LOW_BITS) + torch.arange(k)] = True
            words.append(_words_of(bits))
            lows.append((pos & ((1 << PACK_LOW_BITS) - 1)).to(torch.uint8))
            starts.append(starts[-1] + words[-1].numel())
        low = torch.cat(lows) if lows else torch.zeros(0, dtype=torch.uint8)
        high = torch.cat(words) if words else torch.zeros(0, dtype=torch.int64)
        return cls(ptr[:, marks].to(device=device, dtype=bank.row_ptr.dtype), low.to(device), high.to(device),
                   torch.tensor(starts, dtype=torch.int64, device=device), bank.values, bank.max_row_entries,
                   n_cols, n_rows)

    def positions(self, delta: int) -> torch.Tensor:
        """Delta `delta`'s flat positions `i * C + j` ([k] int64, ascending), decoded.

        Raises:
            ValueError: the words mark fewer entries than the block pointers count.
        """
        start, end = (int(v) for v in self.block_ptr[delta, [0, -1]].tolist())
        k = end - start
        words = self.high[int(self.high_start[delta]):int(self.high_start[delta + 1])].cpu()
        ones = _bits_of(words).nonzero().view(-1)
        if ones.numel() < k:
            raise ValueError(f"delta {delta}'s unary words mark {ones.numel()} entries, its block pointers count {k}")
        return ((ones[:k] - torch.arange(k)) << PACK_LOW_BITS) | self.low[start:end].cpu().long()

    def unpacked(self) -> DeltaBank:
        """The same deltas as a `DeltaBank` (CSR).

        Raises:
            ValueError: the bank is malformed (positions out of order or outside the weight, block
                pointers that disagree with them).
        """
        n_rows, n_cols = self.out_features, self.in_features
        starts = self.high_start.cpu()
        if self.n_deltas and (int(starts[0]) < 0 or int(starts[-1]) > self.high.numel()
                              or bool((starts[1:] < starts[:-1]).any())):
            raise ValueError(f"high_start must be non-decreasing within the {self.high.numel()} words of high")
        ptrs, cols = [], []
        for d in range(self.n_deltas):
            pos = self.positions(d)
            offset = int(self.block_ptr[d, 0])
            if pos.numel() and (int(pos[-1]) >= n_rows * n_cols or bool((pos[1:] <= pos[:-1]).any())):
                raise ValueError(f"delta {d}'s positions are not ascending and inside the [{n_rows}, {n_cols}] "
                                 "weight")
            rows = pos // max(n_cols, 1)
            ptr = torch.zeros(n_rows + 1, dtype=torch.int64)
            ptr[1:] = torch.bincount(rows, minlength=n_rows).cumsum(0)
            if not torch.equal(ptr[list(range(0, n_rows, PACK_ROWS)) + [n_rows]] + offset,
                               self.block_ptr[d].cpu().long()):
                raise ValueError(f"block_ptr[{d}] does not count delta {d}'s entries per block of {PACK_ROWS} rows")
            ptrs.append(ptr + offset)
            cols.append(pos % max(n_cols, 1))
        row_ptr = torch.stack(ptrs) if ptrs else torch.zeros(0, n_rows + 1, dtype=torch.int64)
        col = torch.cat(cols) if cols else torch.zeros(0, dtype=torch.int64)
        return DeltaBank(row_ptr.to(device=self.device, dtype=self.block_ptr.dtype),
                         col.to(device=self.device, dtype=col_dtype_for(n_cols)), self.values,
                         self.max_row_entries, n_cols)

    def narrowed(self, dtype: torch.dtype) -> PackedDeltaBank:
        """`DeltaBank.narrowed` in the packed form."""
        narrow = _narrowed_values(self.values, dtype)
        return self if narrow is self.values else dataclasses.replace(self, values=narrow)

    def appended(self, rows: torch.Tensor, cols: torch.Tensor, values: torch.Tensor) -> PackedDeltaBank:
        """`DeltaBank.appended` in the packed form (the bank is unpacked and packed again: a load's cost)."""
        return self.unpacked().appended(rows, cols, values).packed()

    def without(self, delta: int) -> PackedDeltaBank:
        """`DeltaBank.without` in the packed form."""
        return self.unpacked().without(delta).packed()
