"""Periodic re-selection of `SparseAdamW`'s entries: drop the entries that moved least, grow new ones.

After SpIEL's drop-and-grow (Ansell et al.), with one step's dense gradient. A sparse weight whose
update count `s` (its state's `step`, the updates applied since its selection) is a positive multiple
of `reselect_every` is re-selected at the start of the `step()` that applies its update `s + 1`,
before that update, on that step's dense gradient `g`:

    n = floor(f(s) * k)                  (k: the weight's entries; at most numel - k)
    drop  the n kept entries of smallest |delta| ("spiel"), |g| ("magnitude") or |theta * g| ("saliency")
    grow  the n entries not selected before this step of largest |g| (|theta * g| for "saliency")

where a score is summed over the `reselect_steps` steps ending with this one (unscaled; the earlier ones only
score, in `state["reselect_score"]`, and train as usual).

Equal scores go to the lower flat index (dropped first, grown first). `f(s)` is `reselect_fraction`
times 1 ("constant"), `1 - t` ("linear") or `(1 + cos(pi t)) / 2` ("cosine"), `t = min(s / T, 1)`
with `T = reselect_total_steps`.

Every gradient route takes part (`Reselector`): after a step, the weights whose next step re-selects are
known (`Reselector.due`, from the step counts in the state, so a resumed optimizer knows them too), and
for that one step their backward keeps the dense gradient as a selecting step does (the compact hook, the
sparse backward and the update in backward let it through); `step()` re-selects from it, gathers the new
entries' gradient where the mode keeps it and frees the dense one. So every memory mode re-selects
exactly what plain mode does. A `clip_grad_norm_` before that step clips the entries the step will
re-select (worked out, not committed, as for a selecting step).

What each entry keeps (indices stay sorted, every [k] tensor follows its index):
- a kept entry keeps its moments, `delta` and `base`;
- a dropped entry leaves its increment in the weight and in the retired record (`reselect_drop=
  "merge"`, the default: `SparseDelta.from_optimizer` still holds it), or is written back to its
  `base` and forgotten ("revert");
- a grown entry starts with `delta = 0` and `base` = the weight's current value; one that an earlier
  re-selection dropped takes its `delta` and `base` back from the retired record instead (the same
  weight value, its increment since the first selection kept whole).

Grown entries' moments. A fresh Adam entry taking its first step on `g` ends with
`exp_avg = (1 - b1) g`, `exp_avg_sq = (1 - b2) g^2` and bias corrections `1 - b^1`. The kernels
keep one step count per weight, so this update runs at the weight's count `s + 1`, corrected by
`1 - b^(s+1)`. Seeding the grown entries, before the update, with

    exp_avg = (1 - b1^s) g,   exp_avg_sq = (1 - b2^s) g^2

makes the update's moments `b (1 - b^s) x + (1 - b) x = (1 - b^(s+1)) x` (x = g, g^2): read through
the weight's correction, exactly a fresh entry's corrected moments `g` and `g^2`, so the grown
entries' first update is a fresh entry's first update. `g` is the gradient that update applies: unscaled
(GradScaler), clipped (`max_grad_norm`, `clip_grad_norm_`), averaged across ranks.

A 4-bit or int8 layer (`sift.quantized`) re-selects in its backward, where its dense weight gradient lives for
one layer at a time: its [k] values then take their gradient at the new entries, and `step()` moves the values
and moments of the kept entries with them. Its packed base never changes, so a dropped entry's increment cannot
be merged: these layers take `reselect_drop="revert"` only.

The lean state keeps no `delta` and no `base`: it re-selects by `reselect_rule="magnitude"` or `"saliency"` with
`reselect_drop="merge"` (the dropped positions join its `retired_indices`, so `SparseDelta.from_optimizer` with the
base model still finds their increments); the grown entries' bf16 moments take the seeds rounded to nearest.

FSDP2 shards (`sharded_selection="global"`, the default) re-select the whole weight's entries as one process
would: the n lowest drop scores and the n highest growth scores across the shards (`plan_all`, by
`sift.optim.selection.sharded_top_k`), each rank keeping its shard's part, however many. Every setting lives in
the param groups (`group["reselect"]`), so `state_dict` carries it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import Any

import torch

from sift._index import lookup as _lookup
from sift._index import top_k_positions
from sift._rules import step_score
from sift.optim.clip import clip_each_
from sift.optim.part import Part
from sift.optim.selection import sharded_top_k
from sift.optim.settings import Settings
from sift.optim.sharded import shard_group
from sift.optim.state import is_dtensor, is_selected, local_tensor, num_entries, uses_grad

logger = logging.getLogger("sift")

SCHEDULES = ("constant", "linear", "cosine")
RULES = ("spiel", "magnitude", "saliency")
DROPS = ("merge", "revert")


def reselect_settings(every: int | None, fraction: float = 0.2, schedule: str = "constant",
                      total_steps: int | None = None, rule: str = "spiel", drop: str = "merge", steps: int = 1
                      ) -> dict[str, Any] | None:
    """The validated re-selection settings a param group keeps, or None when `every` is None (off).

    Raises:
        ValueError: a setting out of range, naming its `reselect_*` argument.

    Example:
        >>> reselect_settings(100, 0.1)["fraction"]
        0.1
        >>> reselect_settings(None) is None
        True
    """
    if every is None:
        return None
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"reselect_every must be a positive integer or None, got {every!r}")
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 < fraction <= 1.0:
        raise ValueError(f"reselect_fraction must be in (0, 1], got {fraction!r}")
    if schedule not in SCHEDULES:
        raise ValueError(f"reselect_schedule must be one of {SCHEDULES}, got {schedule!r}")
    if total_steps is not None and (isinstance(total_steps, bool) or not isinstance(total_steps, int)
                                    or total_steps < 1):
        raise ValueError(f"reselect_total_steps must be a positive integer or None, got {total_steps!r}")
    if schedule != "constant" and total_steps is None:
        raise ValueError(f"reselect_schedule={schedule!r} decays over reselect_total_steps: pass it")
    if rule not in RULES:
        raise ValueError(f"reselect_rule must be one of {RULES}, got {rule!r}")
    if drop not in DROPS:
        raise ValueError(f"reselect_drop must be one of {DROPS}, got {drop!r}")
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= every:
        raise ValueError(f"reselect_steps must be an integer in [1, reselect_every={every}], got {steps!r}")
    return dict(every=every, fraction=float(fraction), schedule=schedule, total_steps=total_steps, rule=rule,
                drop=drop, steps=steps)


def check_reselect_modes(*, state: str, rule: str, drop: str) -> None:
    """Refuse, before anything is built, what the lean state cannot re-select by."""
    if state == "lean" and rule == "spiel":
        raise ValueError("reselect_rule='spiel' ranks each entry's delta, which state='lean' does not keep: use "
                         "reselect_rule='magnitude' (or 'saliency') or state='exact'")


def check_reselect_param(p: torch.Tensor, label: str, settings: dict[str, Any], lean: bool) -> None:
    """Refuse a sparse param re-selection cannot train (a lean one to revert), before its group is added."""
    if lean and settings["drop"] == "revert":
        raise ValueError("reselect_drop='revert' writes each dropped entry back to its base, which state='lean' "
                         f"does not keep ({label}): use reselect_drop='merge' or state='exact'")


def reselect_memory(memory: str, model: torch.nn.Module, kwargs: dict[str, Any]) -> str:
    """`for_model`'s memory preset with re-selection: "lowest" keeps the exact state (one log line).

    Raises:
        ValueError: re-selection asked for on a model with 4-bit or int8 (bitsandbytes) layers.
    """
    if kwargs.get("reselect_every") is None:
        return memory
    # By class name, as sift.quantized matches them (importing it here would close an import cycle).
    quantized = any(type(getattr(m, "weight", None)).__name__ in ("Params4bit", "Int8Params") for m in model.modules())
    if quantized and kwargs.get("reselect_drop", "merge") != "revert":
        raise ValueError("reselect_drop='merge' cannot fold a dropped entry's increment into a 4-bit or int8 base "
                         "(its packed weight never changes): pass reselect_drop='revert' on such a model")
    rule, drop = kwargs.get("reselect_rule", "spiel"), kwargs.get("reselect_drop", "merge")
    if memory == "lowest" and kwargs.get("state") is None and (rule == "spiel" or drop == "revert"):
        logger.warning("sift: memory='lowest' without state='lean': reselect_rule=%r and reselect_drop=%r need each "
                       "entry's delta and base, which only the exact state keeps", rule, drop)
        kwargs["state"] = "exact"
    return memory


def fraction_at(settings: dict[str, Any], step: int) -> float:
    """The fraction of a weight's entries re-selected at its update count `step`.

    Example:
        >>> fraction_at(reselect_settings(10, 0.2, "linear", 100), 50)
        0.1
    """
    if settings["schedule"] == "constant":
        return settings["fraction"]
    t = min(step / settings["total_steps"], 1.0)
    decay = 1.0 - t if settings["schedule"] == "linear" else 0.5 * (1.0 + math.cos(math.pi * t))
    return settings["fraction"] * decay


def replaced(settings: dict[str, Any], count: int, k: int, numel: int) -> int:
    """n: how many of a weight's k entries (of numel) a re-selection at update count `count` replaces; 0 when
    it is not due then."""
    if count == 0 or count % settings["every"]:
        return 0
    return max(0, min(int(fraction_at(settings, count) * k), numel - k))


class Reselector(Part):
    """`SparseAdamW`'s periodic re-selection (see the module docstring): which weights re-select at the next
    step (`due`, known before its backward so that every gradient route keeps their dense gradient), the
    drop and grow each one would make (`plan`, also what `clip_grad_norm_` clips by), and the commit in
    `step()` with the grown entries' moments seeded from the gradient the update applies."""

    def __init__(self, opt: Any, settings: Settings) -> None:
        super().__init__(opt, settings)
        self.due: dict[torch.Tensor, int] = {}  # weight -> its update count, for the weights the next step re-selects
        self.scoring: dict[torch.Tensor, int] = {}  # the same for those it scores for a later re-selection
        # Host copies of the update counts (`state["step"]`), kept by `stepped`, so that a step reads no device
        # count: each is read once, when first needed (after its selection, or a load: `refresh(reread=True)`).
        self.counts: dict[torch.Tensor, int] = {}
        self.new_step()

    def new_step(self) -> None:
        """Forget what lived for one step: the plans (keyed by the gradient they came from) and the grown entries
        still to be seeded."""
        self.plans: dict[torch.Tensor, tuple[tuple, torch.Tensor]] = {}
        self.grown: dict[torch.Tensor, tuple[torch.Tensor, int]] = {}

    def enabled(self) -> bool:
        return any(group.get("reselect") for group in self.opt.param_groups)

    def stepped(self, params: Iterable[torch.Tensor]) -> None:
        """The step kernels just counted an update of each of `params`: so do the host copies."""
        if self.counts:
            for p in params:
                if p in self.counts:
                    self.counts[p] += 1

    def refresh(self, reread: bool = False) -> None:
        """Work out `due` from the update counts: after each step that updated, a load (`reread`: the counts came
        from the checkpoint), `set_indices`. Reads from the device only the counts not known on the host yet (a
        weight's first, after its selection): one transfer per device then, none on a steady step."""
        self.due, self.scoring = {}, {}
        if reread:
            self.counts = {}
        if not self.enabled():
            return
        candidates = []  # (settings, weight, its step count, k, numel)
        routes = self.opt.grads.quantized
        for group in self.opt.param_groups:
            settings = group.get("reselect")
            if not settings:
                continue
            for p in group["params"]:
                state = self.opt.state.get(p)
                if not state or "step" not in state:
                    continue
                if group["density"] < 1.0 and is_selected(state):
                    candidates.append((settings, p, state["step"], num_entries(state), local_tensor(p).numel()))
                elif p in routes and routes[p].selected:  # a 4-bit or int8 layer's [k] delta values
                    candidates.append((settings, p, state["step"], routes[p].k, routes[p].numel))
        by_device: dict[torch.device, list[int]] = {}
        for i, candidate in enumerate(candidates):
            if candidate[1] not in self.counts:
                by_device.setdefault(candidate[2].device, []).append(i)
        for positions in by_device.values():
            read = torch.stack([candidates[i][2] for i in positions]).tolist()
            for i, count in zip(positions, read):
                self.counts[candidates[i][1]] = int(count)
        for settings, p, _, k, numel in candidates:
            count = self.counts[p]
            if self.opt.selector.selects_globally(p):  # FSDP2: the whole weight's k and size, alike on every rank
                k, numel = self.opt.selector.num_selected(self.opt.entries.group_of(p), p), p.numel()
            if replaced(settings, count, k, numel):
                self.due[p] = count
                continue
            # The steps before a re-selection that add to its score (`reselect_steps`), up to the one that fires.
            ahead = -count % settings["every"]
            if 0 < ahead < settings.get("steps", 1) and replaced(settings, count + ahead, k, numel):
                self.scoring[p] = count

    def is_due(self, p: torch.Tensor) -> bool:
        """Whether p's next step re-selects its entries or scores for a re-selection (its backward keeps the dense
        gradient)."""
        return p in self.due or p in self.scoring

    def fires(self, p: torch.Tensor) -> bool:
        """Whether p's next step re-selects its entries (not only scores)."""
        return p in self.due

    def due_with_grad(self) -> list[tuple[dict[str, Any], torch.Tensor]]:
        """The weights whose dense gradient this step reads (re-selecting or scoring), with their groups."""
        return [(self.opt.entries.group_of(p), p) for p in [*self.due, *self.scoring] if uses_grad(p)]

    def score_now(self, group: dict[str, Any], p: torch.Tensor, grad: torch.Tensor, inv_scale: Any) -> torch.Tensor:
        """This step's re-selection score of p's positions ([numel] fp32, a new tensor): |g|, or first-order saliency
        |theta * g| (`sift._rules.step_score`); unscaled by `inv_scale` (GradScaler's, which may change between the
        scoring steps)."""
        weight = local_tensor(p.detach()).reshape(-1)
        return step_score(self.scoring_rule(group), local_tensor(grad).reshape(-1), weight, inv_scale, signed=False)

    @staticmethod
    def scoring_rule(group: dict[str, Any]) -> str:
        """The selection rule a re-selection scores by: "saliency", else "magnitude" (SpIEL grows by |g|)."""
        return "saliency" if group["reselect"]["rule"] == "saliency" else "magnitude"

    def add_score(self, p: torch.Tensor, score: torch.Tensor) -> None:
        """A scoring step's score joins p's summed score (optimizer state, so `state_dict` carries it)."""
        self.opt.entries.add_reselect_score(p, score)
        self.scoring.pop(p, None)

    def plan(self, group: dict[str, Any], p: torch.Tensor) -> torch.Tensor:
        """The entries p's re-selection this step leaves it with ([k] sorted, the index dtype), from its dense
        gradient, not committed. Ranks alike whether the gradient is loss-scaled or not."""
        if p in self.scoring:  # it only scores this step: its entries stay
            return self.opt.indices_of(p)
        key = self.opt.selector.grad_key(p)
        hit = self.plans.get(p)
        if hit is not None and hit[0] == key:
            return hit[1]
        if self.opt.selector.selects_globally(p):
            # Planned with the other ranks (`plan_all`): planning here alone would leave them waiting.
            raise RuntimeError("the gradient of an FSDP2 weight changed after its re-selection was planned across "
                               "the ranks in this step; change gradients before clip_grad_norm_ and step()")
        self.plans[p] = (key, self.choose(*self.scores(group, p, local_tensor(p).numel())))
        return self.plans[p][1]

    def scores(self, group: dict[str, Any], p: torch.Tensor, numel: int, grad: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """(p's entries on this rank, the drop score of each: lowest leaves; the growth score of this rank's
        positions: highest joins, -inf at the entries; n, of the weight of `numel` elements). From p's `.grad`
        unless `grad` is given."""
        settings, state = group["reselect"], self.opt.state[p]
        old = self.opt.indices_of(p)
        k = self.opt.selector.num_selected(group, p) if self.opt.selector.selects_globally(p) else old.numel()
        grad = local_tensor(p.grad if grad is None else grad).reshape(-1)
        n = replaced(settings, self.due[p], k, numel)
        old_long = old.long()
        # |g|, or first-order saliency |theta * g| (sift's selection rules), plus the scoring steps' sum; one
        # weight-sized fp32 buffer. Ranking one step's score needs no unscaling; a sum over steps does.
        summed = state.get("reselect_score")
        candidates = self.score_now(group, p, grad, self.opt.amp.grad_inv_scale if summed is not None else None)
        if summed is not None:
            candidates.add_(summed)
        return (old, *self.ranked(candidates, old_long, settings["rule"], state.get("delta")), n)

    @staticmethod
    def ranked(score: torch.Tensor, old_long: torch.Tensor, rule: str, delta: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """(each entry's drop score: lowest leaves; every position's growth score: highest joins) from `score`
        ([numel] fp32, consumed: it becomes the growth score) at the entries `old_long` ([k] int64); "spiel" drops
        by |delta| ([k], the increments since selection)."""
        moved = delta.float().abs() if rule == "spiel" else score[old_long]
        score.nan_to_num_(nan=-1.0)  # a NaN never outranks a finite gradient
        score[old_long] = float("-inf")  # only entries not selected before this step grow
        return moved, score

    @staticmethod
    def choose(old: torch.Tensor, moved: torch.Tensor, candidates: torch.Tensor, n: int) -> torch.Tensor:
        """The n entries of `old` ([k] sorted) of lowest `moved` leave and the n positions of highest `candidates`
        join (ties to the lower index): the new [k] sorted entries."""
        return Reselector.merged(old, top_k_positions(-moved, n), top_k_positions(candidates, n))

    @staticmethod
    def merged(old: torch.Tensor, dropped: torch.Tensor, grown: torch.Tensor) -> torch.Tensor:
        """The kept entries of `old` ([k] sorted) without the positions `dropped`, with the flat positions `grown`."""
        keep = torch.ones(old.numel(), dtype=torch.bool, device=old.device)
        keep[dropped] = False
        return torch.cat([old[keep], grown.to(old.dtype)]).sort().values

    def plan_all(self) -> None:
        """Plan together, across the shards, the re-selection of every due FSDP2 weight selecting globally: the
        whole weight's n entries of lowest drop score leave and its n positions of highest growth score join, as
        one process would choose (`sharded_top_k`, ties to the lower flat position). Collective over each weight's
        mesh, a no-op without such weights; every rank holds the same due weights (their step counts agree)."""
        members = [(group, p) for group, p in self.due_with_grad()
                   if p in self.due and self.opt.selector.selects_globally(p)]
        by_group: dict[Any, list[tuple[dict[str, Any], torch.Tensor]]] = {}
        for group, p in members:
            key = self.opt.selector.grad_key(p)
            if self.plans.get(p, (None,))[0] != key:
                by_group.setdefault(shard_group(p), []).append((group, p))
        for mesh_group, chunk in by_group.items():
            planned = [self.scores(group, p, p.numel()) for group, p in chunk]
            ns = [n for *_, n in planned]
            dropped = sharded_top_k([-moved for _, moved, _, _ in planned], ns, mesh_group)
            grown = sharded_top_k([candidates for _, _, candidates, _ in planned], ns, mesh_group)
            for (_, p), (old, *_), d, g in zip(chunk, planned, dropped, grown):
                self.plans[p] = (self.opt.selector.grad_key(p), self.merged(old, d, g))

    def quantized_score(self, route: Any, dense: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        """A 4-bit or int8 layer's re-selection score from its dense weight gradient (`dense`, [out, in] fp32,
        consumed) and the weight it computes with (`weight`, for "saliency"), flat; still loss-scaled."""
        values = route.values
        rule = self.scoring_rule(self.opt.entries.group_of(values))
        if rule == "saliency" and weight is None:
            weight = route.weight(torch.float32, values.detach(), route.indices)
        return step_score(rule, dense.view(-1), None if weight is None else weight.reshape(-1), reuse=True,
                          signed=False)

    def plan_quantized(self, route: Any, dense: torch.Tensor, weight: torch.Tensor | None,
                       inv_scale: torch.Tensor | None) -> torch.Tensor:
        """The entries a 4-bit or int8 layer's re-selection leaves it with ([k] sorted), from this step's score
        (`quantized_score` of `dense` and `weight`) plus the scoring steps' (unscaled, so this step's is unscaled by
        `inv_scale`, its loss's). Called in the layer's backward."""
        values = route.values
        settings = self.opt.entries.group_of(values)["reselect"]
        old = route.indices
        n = replaced(settings, self.due[values], old.numel(), route.numel)
        flat = self.quantized_score(route, dense, weight)
        summed = self.opt.state[values].get("reselect_score")
        if summed is not None:
            if inv_scale is not None:
                flat.mul_(inv_scale.to(flat.device))
            flat.add_(summed)
        # The delta's values are its increments since selection.
        return self.choose(old, *self.ranked(flat, old.long(), settings["rule"], values.detach()), n)

    def reselect(self) -> None:
        """Commit the re-selection of every due weight that has a gradient this step. Called by `step()` once it
        knows it updates, after the ranks' gradients are averaged, before anything reads the entries."""
        due = self.due_with_grad()
        self.plan_all()
        if any(is_dtensor(p) for _, p in due):
            # The sparse backward's cross-rank plans gather every rank's new entries after this step.
            self.opt.grads.recheck_plans()
        for group, p in due:
            if p in self.opt.grads.quantized and p in self.scoring:
                route = self.opt.grads.quantized[p]
                if route.step_score is not None:  # scored in backward, still loss-scaled
                    inv_scale = route.commit_inverse_scale()
                    self.add_score(p, route.step_score if inv_scale is None else
                                   route.step_score.mul_(inv_scale.to(route.step_score.device)))
                continue
            if p in self.opt.grads.quantized:
                self.commit_quantized(p)
                continue
            if p in self.scoring:
                self.add_score(p, self.score_now(group, p, p.grad, self.opt.amp.grad_inv_scale))
                # Its update waited for the dense gradient, as on a selecting step.
                if self.opt.memory.update_in_backward:
                    self.opt.grads.update_now(p, self.applied(p, p.grad), clip=False)
                    p.grad = None
                    continue
            else:
                self.commit(group, p, self.plan(group, p))
            if self.settings.compact_grads and not self.opt.memory.update_in_backward:
                self.opt.grads.gather_selected(p, self.opt.selector.clipped_grad(p))
                p.grad = None  # as the hook does once the entries are known

    def commit(self, group: dict[str, Any], p: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """Give p the entries `indices` (its plan): revert or retire the leaving ones, keep the rest's state.
        Returns which of the new entries are grown ([k] bool)."""
        old = self.opt.indices_of(p)
        if group["reselect"]["drop"] == "revert":
            self.opt.entries.revert(p, old, ~_lookup(indices, old)[0])
        # What a clip gathered was gathered at these very entries: it outlives the change of entries.
        self.opt.entries.set_indices(p, indices, keep_gathered=True)
        fresh = ~_lookup(old, indices)[0]
        self.grown[p] = (fresh, self.due.pop(p))
        self.opt.entries.drop_reselect_score(p)
        return fresh


    def reselect_in_backward(self, p: torch.Tensor, grad: torch.Tensor) -> None:
        """update_in_backward, one process, p's whole gradient of its only backward this step (`grad`, dense):
        re-select, seed and step p now, so that its dense gradient goes with its layer's backward and no two
        weights' dense gradients live at once. The same plan, seeds and update as `step()` would make."""
        group = self.opt.entries.group_of(p)
        if p in self.scoring:
            self.add_score(p, self.score_now(group, p, grad, None))  # the update in backward takes no GradScaler
            compact = torch.index_select(local_tensor(grad).reshape(-1), 0, self.opt.indices_of(p)).float()
            self.opt.grads.update_now(p, compact)
            return
        indices = self.choose(*self.scores(group, p, local_tensor(p).numel(), grad))
        self.commit(group, p, indices)
        # Its own [k] buffer: the shared scratch may hold another weight's gradient still arriving.
        compact = torch.index_select(local_tensor(grad).reshape(-1), 0, indices).float()
        if self.settings.max_grad_norm is not None:
            clip_each_([compact], self.settings.max_grad_norm)
        self.seed_one(p, grad, compact)
        del self.grown[p]

    def commit_quantized(self, values: torch.Tensor) -> None:
        """A 4-bit or int8 layer: its new entries (chosen in backward, whose gradient is already theirs) in the
        state; the values and moments of kept entries follow them, dropped ones leave (their increment gone:
        "revert"), grown ones start at 0."""
        route = self.opt.grads.quantized[values]
        new = route.tentative
        if new is None:  # no backward reached the layer this step
            return
        kept = self.opt.entries.move_delta_entries(values, route.indices, new, route.numel)
        self.grown[values] = (~kept, self.due.pop(values))

    def seed(self) -> None:
        """Seed the grown entries' moments from the gradient this step's update applies to them (unscaled,
        clipped), just before it; with the update in backward, apply that update here (as the selecting
        step does)."""
        for p in list(self.grown):
            self.seed_one(p, p.grad)

    def applied(self, p: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """The [k] gradient this step's update applies to p (a 4-bit delta's: its whole gradient)."""
        if p in self.opt.grads.quantized:
            return p.grad  # a dense group's gradient: unscaled and clipped in place by now
        if self.opt.memory.update_in_backward:
            compact = self.opt.grads.gather_scratch(p, grad)
            if self.settings.max_grad_norm is not None:
                clip_each_([compact], self.settings.max_grad_norm)
            return compact
        if self.settings.compact_grads:
            return self.opt.grads.compact[p]
        return self.opt.selector.gathered_grad(p)

    def seed_one(self, p: torch.Tensor, grad: torch.Tensor, compact: torch.Tensor | None = None) -> None:
        """`seed` for one weight whose dense gradient is `grad` (`compact`: its [k] gradient, gathered already)."""
        fresh, count = self.grown[p]
        group = self.opt.entries.group_of(p)
        if compact is None:
            compact = self.applied(p, grad)
        g = compact[fresh]
        if group["maximize"]:
            g = -g
        beta1, beta2 = (float(b) for b in group["betas"])
        self.opt.entries.seed_moments(p, fresh, g, count, (beta1, beta2))
        if self.opt.memory.update_in_backward and p not in self.opt.grads.quantized:
            self.opt.grads.update_now(p, compact, clip=False)
            p.grad = None
