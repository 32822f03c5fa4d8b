"""The `sparse_adamw_` op: one fused SparseAdamW step on the exact state, its contract and reference."""

from __future__ import annotations

import torch

from sift._ops.step import _bias_corrections, _define_step, _step_grad
from sift.triton_kernels._step_args import AdamWHyper, ExactState, check_step, takes_step_lists


# ---------------------------------------------------------------------------------------
# sparse_adamw_: one fused SparseAdamW step over a list of tensors of one device and dtype.
#
# For tensor i with k_i chosen entries (flat positions indices[i], sorted ascending):
#   g      = grads[i]              if compact_grads  ([k_i] fp32, already gathered)
#          = grads[i].view(-1)[indices[i]]         otherwise (dense grad, param's shape)
#   g      = -g if maximize
#   m      = beta1 * m + (1 - beta1) * g           (exp_avgs[i], [k_i] fp32)
#   v      = beta2 * v + (1 - beta2) * g * g       (exp_avg_sqs[i], [k_i] fp32)
#   t      = steps[i]                               (0-d fp32, already incremented)
#   w      = params[i].view(-1)[indices[i]]  (no bases: fp32 params only)
#          = bases[i] + deltas[i]            (with bases: the exact fp32 weight)
#   upd    = -lr * weight_decay * w - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
#   deltas[i] += upd                                ([k_i] fp32: total increment since selection)
#   params[i].view(-1)[indices[i]] = w + upd  (no bases) | round(bases[i] + deltas[i]) (bases)
# Entries not in indices[i] are never written. `bases` is empty or has one [k_i] tensor per
# param in the param dtype (the values at selection time): required for bf16/fp16 params,
# optional for fp32 ones (SparseAdamW's exact state always passes them).
# ---------------------------------------------------------------------------------------


@takes_step_lists(ExactState)
def sparse_adamw_ref(state: ExactState, hyper: AdamWHyper, *, table_cache: dict | None = None) -> None:
    """Plain-torch reference of one fused SparseAdamW step (see the contract above).

    Takes `(state, hyper)` through `.structured`, or the eight lists of `ExactState` and the
    keywords of `AdamWHyper` plus `compact_grads`, as every backend's entry does.
    `table_cache` (the caller's dict for a backend's launch tables) is accepted and unused.
    """
    check_step(state, hyper)
    for i, p in enumerate(state.params):
        flat = p.view(-1)
        idx = state.indices[i].long()
        g = _step_grad(state, hyper, i, idx)
        m, v, d = state.exp_avgs[i], state.exp_avg_sqs[i], state.deltas[i]
        m.mul_(hyper.beta1).add_(g, alpha=1 - hyper.beta1)
        v.mul_(hyper.beta2).addcmul_(g, g, value=1 - hyper.beta2)
        bc1, bc2 = _bias_corrections(hyper, state.steps[i])
        lr_f = hyper.lr.double() if hyper.lr_on_device else torch.tensor(float(hyper.lr), dtype=torch.float64)
        step_size = (lr_f / bc1).float().to(p.device)
        bc2_sqrt = bc2.sqrt().float().to(p.device)
        lr32 = lr_f.float().to(p.device)
        base = state.bases[i].float() if state.bases else None
        w = flat[idx].float() if base is None else base + d
        upd = -lr32 * hyper.weight_decay * w - step_size * m / (v.sqrt() / bc2_sqrt + hyper.eps)
        d.add_(upd)
        flat[idx] = w + upd if base is None else (base + d).to(p.dtype)


_define_step("sparse_adamw_", sparse_adamw_ref,
             "Tensor(a!)[] params, Tensor[] grads, Tensor[] indices, Tensor(b!)[] exp_avgs, "
             "Tensor(c!)[] exp_avg_sqs, Tensor(d!)[] deltas, Tensor[] bases, Tensor[] steps", ExactState)
