"""Selection: which entries of each sparse weight `SparseAdamW` trains.

Every rule lives here: "magnitude" (the summed |grad|), "saliency" (|sum of -theta * grad|)
and "random" (seeded). `_select` is the one entry point that commits a selection, called by
`step()` alone once it knows it updates; `_tentative_indices` is what `clip_grad_norm_` (and
the committing step) computes the entries with, so the clip and the step agree. Both modes go
through it: in plain mode the step reads the dense gradient at the chosen entries, in
`compact_grads` mode the dense gradient is gathered into the compact buffer and freed.
"""

from __future__ import annotations

from typing import Any

import torch

from sift._index import entries_for as _entries_for
from sift._index import index_dtype as _index_dtype
from sift._index import top_k_positions
from sift.optim.state import is_selected, local_tensor, uses_grad


class SelectionMixin:
    """`SparseAdamW`'s selection of entries, scores accumulated over `select_steps` steps."""

    def _num_selected(self, group: dict[str, Any], p: torch.Tensor) -> int:
        return max(1, _entries_for(group["density"], local_tensor(p).numel()))

    def _choose(self, group: dict[str, Any], p: torch.Tensor, score: torch.Tensor | None) -> torch.Tensor:
        k = self._num_selected(group, p)
        if self.selection == "random":
            position = next(i for i, q in enumerate(q for _, q in self._sparse_params()) if q is p)
            gen = torch.Generator(device=p.device).manual_seed(self.seed * 1_000_003 + position)
            score = torch.rand(local_tensor(p).numel(), generator=gen, device=p.device)
        assert score is not None
        return top_k_positions(score, k).to(_index_dtype(local_tensor(p).numel()))

    def _score_now(self, p: torch.Tensor) -> torch.Tensor | None:
        """This step's contribution to p's selection score (fp32, p's local shape); None for "random"."""
        grad = local_tensor(p.grad.detach())
        if self.selection == "magnitude":
            score = grad.abs().float()
        elif self.selection == "saliency":
            # First-order saliency: the loss change predicted for zeroing the entry. Summed
            # signed over the selection steps; the magnitude of the sum ranks (the average's order).
            score = -(local_tensor(p.detach()).float() * grad.float())
        else:
            return None
        if self._grad_inv_scale is not None:
            # GradScaler's scale may change between selection steps: scores add unscaled.
            score.mul_(self._grad_inv_scale.to(score.device))
        return score

    @staticmethod
    def _grad_key(p: torch.Tensor) -> tuple:
        """Identifies the gradient a cached result came from (a new or modified grad misses)."""
        g = p.grad
        return (id(g), g._version, g.data_ptr()) if g is not None else ()

    def _is_final_selection(self, p: torch.Tensor) -> bool:
        return self.state[p].get("selection_calls", 0) + 1 >= self.select_steps

    def _pending_with_grad(self) -> list[tuple[dict[str, Any], torch.Tensor]]:
        """Sparse params whose entries are not chosen yet, that this step would select for."""
        if self._pending == []:
            return []
        candidates = self._pending if self._pending is not None else list(self._sparse_params())
        return [(group, p) for group, p in candidates
                if not is_selected(self.state.get(p, {})) and local_tensor(p).numel() > 0 and uses_grad(p)]

    def _tentative_indices(self, group: dict[str, Any], p: torch.Tensor) -> torch.Tensor:
        """The entries this step would choose for pending p (its final selection step); not committed."""
        key = self._grad_key(p)
        hit = self._tentative.get(p)
        if hit is not None and hit[0] == key:
            return hit[1]
        score = self._score_now(p)
        previous = self.state[p].get("score")
        if score is not None and previous is not None:
            score = score.add_(previous)
        if score is not None and self.selection == "saliency":
            score = score.abs_()
        indices = self._choose(group, p, score)
        self._tentative[p] = (key, indices)
        return indices

    def _select(self) -> None:
        """Commit this step's selection: called by `step()` alone, after it knows it updates."""
        self._average_pending()
        for group, p in self._pending_with_grad():
            state = self.state[p]
            calls = state.get("selection_calls", 0) + 1
            if calls >= self.select_steps:
                indices = self._tentative_indices(group, p)
                self._init_sparse_state(p, indices)
                if self.update_in_backward:
                    # The first update, here since the gradient was dense in backward.
                    self._update_now(p, self._gather_scratch(p, p.grad))
                elif self.compact_grads:
                    self._gather_compact(p, self._clipped_grad(p))
            else:
                score = self._score_now(p)
                if score is not None:
                    state["score"] = score if "score" not in state else state["score"].add_(score)
            state["selection_calls"] = calls
            if self.compact_grads:
                p.grad = None  # as the hook does once the entries are known
        # Only params still pending are scanned next time: after selection the per-step cost is nil.
        candidates = self._pending if self._pending is not None else list(self._sparse_params())
        self._pending = [(g, p) for g, p in candidates if not is_selected(self.state.get(p, {}))
                         and local_tensor(p).numel() > 0]

    def _clipped_grad(self, p: torch.Tensor) -> torch.Tensor | None:
        """The [k] gradient gathered for this step (by `clip_grad_norm_` or the unscale), if still current."""
        hit = self._clipped.get(p)
        return hit[1] if hit is not None and hit[0] == self._grad_key(p) else None

    def _gathered_grad(self, p: torch.Tensor, indices: torch.Tensor | None = None) -> torch.Tensor:
        """p's [k] fp32 gradient at `indices` (default: its chosen entries), gathered once a step from
        its dense `.grad`: the step then reads these instead of `.grad`, which is never written."""
        gathered = self._clipped_grad(p)
        if gathered is None:
            indices = self.indices_of(p) if indices is None else indices
            # index_select takes the int32 indices as they are: no int64 copy on every step.
            gathered = torch.index_select(local_tensor(p.grad).reshape(-1), 0, indices).float()
            self._clipped[p] = (self._grad_key(p), gathered)
        return gathered

    def _gather_compact(self, p: torch.Tensor, clipped: torch.Tensor | None) -> None:
        """compact_grads, at selection: fill p's compact buffer from its dense grad (or the clipped gather)."""
        compact = self._compact[p]
        if clipped is not None:
            compact.copy_(clipped)
        else:
            compact.copy_(torch.index_select(local_tensor(p.grad).reshape(-1), 0, self.indices_of(p)))
        self._grad_ready.add(p)
        if self._grad_inv_scale is not None:  # gathered from a `.grad` GradScaler has not unscaled
            self._scaled_compact.add(p)

