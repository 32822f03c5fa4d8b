"""Selection: which entries of each sparse weight `SparseAdamW` trains.

Every rule lives here: "magnitude" (the summed |grad|), "saliency" (|sum of -theta * grad|)
and "random" (seeded, drawn by each weight's name). `_select` is the one entry point that commits a
selection, called by `step()` alone once it knows it updates; `_tentative_indices` is what `clip_grad_norm_` (and
the committing step) computes the entries with, so the clip and the step agree. Both modes go
through it: in plain mode the step reads the dense gradient at the chosen entries, in
`compact_grads` mode the dense gradient is gathered into the compact buffer and freed.

FSDP2 params (`sharded_selection="global"`, the default) take the whole weight's top-k: every
pending weight's k-th largest score across the shards is found at once by `sharded_top_k`, a
bisection over the scores' fp32 bit patterns with one all-reduce of a count vector per round, and
each rank keeps its shard's part (any number of entries, 0 included).

A score that ranks nothing (zero on the whole weight, as below a zero-initialised head or on a batch whose
labels are all ignored, or not finite) chooses nothing: the weight stays pending, its state as it was and the
step not counted, with one warning naming it, until a step whose gradient ranks its entries. Every rank
decides alike: on gradients averaged across a process group or DDP, and under FSDP2's global selection on the
whole weight's score, agreed in the search's first all-reduce (FSDP2 shards selecting per shard choose as before).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from sift._index import entries_for as _entries_for
from sift._index import index_dtype as _index_dtype
from sift._rules import random_entries, ranks_nothing, score_flags, step_score, top_k, total_score, warn_unscored
from sift.optim.part import Part
from sift.optim.settings import Settings
from sift.optim.sharded import shard_group, shard_offset
from sift.optim.state import is_dtensor, is_selected, local_tensor, uses_grad

# Weights searched together hold their fp32 scores at once: at most this many elements of whole
# weights a round of collectives (a shard holds its share), so selection never holds a copy of them all.
SEARCH_BUDGET = 2**30


def _order_keys(score: torch.Tensor) -> torch.Tensor:
    """int32 keys ordered as `score`'s floats, in place of it ([n] fp32, consumed): NaN ranks below every
    number and -0.0 ties +0.0, as in `top_k_positions`."""
    score.masked_fill_(torch.isnan(score), float("-inf")).add_(0.0)  # + 0.0 turns -0.0 into +0.0
    key = score.view(torch.int32)
    # Non-negative floats order as their bits; negative ones in reverse: flip their 31 low bits.
    return key.bitwise_xor_(key.bitwise_right_shift(31).bitwise_and_(0x7FFFFFFF))


def sharded_top_k(scores: list[torch.Tensor], ks: list[int], group: Any) -> list[torch.Tensor]:
    """Each weight's top-k across the shards of `group`: this rank's part, as positions in its shard.

    Collective: every rank of `group` calls it with the same weights in the same order, rank r holding
    the r-th block of each weight's flat positions (FSDP2's row shards). The result equals
    `top_k_positions` of the whole weight, ties taken by the lowest flat position: the k-th largest
    key is found by bisection (one all-reduce of [n] counts a round, about 32 rounds for all weights at
    once; after every 8 rounds only the keys still undecided are read), then one all-reduce of every
    rank's counts above and at it tells each rank how many of its ties come first.

    Args:
        scores: n [numel_r] fp32 scores of this rank's shards (consumed: they become the keys).
        ks: n entries to choose of each whole weight, 0 <= k <= its numel.
        group: the process group the weights are sharded over.

    Returns:
        n [k_r] int64 ascending positions within this rank's shards (the k_r add up to k).
    """
    import torch.distributed as dist

    if not scores:
        return []
    world, me, n = dist.get_world_size(group), dist.get_rank(group), len(scores)
    device = scores[0].device
    keys = [_order_keys(s.reshape(-1)) for s in scores]
    far = 1 << 40  # beyond every int32 key: an empty shard's bounds never win
    lows = torch.stack([-k.min().long() if k.numel() else torch.tensor(-far, device=device) for k in keys])
    highs = torch.stack([k.max().long() if k.numel() else torch.tensor(-far, device=device) for k in keys])
    bounds = torch.cat([lows, highs])
    dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=group)
    # count(key >= lo) >= k > count(key >= hi) all along: lo ends as the k-th largest key.
    lo, hi = -bounds[:n], bounds[n:] + 1
    need = torch.tensor(ks, dtype=torch.long, device=device)
    rounds = max(1, int((hi - lo).max()).bit_length())  # one host read: the same count on every rank
    # The keys still undecided ([lo, hi)) and, per weight, how many of this rank's lie at or above hi: every
    # 8 rounds the undecided ones are kept alone, so later rounds read a small fraction of the scores.
    live, above = keys, torch.zeros(n, dtype=torch.long, device=device)
    for r in range(rounds):
        if r and r % 8 == 0:
            above = above + torch.stack([(k >= h).sum() for k, h in zip(live, hi.to(torch.int32))])
            live = [k[(k >= a) & (k < b)] for k, a, b in zip(live, lo.to(torch.int32), hi.clamp_max(2**31 - 1)
                                                               .to(torch.int32))]
        mid = torch.div(lo + hi, 2, rounding_mode="floor")
        counts = above + torch.stack([(k >= m).sum() for k, m in zip(live, mid.to(torch.int32))])
        dist.all_reduce(counts, group=group)
        enough = counts >= need
        lo, hi = torch.where(enough, mid, lo), torch.where(enough, hi, mid)
    threshold = lo.to(torch.int32)
    table = torch.zeros(world, 2 * n, dtype=torch.long, device=device)
    table[me] = torch.stack([(k > t).sum() for k, t in zip(keys, threshold)] +
                            [(k == t).sum() for k, t in zip(keys, threshold)])
    dist.all_reduce(table, group=group)
    # Ties in rank order are ties in flat order: the ranks before this one take theirs first.
    ties = need - table[:, :n].sum(0) - table[:me, n:].sum(0)
    take = torch.minimum(ties.clamp_min(0), table[me, n:]).tolist()
    out = []
    for k, t, m in zip(keys, threshold, take):
        tied = k == t
        # Everything above the threshold and this rank's first m ties, already in ascending order.
        out.append(((k > t) | (tied & (tied.cumsum(0) <= m))).nonzero().reshape(-1))
    return out


class Selector(Part):
    """`SparseAdamW`'s selection of entries, scores accumulated over `select_steps` steps: one engine for
    every 16-bit weight (scores unscaled, ties to the lower index, inf/NaN and all-zero scores left
    pending, the random stream keyed by the weight's name). 4-bit layers score through the same rules
    in `sift.quantized`."""

    def __init__(self, opt: Any, settings: Settings) -> None:
        super().__init__(opt, settings)
        # Sparse params still waiting for their selection (None: scan all of them). Frozen
        # and gradless params stay on it, so a layer unfrozen later is still selected.
        self.pending: list[tuple[dict[str, Any], torch.Tensor]] | None = None
        self.warned_unscored: set[torch.Tensor] = set()  # weights whose score ranked nothing, said once
        self.new_step()

    def new_step(self) -> None:
        """For one step: the entries a selecting step will choose (computed by `clip_grad_norm_` or the
        step, committed only by the step) and the clipped [k] gradients `clip_grad_norm_` (or the
        unscale) gathered for the step. Keyed by the gradient they came from, so a stale entry is never
        used."""
        self.tentative: dict[torch.Tensor, tuple[tuple, torch.Tensor]] = {}
        self.clipped: dict[torch.Tensor, tuple[tuple, torch.Tensor]] = {}

    def rescan(self) -> None:
        """The groups or the state changed (a group added, a load): the next step scans every sparse param."""
        self.pending = None

    def selects_globally(self, p: torch.Tensor) -> bool:
        """Whether p is an FSDP2 shard whose entries are the whole weight's top-k (`sharded_selection`)."""
        return is_dtensor(p) and self.settings.sharded_selection == "global"

    def num_selected(self, group: dict[str, Any], p: torch.Tensor) -> int:
        """k: of the whole weight when selecting globally (`p.numel()` of a DTensor is the full one)."""
        numel = p.numel() if self.selects_globally(p) else local_tensor(p).numel()
        return max(1, _entries_for(group["density"], numel))

    def choose(self, group: dict[str, Any], p: torch.Tensor, score: torch.Tensor | None) -> torch.Tensor:
        k = self.num_selected(group, p)
        local = local_tensor(p).numel()
        if self.settings.selection == "random":
            # Drawn by the weight's name (the group's param_names); a param given without one by its position.
            position = next(i for i, q in enumerate(q for _, q in self.opt.entries.sparse_params()) if q is p)
            names = group.get("param_names") or ()
            name = next((n for n, q in zip(names, group["params"]) if q is p), None)
            if not self.selects_globally(p):
                return random_entries(self.settings.seed, name, position, local, k, p.device)
            # Every rank draws the whole weight's scores, as one process does, and keeps its shard's part.
            start = shard_offset(p)
            chosen = random_entries(self.settings.seed, name, position, p.numel(), k, p.device).long()
            chosen = chosen[(chosen >= start) & (chosen < start + local)] - start
            return chosen.to(_index_dtype(local))
        assert score is not None
        return top_k(score, k)

    def average_pending(self) -> None:
        """The cross-rank work before anything selects (`step()` and `clip_grad_norm_` call it): the
        process group's averaging, then the global search of FSDP2 weights on their selecting step."""
        self.opt.grads.average_pending()
        self.search_globally()

    def search_globally(self) -> None:
        """Choose, by `sharded_top_k`, the entries of every FSDP2 weight selecting globally this step, and
        cache them as the tentative indices. Collective over each weight's mesh; a no-op once every weight
        is selected. The weights considered are the same on every rank (empty shards included)."""
        import torch.distributed as dist

        if self.settings.selection == "random":
            return  # drawn locally, from the seed (see _choose)
        pending = [(group, p) for group, p in self.pending_with_grad()
                   if self.selects_globally(p) and p.numel() > 0 and self.is_final_selection(p)]
        by_group: dict[Any, list[tuple[dict[str, Any], torch.Tensor]]] = {}
        for group, p in pending:
            by_group.setdefault(shard_group(p), []).append((group, p))
        for mesh_group, members in by_group.items():
            # A clip before the step searched already: search again only if any rank's gradient changed. The
            # same all-reduce agrees on the weights whose whole score ranks nothing (see `score_flags`).
            device = local_tensor(members[0][1]).device
            changed = float(any(self.tentative.get(p, (None,))[0] != self.grad_key(p) for _, p in members))
            flags = torch.cat([torch.tensor([changed], device=device)] +
                              [score_flags(self.final_score(p)).to(device) for _, p in members])
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=mesh_group)
            flags = flags.tolist()
            if not flags[0]:
                continue
            unscored = [bool(bad) or not nonzero for bad, nonzero in zip(flags[1::2], flags[2::2])]
            for (_, p), skip in zip(members, unscored):
                if skip:  # pending on every rank alike
                    self.tentative[p] = (self.grad_key(p), None)
            members = [member for member, skip in zip(members, unscored) if not skip]
            chunk: list[tuple[dict[str, Any], torch.Tensor]] = []
            for i, (group, p) in enumerate(members):
                chunk.append((group, p))
                size = sum(q.numel() for _, q in chunk)
                if i + 1 == len(members) or size + members[i + 1][1].numel() > SEARCH_BUDGET:
                    keys = [self.grad_key(q) for _, q in chunk]
                    chosen = sharded_top_k([self.final_score(q) for _, q in chunk],
                                           [self.num_selected(g, q) for g, q in chunk], mesh_group)
                    for (_, q), key, idx in zip(chunk, keys, chosen):
                        self.tentative[q] = (key, idx.to(_index_dtype(local_tensor(q).numel())))
                    chunk = []

    def score_now(self, p: torch.Tensor) -> torch.Tensor | None:
        """This step's contribution to p's selection score (fp32, p's local shape; `sift._rules.step_score`), unscaled
        by GradScaler's scale, whose value may change between selection steps; None for "random"."""
        return step_score(self.settings.selection, local_tensor(p.grad.detach()), local_tensor(p.detach()),
                          self.opt.amp.grad_inv_scale)

    @staticmethod
    def grad_key(p: torch.Tensor) -> tuple:
        """Identifies the gradient a cached result came from (a new or modified grad misses)."""
        g = p.grad
        return (id(g), g._version, g.data_ptr()) if g is not None else ()

    def is_final_selection(self, p: torch.Tensor) -> bool:
        return self.opt.state.get(p, {}).get("selection_calls", 0) + 1 >= self.settings.select_steps

    def has_entries_to_choose(self, p: torch.Tensor) -> bool:
        """An empty shard (FSDP2 pads dim 0) chooses nothing per shard; selecting globally it takes part
        in the search like every rank, and gets 0 entries."""
        return local_tensor(p).numel() > 0 or (self.selects_globally(p) and p.numel() > 0)

    def pending_with_grad(self) -> list[tuple[dict[str, Any], torch.Tensor]]:
        """Sparse params whose entries are not chosen yet, that this step would select for."""
        if self.pending == []:
            return []
        candidates = self.pending if self.pending is not None else list(self.opt.entries.sparse_params())
        return [(group, p) for group, p in candidates
                if not is_selected(self.opt.state.get(p, {})) and self.has_entries_to_choose(p) and uses_grad(p)]

    def final_score(self, p: torch.Tensor) -> torch.Tensor | None:
        """The score p's entries are chosen by on its last selection step (fp32, p's local shape; a new
        tensor): this step's plus the earlier steps'; None for "random"."""
        score = self.score_now(p)
        if score is None:
            return None
        return total_score(self.settings.selection, score, self.opt.state.get(p, {}).get("score"))

    def tentative_indices(self, group: dict[str, Any], p: torch.Tensor) -> torch.Tensor | None:
        """The entries this step would choose for pending p (its final selection step); not committed. None
        when p's score ranks nothing (`sift._rules.ranks_nothing`): p then stays pending. FSDP2 shards selecting per
        shard choose as before, since their ranks could not agree on it without a collective."""
        key = self.grad_key(p)
        hit = self.tentative.get(p)
        if hit is not None and hit[0] == key:
            return hit[1]
        if self.selects_globally(p) and self.settings.selection != "random":
            # Chosen together with the other ranks: computing it here alone would leave them waiting.
            raise RuntimeError("the gradient of an FSDP2 weight changed after its entries were searched across "
                               "the ranks in this step; change gradients before clip_grad_norm_ and step()")
        score = self.final_score(p)
        per_shard = is_dtensor(p)  # per_shard selection: every rank chooses on its own, so all of them do
        indices = None if not per_shard and ranks_nothing(score) else self.choose(group, p, score)
        self.tentative[p] = (key, indices)
        return indices

    def select(self) -> None:
        """Commit this step's selection: called by `step()` alone, after it knows it updates."""
        self.average_pending()
        for group, p in self.pending_with_grad():
            calls = self.opt.state.get(p, {}).get("selection_calls", 0) + 1
            if calls >= self.settings.select_steps:
                indices = self.tentative_indices(group, p)
                if indices is None:  # nothing to rank the entries by
                    self.leave_pending(group, p)
                    continue
                self.opt.entries.allocate(p, indices)
                if self.opt.memory.update_in_backward:
                    # The first update, here since the gradient was dense in backward.
                    self.opt.grads.update_now(p, self.opt.grads.gather_scratch(p, p.grad))
                elif self.settings.compact_grads:
                    self.opt.grads.gather_selected(p, self.clipped_grad(p))
            else:
                score = self.score_now(p)
                if not is_dtensor(p) and ranks_nothing(score):
                    # Not counted (as a step that did not reach p): a NaN would stay in the sum for good. FSDP2
                    # shards add theirs: their ranks agree on the whole weight's score at the final step alone.
                    self.leave_pending(group, p)
                    continue
                if score is not None:
                    self.opt.entries.add_selection_score(p, score)
            self.opt.entries.count_selection_step(p, calls)
            if self.settings.compact_grads:
                p.grad = None  # as the hook does once the entries are known
        # Only params still pending are scanned next time: after selection the per-step cost is nil.
        candidates = self.pending if self.pending is not None else list(self.opt.entries.sparse_params())
        self.pending = [(g, p) for g, p in candidates if not is_selected(self.opt.state.get(p, {}))
                         and self.has_entries_to_choose(p)]

    def leave_pending(self, group: dict[str, Any], p: torch.Tensor) -> None:
        """p's score ranked nothing this step: its state stays as it was (the step is not counted), its
        gradient is used up as on any selection step, and it is said once per weight."""
        if self.settings.compact_grads:
            p.grad = None
        if p in self.warned_unscored:
            return
        self.warned_unscored.add(p)
        names = group.get("param_names") or ()
        position = next(j for j, q in enumerate(group["params"]) if q is p)
        label = (repr(names[position]) if position < len(names) else
                 f"group {next(i for i, g in enumerate(self.opt.param_groups) if g is group)}, param {position}")
        warn_unscored(label, stacklevel=4)

    def clipped_grad(self, p: torch.Tensor) -> torch.Tensor | None:
        """The [k] gradient gathered for this step (by `clip_grad_norm_` or the unscale), if still current."""
        hit = self.clipped.get(p)
        return hit[1] if hit is not None and hit[0] == self.grad_key(p) else None

    def forget_gathered(self, p: torch.Tensor, keep_clipped: bool = False) -> None:
        """p's entries change outside `step()` (`set_indices`): what this step gathered and clipped at the
        former entries must not reach the new ones. `keep_clipped`: a re-selection, whose clip gathered at the
        new entries already."""
        self.tentative.pop(p, None)
        if not keep_clipped and self.clipped.pop(p, None) is not None:
            warnings.warn("SparseAdamW.set_indices after clip_grad_norm_: the gradient clipped at the former entries "
                          "is dropped, so the new entries' gradient is not clipped this step; call clip_grad_norm_ "
                          "after set_indices", stacklevel=3)

    def gathered_grad(self, p: torch.Tensor, indices: torch.Tensor | None = None) -> torch.Tensor:
        """p's [k] fp32 gradient at `indices` (default: its chosen entries), gathered once a step from
        its dense `.grad`: the step then reads these instead of `.grad`, which is never written."""
        gathered = self.clipped_grad(p)
        if gathered is None:
            indices = self.opt.indices_of(p) if indices is None else indices
            # index_select takes the int32 indices as they are: no int64 copy on every step.
            gathered = torch.index_select(local_tensor(p.grad).reshape(-1), 0, indices).float()
            self.clipped[p] = (self.grad_key(p), gathered)
        return gathered
