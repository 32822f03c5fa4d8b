"""`sparse_trainer(GRPOTrainer)`: TRL's GRPO (generation through transformers, no vLLM) with a rule-based reward on a
tiny random chat Llama trains only the chosen entries, clips and logs as a manual loop does, saves the fine-tune
and resumes from a checkpoint bit for bit."""

from __future__ import annotations

import os

import pytest
import torch

import sift
from sift import SparseAdamW, SparseDelta
from conftest import assert_only_chosen_entries_moved

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
datasets = pytest.importorskip("datasets")
trl = pytest.importorskip("trl")

DENSITY = 0.05
MAX_NORM = 0.05


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    from sift.bench.llm import tiny_llama_dir

    return tiny_llama_dir(str(tmp_path_factory.mktemp("tiny-chat-llama")))


def closeness_to_a(completions, **kwargs) -> list[float]:
    """Rule-based: each character scores 1 / (1 + its code point's distance from "a"), averaged over the completion
    (a random model's completions seldom hold an "a" itself, and a group of equal rewards has no advantage)."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [sum(1.0 / (1 + abs(ord(ch) - ord("a"))) for ch in text) / max(len(text), 1) for text in texts]


def _prompts() -> datasets.Dataset:
    # Eight prompts, two a step: the four steps are one epoch, and the checkpoint at step 2 falls inside it.
    words = ("abc", "hello", "sparse", "tune", "delta", "reward", "group", "policy")
    return datasets.Dataset.from_dict({"prompt": [[{"role": "user", "content": w}] for w in words]})


def _trainer(cls, folder: str, out, model=None, save_strategy: str = "no", **kwargs):
    args = trl.GRPOConfig(
        output_dir=str(out), max_steps=kwargs.pop("max_steps", 4), per_device_train_batch_size=4, num_generations=2, max_completion_length=8,
        learning_rate=1e-2, max_grad_norm=MAX_NORM, lr_scheduler_type="constant", bf16=False, use_cpu=True,
        report_to=[], logging_steps=1, save_strategy=save_strategy, seed=0, data_seed=0, **kwargs)
    model = model if model is not None else transformers.AutoModelForCausalLM.from_pretrained(folder)
    extra = {"density": DENSITY} if issubclass(cls, sift.integrations.hf.SparseTrainerMixin) else {}
    return cls(model=model, reward_funcs=closeness_to_a, args=args, train_dataset=_prompts(),
               processing_class=transformers.AutoTokenizer.from_pretrained(folder), **extra)


def _recording(cls: type) -> type:
    """`cls` keeping every batch its loss is computed on (the completions, their advantages), to replay."""

    class Recording(cls):
        def compute_loss(self, model, inputs, *args, **kwargs):
            self.batches = [*getattr(self, "batches", []),
                            {k: v.clone() if torch.is_tensor(v) else v for k, v in inputs.items()}]
            return super().compute_loss(model, inputs, *args, **kwargs)

    return Recording


def test_integrated_grpo_trainer_trains_clips_saves_and_resumes(tmp_path, folder):
    """GRPOTrainer through sparse_trainer: the chosen entries alone move, grad_norm is sift.clip_grad_norm_'s as in a
    manual loop over the same completions, save_model writes the delta directory, and a resume is bit for bit."""
    from sift.integrations import sparse_trainer

    cls = sparse_trainer(trl.GRPOTrainer)
    base = transformers.AutoModelForCausalLM.from_pretrained(folder)
    trainer = _trainer(_recording(cls), folder, tmp_path / "straight")
    model = trainer.model
    trainer.train()
    opt = trainer.optimizer.optimizer
    assert isinstance(opt, SparseAdamW)

    # Only the chosen entries of the sparse weights move.
    assert_only_chosen_entries_moved(model, dict(base.named_parameters()), opt)

    # The logged grad_norm is the clipped norm of the manual loop over the recorded completions.
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder)
    loss_of = _trainer(trl.GRPOTrainer, folder, tmp_path / "ref", model=reference)
    loss_of.current_gradient_accumulation_steps = 1  # set by the Trainer's loop, which the manual one replaces
    ref_opt = SparseAdamW.for_model(reference, density=DENSITY, lr=1e-2, weight_decay=0.0)
    reference.train()
    norms = []
    for inputs in trainer.batches:
        ref_opt.zero_grad()
        loss_of.compute_loss(reference, dict(inputs)).backward()
        norms.append(sift.clip_grad_norm_(ref_opt, MAX_NORM).item())
        ref_opt.step()
    logged = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    assert len(trainer.batches) == 4 and logged == norms
    assert any(n > MAX_NORM for n in norms), "the clip must bite for the test to mean anything"
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(a, b), name

    # The fine-tune on disk: a delta directory that puts the trained weights on a fresh base.
    trainer.save_model(str(tmp_path / "tune"))
    files = sorted(os.listdir(tmp_path / "tune"))
    assert "delta.safetensors" in files and "sift_config.json" in files and "model.safetensors" not in files, files
    fresh = transformers.AutoModelForCausalLM.from_pretrained(folder)
    SparseDelta.from_pretrained(tmp_path / "tune").apply_(fresh)
    for (name, a), b in zip(fresh.named_parameters(), model.parameters()):
        assert torch.equal(a, b), name

    # A run checkpointed at step 2, resumed on a fresh base, ends where the uninterrupted run ended.
    _trainer(cls, folder, tmp_path / "b", save_strategy="steps", save_steps=2).train()
    checkpoint = tmp_path / "b" / "checkpoint-2"
    assert "sift_config.json" in os.listdir(checkpoint) and "model.safetensors" not in os.listdir(checkpoint)
    resumed = _trainer(cls, folder, tmp_path / "b")
    resumed.train(resume_from_checkpoint=str(checkpoint))
    for (name, a), b in zip(resumed.model.named_parameters(), model.parameters()):
        assert torch.equal(a, b), name
    assert [h["grad_norm"] for h in resumed.state.log_history if "grad_norm" in h] == logged


def test_a_resume_past_the_first_epoch_continues_the_uninterrupted_order_bit_for_bit(tmp_path, folder):
    """TRL's RepeatSampler has no set_epoch: a Trainer resumed in the second epoch replayed the first epoch's
    prompts. Through sparse_trainer the order of every epoch is TRL's own, and a resume there is bit for bit."""
    from sift.integrations import sparse_trainer
    from trl.trainer.utils import RepeatSampler

    cls = sparse_trainer(trl.GRPOTrainer)
    straight = _trainer(_recording(cls), folder, tmp_path / "straight", max_steps=6)  # 4 steps an epoch
    sampler = straight._get_train_sampler()
    own = RepeatSampler(sampler.data_source, sampler.mini_repeat_count, sampler.batch_size, sampler.repeat_count,
                        shuffle=True, seed=sampler.seed)
    passes = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        passes.append(list(sampler))
    assert passes == [list(own), list(own)], "the uninterrupted order must stay TRL's"
    assert passes[0] != passes[1], "epochs in the same order would not show a replay"
    straight.train()
    _trainer(cls, folder, tmp_path / "b", max_steps=6, save_strategy="steps", save_steps=5).train()
    resumed = _recording(cls)
    resumed = _trainer(resumed, folder, tmp_path / "b", max_steps=6)
    resumed.train(resume_from_checkpoint=str(tmp_path / "b" / "checkpoint-5"))
    assert [b["prompt_ids"].tolist() for b in resumed.batches] == [straight.batches[-1]["prompt_ids"].tolist()]
    for (name, a), b in zip(resumed.model.named_parameters(), straight.model.parameters()):
        assert torch.equal(a, b), name
