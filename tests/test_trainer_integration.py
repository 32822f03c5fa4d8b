"""`sift.integrations.sparse_trainer` over transformers' Trainer and TRL's trainers: clipping, logging, the
fine-tune on disk, resuming, the best checkpoint; and a Trainer that does not integrate sift."""

from __future__ import annotations

import logging
import os

import pytest
import torch

import sift
from conftest import assert_best_checkpoint_loaded, assert_only_chosen_entries_moved
from sift import SparseAdamW, SparseDelta

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
datasets = pytest.importorskip("datasets")
trl = pytest.importorskip("trl")
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402  (after the skips)

LETTERS = list("abcdefghijklmnopqrstuvwxyz")
DENSITY = 0.05


def _tokenizer() -> transformers.PreTrainedTokenizerFast:
    """One token a letter, built here: nothing is downloaded."""
    vocab = {t: i for i, t in enumerate(["<pad>", "<s>", "</s>", "<unk>", *LETTERS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                pad_token="<pad>", unk_token="<unk>")


def _llama(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A tiny random Llama whose head is tied to the input embeddings."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return transformers.LlamaForCausalLM(config).to(dtype)


TEXTS = ["helloworld", "sparsefine", "tuningtest", "abcdefghij", "kilomanjar", "quietzones"]


def _lm_data(n: int = 4) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    return [{"input_ids": ids, "labels": ids} for ids in torch.randint(4, 30, (n, 10), generator=gen)]


def _args(out, config=transformers.TrainingArguments, **kwargs):
    defaults = dict(per_device_train_batch_size=2, learning_rate=1e-2, max_grad_norm=0.05, report_to=[],
                    use_cpu=True, logging_steps=1, save_strategy="no", seed=0, data_seed=0, max_steps=4,
                    lr_scheduler_type="constant")
    if config is not transformers.TrainingArguments:
        defaults.update(max_length=32, bf16=False)  # TRL's configs turn bf16 autocast on by default
    return config(output_dir=str(out), **{**defaults, **kwargs})


def _recording(cls: type) -> type:
    """`cls` keeping every training batch and its token count, for a manual loop to replay."""

    class Recording(cls):
        def training_step(self, model, inputs, num_items_in_batch=None):
            self.batches = [*getattr(self, "batches", []), ({k: v.clone() for k, v in inputs.items()},
                                                            num_items_in_batch)]
            return super().training_step(model, inputs, num_items_in_batch)

    return Recording


def _trainer_kwargs(kind: str, model, out, **kwargs) -> dict:
    if kind == "sft":
        ds = datasets.Dataset.from_dict({"text": TEXTS[:4]})
        return dict(model=model, args=_args(out, trl.SFTConfig, **kwargs), train_dataset=ds,
                    processing_class=_tokenizer())
    return dict(model=model, args=_args(out, **kwargs), train_dataset=_lm_data())


def _grad_norms(trainer) -> list[float]:
    return [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]


CASES = {  # id: (trainer kind, memory, dtype, optimizer given in optimizers=, max_grad_norm)
    "trainer-low": ("trainer", "low", torch.float32, False, 0.05),
    "trainer-plain": ("trainer", "plain", torch.float32, False, 0.05),
    "trainer-lowest": ("trainer", "lowest", torch.float32, False, 0.05),
    "trainer-bf16": ("trainer", "low", torch.bfloat16, False, 0.05),
    "trainer-given-optimizer": ("trainer", "low", torch.float32, True, 0.05),
    "trainer-no-clip": ("trainer", "low", torch.float32, False, 0.0),
    "trainer-lowest-no-clip": ("trainer", "lowest", torch.float32, False, 0.0),  # steps in backward: no norm
    "sft-low": ("sft", "low", torch.float32, False, 0.05),
}


@pytest.mark.parametrize("case", list(CASES))
def test_integrated_trainer_clips_like_a_manual_loop(tmp_path, case):
    """A Trainer given SparseAdamW.for_model clipped nothing after step 1 (no .grad left) and logged grad_norm 0.0:
    the integrated class clips with sift.clip_grad_norm_ as a manual loop does and logs that norm."""
    from sift.integrations import sparse_trainer

    kind, memory, dtype, given, max_norm = CASES[case]
    base_cls = trl.SFTTrainer if kind == "sft" else transformers.Trainer
    model = _llama(dtype)
    kwargs = _trainer_kwargs(kind, model, tmp_path / "run", max_grad_norm=max_norm)
    if given:
        kwargs["optimizers"] = (SparseAdamW.for_model(model, density=DENSITY, lr=1e-2, memory=memory,
                                                      weight_decay=0.0), None)
    else:
        kwargs.update(density=DENSITY, memory=memory)
    trainer = _recording(sparse_trainer(base_cls))(**kwargs)
    trainer.train()

    reference = _llama(dtype)
    # The plain class computes the loss (TRL's SFT loss included); clipping and stepping are the manual loop's.
    loss_of = base_cls(**_trainer_kwargs(kind, reference, tmp_path / "ref", max_grad_norm=max_norm))
    # The trainer keeps the exact state (its checkpoints export increments) and, when it clips, steps after backward.
    opt = SparseAdamW.for_model(reference, density=DENSITY, lr=1e-2, weight_decay=0.0,  # TrainingArguments'
                                memory="low" if memory == "lowest" and max_norm else memory,
                                **({"state": "exact"} if memory == "lowest" else {}))
    norms = []
    reference.train()
    for inputs, num_items in trainer.batches:
        opt.zero_grad()
        loss_of.compute_loss(reference, dict(inputs), num_items_in_batch=num_items).backward()
        if not opt.update_in_backward:  # which leaves no gradient to take a norm of (nor a 0.0 to log)
            norms.append(sift.clip_grad_norm_(opt, max_norm if max_norm else float("inf")).item())
        opt.step()
    assert len(trainer.batches) == 4
    assert _grad_norms(trainer) == norms
    assert all(n > 0 for n in norms)
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(a, b), name
    if max_norm:
        assert any(n > max_norm for n in norms), "the clip must bite for the test to mean anything"


def test_integrated_trainer_logs_what_it_trains_once(tmp_path, caplog):
    """SparseTrainer never said what it trains: the trainable summary is logged once when training starts."""
    from sift.integrations.hf import SparseTrainer

    trainer = SparseTrainer(**_trainer_kwargs("trainer", _llama(), tmp_path, max_steps=2), density=DENSITY)
    with caplog.at_level(logging.INFO, logger="sift"):
        trainer.train()
    summaries = [r.getMessage() for r in caplog.records if "| mode |" in r.getMessage()]
    assert len(summaries) == 1
    assert "self_attn.q_proj.weight" in summaries[0] and "sparse" in summaries[0]
    assert not [r for r in caplog.records if "a dense fine-tune's rate" in r.getMessage()]


def test_integrated_trainer_warns_of_a_dense_learning_rate(tmp_path, caplog):
    """Trainer's default rate (5e-5) barely moves a sparse fine-tune: the integration says so, once."""
    from sift.integrations.hf import SparseTrainer

    trainer = SparseTrainer(**_trainer_kwargs("trainer", _llama(), tmp_path, max_steps=1, learning_rate=5e-5),
                            density=DENSITY)
    with caplog.at_level(logging.INFO, logger="sift"):
        trainer.train()
    warned = [r.getMessage() for r in caplog.records if "a dense fine-tune's rate" in r.getMessage()]
    assert len(warned) == 1 and "learning_rate 5e-05" in warned[0]


@pytest.mark.parametrize("kind", ["trainer", "sft"])
def test_integrated_trainer_save_model_writes_the_fine_tune(tmp_path, kind):
    """save_model writes the delta directory, which reloads onto a fresh base with the same logits bit for bit."""
    from sift.integrations import sparse_trainer

    model = _llama()
    base_cls = trl.SFTTrainer if kind == "sft" else transformers.Trainer
    trainer = sparse_trainer(base_cls)(**_trainer_kwargs(kind, model, tmp_path / "run", max_steps=3),
                                       density=DENSITY)
    trainer.train()
    trainer.save_model(str(tmp_path / "tune"))
    files = sorted(os.listdir(tmp_path / "tune"))
    assert "delta.safetensors" in files and "sift_config.json" in files and "model.safetensors" not in files, files
    fresh = _llama()
    SparseDelta.from_pretrained(tmp_path / "tune").apply_(fresh)
    ids = torch.randint(4, 30, (2, 12), generator=torch.Generator().manual_seed(1))
    model.eval()
    with torch.no_grad():
        assert not torch.equal(_llama()(ids).logits, model(ids).logits), "training must change the logits"
        assert torch.equal(fresh(ids).logits, model(ids).logits)


def test_integrated_sft_trainer_resumes_bit_for_bit(tmp_path):
    """Resuming sparse_trainer(SFTTrainer) from a mid-run checkpoint (fine-tune + optimizer state) on a fresh base
    equals the uninterrupted run bit for bit."""
    from sift.integrations import sparse_trainer

    cls = sparse_trainer(trl.SFTTrainer)
    straight = _llama()
    cls(**_trainer_kwargs("sft", straight, tmp_path / "a"), density=DENSITY).train()
    cls(**_trainer_kwargs("sft", _llama(), tmp_path / "b", save_strategy="steps", save_steps=2),
        density=DENSITY).train()
    checkpoint = tmp_path / "b" / "checkpoint-2"
    files = sorted(os.listdir(checkpoint))
    assert "sift_config.json" in files and "optimizer.pt" in files and "model.safetensors" not in files, files
    resumed = _llama()
    cls(**_trainer_kwargs("sft", resumed, tmp_path / "b"), density=DENSITY).train(
        resume_from_checkpoint=str(checkpoint))
    for (name, a), b in zip(resumed.named_parameters(), straight.parameters()):
        assert torch.equal(a, b), name
    assert not torch.equal(straight.model.layers[0].self_attn.q_proj.weight,
                           _llama().model.layers[0].self_attn.q_proj.weight)


def _best_run(out, saved: dict, resume: str | None = None, best_step: int | None = None, **trainer_kwargs):
    """3 steps, evaluated and saved at each; the highest eval loss is "best": training lowers it, so the best
    checkpoint is the first, not the last (`best_step`: that step's checkpoint is best instead). `saved` gets the
    weights at every save."""
    from sift.integrations.hf import SparseTrainer

    class Snapshot(transformers.TrainerCallback):
        def on_save(self, args, state, control, model=None, **kwargs):
            saved[state.global_step] = {n: p.detach().clone() for n, p in model.named_parameters()}

    class Pick(transformers.TrainerCallback):
        def on_evaluate(self, args, state, control, metrics=None, **kwargs):
            metrics["eval_pick"] = float(state.global_step == best_step)  # read by the Trainer after this call

    model = _llama()
    data = _lm_data()
    args = _args(out, max_steps=3, per_device_train_batch_size=4, eval_strategy="steps", eval_steps=1,
                 save_strategy="steps", save_steps=1, load_best_model_at_end=True,
                 metric_for_best_model="eval_loss" if best_step is None else "eval_pick",
                 greater_is_better=True, per_device_eval_batch_size=4)
    trainer = SparseTrainer(model=model, args=args, train_dataset=data, eval_dataset=data, density=DENSITY,
                            callbacks=[Snapshot(), Pick()], **trainer_kwargs)
    trainer.train(resume_from_checkpoint=resume)
    return trainer, model


def test_load_best_model_at_end_restores_the_best_checkpoint(tmp_path):
    """SparseTrainer with load_best_model_at_end=True kept the last model (its checkpoints hold no
    model.safetensors for the Trainer to load): it now restores the best checkpoint's fine-tune, and save_model
    then writes that one."""
    saved = {}
    trainer, model = _best_run(tmp_path / "run", saved)
    best = assert_best_checkpoint_loaded(trainer, model, saved)
    trainer.save_model(str(tmp_path / "tune"))
    fresh = _llama()
    SparseDelta.from_pretrained(tmp_path / "tune").apply_(fresh)
    for name, p in fresh.named_parameters():
        torch.testing.assert_close(p, saved[best][name], rtol=0, atol=1e-7, msg=name)


def test_load_best_model_at_end_after_resuming_from_the_best_checkpoint(tmp_path):
    """Resumed from the checkpoint that stays best, loading it again at the end is the same delta applied twice
    over: it restores the base first, so the weights are that checkpoint's, not doubled or refused."""
    saved = {}
    _best_run(tmp_path / "run", saved)
    resumed, model = _best_run(tmp_path / "run", {}, resume=str(tmp_path / "run" / "checkpoint-1"))
    assert resumed.state.best_model_checkpoint.endswith("checkpoint-1")
    for name, p in model.named_parameters():
        assert torch.equal(p, saved[1][name]), name


RESELECT = {"reselect_every": 1, "reselect_fraction": 0.5}  # re-selects at every step after the first


def _optimizer_of(trainer) -> SparseAdamW:
    return getattr(trainer.optimizer, "optimizer", trainer.optimizer)


def _assert_same_optimizer_state(a: SparseAdamW, b: SparseAdamW) -> None:
    for key, (sa, sb) in enumerate(zip(a.state_dict()["state"].values(), b.state_dict()["state"].values())):
        assert sa.keys() == sb.keys(), key
        for name, value in sa.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, sb[name]), (key, name)
            else:
                assert value == sb[name], (key, name)


@pytest.mark.parametrize("path", ["targets", "by-dimension"])
def test_integrated_trainer_takes_the_reselect_arguments(tmp_path, path):
    """The integrated Trainer refused reselect_every and the other reselect_* arguments (TypeError): it passes them
    to the SparseAdamW it builds, by target modules and by the rule by dimension alike, and checks them first."""
    from sift.integrations.hf import SparseTrainer
    from sift.optim.reselection import reselect_settings

    settings = {"reselect_every": 1, "reselect_fraction": 0.5, "reselect_schedule": "linear",
                "reselect_total_steps": 8, "reselect_rule": "magnitude", "reselect_drop": "revert", "reselect_steps": 1}
    by_dimension = {"indices": {}} if path == "by-dimension" else {}  # given indices keep the rule by dimension
    model = _llama()
    trainer = SparseTrainer(**_trainer_kwargs("trainer", model, tmp_path, max_steps=3), density=DENSITY,
                            **settings, **by_dimension)
    trainer.train()
    opt = _optimizer_of(trainer)
    expected = reselect_settings(*(settings[f"reselect_{key}"] for key in
                                   ("every", "fraction", "schedule", "total_steps", "rule", "drop", "steps")))
    sparse = [group for group in opt.param_groups if group["density"] < 1.0]
    assert sparse and all(group["reselect"] == expected for group in sparse)
    q_proj = model.model.layers[0].self_attn.q_proj.weight
    first = SparseTrainer(**_trainer_kwargs("trainer", _llama(), tmp_path / "once", max_steps=1), density=DENSITY,
                          **by_dimension)
    first.train()
    assert not torch.equal(opt.indices_of(q_proj), _optimizer_of(first).indices_of(
        first.model.model.layers[0].self_attn.q_proj.weight)), "the later steps must have re-selected"
    with pytest.raises(ValueError, match="reselect_fraction"):
        SparseTrainer(**_trainer_kwargs("trainer", _llama(), tmp_path / "bad"), density=DENSITY, reselect_every=2,
                      reselect_fraction=1.5)


def test_integrated_trainer_resumes_bit_for_bit_after_a_reselection(tmp_path):
    """A checkpoint written after a re-selection could not be resumed (shape mismatch: the exact values were saved
    at the active entries, loaded at the delta's active and retired ones): the resumed run's params and optimizer
    state now equal the uninterrupted run's bit for bit."""
    from sift.integrations.hf import SparseTrainer

    data = _lm_data(12)
    straight = SparseTrainer(model=_llama(), args=_args(tmp_path / "a", max_steps=5), train_dataset=data,
                             density=DENSITY, **RESELECT)
    straight.train()
    SparseTrainer(model=_llama(), args=_args(tmp_path / "b", max_steps=5, save_strategy="steps", save_steps=3),
                  train_dataset=data, density=DENSITY, **RESELECT).train()
    checkpoint = tmp_path / "b" / "checkpoint-3"
    saved = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    assert any("retired_indices" in s for s in saved["state"].values()), "the checkpoint must follow a re-selection"
    resumed = SparseTrainer(model=_llama(), args=_args(tmp_path / "b", max_steps=5), train_dataset=data,
                            density=DENSITY, **RESELECT)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    for (name, a), b in zip(resumed.model.named_parameters(), straight.model.parameters()):
        assert torch.equal(a, b), name
    _assert_same_optimizer_state(_optimizer_of(resumed), _optimizer_of(straight))


def test_load_best_model_at_end_after_a_reselection(tmp_path):
    """load_best_model_at_end failed on a best checkpoint written after a re-selection (the same shape mismatch as a
    resume): it now puts that checkpoint's weights on the model bit for bit."""
    saved = {}
    trainer, model = _best_run(tmp_path / "run", saved, best_step=2, **RESELECT)
    state = torch.load(tmp_path / "run" / "checkpoint-2" / "optimizer.pt", weights_only=True)["state"]
    assert any("retired_indices" in s for s in state.values()), "the best checkpoint must follow a re-selection"
    assert assert_best_checkpoint_loaded(trainer, model, saved) == 2


@pytest.mark.parametrize("kind", ["trainer", "sft"])
def test_unintegrated_trainer_with_sift_optimizer_is_refused(tmp_path, kind):
    """A plain Trainer (or SFTTrainer) given SparseAdamW.for_model trained with its clipping silently lost and
    logged grad_norm 0.0: it is refused before the first step, naming the fix."""
    model = _llama()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    base_cls = trl.SFTTrainer if kind == "sft" else transformers.Trainer
    kwargs = _trainer_kwargs(kind, model, tmp_path, max_steps=2)
    kwargs["optimizers"] = (SparseAdamW.for_model(model, density=DENSITY, lr=1e-2), None)
    trainer = base_cls(**kwargs)
    with pytest.raises(ValueError, match=rf"sift.integrations.sparse_trainer\({base_cls.__name__}\)"):
        trainer.train()
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name


def test_unintegrated_trainer_without_clipping_warns_of_the_logged_norm(tmp_path, caplog):
    """Without clipping the plain Trainer's step is right but it logs grad_norm 0.0: one warning names the fix."""
    model = _llama()
    trainer = transformers.Trainer(**_trainer_kwargs("trainer", model, tmp_path, max_steps=2, max_grad_norm=0.0),
                                   optimizers=(SparseAdamW.for_model(model, density=DENSITY, lr=1e-2), None))
    with caplog.at_level(logging.WARNING, logger="sift"):
        trainer.train()
    warnings = [r.getMessage() for r in caplog.records if "sparse_trainer(Trainer)" in r.getMessage()]
    assert len(warnings) == 1 and "0.0" in warnings[0]


def test_unintegrated_trainer_in_plain_mode_trains_as_before(tmp_path):
    """Plain mode keeps .grad, which the Trainer's own clip reads: nothing is refused there."""
    model = _llama()
    opt = SparseAdamW.for_model(model, density=DENSITY, lr=1e-2, memory="plain")
    trainer = transformers.Trainer(**_trainer_kwargs("trainer", model, tmp_path, max_steps=2), optimizers=(opt, None))
    trainer.train()
    assert all(n > 0 for n in _grad_norms(trainer))


def _preferences() -> datasets.Dataset:
    return datasets.Dataset.from_dict({"prompt": ["abc", "hello", "sparse", "tune"],
                                       "chosen": ["def", "world", "delta", "well"],
                                       "rejected": ["xyz", "there", "dense", "badly"]})


def test_integrated_dpo_trainer_trains(tmp_path):
    """sparse_trainer(DPOTrainer) builds SparseAdamW, clips with sift.clip_grad_norm_ (a positive norm is logged)
    and moves only the chosen entries of the sparse weights."""
    from sift.integrations import sparse_trainer

    model = _llama()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = _args(tmp_path, trl.DPOConfig, max_steps=2, per_device_train_batch_size=2)
    trainer = sparse_trainer(trl.DPOTrainer)(model=model, ref_model=_llama(), args=args,
                                             train_dataset=_preferences(), processing_class=_tokenizer(),
                                             density=DENSITY)
    trainer.train()
    opt = trainer.optimizer.optimizer
    assert isinstance(opt, SparseAdamW)
    norms = _grad_norms(trainer)
    assert len(norms) == 2 and all(n > 0 for n in norms)
    assert_only_chosen_entries_moved(model, before, opt)
