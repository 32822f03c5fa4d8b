"""transformers `Trainer` integration, for any Trainer class (TRL's `SFTTrainer`, `DPOTrainer`, ...).

`SparseTrainerMixin` gives a Trainer class sift's behaviour: it builds a `SparseAdamW` from the Trainer's own
arguments (or takes the one given in `optimizers=`), clips the gradients the optimizer actually uses with
`sift.clip_grad_norm_` and logs their true norm, logs what it trains, and writes the fine-tune (a delta
directory), not the model, in `save_model`, checkpoints and `load_best_model_at_end`.
`sparse_trainer(SFTTrainer)` applies it over any Trainer class; `SparseTrainer` is `sparse_trainer(Trainer)`."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch

try:
    from transformers import Trainer, TrainerCallback
except ImportError as exc:  # pragma: no cover - exercised only without transformers
    raise ImportError("sift.integrations.hf needs transformers: pip install 'sift-kernels[hf]'") from exc

from sift.integrations.epochs import with_epochs
from sift.optim import SparseAdamW, clip_grad_norm_
from sift.optim.memory import resolve_memory
from sift.optim.reselection import reselect_settings
from sift.optim.state import first_shard, increments, quantized_routes
from sift.quantized import DELTA, is_quantized_linear
from sift.targets import DEFAULT_SELECTION, model_family, plan_targets, rate_advice, trainable_summary

logger = logging.getLogger(__name__)
TRAINED_VALUES = "sift_trained_values.safetensors"  # in checkpoints: the trained entries' exact values


class _ReportSkippedSteps(TrainerCallback):
    """Marks a step SparseAdamW skipped under fp16 loss scaling as skipped for accelerate.

    SparseAdamW takes GradScaler's scale itself, so `scaler.step` calls it even when it skips;
    accelerate, which counts a step as skipped only when `step()` was not called, would then
    advance the learning-rate schedule on overflow steps.
    """

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        inner = getattr(optimizer, "optimizer", None)
        if isinstance(inner, SparseAdamW) and inner.last_step_skipped and hasattr(optimizer, "_is_overflow"):
            optimizer._is_overflow = True


class _SummaryAtTrainStart(TrainerCallback):
    """Logs once, when training starts, what the optimizer trains (`sift.trainable_summary`)."""

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        inner = getattr(optimizer, "optimizer", optimizer)
        if isinstance(inner, SparseAdamW) and model is not None and state.is_world_process_zero:
            logger.warning("sift trains:\n%s", trainable_summary(model, inner))
            if (advice := rate_advice(inner)) is not None:
                logger.warning(advice)


class SparseTrainerMixin:
    """Fine-tuning with `sift.SparseAdamW` for any `transformers.Trainer` class (Trainer, TRL's
    `SFTTrainer`, `DPOTrainer`, ...): `sparse_trainer(TrainerClass)` puts it first among the bases.

    Unless `optimizers=(SparseAdamW..., None)` gives one, it trains what `SparseAdamW.for_model` trains (one plan for both): the attention projections'
    weights sparsely at `density`, the new task head densely, everything else frozen. For a model
    whose family `for_model` does not know, and without `target_modules`, it falls back (with one
    log line) to a rule by dimension: weights (two or more dimensions) sparsely, biases and norm
    scales densely unless `dense_1d=False`; so does a trainer given `indices` without
    `target_modules`. Learning rate,
    betas, eps and weight decay (with the Trainer's usual no-decay set) come from
    `TrainingArguments`; the Trainer's LR scheduler drives the optimizer unchanged.
    `max_grad_norm` clips with `sift.clip_grad_norm_`, i.e. over the entries the optimizer
    uses, which also works in `compact_grads` mode where no dense gradient is left, and that norm
    is the `grad_norm` logged. What trains is logged once when training starts
    (`sift.trainable_summary`). bf16 or fp16 on the CPU (TRL's configs default to bf16=True) trains as asked,
    with one warning when the trainer is built: that autocast is many times slower than fp32 there.
    `save_model` and checkpoints write the fine-tune (the delta directory, `SparseDelta.save_pretrained`),
    checkpoints also the optimizer state: `resume_from_checkpoint` continues bit for bit, and
    `load_best_model_at_end` puts the best checkpoint's fine-tune on the model (and `save_model` then writes
    that one).

    A model loaded in 4 or 8 bits by bitsandbytes (`quantization_config=BitsAndBytesConfig(...)`) trains a
    sparse delta over each packed target layer (`sift.quantized`), with its packed weights and every other
    param frozen: the Trainer's refusal of a quantized model without an adapter does not apply (nor TRL's
    cast of its trainable params to bf16), checkpoints keep the deltas and a resume puts them back on the
    freshly loaded packed model. Pass the model loaded, not a name with `quantization_config`.

    Args:
        *args: passed to the Trainer class.
        density: fraction of each weight's entries to train, in (0, 1].
        memory: the memory mode, as for `SparseAdamW.for_model` (`sift.optim.memory`): "low" (the
            default: hook mode and the sparse backward), "lowest" (also the update in backward, which
            the Trainer's clipping, gradient accumulation or fp16 scaling drop with a log line; the
            state stays exact, since the Trainer's checkpoints export its increments) or "plain".
            With several processes the Trainer's DDP reduces `.grad` (and accelerate's FSDP2 swaps
            the shards into the optimizer after it is built), so a preset falls back to plain mode
            there, with one log line.
        compact_grads: gradient-hook mode of `SparseAdamW` explicitly (single process only: with
            several processes use plain mode, which the Trainer's DDP handles). Under fp16
            loss scaling the optimizer is given the Trainer's scaler (`grad_scaler`), so the
            compact gradients are unscaled and checked for inf/NaN like `.grad`.
        select_steps: `SparseAdamW(select_steps=...)`.
        dense_1d: in the fallback rule by dimension, train one-dimensional params densely.
        indices: {param name: [k] sorted flat positions (or a bool mask of the param's shape)}
            to train instead of a top-|grad| choice, e.g. HiFi's
            `sift.heads.trainable_indices(model, sift.heads.select_heads(...))`. The other
            params follow `density` and `dense_1d` as usual; to train only these entries,
            freeze the rest (`requires_grad_(False)`) first. With `target_modules`, they must
            name target weights.
        target_modules: these modules' weights sparsely at `density` (default: `for_model`'s,
            the attention projections), `dense_modules` densely, everything else frozen (set
            when the optimizer is built). Weight decay applies to every trained param
            (`TrainingArguments.weight_decay`, default 0).
        dense_modules: see `target_modules` (default there: the task head).
        selection: `SparseAdamW(selection=...)`: "random" by default (`for_model`'s, the chat board's choice;
            it wants a learning rate near 1e-2 at 1%), "magnitude" for SIFT's top-|grad| (1e-3 to 3e-3).
        reselect_every, reselect_fraction, reselect_schedule, reselect_total_steps, reselect_rule,
            reselect_drop, reselect_steps: `SparseAdamW`'s periodic drop-and-grow re-selection, off by
            default (`sift.optim.reselection`, docs/reselection.md); checked before the Trainer is built.
            Checkpoints written after a re-selection resume bit for bit, as the others do.
        **kwargs: passed to the Trainer class.

    Raises:
        ValueError: density outside (0, 1], a `reselect_*` setting out of range, compact_grads with several processes,
            `indices` naming a param the model does not have (or a frozen one, or with
            `target_modules` one that is not a target weight), or `target_modules` /
            `dense_modules` that do not fit the model (see `sift.targets.plan_targets`), or a model
            given by name with a `quantization_config` (pass it loaded).

    Example (`model` a transformers model, `ds` its training dataset)::

        trainer = SparseTrainer(model=model, args=TrainingArguments("out"), train_dataset=ds,
                                density=0.01)
        trainer.train()
        trainer = SparseTrainer(model=model, args=TrainingArguments("out"), train_dataset=ds,
                                density=0.01, target_modules=["query", "key", "value"])
    """

    sift_integrated = True  # read by sift.optim.trainer_check: this class clips with sift.clip_grad_norm_

    def __init__(self, *args: Any, density: float = 0.01, memory: str = "low", compact_grads: bool | None = None,
                 select_steps: int = 1,
                 dense_1d: bool = True, indices: Mapping[str, torch.Tensor] | None = None,
                 target_modules: str | list[str] | None = None, dense_modules: str | list[str] | None = None,
                 selection: str = DEFAULT_SELECTION, reselect_every: int | None = None, reselect_fraction: float = 0.2,
                 reselect_schedule: str = "constant", reselect_total_steps: int | None = None,
                 reselect_rule: str = "spiel", reselect_drop: str = "merge", reselect_steps: int = 1,
                 **kwargs: Any) -> None:
        if not 0.0 < density <= 1.0:
            raise ValueError(f"density must be in (0, 1], got {density!r}")
        reselect = {"reselect_every": reselect_every, "reselect_fraction": reselect_fraction,
                    "reselect_schedule": reselect_schedule, "reselect_total_steps": reselect_total_steps,
                    "reselect_rule": reselect_rule, "reselect_drop": reselect_drop, "reselect_steps": reselect_steps}
        # Checked before Trainer.__init__ touches the model, as the optimizer would check them.
        reselect_settings(reselect_every, reselect_fraction, reselect_schedule, reselect_total_steps, reselect_rule,
                          reselect_drop, reselect_steps)
        model = kwargs.get("model", args[0] if args else None)
        host = model if _is_bitsandbytes_base(model) else None
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if isinstance(model, str) and (kwargs.get("quantization_config") is not None or "quantization_config" in (
                getattr(training_args, "model_init_kwargs", None) or {})):
            # TRL would load it and Trainer.__init__ refuse it before the integration sees the model.
            raise ValueError("a quantized model must be given to the integrated trainer loaded (model=AutoModelFor"
                             "CausalLM.from_pretrained(name, quantization_config=...)), not as the name "
                             f"{model!r} with quantization_config")
        given = (kwargs.get("optimizers") or (None,))[0]
        if not isinstance(model, torch.nn.Module) or isinstance(given, SparseAdamW):
            model = None  # a model id TRL loads itself (planned when the optimizer is built), or the user's plan
        # Given indices (HiFi's heads, their biases too) say what trains: they keep the rule by dimension.
        by_targets = target_modules is not None or dense_modules is not None or (
            indices is None and model is not None and model_family(model) is not None)
        if not by_targets and indices is None and model is not None:
            logger.warning("SparseTrainer: for_model does not know the attention projections of %s; training every "
                           "weight sparsely and every 1-D param densely (pass target_modules to choose)",
                           type(model).__name__)
        if by_targets and model is not None:
            # Planned now so that a bad pattern fails before Trainer.__init__ touches the model;
            # the freezing itself waits for create_optimizer (before any DDP wrapping).
            plan = plan_targets(model, target_modules=target_modules, dense_modules=dense_modules)
            not_sparse = sorted(set(indices or {}) - set(plan.sparse))
            if not_sparse:
                raise ValueError(f"indices names params that are not target weights: {not_sparse}")
        elif indices is not None and model is not None:
            # Checked before Trainer.__init__, like the other misuse, so the model is untouched.
            named = dict(model.named_parameters())
            unknown = sorted(n for n in indices if n not in named)
            frozen = sorted(n for n in indices if n in named and not named[n].requires_grad)
            if unknown or frozen:
                raise ValueError(f"indices names params the model does not train: unknown {unknown}, "
                                 f"frozen {frozen}")
        if compact_grads and training_args is not None and training_args.world_size > 1:
            # Checked before Trainer.__init__ so that nothing (device placement) touches the model.
            raise ValueError(
                f"compact_grads=True is single-process only (world_size is {training_args.world_size}): its hooks "
                "free the dense gradients that DDP reduces; use compact_grads=False with several processes"
            )
        if memory != "plain" and compact_grads is None and training_args is not None and training_args.world_size > 1:
            logger.warning("SparseTrainer: memory=%r falls back to plain mode with %d processes (the Trainer's DDP "
                           "averages .grad, which the memory modes free; under FSDP2 accelerate swaps the shards in "
                           "after the optimizer is built, which only plain mode follows)", memory,
                           training_args.world_size)
            memory = "plain"
        if memory == "lowest":
            # Its checkpoints are deltas, built from the exact state's increments; the lean state keeps none.
            logger.warning("SparseTrainer: memory='lowest' keeps the exact state (its checkpoints and save_model "
                           "export the increments, which the lean state does not keep)")
        self.sift_density = density
        self.sift_memory = memory
        self.sift_compact_grads = compact_grads
        self.sift_select_steps = select_steps
        self.sift_dense_1d = dense_1d
        self.sift_indices = dict(indices) if indices is not None else {}
        # A model not known yet (an id TRL loads) is planned by for_model's rule when the optimizer is built.
        self.sift_targets = (target_modules, dense_modules) if by_targets or (model is None and indices is None) \
            else None
        self.sift_selection = selection
        self.sift_reselect = reselect
        with _hosting_sift_delta(host):
            super().__init__(*args, **kwargs)
        _warn_cpu_autocast(type(self).__name__, self.args)
        self.add_callback(_ReportSkippedSteps())
        self.add_callback(_SummaryAtTrainStart())

    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        if self.is_fsdp_enabled and self.args.save_strategy != "no":
            # Its optimizer state would go through torch's FSDP state-dict helpers, which save SparseAdamW's
            # per-shard [k] tensors once as if replicated: a resume would be wrong. Refused before training.
            raise ValueError(
                f"SparseTrainer cannot write checkpoints under FSDP (save_strategy={self.args.save_strategy!r}): "
                "set save_strategy='no' and call trainer.save_model() at the end (the fine-tune, gathered from the "
                "shards), or checkpoint with torch.distributed.checkpoint and sift.optim.sharded.ShardedOptimizerState")
        if self.optimizer is None:
            opt_model = self.model if model is None else model
            if self.sift_targets == (None, None) and model_family(opt_model) is None:
                logger.warning("SparseTrainer: for_model does not know the attention projections of %s; training "
                               "every weight sparsely and every 1-D param densely (pass target_modules to choose)",
                               type(opt_model).__name__)
                self.sift_targets = None
            self.optimizer = (self._create_optimizer_for_targets(opt_model) if self.sift_targets is not None
                              else self._create_sparse_optimizer(opt_model))
            if getattr(self, "_sift_pending_deltas", None):  # a resume's, loaded before the optimizer existed
                self._put_pending_deltas(opt_model)
        # The scaler's unscale_ sees only .grad: the optimizer unscales its compact buffers itself
        # by this scaler's scale (see sift.optim.amp). Linked here, before any step, since the
        # Trainer may unscale without clipping.
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None and isinstance(self.optimizer, SparseAdamW):
            self.optimizer.grad_scaler = scaler
        return self.optimizer

    def _create_sparse_optimizer(self, opt_model: torch.nn.Module) -> SparseAdamW:
        decay = set(self.get_decay_parameter_names(opt_model))
        groups: dict[tuple[float, float], list[torch.Tensor]] = {}
        given: dict[torch.Tensor, torch.Tensor] = {}
        for name, p in opt_model.named_parameters():
            if not p.requires_grad:
                continue
            density = 1.0 if (self.sift_dense_1d and p.dim() < 2) else self.sift_density
            if name in self.sift_indices:
                given[p] = self.sift_indices[name]
                # Any density below 1 makes the group sparse; the given entries replace its selection.
                density = min(self.sift_density, 0.5)
            weight_decay = self.args.weight_decay if name in decay else 0.0
            groups.setdefault((density, weight_decay), []).append(p)
        flags, auto = self._memory_flags(opt_model)
        sparse_backward = flags.pop("sparse_backward")
        optimizer = SparseAdamW(
            [{"params": ps, "density": d, "weight_decay": wd} for (d, wd), ps in groups.items()],
            lr=self.args.learning_rate,
            betas=(self.args.adam_beta1, self.args.adam_beta2),
            eps=self.args.adam_epsilon,
            select_steps=self.sift_select_steps,
            selection=self.sift_selection,
            **self.sift_reselect,
            **flags,
        )
        optimizer.memory.chosen_by_preset(auto)
        for p, idx in given.items():
            optimizer.set_indices(p, idx)
        if sparse_backward:
            from sift.sparse_backward import enable_sparse_backward

            optimizer.grads.hold_sparse_backward(enable_sparse_backward(opt_model, optimizer))
        return optimizer

    def _memory_flags(self, model: torch.nn.Module) -> tuple[dict[str, Any], bool]:
        """The memory preset's flags for `model` (`resolve_memory`), given the explicit `compact_grads`, the
        exact state (the checkpoints are deltas) and the Trainer's clipping, which rules the update in backward
        out up front; and whether the first step may still drop the update in backward."""
        hints: dict[str, Any] = {"compact_grads": self.sift_compact_grads, "state": "exact"}
        if self.args.max_grad_norm:
            hints["max_grad_norm"] = self.args.max_grad_norm  # clipped by the Trainer over all weights
        return resolve_memory(self.sift_memory, model, hints)

    def _create_optimizer_for_targets(self, opt_model: torch.nn.Module) -> SparseAdamW:
        target_modules, dense_modules = self.sift_targets
        flags, auto = self._memory_flags(opt_model)
        optimizer = SparseAdamW.for_model(
            opt_model,
            density=self.sift_density,
            lr=self.args.learning_rate,
            target_modules=target_modules,
            dense_modules=dense_modules,
            selection=self.sift_selection,
            betas=(self.args.adam_beta1, self.args.adam_beta2),
            eps=self.args.adam_epsilon,
            weight_decay=self.args.weight_decay,
            select_steps=self.sift_select_steps,
            **self.sift_reselect,
            **flags,
        )
        optimizer.memory.chosen_by_preset(auto)
        params = dict(opt_model.named_parameters())
        for name, idx in self.sift_indices.items():
            optimizer.set_indices(params[name], idx)
        return optimizer

    # ------------------------------------------------------------------ the fine-tune on disk

    def _sparse_optimizer(self) -> SparseAdamW | None:
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)  # accelerate wraps it
        return optimizer if isinstance(optimizer, SparseAdamW) else None

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """Write the fine-tune, not the model: the delta directory (`SparseDelta.save_pretrained`),
        the processing class and the training arguments. Checkpoints also keep the trained entries'
        exact values (`sift_trained_values.safetensors`, 4 bytes an entry) so that a resume
        continues bit for bit where base + increment would round differently (fp32 weights)."""
        optimizer = self._sparse_optimizer()
        sharded = optimizer is not None and first_shard(optimizer) is not None
        if optimizer is None or not (self.args.should_save or sharded):
            return super()._save(output_dir, state_dict)
        from safetensors.torch import save_file

        from sift.delta import SparseDelta

        model = self.accelerator.unwrap_model(self.model)
        # Under FSDP2 every rank gathers the shards' k entries (collective); the main process writes.
        best = None if getattr(self, "_sift_checkpointing", False) else getattr(self, "_sift_best_delta", None)
        delta = best if best is not None else SparseDelta.from_optimizer(optimizer, model)
        if not self.args.should_save:
            return
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        os.makedirs(output_dir, exist_ok=True)
        delta.save_pretrained(output_dir, model)
        if getattr(self, "_sift_checkpointing", False):
            names = {p: n for n, p in model.named_parameters()}
            exact = {}
            for p, state in optimizer.state.items():
                if "indices" in state and p in names:
                    # At every position the delta holds, which the load writes: the active entries and those a
                    # re-selection (or set_indices) retired, whose increments stay in the weight.
                    positions = delta[names[p]].indices.to(p.device).long()
                    exact[f"{names[p]}.values"] = p.detach().reshape(-1)[positions].cpu().contiguous()
            for values, route in quantized_routes(optimizer).items():  # a packed layer's [k] delta, whole
                exact[f"{route.name}.{DELTA}"] = values.detach().float().cpu().contiguous()
            save_file(exact, os.path.join(output_dir, TRAINED_VALUES))
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, "training_args.bin"))

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Under FSDP2 the fine-tune is gathered from the shards' chosen entries on every rank and written
        by the main process, without the Trainer's gather of the whole model's state dict."""
        optimizer = self._sparse_optimizer()
        if optimizer is None or first_shard(optimizer) is None:
            return super().save_model(output_dir, _internal_call)
        self._save(output_dir)
        self.accelerator.wait_for_everyone()

    def train(self, *args: Any, **kwargs: Any) -> Any:
        self._sift_best_delta = None  # the fine-tune load_best_model_at_end chose; this run chooses anew
        return super().train(*args, **kwargs)

    def _save_checkpoint(self, model: torch.nn.Module, trial: Any) -> None:
        self._sift_checkpointing = True
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._sift_checkpointing = False

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: torch.nn.Module | None = None) -> None:
        """A checkpoint holding a fine-tune directory: apply its delta to the (base) model, then the
        trained entries' exact values; any other checkpoint as the Trainer loads it."""
        from sift.pretrained import CONFIG_NAME

        if not os.path.isfile(os.path.join(resume_from_checkpoint, CONFIG_NAME)):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        from safetensors.torch import load_file

        from sift.delta import SparseDelta

        model = self.model if model is None else model
        delta = SparseDelta.from_pretrained(resume_from_checkpoint)
        exact_file = os.path.join(resume_from_checkpoint, TRAINED_VALUES)
        exact = load_file(exact_file) if os.path.isfile(exact_file) else {}
        # A packed (4-bit or int8) layer's entries are its trainable delta's values, not weights to write into.
        modules = dict(model.named_modules())
        packed = {name[: -len(".weight")]: entry for name, entry in delta.entries.items()
                  if name.endswith(".weight") and is_quantized_linear(modules.get(name[: -len(".weight")]))}
        if packed:
            delta = SparseDelta({n: e for n, e in delta.entries.items() if n[: -len(".weight")] not in packed},
                                delta.base, delta.dense)
            self._sift_pending_deltas = {layer: (entry.indices, exact.pop(f"{layer}.{DELTA}", entry.values))
                                         for layer, entry in packed.items()}
            if self._sparse_optimizer() is not None:  # the best checkpoint, loaded after training
                self._put_pending_deltas(model)
        # Over the base restored by _load_best_model the same checkpoint may come back (a resume's, or an earlier
        # best): the registry of applied deltas would refuse it as already applied.
        delta.apply_(model, stack=getattr(self, "_sift_loading_best", False))
        params = dict(model.named_parameters())
        with torch.no_grad():
            for key, values in exact.items():
                name = key[: -len(".values")]
                positions = delta[name].indices.long()
                if values.numel() != positions.numel():
                    raise ValueError(f"{exact_file}: {name} has {values.numel()} exact values, its delta "
                                     f"{positions.numel()} entries (a checkpoint written after a re-selection by a "
                                     "version that saved the active entries only): resume from an earlier checkpoint")
                params[name].view(-1)[positions.to(params[name].device)] = values.to(params[name].dtype)

    def _put_pending_deltas(self, model: torch.nn.Module) -> None:
        """Write a checkpoint's packed-layer deltas into the values the optimizer trains (`sift.quantized`): a
        resume loads them before the optimizer exists, so `create_optimizer` calls this once it has built it."""
        pending = getattr(self, "_sift_pending_deltas", None) or {}
        routes = {route.name: (values, route) for values, route in
                  quantized_routes(self._sparse_optimizer()).items()}
        problems = []
        for layer, (indices, values) in pending.items():
            if layer not in routes:
                problems.append(f"{layer}: the optimizer trains no delta over it")
            elif routes[layer][0].numel() != values.numel():
                problems.append(f"{layer}: {values.numel()} entries, the optimizer trains {routes[layer][0].numel()}")
            elif routes[layer][1].indices is not None and not torch.equal(routes[layer][1].indices.cpu().long(),
                                                                          indices.long()):
                problems.append(f"{layer}: other entries than the optimizer's")
        if problems:
            raise ValueError("the checkpoint's deltas over quantized layers do not fit the optimizer: "
                             + "; ".join(problems))
        with torch.no_grad():
            for layer, (_, values) in pending.items():
                routes[layer][0].copy_(values.to(routes[layer][0].device, torch.float32))
        self._sift_pending_deltas = None

    def _load_best_model(self) -> None:
        """Put the best checkpoint's fine-tune on the model: the trained entries go back to their base values
        (kept in the optimizer's exact state), then the checkpoint loads as for a resume."""
        from sift.pretrained import CONFIG_NAME

        best = self.state.best_model_checkpoint
        optimizer = self._sparse_optimizer()
        if optimizer is None or not os.path.isfile(os.path.join(best, CONFIG_NAME)):
            return super()._load_best_model()
        from sift.delta import SparseDelta

        logger.info("Loading the best fine-tune from %s (score: %s).", best, self.state.best_metric)
        model = self.accelerator.unwrap_model(self.model)
        _restore_base(optimizer, model)
        self._sift_loading_best = True
        try:
            self._load_from_checkpoint(best, model)
        finally:
            self._sift_loading_best = False
        # save_model after this writes the best fine-tune, not the optimizer's last one.
        self._sift_best_delta = SparseDelta.from_pretrained(best)

    def _get_train_sampler(self, *args: Any, **kwargs: Any) -> Any:
        return with_epochs(super()._get_train_sampler(*args, **kwargs))  # GRPO's order, resumable past epoch 1

    def _clip_grad_norm(self, model: torch.nn.Module) -> torch.Tensor:
        # fp16 loss scaling: clip (and report) the true gradients, not the scaled ones; the
        # scaler remembers the unscale and does not repeat it in step().
        optimizer = self._sparse_optimizer()
        if optimizer is None:
            return super()._clip_grad_norm(model)
        self.accelerator.unscale_gradients()
        return clip_grad_norm_(optimizer, self.args.max_grad_norm)

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm: torch.Tensor | float | None = None):
        """Without clipping, the norm `sift.clip_grad_norm_` would clip (a bound of inf scales by exactly 1),
        not the Trainer's norm of `.grad`, which the memory modes free; none with the update in backward,
        whose gradients are gone by now."""
        optimizer = self._sparse_optimizer()
        if grad_norm is None and optimizer is not None:
            if optimizer.update_in_backward:
                return None
            self.accelerator.unscale_gradients()
            grad_norm = clip_grad_norm_(optimizer, float("inf"))
        return super()._get_grad_norm(model, grad_norm)


def _is_bitsandbytes_base(model: Any) -> bool:
    """Whether `model` is a transformers model loaded in 4 or 8 bits by bitsandbytes, whose packed layers sift
    trains as sparse deltas (`sift.quantized`)."""
    quantizer = getattr(model, "hf_quantizer", None)
    method = getattr(getattr(quantizer, "quantization_config", None), "quant_method", None)
    return (isinstance(model, torch.nn.Module) and getattr(model, "is_quantized", False)
            and str(getattr(method, "value", method)) == "bitsandbytes"
            and any(is_quantized_linear(m) for m in model.modules()))


def _warn_cpu_autocast(trainer_name: str, args: Any) -> None:
    """Warns once, when the trainer is built, that bf16/fp16 on the CPU trains under autocast, which a CPU without
    16-bit matmul instructions runs many times slower than fp32: TRL's configs turn bf16 on by default. The setting
    stays the user's (a CPU with AMX runs bf16 well, and CPU autocast is how 16-bit code is tested without a GPU)."""
    if args.device.type != "cpu" or not (args.bf16 or args.fp16):
        return
    precision = "bf16" if args.bf16 else "fp16"
    logger.warning("%s: %s=True on the CPU trains every step under %s autocast, which a CPU without 16-bit matmul "
                   "instructions runs many times slower than fp32 (SmolLM2-135M, forward and backward of 8 short "
                   "chats on a 2-core AMD EPYC: 386 s in bf16, 27-35 s in fp32). TRL's configs set bf16=True by "
                   "default: pass %s=False to train in fp32 on the CPU, or drop use_cpu=True on a GPU machine.",
                   trainer_name, precision, precision, precision)


@contextlib.contextmanager
def _hosting_sift_delta(model: torch.nn.Module | None) -> Iterator[None]:
    """While the Trainer class initialises, a bitsandbytes base passes as what it becomes once the optimizer is
    built: a frozen quantized model carrying trainable deltas.

    Trainer.__init__ refuses a quantized model without a PEFT adapter ("cannot perform fine-tuning on purely
    quantized models"): it is marked as carrying one (transformers' `_hf_peft_config_loaded`). TRL's SFTTrainer
    casts the trainable params of a quantized model to bf16 (its QLoRA recipe), which would round the base's
    16-bit weights (embeddings, norms): every param is frozen meanwhile. Both are restored on the way out; the
    optimizer then freezes and trains by its own plan.
    """
    if model is None:
        yield
        return
    marked = "_hf_peft_config_loaded" in vars(model)
    previous = vars(model).get("_hf_peft_config_loaded")
    trainable = [p for p in model.parameters() if p.requires_grad]
    model._hf_peft_config_loaded = True
    for p in trainable:
        p.requires_grad_(False)
    try:
        yield
    finally:
        if marked:
            model._hf_peft_config_loaded = previous
        else:
            del model._hf_peft_config_loaded
        for p in trainable:
            p.requires_grad_(True)


def _restore_base(optimizer: SparseAdamW, model: torch.nn.Module) -> None:
    """Write the base values back at every entry `optimizer` changed (its exact state keeps them), so that a
    checkpoint's delta can be applied onto the base. Dense params are left: a delta replaces them whole."""
    names = {p: n for n, p in model.named_parameters()}
    with torch.no_grad():
        for p, state in optimizer.state.items():
            exact = increments(state, p.numel()) if p in names else None
            if exact is None or exact[2] is None:
                continue
            idx, _, base = exact
            p.view(-1)[idx.to(p.device).long()] = base.to(p.device, p.dtype)


_INTEGRATED: dict[type, type] = {}


def sparse_trainer(trainer_cls: type[Trainer]) -> type[Trainer]:
    """`trainer_cls` with sift's fine-tuning (`SparseTrainerMixin`): the same class, taking `density`,
    `memory`, `target_modules` and the other `SparseTrainer` arguments, or a `SparseAdamW` in `optimizers=`.

    Args:
        trainer_cls: `transformers.Trainer` or a subclass of it (TRL's `SFTTrainer`, `DPOTrainer`, ...).

    Returns:
        The subclass `Sparse<Name>` (one per class: calling again returns the same one);
        `sparse_trainer(Trainer)` is `SparseTrainer`, and an integrated class comes back unchanged.

    Raises:
        TypeError: `trainer_cls` is not a `transformers.Trainer` subclass.

    Example:
        >>> from transformers import Trainer
        >>> sparse_trainer(Trainer) is SparseTrainer
        True
    """
    if not (isinstance(trainer_cls, type) and issubclass(trainer_cls, Trainer)):
        raise TypeError(f"trainer_cls must be a transformers.Trainer subclass, got {trainer_cls!r}")
    if issubclass(trainer_cls, SparseTrainerMixin):
        return trainer_cls
    if trainer_cls not in _INTEGRATED:
        name = f"Sparse{trainer_cls.__name__}"
        _INTEGRATED[trainer_cls] = type(name, (SparseTrainerMixin, trainer_cls), {
            "__module__": __name__, "__qualname__": name,
            "__doc__": f"`{trainer_cls.__name__}` with sift's fine-tuning: see `SparseTrainerMixin`."})
    return _INTEGRATED[trainer_cls]


class SparseTrainer(SparseTrainerMixin, Trainer):
    """A `transformers.Trainer` that fine-tunes with `sift.SparseAdamW` (`sparse_trainer(Trainer)`);
    arguments, behaviour and examples: `SparseTrainerMixin`."""


_INTEGRATED[Trainer] = SparseTrainer
