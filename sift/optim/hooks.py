"""Gradient hooks of `SparseAdamW`: `compact_grads` mode, `update_in_backward`, and averaging
across the ranks of a `process_group`.

Averaging: with a `process_group` given to the optimizer, `step()` averages every gradient it reads (the
compact buffers, the pending weights' dense gradients before selection, the dense groups' `.grad`) once.
With the default group adopted under DDP (the sparse weights were excluded from DDP before the wrap), it
averages only the params DDP ignores: DDP has already averaged the others' `.grad`.

In `compact_grads` mode a post-accumulate-grad hook on each selected sparse weight gathers
`grad[indices]` into a [k] fp32 buffer and frees the dense gradient; a sparse backward
(`sift.sparse_backward`) writes those buffers directly through `compact_grad_target`. With
`update_in_backward` the weight is stepped as soon as its [k] gradient is complete: a pre-hook on
the weight's gradient accumulator (autograd's AccumulateGrad node) runs once per backward, after
every use of the weight in the forward has sent its part (a Linear applied twice, tied embeddings
and head, shared layers), so the update sees the whole gradient. The dense part arrives as the
node's input and is gathered there, never accumulated into `.grad`; a sparse backward's part is
already in the weight's open [k] buffer.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from sift.optim.clip import clip_each_
from sift.optim.part import Part
from sift.optim.settings import Settings
from sift.optim.sharded import attach_sparse_backward, refresh_if_stale, refresh_sparse_backward, sharded_update_hook
from sift.optim.state import first_shard, is_dtensor, is_selected, local_tensor, num_entries, uses_grad


logger = logging.getLogger(__name__)


ONE_BACKWARD = ("update_in_backward=True takes one backward per step(): a second backward reached a weight before "
                "step() (gradient accumulation is not supported in this mode; use update_in_backward=False to "
                "accumulate micro-batches)")


def _gather_into(buffer: torch.Tensor, grad: torch.Tensor, indices: torch.Tensor, accumulate: bool) -> None:
    """`buffer` [k] fp32 = (or +=) `grad`'s flat values at `indices`; an fp32 gradient is gathered
    straight into the buffer, no temporary."""
    flat = local_tensor(grad).reshape(-1)
    if accumulate:
        buffer.add_(torch.index_select(flat, 0, indices))
    elif flat.dtype == torch.float32:
        torch.index_select(flat, 0, indices, out=buffer)
    else:
        buffer.copy_(torch.index_select(flat, 0, indices))


class GradRoutes(Part):
    """Where each trained weight's gradient comes from and where it waits for `step()`: the hooks of
    `compact_grads` mode, the [k] fp32 compact buffers (and the shared scratch of the update in backward),
    the 4-bit layers' delta values, and the averaging across a process group's ranks."""

    def __init__(self, opt: Any, settings: Settings) -> None:
        super().__init__(opt, settings)
        self.compact: dict[torch.Tensor, torch.Tensor] = {}  # param -> [k] fp32 gathered grad
        self.ready: set[torch.Tensor] = set()  # params whose compact grad holds this step's grad
        # update_in_backward: device -> [max k] fp32 scratch gradient shared by every weight, and
        # the sparse params a backward reached since the last step() (a second backward raises).
        self.scratch: dict[torch.device, torch.Tensor] = {}
        self.backward_seen: set[torch.Tensor] = set()
        # A second backward reached a weight not stepped in backward yet: step() refuses, before anything changes.
        self.repeated_backward = False
        # update_in_backward: the [k] gradients still receiving parts from a weight's uses (param ->
        # buffer), which weight holds each device's scratch, and each hooked param's AccumulateGrad.
        self.open: dict[torch.Tensor, torch.Tensor] = {}
        self.scratch_owner: dict[torch.device, torch.Tensor | None] = {}
        self.accumulators: dict[torch.Tensor, Any] = {}
        # 4-bit layers' sparse deltas (sift.quantized): values param -> its route, set by for_model.
        self.quantized: dict[torch.Tensor, Any] = {}
        self.hook_handles: dict[torch.Tensor, Any] = {}  # compact_grads: param -> its grad hook
        self.quantized_handles: dict[torch.Tensor, Any] = {}  # update_in_backward: 4-bit values -> pre-hook
        self.unhooked: list[torch.Tensor] = []  # compact_grads: frozen sparse params (no hook possible yet)
        self.hooks_ready = False  # until the groups exist: add_param_group then hooks a group added later
        # The default group when adopted because DDP leaves the sparse weights to this optimizer: DDP
        # averages the other params' `.grad` then, and the optimizer must not again. A copy has no process
        # group, so it has none adopted either.
        self.ddp_process_group: Any = None
        # FSDP2 with the sparse backward (`sift.optim.sharded`): each weight's plan and hooks, and whether
        # every plan is final (all entries chosen).
        self.sharded_plans: list[Any] = []
        self.sharded_plans_final = False
        self.routes: list[Any] = []  # the sparse backward's routes (`sift.sparse_backward`) to this optimizer
        self.sparse_backward_handle: Any = None  # what undoes the sparse backward `for_model` enabled
        # The ranks whose gradients are averaged (`process_group`): given, or the default group adopted under DDP.
        self.process_group: Any = None
        self.new_step()

    def new_step(self) -> None:
        """Forget what lived for one step: which pending dense grads were averaged across ranks."""
        self.averaged: set[torch.Tensor] = set()

    def carried(self) -> dict[str, Any]:
        """A copy carries the compact gradients gathered this step (the hooks are the copy's own)."""
        return {"compact": self.compact, "ready": self.ready}

    def carry(self, carried: dict[str, Any]) -> None:
        self.compact, self.ready = carried.get("compact", {}), carried.get("ready", set())

    def check_data_parallel(self, update_in_backward: bool | None = None) -> None:
        """compact_grads in a job of several processes: its compact gradients must be averaged by this
        optimizer, since DDP averages `.grad`, which this mode frees or never forms.

        When every sparse weight is excluded from DDP (`for_model` and `enable_sparse_backward` mark
        them before the model is wrapped), the optimizer averages over the default process group
        itself; otherwise (or with update_in_backward, which cannot average inside backward) it
        refuses before anything changes, since unaveraged replicas would silently drift apart.
        """
        if not self.settings.compact_grads or self.process_group is not None:
            return
        import torch.distributed as dist

        # The mode the step runs in (memory="lowest" may drop the update in backward at it); default: the optimizer's.
        update_in_backward = self.opt.memory.update_in_backward if update_in_backward is None else update_in_backward
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return
        world = dist.get_world_size()
        if update_in_backward and any(route.process_group is None for route in self.quantized.values()):
            # DDP reduces a 4-bit layer's delta gradient after its accumulator ran: stepped before that, each
            # replica would train on its own gradient.
            raise RuntimeError(f"update_in_backward=True in a job of {world} processes: the 4-bit layers' deltas would "
                               "be stepped inside backward on each rank's own gradient, before DDP averages it; use "
                               "update_in_backward=False")
        if all(is_dtensor(p) for _, p in self.opt.entries.sparse_params()):
            return  # FSDP2 reduce-scatters each shard's gradient before the hooks gather or step it
        excluded = all(getattr(p, "_ddp_ignored", False) for _, p in self.opt.entries.sparse_params())
        if excluded and not update_in_backward:
            logger.info("SparseAdamW: %d processes: averaging the compact gradients over the default process group "
                        "(the sparse weights are excluded from DDP)", world)
            self.process_group = self.ddp_process_group = dist.group.WORLD
            return
        reason = ("update_in_backward=True steps each weight inside backward, before its gradient could be averaged "
                  "across ranks: use update_in_backward=False" if update_in_backward else
                  "its compact gradients are not averaged by DistributedDataParallel, which reduces .grad. Build the "
                  "optimizer with SparseAdamW.for_model (or call sift.enable_sparse_backward) before wrapping the "
                  "model in DDP, or pass process_group=torch.distributed.group.WORLD and do not wrap the model")
        raise RuntimeError(f"compact_grads mode (hook mode, the sparse backward, update_in_backward) in a job of "
                           f"{world} processes: {reason}; or train in plain mode under DDP")

    def attach_sparse_backward(self, routes: list[Any]) -> None:
        """The sparse backward routed these layers (`sift.enable_sparse_backward`): FSDP2 weights among them get
        their cross-rank plans (`sift.optim.sharded`)."""
        self.routes.extend(routes)
        self.sharded_plans.extend(attach_sparse_backward(self.opt, routes))

    def average_over(self, process_group: Any) -> None:
        """`optimizer.process_group = group`: average what each step reads across these ranks (None: do not)."""
        self.process_group = process_group

    def hold_sparse_backward(self, handle: Any) -> None:
        """Keep what undoes the sparse backward enabled for this optimizer (`optimizer.sparse_backward_handle`)."""
        self.sparse_backward_handle = handle

    def route_quantized(self, routes: list[Any]) -> None:
        """The 4-bit and 8-bit layers' deltas this optimizer trains (`sift.quantized`), hooked for the update in
        backward."""
        self.quantized = {route.values: route for route in routes}
        self.hook_quantized()

    def recheck_plans(self) -> None:
        """Entries changed (a re-selection, or outside `step()`): the next step checks the FSDP2 plans again."""
        self.sharded_plans_final = False

    def routed(self, p: torch.Tensor) -> bool:
        """Whether the sparse backward writes p's gradient (a layer routed to this optimizer and not restored)."""
        return any(route.weight is p and not route.removed for route in self.routes)

    def after_step(self) -> None:
        """The end of every step, run or skipped: FSDP2 weights under the sparse backward rebuild their cross-rank
        plans if any rank's entries changed (one all-reduce a step, until every weight's entries are chosen)."""
        if self.sharded_plans and not self.sharded_plans_final:
            self.sharded_plans_final = refresh_if_stale(self.opt)

    def after_load(self) -> None:
        """`load_state_dict` installed other entries (every part resumed): nothing gathered so far is kept, each
        selected weight gets a fresh compact buffer, a group that turned sparse or dense is hooked again, and FSDP2
        weights under the sparse backward rebuild their plans (collective)."""
        self.compact.clear()
        self.ready.clear()
        self.forget_backwards()
        self.clear_open_buffers()
        for p, state in self.opt.state.items():
            if is_selected(state):
                self.new_compact(p, num_entries(state))
        if self.hooks_ready:
            self.sync_hooks()
        if self.sharded_plans:
            refresh_sparse_backward(self.opt)

    def drop_gathered(self) -> None:
        """`zero_grad`: the compact gradients gathered so far, and the 4-bit layers' tentative entries that came
        with them, are dropped."""
        self.ready.clear()
        for route in self.quantized.values():
            route.discard()

    def new_compact(self, p: torch.Tensor, k: int) -> None:
        """p's entries were just chosen (k of them): a zeroed [k] fp32 compact buffer where the mode keeps one (the
        update in backward gathers into its scratch instead)."""
        if self.settings.compact_grads and not self.opt.memory.update_in_backward:
            self.compact[p] = torch.zeros(k, dtype=torch.float32, device=p.device)

    def keep_compact(self, p: torch.Tensor, kept: torch.Tensor, values: torch.Tensor) -> None:
        """p's entries changed (`set_indices`): the new entries `kept` ([k] bool) take the gradient gathered at
        them before."""
        self.compact[p][kept] = values

    def gather_selected(self, p: torch.Tensor, clipped: torch.Tensor | None) -> None:
        """compact_grads, at a selection or re-selection: fill p's compact buffer from its dense grad (or the [k]
        gradient a clip gathered)."""
        compact = self.compact[p]
        if clipped is not None:
            compact.copy_(clipped)
        else:
            compact.copy_(torch.index_select(local_tensor(p.grad).reshape(-1), 0, self.opt.indices_of(p)))
        self.ready.add(p)
        if self.opt.amp.grad_inv_scale is not None:  # gathered from a `.grad` GradScaler has not unscaled
            self.opt.amp.mark_scaled(p)

    def end_step(self) -> None:
        """After a step (run or skipped): the gathered gradients, the backward marks, the open buffers (the step
        caches go with every part's `new_step`, `SparseAdamW._forget_step_caches`)."""
        self.ready.clear()
        self.forget_backwards()
        self.clear_open_buffers()
        for route in self.quantized.values():
            route.discard()

    def average_pending(self) -> None:
        """With a process group: average the pending params' dense grads across ranks (once a
        step) before anything selects from them, so every rank chooses the same entries."""
        if self.process_group is None:
            return
        for _, p in self.opt.selector.pending_with_grad() + self.opt.reselector.due_with_grad():
            if p not in self.averaged:
                self.average_across_ranks(p.grad)
                self.averaged.add(p)

    # ---------------------------------------------------------- gradient hooks

    def sync_hooks(self) -> None:
        """Give every sparse param one grad hook, and dense ones none (groups may change)."""
        sparse = [p for _, p in self.opt.entries.sparse_params()]
        sparse_ids = {id(p) for p in sparse}
        for p in [q for q in self.hook_handles if id(q) not in sparse_ids]:
            self.hook_handles.pop(p).remove()
            self.accumulators.pop(p, None)
        # torch refuses hooks on tensors that do not require grad: those get theirs when unfrozen.
        self.unhooked = []
        for p in sparse:
            if p in self.hook_handles:
                continue
            if p.requires_grad:
                self.hook_handles[p] = self.register_grad_hook(p)
            else:
                self.unhooked.append(p)

    def register_grad_hook(self, p: torch.Tensor):
        """compact_grads: a post-accumulate-grad hook on p. update_in_backward: a pre-hook on p's
        AccumulateGrad node, which autograd runs once per backward after all of p's uses."""
        if not self.opt.memory.update_in_backward:
            return p.register_post_accumulate_grad_hook(self.grad_hook)
        if is_dtensor(p):  # an FSDP2 shard: FSDP2 runs this hook once its gradient is reduce-scattered
            return p.register_post_accumulate_grad_hook(functools.partial(sharded_update_hook, self.opt))
        return self.accumulator_of(p).register_prehook(functools.partial(self.accumulator_prehook, p))

    def accumulator_of(self, p: torch.Tensor):
        with torch.enable_grad():
            accumulator = p.view_as(p).grad_fn.next_functions[0][0]
        # A tensor holds its accumulator weakly: this reference keeps the node (and its hook) the
        # one autograd uses for p in every later forward.
        self.accumulators[p] = accumulator
        return accumulator

    def hook_quantized(self) -> None:
        """update_in_backward: each 4-bit layer's [k] delta values are stepped from a pre-hook on
        their AccumulateGrad node, so at most one layer's [k] gradient is alive at a time."""
        if not self.opt.memory.update_in_backward:
            return
        for values in self.quantized:
            if values not in self.quantized_handles:
                self.quantized_handles[values] = self.accumulator_of(values).register_prehook(
                    functools.partial(self.quantized_prehook, values))

    # The gradient hooks run from the eager backward, also when a training step is compiled whole
    # (`.backward()` breaks the graph there): dynamo tracing their Python state would only add graphs.
    @torch.compiler.disable
    @torch.no_grad()
    def quantized_prehook(self, p: torch.Tensor, grad_inputs: tuple[torch.Tensor | None, ...]):
        """update_in_backward: a 4-bit layer's delta values have their whole gradient (every use has
        sent its part); once the layer's entries are chosen, step them now and keep no `.grad`.
        Before that the gradient accumulates as in plain mode and `step()` commits the selection."""
        grad = grad_inputs[0]
        if grad is None:
            return None
        # A layer re-selecting this step takes its gradient at the new entries: step() moves the values first.
        selected = self.gathers_entries(p)
        self.mark_backward(p, selected)
        if not selected or not p.requires_grad:
            return None
        if self.settings.max_grad_norm is not None:
            grad = grad.clone()  # clipped on its own, as every weight stepped in backward
            clip_each_([grad], self.settings.max_grad_norm)
        self.opt.steps.dense_update(self.opt.entries.group_of(p), [p], [grad])
        return (None,)

    def hook_unfrozen(self) -> None:
        """compact_grads: hook the sparse params unfrozen since the last step."""
        for p in [q for q in self.unhooked if q.requires_grad]:
            self.unhooked.remove(p)
            self.hook_handles[p] = self.register_grad_hook(p)
            if self.opt.memory.update_in_backward:
                continue  # a gradient that arrived before the hook is dense: step() selects from it
            # This step's gradient arrived before the hook existed: gather (and free) it now.
            self.grad_hook(p)
            if self.opt.amp.dense_grads_unscaled():  # scaler.unscale_ saw it as a `.grad`
                self.opt.amp.mark_unscaled(p)

    def install_hooks(self) -> None:
        """From now on every sparse param has its grad hook, a group added later included (`sync_hooks`)."""
        self.hooks_ready = True
        self.sync_hooks()

    def remove_hooks(self) -> None:
        """See `SparseAdamW.remove_hooks`."""
        for handle in self.hook_handles.values():
            handle.remove()
        self.hook_handles.clear()
        for handle in self.quantized_handles.values():
            handle.remove()
        self.quantized_handles.clear()
        self.accumulators.clear()
        self.unhooked = []
        self.hooks_ready = False

    @torch.compiler.disable
    @torch.no_grad()
    def grad_hook(self, p: torch.Tensor) -> None:
        grad = p.grad
        if grad is None:
            return
        if grad.is_sparse:
            raise ValueError("sparse-layout gradients are not supported; use dense gradients")
        if not self.gathers_entries(p):
            # Not selected yet (or re-selecting at the next step): the dense gradient accumulates as in plain
            # mode and `step()` selects from it, so micro-batches and skipped steps count exactly as there.
            return
        _gather_into(self.compact[p], grad, self.opt.indices_of(p), accumulate=p in self.ready)
        self.ready.add(p)
        self.opt.amp.mark_scaled(p)  # as GradScaler scaled the loss; unscaled once, before the step
        p.grad = None

    def average_across_ranks(self, tensor: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        world = dist.get_world_size(self.process_group)
        if world > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.process_group)
            tensor.div_(world)
        return tensor

    def reduced_by_ddp(self, p: torch.Tensor) -> bool:
        """Whether DDP already averaged p's `.grad`: the optimizer adopted the default group because DDP
        ignores the sparse weights, and DDP does not ignore p (a dense head, a 4-bit layer's delta)."""
        adopted = self.ddp_process_group
        return adopted is not None and self.process_group is adopted and not getattr(p, "_ddp_ignored", False)

    def sync_grads(self) -> None:
        """compact_grads + process_group: average what this step uses across ranks, once a step.

        Every rank must have run backward over the same params (as with DDP).
        """
        if self.process_group is None:
            return
        for group in self.opt.param_groups:
            for p in group["params"]:
                if p in self.averaged:
                    continue
                if group["density"] >= 1.0:
                    if uses_grad(p) and not self.reduced_by_ddp(p):
                        self.average_across_ranks(p.grad)
                        self.averaged.add(p)
                elif p in self.ready:
                    self.average_across_ranks(self.compact[p])
                    self.averaged.add(p)

    def agreement_group(self) -> tuple[Any, torch.device | None]:
        """The ranks that take each step's decisions together, and the device of their agreement: the process
        group (given, or adopted under DDP), else an FSDP2 mesh's; (None, None) for one process."""
        if self.process_group is not None:
            first = next((p for group in self.opt.param_groups for p in group["params"]), None)
            return self.process_group, local_tensor(first).device if first is not None else torch.device("cpu")
        sharded = first_shard(self.opt)
        if sharded is None:
            return None, None
        return sharded.device_mesh.get_group(), local_tensor(sharded).device

    def hook_new_params(self) -> None:
        """compact_grads: hook sparse params unfrozen since the last step."""
        if self.unhooked:
            self.hook_unfrozen()

    def compact_grad_target(self, param: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """See `SparseAdamW.compact_grad_target`."""
        if not self.settings.compact_grads or not self.gathers_entries(param):
            return None
        if self.opt.memory.update_in_backward:
            # Each use adds its part; the accumulator's pre-hook steps once all uses have.
            indices = self.opt.indices_of(param)
            return indices, self.open_buffer(param, indices.numel())
        buffer = self.compact[param]
        if param not in self.ready:
            buffer.zero_()
            self.ready.add(param)
        self.opt.amp.mark_scaled(param)
        return self.opt.indices_of(param), buffer

    # ----------------------------------------------------- update in backward

    @torch.compiler.disable
    @torch.no_grad()
    def accumulator_prehook(self, p: torch.Tensor, grad_inputs: tuple[torch.Tensor | None, ...]):
        """update_in_backward: p's AccumulateGrad node is about to run, so every use of p in this
        backward has contributed (its dense part is `grad_inputs[0]`, a sparse backward's part is in
        p's open buffer). Step p on the whole gradient and let no dense gradient accumulate."""
        grad = grad_inputs[0]
        buffer = self.open.get(p)
        if grad is None and buffer is None:
            return None
        if grad is not None and grad.is_sparse:
            raise ValueError("sparse-layout gradients are not supported; use dense gradients")
        selected = self.gathers_entries(p)
        self.mark_backward(p, selected)
        if (not selected and grad is not None and buffer is None and self.process_group is None
                and self.opt.reselector.is_due(p)):
            # Its whole gradient of the step's one backward: re-selected and stepped now, so that no two weights'
            # dense gradients live at once (one process: nothing is averaged later).
            self.opt.reselector.reselect_in_backward(p, grad)
            return (None,)
        if not selected:
            return None  # accumulated as in plain mode: the selection in step() reads it
        if grad is not None:
            indices = self.opt.indices_of(p)
            accumulate = buffer is not None  # a sparse backward's part is already there
            if buffer is None:
                buffer = self.open_buffer(p, indices.numel(), zero=False)
            _gather_into(buffer, grad, indices, accumulate)
        try:
            self.update_now(p, buffer)
        finally:
            self.close_buffer(p)
        return (None,)

    def open_buffer(self, p: torch.Tensor, k: int, zero: bool = True) -> torch.Tensor:
        """p's [k] fp32 gradient for this backward, open until its accumulator's pre-hook steps it.

        The device's scratch when no other weight holds it (a weight used once is stepped right after
        its layer's backward, so one buffer serves every such weight); a buffer of its own while
        another weight's uses are still arriving (shared layers).
        """
        buffer = self.open.get(p)
        if buffer is not None:
            return buffer
        if self.scratch_owner.get(p.device) is None:
            buffer = self.scratch_for(p, k)
            self.scratch_owner[p.device] = p
        else:
            buffer = torch.empty(k, dtype=torch.float32, device=p.device)
        if zero:
            buffer.zero_()
        self.open[p] = buffer
        return buffer

    def close_buffer(self, p: torch.Tensor) -> None:
        self.open.pop(p, None)
        if self.scratch_owner.get(p.device) is p:
            self.scratch_owner[p.device] = None

    def clear_open_buffers(self) -> None:
        """Forget open gradients (end of a step, a load, a copy)."""
        self.open = {}
        self.scratch_owner = {}

    def mark_backward(self, p: torch.Tensor, selected: bool = True) -> None:
        """update_in_backward: record that a backward reached `p`. A second one before step() raises at once for
        a weight stepped in backward; for one that is not (before its selection) `step()` refuses instead, before
        anything changes, so that the backward completes (an error inside it would leave FSDP2's layers
        unsharded). With the update in backward from `memory="lowest"`, the first step drops it instead
        (micro-batches accumulate)."""
        if p in self.backward_seen:
            if self.opt.memory.auto and not selected:
                self.opt.memory.saw_accumulation()
                return
            if not selected:
                self.repeated_backward = True
                return
            raise RuntimeError(ONE_BACKWARD)
        self.backward_seen.add(p)

    def forget_backwards(self) -> None:
        """A new step (or a load, or a mode dropped): no backward has reached any weight."""
        self.backward_seen.clear()
        self.repeated_backward = False

    def check_one_backward(self) -> None:
        """update_in_backward: refuse a step after several backwards (`mark_backward`), before anything changes."""
        if self.repeated_backward:
            raise RuntimeError(ONE_BACKWARD)

    def scratch_for(self, p: torch.Tensor, k: int) -> torch.Tensor:
        """A [k] fp32 view of p's device's scratch gradient, grown to the largest k selected there."""
        buffer = self.scratch.get(p.device)
        if buffer is None or buffer.numel() < k:
            states = self.opt.state.items()
            largest = max((num_entries(s) for q, s in states if q.device == p.device and is_selected(s)), default=k)
            buffer = torch.empty(max(k, largest), dtype=torch.float32, device=p.device)
            self.scratch[p.device] = buffer
        return buffer[:k]

    def gather_scratch(self, p: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """grad[indices] of selected p, in fp32, into the scratch buffer."""
        indices = self.opt.indices_of(p)
        compact = self.scratch_for(p, indices.numel())
        _gather_into(compact, grad, indices, accumulate=False)
        return compact

    def update_now(self, p: torch.Tensor, compact: torch.Tensor, clip: bool = True) -> None:
        """Clip p's [k] compact gradient on its own (max_grad_norm, unless `clip` is False: done already) and
        run p's fused step at once."""
        if not p.requires_grad:
            return
        if clip and self.settings.max_grad_norm is not None:
            clip_each_([compact], self.settings.max_grad_norm)
        layout = "lean" if "indices_low" in self.opt.state[p] else self.opt.state[p]["indices"].dtype
        self.opt.steps.fused_step(self.opt.entries.group_of(p), p.device, p.dtype, layout, True, [(p, compact)])

    def gathers_entries(self, p: torch.Tensor) -> bool:
        """Whether this backward keeps p's gradient at its chosen entries only, where the mode does: its entries
        (a 4-bit layer's delta's: its route's) are chosen and its next step does not re-select them (that step reads
        the dense gradient)."""
        route = self.quantized.get(p)
        selected = route.selected if route is not None else is_selected(self.opt.state.get(p, {}))
        return selected and not self.opt.reselector.is_due(p)

    def compact_grad(self, param: torch.Tensor) -> torch.Tensor | None:
        """The gradient this step will use for a selected sparse param, as [k] values. (`SparseAdamW.compact_grad`)."""
        state = self.opt.state.get(param, {})
        if not is_selected(state):
            return None
        if self.settings.compact_grads:
            return self.compact[param] if param in self.ready else None
        if param.grad is None:
            return None
        clipped = self.opt.selector.clipped_grad(param)
        if clipped is not None:
            return clipped
        # index_select takes the int32 indices as they are: no int64 copy on every clip.
        return torch.index_select(local_tensor(param.grad).reshape(-1), 0, self.opt.indices_of(param))

