"""Segment and block tables of the multi-tensor step launchers, and their lifetime.

A segment table `[n_tensors, n_cols]` (int64) holds one row per tensor: its entry count k_i
in column 0, then the addresses (and sizes) its kernel reads. A block table
`[n_blocks, N_BLOCK_COLS]` maps each program to (tensor, first entry); a block never straddles
two tensors.

Table lifetime. A captured CUDA graph keeps reading the tables it was captured with, so a
table must live as long as its owner (the optimizer) may replay it. The caller passes its own
dict (`table_cache`); a launcher keeps there, under its own key, one slot per param set,
rebuilt only when an address or a size changes (a new dense gradient each step in plain mode),
and every table a capture used until the dict is dropped. Without a `table_cache` (a direct
call) the tables are built for the call and nothing outlives it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

COL_NUMEL = 0  # k_i, the entries of the tensor, in every launcher's segment table
# The addresses every step table holds next (param, grad, the two moments, the step count);
# each launcher's own columns follow from N_SHARED_COLS.
COL_PARAM = 1
COL_GRAD = 2
COL_EXP_AVG = 3
COL_EXP_AVG_SQ = 4
COL_STEP = 5
N_SHARED_COLS = 6
BLOCK_COL_TENSOR = 0  # row of the segment table
BLOCK_COL_START = 1  # first entry of the tensor the program updates
N_BLOCK_COLS = 2


class Tables(NamedTuple):
    """The device tables of one launch and what they were built from."""

    columns: tuple[tuple[int, ...], ...]  # the segment table's rows, on the host
    table: torch.Tensor  # [n_tensors, n_cols] int64
    aligned: bool  # whether every address in the launcher's aligned columns is 16-byte aligned
    block: int
    blocks: torch.Tensor  # [n_blocks, N_BLOCK_COLS] int64


class _OwnerTables:
    """The tables of one owner and launcher: one slot per param set, and every table a capture used.

    A slot is keyed by its params' addresses and rebuilt when any column changes. A param is
    stepped in one launch per step, so a new param set first drops the slots it overlaps: the
    slots stay fewer than the params. Tables a CUDA graph captured stay until the owner drops
    the dict, since a replay reads them after the slot has moved on.
    """

    __slots__ = ("slots", "captured")

    def __init__(self) -> None:
        self.slots: dict[tuple, Tables] = {}
        self.captured: dict[int, Tables] = {}  # id(table) -> its tables

    def tables(self) -> list[torch.Tensor]:
        """Every segment and block table alive here, each once."""
        alive = {id(t): t for kept in (*self.slots.values(), *self.captured.values())
                 for t in (kept.table, kept.blocks)}
        return list(alive.values())

    def get(self, slot: tuple, build: Callable[[torch.Tensor | None], Tables], columns: tuple, block: int) -> Tables:
        """The tables of `slot` (whose last item is the params' addresses) for `columns`."""
        old = self.slots.get(slot)
        if old is not None and old.columns == columns and old.block == block:
            return old
        # The block table depends only on the sizes, which a moved gradient keeps.
        same_sizes = old is not None and old.block == block and \
            [row[COL_NUMEL] for row in old.columns] == [row[COL_NUMEL] for row in columns]
        new = build(old.blocks if same_sizes else None)
        if old is None:
            params = set(slot[-1])
            for stale in [key for key in self.slots if not params.isdisjoint(key[-1])]:
                del self.slots[stale]
        self.slots[slot] = new
        return new


def build_tables(columns: tuple[tuple[int, ...], ...], n_cols: int, block: int, device: torch.device,
                 check: Callable[[], None], aligned_cols: tuple[int, ...] = (),
                 blocks: torch.Tensor | None = None) -> Tables:
    """Device tables for `columns`, after `check` validated the tensors behind the addresses."""
    check()
    host = torch.tensor(columns, dtype=torch.int64).reshape(-1, n_cols)
    table = host.to(device, non_blocking=True) if device.type == "cuda" else host
    aligned = all(row[c] % 16 == 0 for row in columns for c in aligned_cols)
    if blocks is None:
        rows = [(t, s) for t, row in enumerate(columns) for s in range(0, row[COL_NUMEL], block)]
        blocks = torch.tensor(rows, dtype=torch.int64).reshape(-1, N_BLOCK_COLS).to(device)
    return Tables(columns, table, aligned, block, blocks)


def launch_tables(table_cache: dict | None, cache_key: str, slot: tuple, columns: tuple[tuple[int, ...], ...],
                  n_cols: int, block: int, device: torch.device, check: Callable[[], None],
                  aligned_cols: tuple[int, ...] = (), build: Callable[..., Tables] = build_tables) -> Tables:
    """The tables for one launch: from the owner's `table_cache` when its rows are unchanged.

    Args:
        table_cache: the caller's dict (None: build for this call only).
        cache_key: the launcher's entry in `table_cache`.
        slot: what else a slot depends on (device, dtypes, ...); its last item is the params' addresses.
        columns: the segment table's rows, `n_cols` ints each.
        block: entries per program.
        check: validates the tensors behind the addresses; runs before any table is built, so a
            refused call keeps no table.
        aligned_cols: columns whose addresses decide `Tables.aligned`.
        build: `build_tables` or a stand-in with its signature.
    """

    def rebuild(blocks: torch.Tensor | None) -> Tables:
        return build(columns, n_cols, block, device, check, aligned_cols, blocks)

    if table_cache is None:
        return rebuild(None)
    owner = table_cache.get(cache_key)
    if owner is None:
        owner = table_cache[cache_key] = _OwnerTables()
    tables = owner.get(slot, rebuild, columns, block)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        owner.captured.setdefault(id(tables.table), tables)
    return tables


def owner_tables(table_cache: dict, cache_key: str) -> list[torch.Tensor]:
    """The segment and block tables a launcher keeps in an owner's `table_cache` under `cache_key`."""
    owner = table_cache.get(cache_key)
    return owner.tables() if owner is not None else []
