"""A causal LM through `sift.integrations.sparse_trainer`: a 4-bit or 8-bit base, loss on the answer tokens only,
`generate` and the text-generation pipeline on the fine-tune (reloaded or merged), a tied head frozen, sparse or
dense, and gradient checkpointing over bf16 weights. A tiny random Llama (tied head) and a letter tokenizer:
nothing is downloaded."""

from __future__ import annotations

import os

import pytest
import torch

import sift
from sift import SparseAdamW, SparseDelta

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
trl = pytest.importorskip("trl")
from test_trainer_integration import _args, _llama, _lm_data, _recording, _tokenizer  # noqa: E402  (after the skips)

from sift.integrations import sparse_trainer  # noqa: E402

DENSITY = 0.05


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> str:
    """The tiny Llama saved as a checkpoint, for the quantized loads and `AutoModelForCausalLM`."""
    folder = str(tmp_path_factory.mktemp("base"))
    _llama().save_pretrained(folder)
    return folder


def _packed(folder: str, bits: int) -> torch.nn.Module:
    """The checkpoint loaded by bitsandbytes on the CPU: NF4 (fp32 compute) or LLM.int8() weights."""
    pytest.importorskip("bitsandbytes")
    quant = (transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                             bnb_4bit_compute_dtype=torch.float32) if bits == 4
             else transformers.BitsAndBytesConfig(load_in_8bit=True))
    return transformers.LlamaForCausalLM.from_pretrained(folder, quantization_config=quant, device_map="cpu")


def _kwargs(kind: str, model, out, **kwargs) -> dict:
    if kind == "sft":
        ds = datasets.Dataset.from_dict({"text": ["helloworld", "sparsefine", "tuningtest", "abcdefghij"]})
        return dict(model=model, args=_args(out, trl.SFTConfig, **kwargs), train_dataset=ds,
                    processing_class=_tokenizer(), density=DENSITY)
    return dict(model=model, args=_args(out, **kwargs), train_dataset=_lm_data(), density=DENSITY)


def _assert_same_params(a: torch.nn.Module, b: torch.nn.Module) -> None:
    named = dict(b.named_parameters())
    assert named.keys() == dict(a.named_parameters()).keys()
    for name, p in a.named_parameters():
        assert torch.equal(p, named[name]), name


IDS = torch.randint(4, 30, (2, 9), generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize("kind,bits", [("trainer", 4), ("trainer", 8), ("sft", 4)],
                         ids=["trainer-nf4", "trainer-int8", "sft-nf4"])
def test_quantized_base_trains_saves_and_resumes_through_the_trainer(tmp_path, base_dir, kind, bits):
    """The integrated Trainer refused a 4-bit or 8-bit base ("cannot perform fine-tuning on purely quantized
    models"), TRL's SFTTrainer cast its 16-bit params to bf16, and a resume could not put the checkpoint's deltas
    back on the packed model: it now trains, saves the fine-tune and resumes bit for bit."""
    cls = sparse_trainer(trl.SFTTrainer if kind == "sft" else transformers.Trainer)
    straight = _packed(base_dir, bits)
    trainer = cls(**_kwargs(kind, straight, tmp_path / "b", save_strategy="steps", save_steps=2))
    assert straight.model.embed_tokens.weight.dtype == torch.float32, "the base's 16-bit weights stay as loaded"
    trainer.train()
    assert not getattr(straight, "_hf_peft_config_loaded", False)
    deltas = {n: p for n, p in straight.named_parameters() if n.endswith(sift.quantized.DELTA)}
    assert len(deltas) == 8 and all(p.count_nonzero() > 0 for p in deltas.values())

    checkpoint = tmp_path / "b" / "checkpoint-2"
    assert "sift_config.json" in os.listdir(checkpoint) and "model.safetensors" not in os.listdir(checkpoint)
    resumed = _packed(base_dir, bits)
    again = cls(**_kwargs(kind, resumed, tmp_path / "b"))
    again.train(resume_from_checkpoint=str(checkpoint))
    assert again.state.global_step == 4
    _assert_same_params(resumed, straight)

    trainer.save_model(str(tmp_path / "tune"))
    assert "model.safetensors" not in os.listdir(tmp_path / "tune")
    tune = SparseDelta.from_pretrained(tmp_path / "tune")
    fresh = _packed(base_dir, bits)
    sift.quantized.attach_delta_(fresh, tune)
    # In train mode (no dropout here): in eval mode bitsandbytes repacks the untrained 4-bit layers for its CPU
    # kernel, which needs 32 | out_features.
    straight.train(), fresh.train()
    with torch.no_grad():
        tuned = straight(IDS).logits
        assert torch.equal(fresh(IDS).logits, tuned)
    assert sorted(tune.entries) == sorted(n.replace(sift.quantized.DELTA, "weight") for n in deltas)


def test_quantized_model_named_with_a_quantization_config_is_refused_up_front(tmp_path):
    """TRL would load a quantized model named by id and Trainer.__init__ refuse it: the integrated class says to
    pass the loaded model, before anything loads."""
    cls = sparse_trainer(trl.SFTTrainer)
    quant = transformers.BitsAndBytesConfig(load_in_4bit=True)
    with pytest.raises(ValueError, match="quantization_config"):
        cls(model="some/model", args=_args(tmp_path, trl.SFTConfig), quantization_config=quant,
            train_dataset=datasets.Dataset.from_dict({"text": ["ab"]}), density=DENSITY)
