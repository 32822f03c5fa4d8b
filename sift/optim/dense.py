"""`SparseAdamW`'s dense steps: torch's AdamW for dense groups (a task head) and, for the [k] delta values of
4-bit and 8-bit layers (`sift.quantized`), the lean kernel in the lean state."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from sift import _ops
from sift.optim.state import uses_grad


class DenseStepMixin:
    """Dense AdamW of `density=1.0` groups, and the quantized layers' delta values."""

    def _lean_delta_step(self, group: dict[str, Any], params: list[torch.Tensor],
                         grads: list[torch.Tensor]) -> None:
        """The lean step of 4-bit layers' [k] delta values (bf16 moments by stochastic rounding): the
        lean kernel over each values vector as a weight whose every entry is chosen. The identity
        indices are views of one shared table per device, not state."""
        for p in params:
            state = self.state[p]
            if "exp_avg" not in state:
                state["exp_avg"] = torch.zeros(p.numel(), dtype=torch.bfloat16, device=p.device)
                state["exp_avg_sq"] = torch.zeros(p.numel(), dtype=torch.bfloat16, device=p.device)
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        by_device: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = defaultdict(list)
        for p, g in zip(params, grads):
            by_device[p.device].append((p, g))
        for device, members in by_device.items():
            _, fn = _ops.resolve("sparse_adamw_lean_", device, self.backend)
            states = [self.state[p] for p, _ in members]
            lows, offsets = zip(*(self._identity_lean_indices(device, p.numel()) for p, _ in members))
            state_args = (list(lows), list(offsets), [s["exp_avg"] for s in states],
                          [s["exp_avg_sq"] for s in states], [])
            self._launch_step(fn, group, device, [p.detach() for p, _ in members], [g for _, g in members],
                              state_args, [s["step"] for s in states], False)

    def _identity_lean_indices(self, device: torch.device, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Lean-encoded 0..k-1: a [k] view of one int16 table per device and its [windows + 1] offsets."""
        cache = self._kernel_cache.setdefault("identity_lean_indices", {})
        table = cache.get(device)
        if table is None or table.numel() < k:
            cache[device] = table = _ops.encode_lean_indices(torch.arange(k, device=device), k)[0]
        offsets = cache.get((device, k))
        if offsets is None:
            cache[(device, k)] = offsets = _ops.encode_lean_indices(torch.arange(k, device=device), k)[1]
        return table[:k], offsets

    def _dense_step(self, group: dict[str, Any]) -> None:
        """torch's own functional AdamW. With a tensor lr on CUDA it runs capturable (step
        counts on the device, no host read), so a CUDA graph can capture the whole step."""
        # A 4-bit layer's delta values train only once its entries are chosen: before that, a gradient can only be
        # the zeros DDP gives a param its backward did not reach, and stepping it would count an Adam step.
        params = [p for p in group["params"] if uses_grad(p)
                  and (p not in self._quantized or self._quantized[p].selected)]
        self._dense_update(group, params, [p.grad for p in params])

    def _dense_update(self, group: dict[str, Any], params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        """AdamW on dense `params` with `grads` (4-bit layers' delta values: the lean step in the lean state)."""
        from torch.optim.adamw import adamw

        if self.state_layout == "lean" and any(p in self._quantized for p in params):
            members = [(p, g) for p, g in zip(params, grads) if p in self._quantized]
            self._lean_delta_step(group, [p for p, _ in members], [g for _, g in members])
            kept = [(p, g) for p, g in zip(params, grads) if p not in self._quantized]
            params, grads = [p for p, _ in kept], [g for _, g in kept]
        if not params:
            return
        lr = group["lr"]
        capturable = isinstance(lr, torch.Tensor) and any(p.is_cuda for p in params)
        for p in params:
            state = self.state[p]
            if "exp_avg" not in state:  # a 4-bit delta's state holds its indices before its moments
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if capturable else "cpu")
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            elif capturable and state["step"].device != p.device:
                state["step"] = state["step"].to(p.device)
        states = [self.state[p] for p in params]
        beta1, beta2 = group["betas"]
        adamw(params, grads, [s["exp_avg"] for s in states],
              [s["exp_avg_sq"] for s in states], [], [s["step"] for s in states], foreach=None,
              capturable=capturable, amsgrad=False, beta1=beta1, beta2=beta2, lr=lr,
              weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"])

