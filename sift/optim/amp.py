"""Loss scaling: `torch.amp.GradScaler`'s scale and inf check reach `SparseAdamW`'s step.

The optimizer sets `_step_supports_amp_scaling`, so `scaler.step(opt)` does not unscale
`.grad` itself: it sets `opt.grad_scale` (a device scalar, or None after `scaler.unscale_`)
and `opt.found_inf` (nonzero when a `.grad` holds inf/NaN) and calls `step()`. The step then
divides what it reads by the scale: the [k] gradients gathered from a sparse weight's `.grad`
(plain mode; `.grad` itself is neither written nor read in full), the compact buffers
(`compact_grads`, sparse backward), and the dense groups' `.grad`. The scaler's inf check
cannot see the compact buffers, so the step checks them itself; any inf/NaN skips the step,
which then changes nothing (params, moments, step counts, a pending selection).

`scaler.unscale_(opt)` unscales `.grad` only. The compact buffers written in backward stay
scaled until `clip_grad_norm_` or the step unscales them, exactly once, by the inverse of the
scale of `optimizer.grad_scaler` (the scaler the optimizer was given).

Every step under the scaler reports its inf/NaN flag to the scaler (`found_inf_per_device`), in every
mode: the compact buffers' flags join the `.grad` check, so `scaler.update()` backs the scale off for an
overflow it could not see, and always finds a check even when no trained param kept a dense `.grad`
(a 4-bit layer's delta scoring on a selection step has none). The scaler that calls `step()` is found
from the call itself when `optimizer.grad_scaler` was not set (and, in the compact modes, kept as the
link); a compact-mode step that cannot find it refuses before changing anything rather than stall.

Across ranks (a `process_group`, the default group adopted under DDP, an FSDP2 mesh) the step agrees
once, in `agree`, before anything branches or changes: one small all-reduce (MAX) of this rank's inf/NaN flag
(the scaler's `.grad` check and the compact buffers') and of how many weights it takes into a
cross-rank selection. Each rank checks only its own gradients before the optimizer averages them, so
without it one rank would skip while another stepped on the averaged inf, or entered the selection's
collectives alone. The agreed flag is what the scaler is told, so every rank backs off alike.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from torch.amp.grad_scaler import OptState

from sift.optim.part import Part
from sift.optim.settings import Settings
from sift.optim.state import is_selected, local_tensor, uses_grad


def _reciprocal(scale: torch.Tensor) -> torch.Tensor:
    """1 / scale as GradScaler computes it (in fp64, then fp32), so both paths unscale alike."""
    return scale.double().reciprocal().float()


def _unscale_(tensors: list[torch.Tensor], inv_scale: torch.Tensor,
              found: dict[torch.device, torch.Tensor] | None) -> None:
    """Multiply `tensors` by `inv_scale` in place and flag inf/NaN into `found` (per device, no host
    sync); `found` None: values the scaler already checked, multiplied only."""
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for t in tensors:
        by_kind[(t.device, t.dtype)].append(t)
    for (device, _), group in by_kind.items():
        if found is None:
            torch._foreach_mul_(group, inv_scale.to(device))
            continue
        if device not in found:
            found[device] = torch.zeros((), dtype=torch.float32, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(group, found[device], inv_scale.to(device))


@dataclass(frozen=True)
class ScaledStep:
    """What `ScalerLink.prepare` found at the start of a step, for `begin` to act on once the ranks agree.

    Attributes:
        under_scaler: a GradScaler drives the step.
        link: the scaler the optimizer keeps linked from now on.
        grad_inv_scale: 1 / `grad_scale`, None without one.
        compact_inv: the inverse scale the compact buffers are unscaled by now, None: not now.
        scored: a 4-bit layer's selection score was checked in backward.
        checked: the compact buffers' and scores' inf/NaN flags, per device.
        found_inf: this rank's inf/NaN flags for `agree`, None when nothing was checked.
    """

    under_scaler: bool
    link: torch.amp.GradScaler | None
    grad_inv_scale: torch.Tensor | None
    compact_inv: torch.Tensor | None
    scored: bool
    checked: dict[torch.device, torch.Tensor]
    found_inf: list[torch.Tensor] | None


class ScalerLink(Part):
    """`SparseAdamW`'s side of GradScaler's protocol (`grad_scale`, `found_inf`), and the step's one
    agreement across ranks (`agree`)."""

    def __init__(self, opt: Any, settings: Settings) -> None:
        super().__init__(opt, settings)
        self.scaler: torch.amp.GradScaler | None = None  # `optimizer.grad_scaler`: not pickled or copied
        # Whether a GradScaler has driven a step: the compact buffers then hold loss-scaled gradients that only a
        # linked scaler can unscale before a clip. Saved in state_dict, since a resumed optimizer has no link.
        self.loss_scaled = False
        self.new_step()

    def link(self, scaler: torch.amp.GradScaler | None) -> None:
        """`optimizer.grad_scaler = scaler`: the scaler whose scale unscales the compact buffers."""
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            raise TypeError(f"grad_scaler must be a torch.amp.GradScaler or None, got {type(scaler).__name__}")
        self.scaler = scaler

    def mark_scaled(self, p: torch.Tensor) -> None:
        """p's compact buffer now holds a gradient of the loss as GradScaler scaled it: unscaled once, before the
        step reads it."""
        self.scaled_compact.add(p)

    def mark_unscaled(self, p: torch.Tensor) -> None:
        """p's compact buffer was gathered from a `.grad` that `scaler.unscale_` unscaled already."""
        self.scaled_compact.discard(p)

    def saved(self) -> dict[str, bool]:
        """Whether a GradScaler has driven a step (the compact buffers then hold scaled gradients)."""
        return {"loss_scaled": self.loss_scaled}

    def resume(self, saved: dict[str, Any]) -> None:
        self.loss_scaled = bool(saved.get("loss_scaled", self.loss_scaled))

    def carried(self) -> dict[str, bool]:
        """A copy carries whether a GradScaler has driven a step; not the link to it."""
        return {"loss_scaled": self.loss_scaled}

    def carry(self, carried: dict[str, Any]) -> None:
        self.loss_scaled = bool(carried.get("loss_scaled", False))

    def new_step(self) -> None:
        """For one step: the compact buffers still holding scaled gradients, the inf/NaN flags of those
        unscaled so far (per device), and the inverse `grad_scale` of the running step."""
        self.scaled_compact: set[torch.Tensor] = set()
        self.compact_found_inf: dict[torch.device, torch.Tensor] = {}
        self.grad_inv_scale: torch.Tensor | None = None

    def scaler_inverse_scale(self, scaler: torch.amp.GradScaler | None = None) -> torch.Tensor | None:
        """The inverse scale `scaler.unscale_(optimizer)` applied to `.grad` this step, if it was called (`scaler`:
        the optimizer's `grad_scaler` by default)."""
        scaler = self.scaler if scaler is None else scaler
        if scaler is None or not scaler.is_enabled():
            return None
        per_optimizer = scaler._per_optimizer_states.get(id(self.opt))
        if per_optimizer is None or per_optimizer["stage"] is not OptState.UNSCALED:
            return None
        return _reciprocal(scaler._scale)

    def dense_grads_unscaled(self) -> bool:
        """Whether GradScaler already unscaled this step's `.grad` tensors (`scaler.unscale_`)."""
        protocol = getattr(self.opt, "found_inf", None) is not None and getattr(self.opt, "grad_scale", None) is None
        return protocol or self.scaler_inverse_scale() is not None

    def scaled_buffers(self) -> list[torch.Tensor]:
        """The compact buffers that hold this step's gradients still loss-scaled."""
        return [self.opt.grads.compact[p] for p in self.scaled_compact if p in self.opt.grads.ready]

    def unscale_compact(self, inv_scale: torch.Tensor) -> None:
        """Unscale (and check for inf/NaN) the compact buffers still holding scaled gradients."""
        _unscale_(self.scaled_buffers(), inv_scale, self.compact_found_inf)
        self.scaled_compact.clear()

    def check(self, update_in_backward: bool | None = None) -> tuple[
            bool, torch.Tensor | None, torch.amp.GradScaler | None, torch.Tensor | None, torch.Tensor | None]:
        """Refuse what cannot run under GradScaler, changing nothing (`step()` calls it with the other checks,
        before anything changes; `prepare` again).

        Args:
            update_in_backward: the mode the step runs in (memory="lowest" may still drop the update in
                backward at this step); default: the optimizer's.

        Returns:
            What `prepare` acts on: whether a GradScaler drives the step, its inf flag of `.grad` (None when it
            checked nothing), the scaler to link, the inverse `grad_scale`, and the inverse scale of the compact
            buffers (None: they are not unscaled now).

        Raises:
            RuntimeError: the update in backward under a GradScaler; a compact mode stepped by a GradScaler it
                cannot find; `scaler.unscale_` ran, compact buffers are scaled, and the optimizer does not know
                the scaler (`grad_scaler` unset).
        """
        update_in_backward = self.opt.memory.update_in_backward if update_in_backward is None else update_in_backward
        grad_scale = getattr(self.opt, "grad_scale", None)
        found_inf = getattr(self.opt, "found_inf", None)
        under_scaler = grad_scale is not None or found_inf is not None
        if update_in_backward and under_scaler:
            raise RuntimeError("update_in_backward=True cannot be used with GradScaler: the weights were stepped "
                               "inside backward, before the scaler's inf/NaN check could skip the step")
        link = self.scaler
        if under_scaler and self.settings.compact_grads and link is None:
            link = self.calling_scaler()
            if link is None:
                raise RuntimeError("SparseAdamW was stepped by a GradScaler it cannot find, and compact_grads mode "
                                   "(or the sparse backward) must report its own inf/NaN checks to it: set "
                                   "`optimizer.grad_scaler = scaler`")
        if not isinstance(found_inf, torch.Tensor):
            # GradScaler hands sum([]) == 0 when no param kept a dense `.grad`: nothing was checked.
            found_inf = None
        grad_inv_scale = _reciprocal(grad_scale) if grad_scale is not None else None
        compact_inv = grad_inv_scale if grad_scale is not None else self.scaler_inverse_scale(link)
        ready = self.opt.grads.ready
        if compact_inv is None and found_inf is not None and any(p in ready for p in self.scaled_compact):
            raise RuntimeError("scaler.unscale_(optimizer) cannot see the compact gradients of compact_grads mode "
                               "(or the sparse backward): set `optimizer.grad_scaler = scaler` so that "
                               "clip_grad_norm_ and step() unscale them")
        return under_scaler, found_inf, link, grad_inv_scale, compact_inv

    def prepare(self) -> ScaledStep:
        """Start of a step: refuse what cannot run under GradScaler (`check`) and find this rank's inf/NaN flags,
        changing nothing, so that the agreement across ranks (`agree`) may still refuse before any change.

        Raises:
            RuntimeError: see `check`.
        """
        under_scaler, found_inf, link, grad_inv_scale, compact_inv = self.check()
        checked = dict(self.compact_found_inf)
        if compact_inv is not None:
            # The check alone: multiplying by one leaves every buffer's bits as they are (GradScaler's kernel
            # skips the product then); `begin` unscales them once the step is agreed.
            one = torch.ones((), dtype=torch.float32)
            by_device: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
            for buffer in self.scaled_buffers():
                by_device[buffer.device].append(buffer)
            for device, buffers in by_device.items():
                found = checked[device].clone() if device in checked else torch.zeros((), dtype=torch.float32,
                                                                                      device=device)
                torch._amp_foreach_non_finite_check_and_unscale_(buffers, found, one.to(device))
                checked[device] = found
        # The 4-bit layers' selection scores (sift.quantized) are formed in backward, where no `.grad` shows them.
        scored = [flag for flag in (route.found_inf() for route in self.opt.grads.quantized.values())
                  if flag is not None]
        if under_scaler:
            for flag in scored:
                held = checked.get(flag.device)
                checked[flag.device] = flag if held is None else held + flag
        flags = [t for t in (found_inf, *checked.values()) if t is not None]
        return ScaledStep(under_scaler, link, grad_inv_scale, compact_inv, bool(scored), checked,
                          flags if under_scaler or flags else None)

    def begin(self, scaled: ScaledStep) -> None:
        """The step is agreed and runs (or is skipped): link the scaler, and unscale the compact buffers written in
        backward (their inf/NaN flags are `scaled.checked` already). Nothing is averaged or decided here."""
        self.grad_inv_scale = scaled.grad_inv_scale
        self.compact_found_inf = scaled.checked
        if scaled.under_scaler:
            self.loss_scaled = True
        self.scaler = scaled.link
        if scaled.compact_inv is not None:
            _unscale_(self.scaled_buffers(), scaled.compact_inv, None)
            self.scaled_compact.clear()
        if scaled.under_scaler and scaled.scored and self.scaler is None:
            # Kept: a later selecting backward unscales its score by it.
            self.scaler = self.calling_scaler()

    def agree(self, found_inf: list[torch.Tensor] | None) -> bool:
        """The step's one agreement across ranks, reached by every rank on every path before anything
        branches (skip, select, average): whether any rank found inf/NaN, and that every rank takes the
        same number of weights into this step's cross-rank selection. Tells the scaler the agreed flag.

        One all-reduce (MAX) of three numbers over the optimizer's ranks, when there are several and a
        scaler drives the step or a selection is still pending; none otherwise.

        Args:
            found_inf: this rank's inf/NaN flags (`prepare`), None without GradScaler.

        Returns:
            Whether the step is skipped (the same on every rank).

        Raises:
            RuntimeError: the ranks would select different weights together (a backward that did not reach
                a trained weight on some rank); raised on every rank, before anything changes.
        """
        group, device = self.opt.grads.agreement_group()
        if group is None or (found_inf is None and self.opt.selector.pending == []):
            if found_inf is None:
                return False
            flag = sum(t.to(found_inf[0].device) for t in found_inf) if found_inf else None
            self.report_found_inf(flag)
            # The one host read of the step: whether it runs decides what selection commits.
            return flag is not None and bool(flag.item())
        import torch.distributed as dist

        selecting = float(self.selecting_together())
        votes = torch.tensor([0.0, selecting, -selecting], dtype=torch.float32, device=device)
        for t in found_inf or ():
            votes[0] += t.to(device).sum()  # FSDP2's check is a [1] tensor
        dist.all_reduce(votes, op=dist.ReduceOp.MAX, group=group)
        inf, most, least = votes.tolist()  # the step's one host read
        if most != -least:  # before the scaler hears of the step: a refused step changes nothing
            raise RuntimeError(f"the ranks of this SparseAdamW disagree on the sparse weights that choose their "
                               f"entries together in this step (from {int(-least)} to {int(most)}): every rank must "
                               "run backward over the same trained weights, as DDP requires")
        if found_inf is not None:
            self.report_found_inf(votes[0])
        return inf > 0

    def selecting_together(self) -> int:
        """How many weights this rank takes into a cross-rank selection this step: every pending one under a
        process group (averaged before it selects), the FSDP2 weights choosing the whole weight's top-k."""
        pending = self.opt.selector.pending_with_grad()
        if self.opt.grads.process_group is not None:
            return len(pending)
        return sum(1 for _, p in pending if self.opt.selector.selects_globally(p))

    def calling_scaler(self) -> torch.amp.GradScaler | None:
        """The GradScaler whose `scaler.step(optimizer)` is running (found on the call stack), or None."""
        frame = sys._getframe(1)
        for _ in range(32):
            if frame is None:
                break
            candidate = frame.f_locals.get("self")
            if isinstance(candidate, torch.amp.GradScaler) and id(self.opt) in candidate._per_optimizer_states:
                return candidate
            frame = frame.f_back
        return None

    def report_found_inf(self, flag: torch.Tensor | None) -> None:
        """Make `flag` (this step's agreed inf/NaN flag; None: nothing was checked, a clean check) the scaler's
        whole check of this optimizer, so that `scaler.update()` backs off for the compact buffers too (its
        own check saw only `.grad`), alike on every rank, and always finds a check."""
        scaler = self.scaler if self.scaler is not None else self.calling_scaler()
        per_optimizer = scaler._per_optimizer_states.get(id(self.opt)) if scaler is not None else None
        if per_optimizer is None:  # a linked scaler that is not the one stepping: nothing to report to
            return
        if flag is None:
            flag = torch.zeros((), dtype=torch.float32, device=scaler._scale.device)
        per_device = per_optimizer["found_inf_per_device"]
        per_device.clear()
        per_device[flag.device] = flag

    def unscale_after_selection(self) -> None:
        """With `grad_scale`: unscale what the step reads from `.grad`, now that selection is done.

        Compact buffers gathered at selection are unscaled in place; a sparse weight in plain mode
        gets its [k] entries gathered in fp32 and unscaled there (its `.grad` is not written);
        dense groups' `.grad` are unscaled in place as GradScaler would have.
        """
        inv_scale = self.grad_inv_scale
        if inv_scale is None:
            return
        self.unscale_compact(inv_scale)
        gathered, dense = [], []
        for group in self.opt.param_groups:
            for p in group["params"]:
                if not uses_grad(p):
                    continue
                if group["density"] >= 1.0:
                    dense.append(local_tensor(p.grad))
                elif not self.settings.compact_grads and is_selected(self.opt.state.get(p, {})):
                    gathered.append(self.opt.selector.gathered_grad(p))
        # The scaler already checked these `.grad` values.
        _unscale_(gathered + dense, inv_scale, None)
