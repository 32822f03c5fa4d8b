"""The integrated Trainer on the CPU with bf16/fp16 set (TRL's configs default to bf16=True): it trains as asked and
warns once, when it is built, that this autocast is many times slower than fp32 there; fp32 trains without it."""

from __future__ import annotations

import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
datasets = pytest.importorskip("datasets")
trl = pytest.importorskip("trl")
from tokenizers import Tokenizer, models, pre_tokenizers  # after the skips

WARNING = "many times slower than fp32"


def _tokenizer() -> transformers.PreTrainedTokenizerFast:
    vocab = {t: i for i, t in enumerate(["<pad>", "<s>", "</s>", "<unk>", *"abcdefghijklmnopqrstuvwxyz"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                pad_token="<pad>", unk_token="<unk>")


def _llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return transformers.LlamaForCausalLM(config)


def _trainer(kind: str, out, **precision):
    from sift.integrations import sparse_trainer

    common = dict(output_dir=str(out), per_device_train_batch_size=2, max_steps=2, learning_rate=1e-2,
                  report_to=[], use_cpu=True, logging_steps=1, save_strategy="no", seed=0, **precision)
    if kind == "sft":  # precision unset: TRL's default, bf16=True
        data = datasets.Dataset.from_dict({"text": ["helloworld", "sparsefine", "tuningtest", "abcdefghij"]})
        return sparse_trainer(trl.SFTTrainer)(model=_llama(), args=trl.SFTConfig(max_length=16, **common),
                                              train_dataset=data, processing_class=_tokenizer(), density=0.05)
    ids = torch.randint(4, 30, (4, 10), generator=torch.Generator().manual_seed(0))
    return sparse_trainer(transformers.Trainer)(model=_llama(), args=transformers.TrainingArguments(**common),
                                                train_dataset=[{"input_ids": x, "labels": x} for x in ids],
                                                density=0.05)


CASES = {  # id: (trainer kind, precision settings, the autocast accelerate runs, warned)
    "sft-default-bf16": ("sft", {}, "bf16", True),
    "sft-bf16-false": ("sft", {"bf16": False}, "no", False),
    "trainer-bf16": ("trainer", {"bf16": True}, "bf16", True),
    "trainer-fp16": ("trainer", {"fp16": True}, "fp16", True),
    "trainer-fp32": ("trainer", {}, "no", False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_cpu_half_precision_warns_once_and_trains_as_asked(tmp_path, caplog, case):
    """A CPU run under TRL's default bf16=True trained about ten times slower than fp32 and nothing said so."""
    kind, precision, autocast, warned = CASES[case]
    with caplog.at_level(logging.WARNING, logger="sift"):
        trainer = _trainer(kind, tmp_path, **precision)
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        trainer.train()
    warnings = [r.getMessage() for r in caplog.records if WARNING in r.getMessage()]
    assert len(warnings) == int(warned), warnings
    if warned:
        name = "bf16" if "fp16" not in precision else "fp16"
        assert f"{name}=False" in warnings[0] and "386 s" in warnings[0]
    assert trainer.accelerator.mixed_precision == autocast  # the setting is the user's: kept, not switched
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    moved = [n for n, p in trainer.model.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert any("q_proj" in n for n in moved), moved
