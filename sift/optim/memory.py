"""The memory presets of `SparseAdamW.for_model` and `SparseTrainer`: one argument for the four flags.

    memory="low"     (the default) hook mode and the sparse backward: after selection no dense
                     weight gradient is formed or kept, only each weight's [k] fp32 gradient; plain
                     mode's result (accumulation, clipping, GradScaler, checkpointing, DDP when
                     `for_model` runs before the wrap), as the contract below says
    memory="lowest"  "low" plus `state="lean"` (at most about 8 bytes per entry: bf16 moments by
                     stochastic rounding, not bit-identical to the exact state) and
                     `update_in_backward=True` (each weight stepped inside backward, so no [k]
                     gradient outlives its layer)
    memory="plain"   dense gradients, as `SparseAdamW(params)`

What "plain mode's result" means, by weight dtype. fp32 weights: hook mode reads plain mode's gradient
bits, micro-batches included (both sum them in fp32, in the same order); the sparse backward sums each
entry over tokens in another order than the dense matmul, so up to float rounding. bf16/fp16 weights:
plain mode rounds each micro-batch's gradient to the weight's dtype and sums the micro-batches in it
(`.grad`); hook mode sums the same micro-batch gradients in fp32, and the sparse backward also forms
each one in fp32. Not the same bits, but at least as accurate: over n micro-batch gradients g_1..g_n of an
entry, hook mode's sum is within (n - 1) * 2**-24 * sum|g_i| of their exact sum, plain mode's within
(n - 1) * u * sum|g_i| (u = 2**-8 for bf16, 2**-11 for fp16), and for two micro-batches it is never
farther from it, entry by entry. Against the true (fp64) gradient both keep the rounding of each
micro-batch's 16-bit gradient (not the sparse backward, within fp32's dot-product bound of it) and hook
mode adds none of the sum: the norm of its error is at most plain mode's in the tests
(tests/test_mode_equivalence.py pins each of these).

A flag given explicitly (`compact_grads`, `sparse_backward`, `state`, `update_in_backward`) wins over
the preset. Where a preset's mode cannot apply, it is dropped with one log line rather than refused:
a model already wrapped in DDP trains in plain mode; the update in backward is dropped under
`max_grad_norm` (it would clip each tensor on its own), with a `grad_scaler`, with several
processes, with FSDP2's sparse backward, and, found on the first step, when micro-batches
accumulate or a GradScaler drives the step. Explicit flags keep their errors.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from sift.optim.part import Part
from sift.optim.settings import Settings
from sift.optim.state import is_selected

logger = logging.getLogger("sift")

MEMORY_MODES = ("low", "lowest", "plain")
FLAGS = ("compact_grads", "sparse_backward", "state", "update_in_backward")
_PRESETS = {
    "plain": dict(compact_grads=False, sparse_backward=False, state="exact", update_in_backward=False),
    "low": dict(compact_grads=True, sparse_backward=True, state="exact", update_in_backward=False),
    "lowest": dict(compact_grads=True, sparse_backward=True, state="lean", update_in_backward=True),
}


def _several_processes() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def resolve_memory(memory: str, model: torch.nn.Module, kwargs: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """The optimizer flags `memory` stands for on `model`, with the explicit ones in `kwargs` over them.

    Args:
        memory: "low", "lowest" or "plain".
        model: the model `for_model` is about to plan (checked for a DDP wrap and FSDP2 params).
        kwargs: the caller's optimizer arguments; the explicit flags among them are kept as given.

    Returns:
        (flags for `compact_grads`, `sparse_backward`, `state`, `update_in_backward`; whether the update in
        backward came from the preset, so that the first step may still drop it).

    Raises:
        ValueError: `memory` is not one of `MEMORY_MODES`, or a compact mode asked for explicitly on a model
            already wrapped in DistributedDataParallel.

    Example:
        >>> flags, _ = resolve_memory("low", torch.nn.Linear(4, 4), {})
        >>> flags["compact_grads"], flags["sparse_backward"], flags["state"]
        (True, True, 'exact')
    """
    if memory not in MEMORY_MODES:
        raise ValueError(f"memory must be one of {', '.join(repr(m) for m in MEMORY_MODES)}, got {memory!r}")
    explicit = {key: kwargs[key] for key in FLAGS if kwargs.get(key) is not None}
    preset = dict(_PRESETS[memory])
    if explicit.get("update_in_backward") or explicit.get("sparse_backward"):
        preset["compact_grads"] = True  # both run in compact_grads mode's hooks
    if explicit.get("compact_grads") is False:
        preset.update(sparse_backward=False, update_in_backward=False)
    chosen = {key: explicit.get(key, preset[key]) for key in FLAGS}

    def drop(keys: tuple[str, ...], why: str) -> None:
        """Turn the preset's `keys` off, with one log line naming those that were on."""
        dropped = [key for key in keys if key not in explicit and chosen[key]]
        for key in dropped:
            chosen[key] = False
        if dropped:
            logger.warning("sift: memory=%r without %s: %s", memory, ", ".join(dropped), why)

    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        asked = [key for key in ("sparse_backward", "update_in_backward", "compact_grads") if explicit.get(key)]
        if asked:
            raise ValueError(f"{asked[0]}=True on a model already wrapped in DistributedDataParallel, which averages "
                             ".grad, but this mode frees or never forms it: build the optimizer (SparseAdamW.for_model) "
                             "on the unwrapped model before wrapping it in DDP, and wrap it in DDP afterwards "
                             "(sift.wrap_ddp), or train in plain mode under DDP")
        drop(("update_in_backward", "sparse_backward", "compact_grads"),
             "the model is already wrapped in DistributedDataParallel (call for_model before wrapping it)")
    if kwargs.get("max_grad_norm") is not None:
        drop(("update_in_backward",), "max_grad_norm clips over all weights, which cannot wait for one inside backward")
    if kwargs.get("grad_scaler") is not None:
        drop(("update_in_backward",), "a GradScaler may skip a step that backward would already have applied")
    if _several_processes():
        drop(("update_in_backward",), "several processes average each gradient before it can be applied")
    if chosen["sparse_backward"] and any(type(p).__name__ == "DTensor" for p in model.parameters()):
        drop(("update_in_backward",), "FSDP2's sparse backward reduces each weight's gradient per use")
    auto = bool(chosen["update_in_backward"]) and "update_in_backward" not in explicit
    return chosen, auto


class MemoryPolicy(Part):
    """`SparseAdamW`'s side of `memory="lowest"`: the first step may still drop the update in backward."""

    def __init__(self, opt: Any, settings: Settings) -> None:
        super().__init__(opt, settings)
        self.update_in_backward = False  # `optimizer.update_in_backward`, given at build (`start`)
        # memory="lowest" chose the update in backward: the first step may still drop it. Saved in state_dict.
        self.auto = False
        self.accumulation_seen = False  # a second backward before the first step (micro-batches)

    def start(self, update_in_backward: bool) -> None:
        """The optimizer's constructor: whether weights are stepped inside backward."""
        self.update_in_backward = update_in_backward

    def chosen_by_preset(self, auto: bool) -> None:
        """Whether the update in backward came from memory="lowest" (`resolve_memory`), so that the first step may
        still drop it; explicit flags stay as given."""
        self.auto = auto

    def saw_accumulation(self) -> None:
        """A second backward reached a weight before the first step: micro-batches accumulate."""
        self.accumulation_seen = True

    def decided(self) -> bool:
        """Whether entries are chosen (anything may have been stepped in backward): memory="lowest"'s choice is
        final from then on."""
        return any(is_selected(self.opt.state.get(p, {})) for _, p in self.opt.entries.sparse_params()) or any(
            route.selected for route in self.opt.grads.quantized.values())

    def drop_reason(self, global_clip: bool = False) -> str | None:
        """Why `settle` would drop the update in backward now, or None when it keeps it; changes nothing (so
        that `step()` checks everything in the mode it will run in before `settle` acts)."""
        if not self.auto or self.decided():
            return None
        if global_clip:
            return "sift.clip_grad_norm_ needs every gradient before any is applied"
        if self.accumulation_seen:
            return "micro-batches accumulate before each step"
        if getattr(self.opt, "grad_scale", None) is not None or getattr(self.opt, "found_inf", None) is not None or \
                self.opt.amp.scaler is not None:
            return "a GradScaler may skip a step that backward would already have applied"
        return None

    def settle(self, global_clip: bool = False) -> None:
        """memory="lowest": on the steps before anything is selected (nothing was stepped in backward yet),
        drop the update in backward with one log line if micro-batches accumulated, a GradScaler drives
        the step or `sift.clip_grad_norm_` clips by the global norm (`global_clip`); once entries are chosen,
        the choice is final (a later misuse raises)."""
        if not self.auto:
            return
        if self.decided():
            self.auto = False
            return
        why = self.drop_reason(global_clip)
        self.accumulation_seen = False
        if why is not None:
            self.drop_update_in_backward(why)

    def drop_update_in_backward(self, why: str) -> None:
        """Leave the update in backward for compact_grads' hooks, with one log line saying why."""
        logger.warning("sift: memory='lowest' without update_in_backward: %s", why)
        self.auto = False
        self.update_in_backward = False
        self.opt.grads.forget_backwards()
        self.opt.grads.remove_hooks()
        self.opt.grads.install_hooks()  # compact_grads' own hooks; remove_hooks took the 4-bit deltas' pre-hooks too

    def saved(self) -> dict[str, bool]:
        """What `state_dict` records of the mode: whether the update in backward is on, and whether that is
        still undecided (memory="lowest" before its first step)."""
        return {"update_in_backward": self.update_in_backward,
                "update_in_backward_auto": self.auto}

    def carried(self) -> dict[str, bool]:
        """A copy carries the mode and `memory="lowest"`'s decision as it stands."""
        return {"auto": self.auto, "update_in_backward": self.update_in_backward}

    def carry(self, carried: dict[str, bool]) -> None:
        self.auto = carried.get("auto", False)
        self.update_in_backward = carried.get("update_in_backward", False)

    def resume(self, saved: dict[str, Any]) -> None:
        """load_state_dict: where memory="lowest" chose this optimizer's update in backward, continue as the
        saved run had decided (it may have dropped it at its first step); explicit flags stay as given."""
        if not self.auto or "update_in_backward" not in saved:
            return
        if saved.get("update_in_backward_auto", False):
            return  # saved before its first step: undecided there too
        if saved["update_in_backward"]:
            self.auto = False  # kept by the saved run: final here too
        else:
            self.drop_update_in_backward("the state_dict comes from a run that dropped it")
