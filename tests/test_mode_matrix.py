"""The generated mode-by-route matrix (tests/mode_matrix.py): each cell matches its one-process plain-mode
reference under the documented promise, or is refused before anything changes.

CI runs a covering subset (every pair of factor values at least once); `SIFT_FULL_MATRIX=1` runs the full
product, `SIFT_MATRIX_ROUTES=one-process,ddp` only some routes' cells, `SIFT_MATRIX_CELLS=<id>,<id>` only
those cells. The count of cells run and refused is printed.
"""

from __future__ import annotations

import os

import torch

import mode_matrix as mm

CELLS = mm.all_cells() if os.environ.get("SIFT_FULL_MATRIX") == "1" else mm.covering_cells()
# The full product runs for hours on a 2-core CPU: `SIFT_MATRIX_ROUTES=ddp,fsdp2` keeps those routes' cells only.
if os.environ.get("SIFT_MATRIX_ROUTES"):
    CELLS = [c for c in CELLS if c.route in os.environ["SIFT_MATRIX_ROUTES"].split(",")]
if os.environ.get("SIFT_MATRIX_CELLS"):  # cell ids, as the failures name them, of the full product
    CELLS = [c for c in mm.all_cells() if c.id in os.environ["SIFT_MATRIX_CELLS"].split(",")]


def _run_distributed(cells: list[mm.Cell], directory) -> dict[str, list[dict]]:
    """Run the multi-process cells, one 2-rank gloo job per route; {cell id: [rank 0 outcome, rank 1 outcome]}."""
    import torch.multiprocessing as mp

    outcomes: dict[str, list[dict]] = {}
    for route in ("ddp", "process-group", "fsdp2"):
        remaining = [c for c in cells if c.route == route]
        attempt = 0
        while remaining:
            out = str(directory / f"{route}-{attempt}")
            attempt += 1
            crash = None
            try:
                mp.spawn(mm.gloo_cells, args=(mm.WORLD, f"{out}.init", remaining, str(directory), out),
                         nprocs=mm.WORLD, join=True)
            except Exception as error:  # noqa: BLE001 - a rank aborted (gloo's collective mismatch): the cell fails
                crash = f"a rank died: {type(error).__name__}: {str(error)[-300:]}"
            per_rank = [torch.load(f"{out}.{rank}", weights_only=False) if os.path.exists(f"{out}.{rank}") else {}
                        for rank in range(mm.WORLD)]
            done = [c for c in remaining if all(c.id in r for r in per_rank)]
            for cell in done:
                outcomes[cell.id] = [r[cell.id] for r in per_rank]
            left = [c for c in remaining if c not in done]
            if left:  # the first cell not finished crashed the job; the others run again
                outcomes[left[0].id] = [{"error": crash or "the rank did not finish this cell"}] * mm.WORLD
            remaining = left[1:]
    return outcomes


def _check(cells: list[mm.Cell], tmp_path) -> tuple[list[str], int, dict[str, str]]:
    """Run `cells` and their references: (failures, how many ran, {refused cell id: message})."""
    references = {}
    for ref in {c.reference() for c in cells}:
        references[ref] = mm.run_cell(ref, directory=str(tmp_path))
    distributed = _run_distributed([c for c in cells if c.route != "one-process"], tmp_path)
    failures, ran, refused = [], 0, {}
    for cell in cells:
        outcomes = distributed.get(cell.id) or [mm.run_cell(cell, directory=str(tmp_path))]
        want = references[cell.reference()]
        for rank, got in enumerate(outcomes):
            where = f"{cell.id} (rank {rank})"
            if "error" in got:
                failures.append(f"{where}: {got['error']}")
            elif "refused" in got:
                if not got["clean"]:
                    failures.append(f"{where}: refused at step {got.get('step')} after changing state: "
                                    f"{got['refused']}")
                refused.setdefault(cell.id, got["refused"])
            elif "refused" in want:
                failures.append(f"{where}: ran, but its plain reference is refused: {want['refused']}")
            else:
                failures.extend(f"{where}: {line}" for line in mm.compare(cell, got["result"], want["result"]))
        if len(outcomes) > 1 and {"refused" in o for o in outcomes} == {True, False}:
            failures.append(f"{cell.id}: refused on some ranks only")
        if len(outcomes) > 1:
            failures.extend(f"{cell.id}: {line}" for line in mm.ranks_agree(outcomes))
        ran += cell.id not in refused
    return failures, ran, refused


def test_every_cell_matches_its_reference_or_is_refused_cleanly(tmp_path, capsys):
    failures, ran, refused = _check(CELLS, tmp_path)
    with capsys.disabled():
        print(f"\nmode matrix: {len(CELLS)} cells, {ran} run against their reference, {len(refused)} refused")
        for cell_id, message in sorted(refused.items()):
            print(f"  refused {cell_id}: {message[:160]}")
    assert not failures, "\n".join(failures)


def test_fsdp2_sparse_backward_resumed_before_selection_still_selects_and_trains(tmp_path):
    """Under FSDP2 the sparse backward resumed while a selection was pending built an empty cross-rank plan, so the
    layer never formed the dense gradient to select from: the weights stayed pending and never trained again."""
    cells = [mm.Cell(memory, "fp32", 1, 2, False, "during-selection", "fsdp2") for memory in ("low", "lowest")]
    failures, ran, _ = _check(cells, tmp_path)
    assert ran == len(cells) and not failures, "\n".join(failures)


def test_update_in_backward_with_micro_batches_under_fsdp2_is_refused_before_anything_changes(tmp_path):
    """The update in backward refused a second backward from inside it, which left FSDP2's 4-bit layers unsharded:
    the refusal changed the model. step() now refuses, after a backward that completed."""
    cells = [mm.Cell("update_in_backward", "nf4", 2, 1, False, "none", "fsdp2")]
    failures, ran, refused = _check(cells, tmp_path)
    assert not failures and ran == 0 and len(refused) == 1, "\n".join(failures)
