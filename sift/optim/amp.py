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

In the compact modes every step under the scaler reports the compact buffers' inf/NaN flags to the
scaler (`found_inf_per_device`), so `scaler.update()` backs the scale off for an overflow it could
not see and finds a check even when no trained param kept a dense `.grad`. The scaler that calls
`step()` is found from the call itself when `optimizer.grad_scaler` was not set (and then kept as
the link); a step that cannot find it refuses before changing anything rather than stall.

Under FSDP2 the scaler's own check all-reduces `.grad`'s flag over the DTensor mesh (torch's DTensor
rule for the check), but each rank checks only its own shard's compact buffers: the step all-reduces
their flag too, so that every rank skips, selects and backs off the scale on the same steps.
"""

from __future__ import annotations

import sys
from collections import defaultdict

import torch
from torch.amp.grad_scaler import OptState

from sift.optim.state import first_shard, is_selected, local_tensor, uses_grad


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


class AmpMixin:
    """`SparseAdamW`'s side of GradScaler's protocol (`grad_scale`, `found_inf`)."""

    _step_supports_amp_scaling = True

    def _scaler_inverse_scale(self) -> torch.Tensor | None:
        """The inverse scale `scaler.unscale_(self)` applied to `.grad` this step, if it was called."""
        scaler = self.grad_scaler
        if scaler is None or not scaler.is_enabled():
            return None
        per_optimizer = scaler._per_optimizer_states.get(id(self))
        if per_optimizer is None or per_optimizer["stage"] is not OptState.UNSCALED:
            return None
        return _reciprocal(scaler._scale)

    def _dense_grads_unscaled(self) -> bool:
        """Whether GradScaler already unscaled this step's `.grad` tensors (`scaler.unscale_`)."""
        protocol = getattr(self, "found_inf", None) is not None and getattr(self, "grad_scale", None) is None
        return protocol or self._scaler_inverse_scale() is not None

    def _unscale_compact(self, inv_scale: torch.Tensor) -> None:
        """Unscale (and check for inf/NaN) the compact buffers still holding scaled gradients."""
        buffers = [self._compact[p] for p in self._scaled_compact if p in self._grad_ready]
        _unscale_(buffers, inv_scale, self._compact_found_inf)
        self._scaled_compact.clear()

    def _amp_begin(self) -> bool:
        """Start of a step under GradScaler: unscale the compact buffers written in backward and
        decide. Returns True when the step must be skipped (inf/NaN in `.grad` or a compact buffer).

        Raises:
            RuntimeError: `scaler.unscale_` ran, compact buffers are scaled, and the optimizer
                does not know the scaler (`grad_scaler` unset).
        """
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        under_scaler = grad_scale is not None or found_inf is not None
        if self.update_in_backward and under_scaler:
            raise RuntimeError("update_in_backward=True cannot be used with GradScaler: the weights were stepped "
                               "inside backward, before the scaler's inf/NaN check could skip the step")
        if under_scaler and self.compact_grads and self.grad_scaler is None:
            self.grad_scaler = self._calling_scaler()
            if self.grad_scaler is None:
                raise RuntimeError("SparseAdamW was stepped by a GradScaler it cannot find, and compact_grads mode "
                                   "(or the sparse backward) must report its own inf/NaN checks to it: set "
                                   "`optimizer.grad_scaler = scaler`")
        if not isinstance(found_inf, torch.Tensor):
            # GradScaler hands sum([]) == 0 when no param kept a dense `.grad`: nothing was checked.
            found_inf = None
        self._grad_inv_scale = _reciprocal(grad_scale) if grad_scale is not None else None
        compact_inv = self._grad_inv_scale if grad_scale is not None else self._scaler_inverse_scale()
        if compact_inv is None and found_inf is not None and any(p in self._grad_ready for p in self._scaled_compact):
            raise RuntimeError("scaler.unscale_(optimizer) cannot see the compact gradients of compact_grads mode "
                               "(or the sparse backward): set `optimizer.grad_scaler = scaler` so that "
                               "clip_grad_norm_ and step() unscale them")
        if compact_inv is not None:
            self._unscale_compact(compact_inv)
        if under_scaler and self.compact_grads:
            self._agree_found_inf()
            self._report_found_inf()
        flags = [t for t in (found_inf, *self._compact_found_inf.values()) if t is not None]
        if not flags:
            return False
        # The one host read of the step: whether it runs decides what selection commits.
        return bool(sum(t.to(flags[0].device) for t in flags).item())

    def _calling_scaler(self) -> torch.amp.GradScaler | None:
        """The GradScaler whose `scaler.step(self)` is running (found on the call stack), or None."""
        frame = sys._getframe(1)
        for _ in range(32):
            if frame is None:
                break
            candidate = frame.f_locals.get("self")
            if isinstance(candidate, torch.amp.GradScaler) and id(self) in candidate._per_optimizer_states:
                return candidate
            frame = frame.f_back
        return None

    def _agree_found_inf(self) -> None:
        """Under FSDP2, make the compact buffers' inf/NaN flag the same on every rank (one scalar all-reduce).

        Each rank checks only its own shard's buffers, which the scaler never sees; a rank that skipped
        while the others stepped would leave their collectives (clip, selection, the next forward) waiting.
        """
        sharded = first_shard(self)
        if sharded is None:
            return
        import torch.distributed as dist

        device = local_tensor(sharded).device
        flag = torch.zeros((), dtype=torch.float32, device=device)
        for t in self._compact_found_inf.values():
            flag.add_(t.to(device))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=sharded.device_mesh.get_group())
        self._compact_found_inf.clear()
        self._compact_found_inf[device] = flag

    def _report_found_inf(self) -> None:
        """Add the compact buffers' inf/NaN flags to the scaler's, so that `scaler.update()` backs off
        the scale for them too (its own check saw only `.grad`) and always finds a check."""
        per_optimizer = self.grad_scaler._per_optimizer_states.get(id(self))
        if per_optimizer is None:  # a linked scaler that is not the one stepping: nothing to report to
            return
        per_device = per_optimizer["found_inf_per_device"]
        for device, flag in self._compact_found_inf.items():
            if device in per_device:
                per_device[device].add_(flag)
            else:
                per_device[device] = flag
        if not per_device:  # no `.grad` and no compact gradient this step: a clean check
            scale = self.grad_scaler._scale
            per_device[scale.device] = torch.zeros((), dtype=torch.float32, device=scale.device)

    def _amp_unscale_after_selection(self) -> None:
        """With `grad_scale`: unscale what the step reads from `.grad`, now that selection is done.

        Compact buffers gathered at selection are unscaled in place; a sparse weight in plain mode
        gets its [k] entries gathered in fp32 and unscaled there (its `.grad` is not written);
        dense groups' `.grad` are unscaled in place as GradScaler would have.
        """
        inv_scale = self._grad_inv_scale
        if inv_scale is None:
            return
        self._unscale_compact(inv_scale)
        gathered, dense = [], []
        for group in self.param_groups:
            for p in group["params"]:
                if not uses_grad(p):
                    continue
                if group["density"] >= 1.0:
                    dense.append(local_tensor(p.grad))
                elif not self.compact_grads and is_selected(self.state.get(p, {})):
                    gathered.append(self._gathered_grad(p))
        # The scaler already checked these `.grad` values.
        _unscale_(gathered + dense, inv_scale, None)
