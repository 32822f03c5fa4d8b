"""SparseAdamW inside real training set-ups: the transformers Trainer and data parallelism."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import sift
from conftest import gloo_rank
from sift import SparseAdamW, SparseDelta


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(8, 12, generator=gen), torch.randint(0, 3, (8,), generator=gen)


def _single_process(steps: int) -> list[torch.Tensor]:
    model = _model()
    opt = SparseAdamW(model.parameters(), lr=1e-2, density=0.2, max_grad_norm=0.5)
    for step in range(steps):
        x, y = _data(step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _train_on_shard(net, opt, rank: int, world: int, steps: int, data=None) -> None:
    """Each rank trains on its contiguous slice of the same batches (`data(step)`, default `_data`)."""
    for step in range(steps):
        x, y = (data or _data)(step)
        n = x.shape[0]
        shard = slice(rank * n // world, (rank + 1) * n // world)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x[shard]), y[shard]).backward()
        opt.step()


@gloo_rank
def _worker(rank: int, world: int, mode: str, steps: int, out: str) -> None:
    model = _model()
    if mode == "ddp-plain":
        net = torch.nn.parallel.DistributedDataParallel(model)
        opt = SparseAdamW(model.parameters(), lr=1e-2, density=0.2, max_grad_norm=0.5)
    else:
        net = model
        opt = SparseAdamW(model.parameters(), lr=1e-2, density=0.2, max_grad_norm=0.5, compact_grads=True,
                          process_group=dist.group.WORLD)
        if mode == "sparse-backward-process-group":
            sift.enable_sparse_backward(model, opt)
    _train_on_shard(net, opt, rank, world, steps)
    if rank == 0:
        torch.save([p.detach().clone() for p in model.parameters()], out)


@pytest.mark.parametrize("mode", ["ddp-plain", "hook-process-group", "sparse-backward-process-group"])
def test_two_ranks_equal_one_process_on_the_full_batch(tmp_path, mode):
    steps = 4
    out = str(tmp_path / "params.pt")
    mp.spawn(_worker, args=(2, str(tmp_path / "init"), mode, steps, out), nprocs=2, join=True)
    got = torch.load(out, weights_only=True)
    for a, b in zip(got, _single_process(steps)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _three_layers() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 3))


def _for_model_three_layers(model, mode: str) -> SparseAdamW:
    kwargs = {"hook": dict(compact_grads=True), "sparse-backward": dict(sparse_backward=True)}[mode]
    return SparseAdamW.for_model(model, density=0.2, lr=1e-2, target_modules=["0", "2"], dense_modules=["4"],
                                 max_grad_norm=0.5, **kwargs)


def _data_of_12(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """12 samples a step: they split evenly over 1, 2 and 3 ranks."""
    gen = torch.Generator().manual_seed(step)
    return torch.randn(12, 12, generator=gen), torch.randint(0, 3, (12,), generator=gen)


@gloo_rank
def _ddp_compact_worker(rank: int, world: int, mode: str, steps: int, out: str) -> None:
    model = _three_layers()
    opt = _for_model_three_layers(model, mode)  # before the wrap: it leaves the sparse weights to the optimizer
    net = torch.nn.parallel.DistributedDataParallel(model)
    _train_on_shard(net, opt, rank, world, steps, _data_of_12)
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    state.update({f"{n}.indices": opt.indices_of(p) for n, p in model.named_parameters()
                  if "indices" in opt.state.get(p, {})})
    torch.save(state, f"{out}.{rank}")


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("mode", ["hook", "sparse-backward"])
def test_ddp_wrapped_compact_modes_equal_one_process_on_the_full_batch(tmp_path, mode, world):
    """Built with for_model before the DDP wrap, hook mode and the sparse backward train under DDP without a
    process_group: the replicas stay identical and equal one process on the whole batch."""
    steps = 4
    out = str(tmp_path / "params")
    mp.spawn(_ddp_compact_worker, args=(world, str(tmp_path / "init"), mode, steps, out), nprocs=world, join=True)
    model = _three_layers()
    _train_on_shard(model, _for_model_three_layers(model, mode), 0, 1, steps, _data_of_12)
    ranks = [torch.load(f"{out}.{rank}", weights_only=True) for rank in range(world)]
    for name, p in model.named_parameters():
        for rank, got in enumerate(ranks):
            torch.testing.assert_close(got[name], p.detach(), rtol=1e-5, atol=1e-6, msg=f"rank {rank} {name}")
            assert torch.equal(got[name], ranks[0][name]), f"rank {rank} drifted from rank 0 at {name}"
    assert "0.weight.indices" in ranks[0] and all(torch.equal(r["0.weight.indices"], ranks[0]["0.weight.indices"])
                                                  for r in ranks)


@gloo_rank
def _fsdp_worker(rank: int, world: int, steps: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model()
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    opt = SparseAdamW(model.parameters(), lr=1e-2, density=0.2, max_grad_norm=0.5)
    _train_on_shard(model, opt, rank, world, steps)
    local = [(p.to_local().detach().clone(), opt.state[p]["indices"].clone()) for p in model.parameters()]
    torch.save(local, f"{out}.{rank}")


def test_fsdp2_shards_train_like_one_process_on_their_entries(tmp_path):
    """FSDP2 (DTensor params): each rank takes its shard's part of the whole weight's top-k and steps on
    it (plain mode)."""
    pytest.importorskip("torch.distributed.fsdp")
    steps, world = 4, 2
    out = str(tmp_path / "params")
    mp.spawn(_fsdp_worker, args=(world, str(tmp_path / "init"), steps, out), nprocs=world, join=True)
    shards = [torch.load(f"{out}.{r}", weights_only=True) for r in range(world)]
    model = _model()
    x, y = _data(0)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    for i, p in enumerate(model.parameters()):  # the ranks' entries together: the whole weight's top-k
        offset, chosen = 0, []
        for r in range(world):
            chosen.append(shards[r][i][1].long() + offset)
            offset += shards[r][i][0].numel()
        k = max(1, -(-p.numel() // 5))  # ceil(0.2 * numel)
        assert torch.equal(torch.cat(chosen), torch.topk(p.grad.abs().reshape(-1), k).indices.sort().values)
    model.zero_grad()
    opt = SparseAdamW(model.parameters(), lr=1e-2, density=0.2, max_grad_norm=0.5)
    expected_params = []
    for i, p in enumerate(model.parameters()):
        offset, chosen = 0, []
        for r in range(world):
            local, idx = shards[r][i]
            chosen.append(idx.long() + offset)
            offset += local.numel()
        opt.set_indices(p, torch.cat(chosen))
        expected_params.append(torch.cat([shards[r][i][0] for r in range(world)]))
    for step in range(steps):
        x, y = _data(step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    for p, want in zip(model.parameters(), expected_params):
        torch.testing.assert_close(p.detach(), want, rtol=1e-5, atol=1e-6)


def test_process_group_requires_compact_grads():
    with pytest.raises(ValueError, match="process_group is for compact_grads"):
        SparseAdamW([torch.nn.Parameter(torch.randn(3))], process_group=object())


def test_max_grad_norm_equals_explicit_clip():
    a, b = _model(), _model()
    opt_a = SparseAdamW(a.parameters(), lr=1e-2, density=0.2, max_grad_norm=0.1)
    opt_b = SparseAdamW(b.parameters(), lr=1e-2, density=0.2)
    for step in range(3):
        x, y = _data(step)
        for model, opt, clip in ((a, opt_a, False), (b, opt_b, True)):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            if clip:
                sift.clip_grad_norm_(opt, 0.1)
            opt.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb)


transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")


@gloo_rank
def _ddp_refusal_worker(rank: int, world: int, mode: str, out: str) -> None:
    """One rank of a DDP-wrapped model in a compact mode: records the error and whether any weight moved."""
    model = _model()
    net = torch.nn.parallel.DistributedDataParallel(model)
    before = [p.detach().clone() for p in model.parameters()]
    error = None
    try:
        if mode == "for-model":
            SparseAdamW.for_model(net, density=0.2, compact_grads=True, target_modules=["module.0"])
        else:
            opt = SparseAdamW(model.parameters(), lr=1e-2, density=0.2, compact_grads=True,
                              update_in_backward=mode == "update-in-backward")
            if mode == "sparse-backward":
                sift.enable_sparse_backward(model, opt)
            _train_on_shard(net, opt, rank, world, 1)
    except (RuntimeError, ValueError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    changed = any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    torch.save({"error": error, "changed": changed}, f"{out}.{rank}")


@pytest.mark.parametrize("mode", ["hook", "sparse-backward", "update-in-backward", "for-model"])
def test_ddp_wrapping_in_a_compact_mode_is_refused_before_any_update(tmp_path, mode):
    """Regression: a DDP-wrapped model in hook mode or with the sparse backward trained without error while
    its compact gradients were never averaged, and the replicas drifted apart (0.073 after 6 steps). An
    optimizer whose sparse weights DDP may still reduce (built by hand and wrapped first) is refused."""
    out = str(tmp_path / "result")
    mp.spawn(_ddp_refusal_worker, args=(2, str(tmp_path / "init"), mode, out), nprocs=2, join=True)
    expected = {"hook": "before wrapping the model in DDP", "sparse-backward": "before wrapping the model in DDP",
                "update-in-backward": "before its gradient could be averaged",
                "for-model": "wrap it in DDP afterwards"}[mode]
    for rank in range(2):
        result = torch.load(f"{out}.{rank}", weights_only=True)
        assert result["error"] is not None and expected in result["error"], result
        assert not result["changed"]


@pytest.mark.parametrize("compact", [False, True], ids=["plain", "hook"])
def test_trainer_fine_tunes_sparsely(tmp_path, compact):
    from sift.integrations.hf import SparseTrainer

    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=48, num_labels=2)
    model = transformers.BertForSequenceClassification(config)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    gen = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(0, 64, (10,), generator=gen), "labels": int(i % 2)} for i in range(16)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=4, learning_rate=1e-2,
        max_grad_norm=1.0, report_to=[], save_strategy="no", use_cpu=True, logging_steps=1,
    )
    trainer = SparseTrainer(model=model, args=args, train_dataset=data, density=0.05, compact_grads=compact)
    trainer.train()
    opt = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    assert isinstance(opt, SparseAdamW)
    changed_weights = 0
    for name, p in model.named_parameters():
        moved = (p.detach() != before[name]).reshape(-1)
        state = opt.state.get(p, {})
        if p.dim() >= 2 and p.requires_grad and "indices" in state:
            outside = torch.ones_like(moved)
            outside[state["indices"].long()] = False
            assert not moved[outside].any(), f"{name} changed outside its chosen entries"
            changed_weights += int(moved.any())
    assert changed_weights > 0
    assert any(isinstance(h.get("grad_norm"), float) for h in trainer.state.log_history)


def _tiny_bert_classifier() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=48, num_labels=2)
    return transformers.BertForSequenceClassification(config)


def _tiny_train_data(n: int = 16) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(0, 64, (10,), generator=gen), "labels": int(i % 2)} for i in range(n)]


def _train_args(output_dir, **kwargs):
    defaults = dict(per_device_train_batch_size=4, learning_rate=1e-2, max_grad_norm=0.5, report_to=[],
                    use_cpu=True, logging_steps=1, save_strategy="no", seed=0, data_seed=0)
    return transformers.TrainingArguments(output_dir=str(output_dir), **{**defaults, **kwargs})


def test_trainer_clips_unscaled_gradients_under_fp16_loss_scaling(tmp_path):
    """SparseTrainer clipped (and logged) the loss-scaled fp16 gradients: grad_norm came out init_scale times too big."""
    from sift.integrations.hf import SparseTrainer

    norms = {}
    for fp16 in (False, True):
        trainer = SparseTrainer(model=_tiny_bert_classifier(), args=_train_args(tmp_path / str(fp16), max_steps=2,
                                fp16=fp16), train_dataset=_tiny_train_data(), density=0.05)
        if fp16:  # CPU has no fp16 scaler: install the one a GPU run gets
            trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
            trainer.accelerator.native_amp = True
        trainer.train()
        norms[fp16] = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    assert len(norms[True]) == 2
    # fp16 autocast changes the forward slightly; a missed unscale is off by 1024x.
    torch.testing.assert_close(torch.tensor(norms[True]), torch.tensor(norms[False]), rtol=2e-2, atol=0)


def test_trainer_compact_grads_under_fp16_loss_scaling_equals_plain_mode(tmp_path):
    """compact_grads with fp16 loss scaling: the scaler's unscale_ sees only .grad, so the trainer links its
    scaler to the optimizer, which unscales the compact buffers itself; grad norms and weights equal plain mode."""
    from sift.integrations.hf import SparseTrainer

    norms, weights = {}, {}
    for compact in (False, True):
        torch.manual_seed(0)
        model = _tiny_bert_classifier()
        trainer = SparseTrainer(model=model, args=_train_args(tmp_path / str(compact), max_steps=3, fp16=True),
                                train_dataset=_tiny_train_data(), density=0.05, memory="plain", compact_grads=compact)
        trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)  # what a GPU run gets
        trainer.accelerator.native_amp = True
        trainer.train()
        norms[compact] = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
        weights[compact] = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert len(norms[True]) == 3
    # A missed unscale of the compact buffers would be off by 1024x.
    torch.testing.assert_close(torch.tensor(norms[True]), torch.tensor(norms[False]), rtol=1e-4, atol=0)
    for name, w in weights[False].items():
        torch.testing.assert_close(weights[True][name], w, rtol=1e-4, atol=1e-6, msg=name)


def test_trainer_compact_grads_under_fp16_without_clipping(tmp_path):
    """With max_grad_norm=0 the Trainer still unscales (without clipping) but SparseTrainer linked its scaler
    only when clipping: the compact step raised "set optimizer.grad_scaler"."""
    from sift.integrations.hf import SparseTrainer

    weights = {}
    for compact in (False, True):
        torch.manual_seed(0)
        model = _tiny_bert_classifier()
        trainer = SparseTrainer(model=model, args=_train_args(tmp_path / str(compact), max_steps=3, fp16=True,
                                                              max_grad_norm=0.0),
                                train_dataset=_tiny_train_data(), density=0.05, memory="plain", compact_grads=compact)
        trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)  # what a GPU run gets
        trainer.accelerator.native_amp = True
        trainer.train()
        assert trainer.optimizer.optimizer.grad_scaler is trainer.accelerator.scaler
        weights[compact] = {n: p.detach().clone() for n, p in model.named_parameters()}
    for name, w in weights[False].items():
        torch.testing.assert_close(weights[True][name], w, rtol=1e-4, atol=1e-6, msg=name)


def test_trainer_skipped_fp16_step_does_not_advance_the_lr_schedule(tmp_path):
    """scaler.step always calls SparseAdamW.step (it takes the scale itself), so accelerate counted a step it
    skipped for inf/NaN as taken and the Trainer advanced the learning-rate schedule."""
    from sift.integrations.hf import SparseTrainer

    model = _tiny_bert_classifier()
    weight = model.classifier.weight
    calls = []

    def inf_in_first_backward(grad):  # GradScaler finds it and the step is skipped
        calls.append(1)
        return grad * float("inf") if len(calls) == 1 else grad

    weight.register_hook(inf_in_first_backward)
    trainer = SparseTrainer(model=model, args=_train_args(tmp_path, max_steps=3, fp16=True),
                            train_dataset=_tiny_train_data(), density=0.05)
    trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    trainer.accelerator.native_amp = True
    trainer.train()
    optimizer = trainer.optimizer.optimizer
    assert len(calls) == 3
    steps = [int(s["step"]) for s in optimizer.state.values() if "step" in s]
    assert steps and all(step == 2 for step in steps)
    assert trainer.lr_scheduler.last_epoch == 2


def test_trainer_compact_grads_misuse_errors_before_touching_the_model(tmp_path, monkeypatch):
    """compact_grads with several processes trained silently wrong (the hooks free the .grad DDP reduces)."""
    from sift.integrations.hf import SparseTrainer

    model = _tiny_bert_classifier()
    monkeypatch.setattr(transformers.TrainingArguments, "world_size", property(lambda self: 2))
    with pytest.raises(ValueError, match=r"compact_grads=True is single-process only \(world_size is 2\)"):
        SparseTrainer(model, _train_args(tmp_path, max_steps=1), compact_grads=True)
    assert not any(module._forward_hooks or module._forward_pre_hooks for module in model.modules())
    assert all(p.grad is None and not p._post_accumulate_grad_hooks for p in model.parameters())


def test_trainer_resume_from_checkpoint_continues_identically(tmp_path):
    """Stopping at a checkpoint (the fine-tune's delta directory, not the model) and resuming on the base model
    (optimizer indices and moments reloaded) equals never stopping, bit for bit."""
    from sift.integrations.hf import SparseTrainer

    data = _tiny_train_data(24)
    straight = _tiny_bert_classifier()
    SparseTrainer(model=straight, args=_train_args(tmp_path / "a", max_steps=4), train_dataset=data,
                  density=0.05).train()
    first = SparseTrainer(model=_tiny_bert_classifier(), args=_train_args(tmp_path / "b", max_steps=4,
                          save_strategy="steps", save_steps=2), train_dataset=data, density=0.05)
    first.train()
    resumed = _tiny_bert_classifier()
    with torch.no_grad():  # another head initialisation: the checkpoint's head must replace it
        resumed.classifier.weight.normal_(generator=torch.Generator().manual_seed(7))

    class CountSteps(transformers.TrainerCallback):
        steps = []

        def on_step_end(self, args, state, control, **kwargs):
            self.steps.append(state.global_step)

    counter = CountSteps()
    trainer = SparseTrainer(model=resumed, args=_train_args(tmp_path / "b", max_steps=4), train_dataset=data,
                            density=0.05, callbacks=[counter])
    trainer.train(resume_from_checkpoint=str(tmp_path / "b" / "checkpoint-2"))
    assert counter.steps == [3, 4], "only the steps after the checkpoint run"
    checkpoint = sorted(os.listdir(tmp_path / "b" / "checkpoint-2"))
    assert "sift_config.json" in checkpoint and "model.safetensors" not in checkpoint, checkpoint
    opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    assert isinstance(opt, SparseAdamW) and any("indices" in s for s in opt.state.values())
    for (name, a), b in zip(resumed.named_parameters(), straight.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_trainer_trains_given_head_indices(tmp_path):
    """SparseTrainer could not take HiFi's head indices: it always chose entries by |grad| itself."""
    from sift import heads
    from sift.integrations.hf import SparseTrainer

    model = _tiny_bert_classifier()
    chosen = heads.trainable_indices(model, {0: [1], 1: [0, 3]})
    for name, p in model.named_parameters():  # HiFi: only the chosen heads (and the classifier) train
        p.requires_grad_(name in chosen or name.startswith("classifier"))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = SparseTrainer(model=model, args=_train_args(tmp_path, max_steps=3), train_dataset=_tiny_train_data(),
                            indices=chosen)
    trainer.train()
    opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    params = dict(model.named_parameters())
    for name, idx in chosen.items():
        p = params[name]
        assert torch.equal(opt.state[p]["indices"].long(), idx.long()), name
        moved = (p.detach() != before[name]).reshape(-1)
        outside = torch.ones_like(moved)
        outside[idx.long()] = False
        assert moved.any() and not moved[outside].any(), name
    for name, p in params.items():
        if not p.requires_grad:
            assert torch.equal(p, before[name]), f"frozen {name} changed"


def test_trainer_indices_for_unknown_or_frozen_params_raise_before_touching_the_model(tmp_path):
    from sift.integrations.hf import SparseTrainer

    model = _tiny_bert_classifier()
    model.bert.embeddings.word_embeddings.weight.requires_grad_(False)
    bad = {"no.such.weight": torch.tensor([0]), "bert.embeddings.word_embeddings.weight": torch.tensor([0])}
    with pytest.raises(ValueError, match=r"unknown \['no.such.weight'\], frozen \['bert.embeddings"):
        SparseTrainer(model=model, args=_train_args(tmp_path, max_steps=1), indices=bad)


def test_trainer_default_trains_what_for_model_trains(tmp_path):
    """Behaviour change: with no target_modules the trainer trained every weight matrix (the word embeddings,
    the MLP, the pooler, 8 entries of the new classifier) and every bias densely; it now follows for_model."""
    from sift.integrations.hf import SparseTrainer

    reference = _tiny_bert_classifier()
    SparseAdamW.for_model(reference, density=0.05)
    model = _tiny_bert_classifier()
    trainer = SparseTrainer(model=model, args=_train_args(tmp_path, max_steps=1), train_dataset=_tiny_train_data(),
                            density=0.05)
    trainer.train()
    opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    assert {n: p.requires_grad for n, p in model.named_parameters()} == \
        {n: p.requires_grad for n, p in reference.named_parameters()}
    groups = {g["name"]: g["param_names"] for g in opt.param_groups}
    assert groups["dense"] == ["classifier.weight", "classifier.bias"]
    assert all(n.endswith(("query.weight", "key.weight", "value.weight", "attention.output.dense.weight"))
               for n in groups["sparse"])


def test_trainer_save_model_writes_the_fine_tune(tmp_path):
    """trainer.save_model() writes the delta directory (kilobytes), not a copy of the model."""
    from sift.integrations.hf import SparseTrainer

    model = _tiny_bert_classifier()
    trainer = SparseTrainer(model=model, args=_train_args(tmp_path / "run", max_steps=2), train_dataset=_tiny_train_data(),
                            density=0.05)
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    files = sorted(os.listdir(tmp_path / "final"))
    assert "delta.safetensors" in files and "model.safetensors" not in files, files
    fresh = _tiny_bert_classifier()
    with torch.no_grad():  # another head initialisation: the fine-tune's head replaces it
        fresh.classifier.weight.normal_()
    SparseDelta.from_pretrained(tmp_path / "final").apply_(fresh)
    for (name, a), b in zip(fresh.named_parameters(), model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)


def test_trainer_lowest_memory_trains_and_saves_its_fine_tune(tmp_path):
    """SparseTrainer(memory="lowest") built a lean optimizer, whose checkpoints and save_model raised (a lean
    state keeps no increments); it keeps the exact state and steps in backward, and saves the delta."""
    from sift.integrations.hf import SparseTrainer

    model = _tiny_bert_classifier()
    trainer = SparseTrainer(model=model, args=_train_args(tmp_path / "out", max_steps=3, max_grad_norm=0.0),
                            train_dataset=_tiny_train_data(), density=0.05, memory="lowest")
    trainer.train()
    opt = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    assert opt.state_layout == "exact" and opt.update_in_backward
    trainer.save_model(str(tmp_path / "tune"))
    fresh = _tiny_bert_classifier()
    SparseDelta.from_pretrained(tmp_path / "tune").apply_(fresh)
    assert all(torch.equal(p, q) for p, q in zip(fresh.parameters(), model.parameters()))
