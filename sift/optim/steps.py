"""`SparseAdamW`'s update kernels: the fused sparse step (`sift._ops`: Triton on CUDA, C++ on CPU, the torch
reference anywhere), torch's AdamW for dense groups (a task head) and, for the [k] delta values of 4-bit and 8-bit
layers (`sift.quantized`), the lean kernel in the lean state."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from sift import _ops
from sift.optim.part import Part
from sift.optim.settings import Settings
from sift.optim.state import is_selected, local_tensor, uses_grad


class Steps(Part):
    """The update kernels: the fused sparse step of selected weights (bucketed by device, dtype and state
    layout), torch's AdamW for `density=1.0` groups, and the lean step of the quantized layers' delta values."""

    def __init__(self, opt: Any, settings: Settings) -> None:
        super().__init__(opt, settings)
        # The kernels' launch tables: a CUDA graph captured over step() reads them, so they live
        # as long as the optimizer (never in state_dict, pickles or copies).
        self.kernel_cache: dict = {}

    def lean_delta_step(self, group: dict[str, Any], params: list[torch.Tensor],
                         grads: list[torch.Tensor]) -> None:
        """The lean step of 4-bit layers' [k] delta values (bf16 moments by stochastic rounding): the
        lean kernel over each values vector as a weight whose every entry is chosen. The identity
        indices are views of one shared table per device, not state."""
        for p in params:
            self.opt.entries.start_lean_moments(p)
        by_device: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = defaultdict(list)
        for p, g in zip(params, grads):
            by_device[p.device].append((p, g))
        for device, members in by_device.items():
            _, fn = _ops.resolve("sparse_adamw_lean_", device, self.settings.backend)
            states = [self.opt.state[p] for p, _ in members]
            lows, offsets = zip(*(self.identity_lean_indices(device, p.numel()) for p, _ in members))
            state_args = (list(lows), list(offsets), [s["exp_avg"] for s in states],
                          [s["exp_avg_sq"] for s in states], [])
            self.launch_step(fn, group, device, [p.detach() for p, _ in members], [g for _, g in members],
                              state_args, [s["step"] for s in states], False)
            self.opt.reselector.stepped(p for p, _ in members)

    def identity_lean_indices(self, device: torch.device, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Lean-encoded 0..k-1: a [k] view of one int16 table per device and its [windows + 1] offsets."""
        cache = self.kernel_cache.setdefault("identity_lean_indices", {})
        table = cache.get(device)
        if table is None or table.numel() < k:
            cache[device] = table = _ops.encode_lean_indices(torch.arange(k, device=device), k)[0]
        offsets = cache.get((device, k))
        if offsets is None:
            cache[(device, k)] = offsets = _ops.encode_lean_indices(torch.arange(k, device=device), k)[1]
        return table[:k], offsets

    def dense_step(self, group: dict[str, Any]) -> None:
        """torch's own functional AdamW. With a tensor lr on CUDA it runs capturable (step
        counts on the device, no host read), so a CUDA graph can capture the whole step."""
        # A 4-bit layer's delta values train only once its entries are chosen: before that, a gradient can only be
        # the zeros DDP gives a param its backward did not reach, and stepping it would count an Adam step.
        params = [p for p in group["params"] if uses_grad(p)
                  and (p not in self.opt.grads.quantized or self.opt.grads.quantized[p].selected)]
        self.dense_update(group, params, [p.grad for p in params])

    def dense_update(self, group: dict[str, Any], params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        """AdamW on dense `params` with `grads` (4-bit layers' delta values: the lean step in the lean state)."""
        from torch.optim.adamw import adamw

        if self.settings.state_layout == "lean" and any(p in self.opt.grads.quantized for p in params):
            members = [(p, g) for p, g in zip(params, grads) if p in self.opt.grads.quantized]
            self.lean_delta_step(group, [p for p, _ in members], [g for _, g in members])
            kept = [(p, g) for p, g in zip(params, grads) if p not in self.opt.grads.quantized]
            params, grads = [p for p, _ in kept], [g for _, g in kept]
        if not params:
            return
        lr = group["lr"]
        capturable = isinstance(lr, torch.Tensor) and any(p.is_cuda for p in params)
        for p in params:
            self.opt.entries.start_dense_moments(p, capturable)
        states = [self.opt.state[p] for p in params]
        beta1, beta2 = group["betas"]
        adamw(params, grads, [s["exp_avg"] for s in states],
              [s["exp_avg_sq"] for s in states], [], [s["step"] for s in states], foreach=None,
              capturable=capturable, amsgrad=False, beta1=beta1, beta2=beta2, lr=lr,
              weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"])
        self.opt.reselector.stepped(params)

    def sparse_step(self, group: dict[str, Any]) -> None:
        buckets: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = defaultdict(list)
        for p in group["params"]:
            state = self.opt.state.get(p)
            if not state or not is_selected(state):
                continue
            if self.settings.compact_grads:
                # The hook gathered a gradient this step (and freed .grad).
                if not (p.requires_grad and p in self.opt.grads.ready):
                    continue
                grad, compact = self.opt.grads.compact[p], True
            else:
                if not uses_grad(p):
                    continue
                # clip_grad_norm_ gathered and scaled the chosen entries: the dense grad stays as it was.
                grad = self.opt.selector.clipped_grad(p)
                compact = grad is not None
                if grad is None:
                    grad = local_tensor(p.grad).contiguous()
            layout = state["indices"].dtype if "indices" in state else "lean"
            buckets[(p.device, p.dtype, layout, compact)].append((p, grad))
        for (device, dtype, layout, compact), members in buckets.items():
            self.fused_step(group, device, dtype, layout, compact, members)

    def fused_step(self, group: dict[str, Any], device: torch.device, dtype: torch.dtype, layout: Any,
                    compact: bool, members: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """One fused sparse step over `members` [(param, grad)], all on `device` in `dtype`, one layout."""
        params = [p for p, _ in members]
        grads = [g for _, g in members]
        states = [self.opt.state[p] for p in params]
        steps = [s["step"] for s in states]
        lean = layout == "lean"
        _, fn = _ops.resolve("sparse_adamw_lean_" if lean else "sparse_adamw_", device, self.settings.backend)
        if lean:
            state_args = ([s["indices_low"] for s in states], [s["window_offsets"] for s in states],
                          [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
                          [s["residual"] for s in states] if dtype != torch.float32 else [])
        else:
            state_args = ([s["indices"] for s in states], [s["exp_avg"] for s in states],
                          [s["exp_avg_sq"] for s in states], [s["delta"] for s in states],
                          [s["base"] for s in states] if "base" in states[0] else [])
        self.launch_step(fn, group, device, [local_tensor(p.detach()) for p in params], grads, state_args, steps,
                          compact)
        self.opt.reselector.stepped(params)

    def launch_step(self, fn, group: dict[str, Any], device: torch.device, params: list[torch.Tensor],
                     grads: list[torch.Tensor], state_args: tuple, steps: list[torch.Tensor], compact: bool) -> None:
        """Run one step kernel with the group's hyper-parameters; the step counts it reads are
        incremented first and taken back if the kernel raises."""
        beta1, beta2 = group["betas"]
        lr = group["lr"]
        if isinstance(lr, torch.Tensor) and lr.device != device:
            lr = lr.to(device)
        torch._foreach_add_(steps, 1.0)
        try:
            fn(params, grads, *state_args, steps, lr=lr, beta1=beta1, beta2=beta2, eps=group["eps"],
               weight_decay=group["weight_decay"], maximize=group["maximize"], compact_grads=compact,
               table_cache=self.kernel_cache)
        except BaseException:
            torch._foreach_sub_(steps, 1.0)
            raise
