"""A causal LM through `sift.integrations.sparse_trainer`: a 4-bit or 8-bit base, loss on the answer tokens only,
`generate` and the text-generation pipeline on the fine-tune (reloaded or merged), a tied head frozen, sparse or
dense, and gradient checkpointing over bf16 weights. A tiny random Llama (tied head) and a letter tokenizer:
nothing is downloaded."""

from __future__ import annotations

import os

import pytest
import torch

import sift
from conftest import assert_best_checkpoint_loaded
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


def _manual_loop(reference: torch.nn.Module, opt: SparseAdamW, batches: list) -> list[float]:
    """Replay a recorded Trainer's batches by hand: the model's own loss over each batch's token count (what the
    Trainer computes; a plain Trainer refuses a quantized model), sift's clip to 0.05, a step. Returns the norms."""
    norms = []
    for inputs, num_items in batches:
        opt.zero_grad()
        reference(**inputs, num_items_in_batch=num_items).loss.backward()
        norms.append(sift.clip_grad_norm_(opt, 0.05).item())
        opt.step()
    return norms


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


def _chat_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """The letter tokenizer with a chat template that marks the answers (`{% generation %}`) and adds no role
    tokens: a prompt is its letters, an answer its letters and `</s>`."""
    tokenizer = _tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}"
                               "{{ m['content'] }}{{ eos_token }}{% endgeneration %}{% else %}{{ m['content'] }}"
                               "{% endif %}{% endfor %}")
    return tokenizer


PAIRS = [("hello", "world"), ("sparse", "finetune"), ("abc", "def"), ("quiet", "zones")]


def _answer_data(form: str) -> datasets.Dataset:
    if form == "messages":
        return datasets.Dataset.from_dict({"messages": [[{"role": "user", "content": p},
                                                         {"role": "assistant", "content": c}] for p, c in PAIRS]})
    return datasets.Dataset.from_dict({"prompt": [p for p, _ in PAIRS], "completion": [c for _, c in PAIRS]})


def _answer_labels(input_ids: torch.Tensor, tokenizer) -> torch.Tensor:
    """The labels of a batch built here from PAIRS, not by TRL: each answer's tokens and `</s>`, the prompt
    and the padding -100."""
    labels = torch.full_like(input_ids, -100)
    rows = {tuple(tokenizer(p + c)["input_ids"]) + (tokenizer.eos_token_id,): len(p) for p, c in PAIRS}
    for row, ids in enumerate(input_ids.tolist()):
        while ids and ids[-1] == tokenizer.pad_token_id:
            ids = ids[:-1]
        prompt_length = rows[tuple(ids)]
        labels[row, prompt_length:len(ids)] = input_ids[row, prompt_length:len(ids)]
    return labels


def _answer_trainer(form: str, model, out, max_steps: int = 4, **kwargs):
    option = {"assistant_only_loss": True} if form == "messages" else {"completion_only_loss": True}
    return _recording(sparse_trainer(trl.SFTTrainer))(
        model=model, args=_args(out, trl.SFTConfig, max_steps=max_steps, **option), train_dataset=_answer_data(form),
        processing_class=_chat_tokenizer(), density=DENSITY, **kwargs)


@pytest.mark.parametrize("form", ["messages", "prompt-completion"])
def test_loss_on_the_answer_tokens_only_trains_as_a_manual_loop(tmp_path, form):
    """SFTTrainer's answer-only loss (assistant_only_loss on chats, completion_only_loss on prompt/completion)
    through sparse_trainer: the prompt's labels are -100 in every batch, and the weights are a manual loop's
    over labels built here, bit for bit (and not the unmasked loop's)."""
    model = _llama()
    trainer = _answer_trainer(form, model, tmp_path / "run")
    trainer.train()
    tokenizer = _chat_tokenizer()
    assert len(trainer.batches) == 4
    for inputs, _ in trainer.batches:
        assert torch.equal(inputs["labels"], _answer_labels(inputs["input_ids"], tokenizer))

    def manual(masked: bool) -> torch.nn.Module:
        reference = _llama()
        # The plain class computes the loss (TRL's SFT loss, which patches the model it is given) from the labels
        # given here.
        loss_of = trl.SFTTrainer(model=reference, args=_args(tmp_path / "ref", trl.SFTConfig),
                                 train_dataset=_answer_data(form), processing_class=tokenizer)
        reference.train()
        opt = SparseAdamW.for_model(reference, density=DENSITY, lr=1e-2, weight_decay=0.0)
        for inputs, num_items in trainer.batches:
            ids, mask = inputs["input_ids"], inputs["attention_mask"]
            labels = _answer_labels(ids, tokenizer) if masked else ids.masked_fill(mask == 0, -100)
            opt.zero_grad()
            loss_of.compute_loss(reference, {**inputs, "labels": labels}, num_items_in_batch=num_items).backward()
            sift.clip_grad_norm_(opt, 0.05)
            opt.step()
        return reference

    _assert_same_params(model, manual(masked=True))
    unmasked = manual(masked=False)
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), unmasked.parameters()))


HEADS = {  # the tied head (lm_head is embed_tokens): frozen (the default), trained sparsely, trained densely
    "head-frozen": {},
    "head-sparse": {"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "lm_head"]},
    "head-dense": {"dense_modules": ["lm_head"]},
}


def _greedy(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                              pad_token_id=0)


@pytest.mark.parametrize("head", list(HEADS))
def test_generation_from_the_reloaded_and_the_merged_fine_tune(tmp_path, head):
    """A tied-head chat fine-tune through sparse_trainer(SFTTrainer), reloaded onto a fresh base and merged into a
    plain checkpoint (AutoModelForCausalLM): the same weights bit for bit, the head still tied, and the same
    greedy tokens from generate and the text-generation pipeline as the trained model."""
    model = _llama()
    trainer = _answer_trainer("messages", model, tmp_path / "run", max_steps=2, **HEADS[head])
    trainer.train()
    trainer.save_model(str(tmp_path / "tune"))
    tune = SparseDelta.from_pretrained(tmp_path / "tune")
    tied = {"head-frozen": [], "head-sparse": ["model.embed_tokens.weight"], "head-dense": []}[head]
    assert [n for n in tune.entries if "embed" in n] == tied
    assert list(tune.dense) == (["model.embed_tokens.weight"] if head == "head-dense" else [])

    reloaded = _llama()
    tune.apply_(reloaded)
    sift.merge_and_save(_llama(), SparseDelta.from_pretrained(tmp_path / "tune"), tmp_path / "merged")
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    tokenizer = _chat_tokenizer()
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hello"}], return_tensors="pt",
                                        return_dict=True)["input_ids"]
    model.eval()
    expected = _greedy(model, ids)
    with torch.no_grad():
        assert not torch.equal(_llama()(ids).logits, model(ids).logits), "training must change the logits"
    text = tokenizer.decode(expected[0, ids.shape[1]:])
    for other in (reloaded, merged):
        assert other.lm_head.weight is other.model.embed_tokens.weight
        _assert_same_params(other, model)
        assert torch.equal(_greedy(other, ids), expected)
        generator = transformers.pipeline("text-generation", model=other, tokenizer=tokenizer, device="cpu")
        out = generator("hello", max_new_tokens=8, do_sample=False, return_full_text=False, pad_token_id=0)
        assert out[0]["generated_text"].replace(" ", "") == text.replace(" ", "")


@pytest.mark.parametrize("memory", ["low", "plain"])
def test_gradient_checkpointing_over_bf16_weights_trains_as_a_manual_loop_and_resumes(tmp_path, memory):
    """The integrated Trainer with activation checkpointing over a bf16 Llama equals a manual loop over the same
    checkpointed model bit for bit, and a resume from its mid-run checkpoint equals the uninterrupted run."""
    model = _llama(torch.bfloat16)
    cls = _recording(sparse_trainer(transformers.Trainer))
    trainer = cls(model=model, args=_args(tmp_path / "run", activation_checkpointing=True, save_strategy="steps",
                                          save_steps=2), train_dataset=_lm_data(), density=DENSITY, memory=memory)
    trainer.train()
    assert model.is_activation_checkpointing

    reference = _llama(torch.bfloat16)
    reference.activation_checkpointing_enable()
    reference.train()
    opt = SparseAdamW.for_model(reference, density=DENSITY, lr=1e-2, weight_decay=0.0, memory=memory)
    norms = _manual_loop(reference, opt, trainer.batches)
    assert [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h] == norms
    _assert_same_params(model, reference)
    assert not torch.equal(model.model.layers[0].self_attn.q_proj.weight,
                           _llama(torch.bfloat16).model.layers[0].self_attn.q_proj.weight)

    resumed = _llama(torch.bfloat16)
    again = cls(model=resumed, args=_args(tmp_path / "run", activation_checkpointing=True), train_dataset=_lm_data(),
                density=DENSITY, memory=memory)
    again.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    _assert_same_params(resumed, model)


def test_quantized_base_load_best_model_at_end(tmp_path, base_dir):
    """load_best_model_at_end over an 8-bit base puts the best checkpoint's deltas back on the packed layers (the
    checkpoint holds no model.safetensors), and save_model then writes that fine-tune."""
    saved = {}

    class Snapshot(transformers.TrainerCallback):
        def on_save(self, args, state, control, model=None, **kwargs):
            saved[state.global_step] = {n: p.detach().clone() for n, p in model.named_parameters()}

    model = _packed(base_dir, 8)
    data = _lm_data()
    args = _args(tmp_path / "run", max_steps=3, per_device_train_batch_size=4, eval_strategy="steps", eval_steps=1,
                 save_strategy="steps", save_steps=1, load_best_model_at_end=True, metric_for_best_model="eval_loss",
                 greater_is_better=True, per_device_eval_batch_size=4)
    trainer = sparse_trainer(transformers.Trainer)(model=model, args=args, train_dataset=data, eval_dataset=data,
                                                   density=DENSITY, callbacks=[Snapshot()])
    trainer.train()
    best = assert_best_checkpoint_loaded(trainer, model, saved)
    trainer.save_model(str(tmp_path / "tune"))
    fresh = _packed(base_dir, 8)
    sift.quantized.attach_delta_(fresh, SparseDelta.from_pretrained(tmp_path / "tune"))
    model.train(), fresh.train()
    with torch.no_grad():
        assert torch.equal(fresh(IDS).logits, model(IDS).logits)


@pytest.mark.parametrize("bits", [4, 8], ids=["nf4", "int8"])
def test_quantized_base_clips_like_a_manual_loop(tmp_path, base_dir, bits):
    """The Trainer's max_grad_norm over a 4-bit or 8-bit base goes through sift's clip: the packed layers' deltas and
    the logged grad_norm equal a manual loop's over the same batches, and the clip bites."""
    model = _packed(base_dir, bits)
    trainer = _recording(sparse_trainer(transformers.Trainer))(**_kwargs("trainer", model, tmp_path / "run"))
    trainer.train()
    reference = _packed(base_dir, bits)
    opt = SparseAdamW.for_model(reference, density=DENSITY, lr=1e-2, weight_decay=0.0)  # TrainingArguments'
    reference.train()
    norms = _manual_loop(reference, opt, trainer.batches)
    assert [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h] == norms
    assert any(n > 0.05 for n in norms), "the clip must bite for the test to mean anything"
    _assert_same_params(model, reference)
