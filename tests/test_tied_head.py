"""A causal LM whose lm_head is tied to its input embeddings, trained densely through `dense_modules=["lm_head"]`:
its delta goes back onto the base it was trained from."""

from __future__ import annotations

import copy

import pytest
import torch

import sift
from sift import SparseAdamW

transformers = pytest.importorskip("transformers")


def _tied_llama(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1,
                                      eos_token_id=2, tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(config)


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(3, 64, (4, 7), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("memory", ["plain", "low"])
@pytest.mark.parametrize("with_base", [False, True], ids=["fingerprint-from-model", "base-given"])
def test_a_densely_trained_tied_head_reloads_applies_and_merges_bit_for_bit(tmp_path, memory, with_base):
    """The fingerprint kept the trained lm_head.weight samples (the tied head's other name), so its own base refused it."""
    model = _tied_llama()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    base_state = copy.deepcopy(model.state_dict())
    opt = SparseAdamW.for_model(model, density=0.1, lr=1e-2, dense_modules=["lm_head"], memory=memory)
    for step in range(2):
        model(_ids(step), labels=_ids(step)).loss.backward()
        opt.step()
        opt.zero_grad()
    ids = _ids(9)
    with torch.no_grad():
        tuned = model(ids).logits
    delta = sift.SparseDelta.from_optimizer(opt, model, base=base_state if with_base else None)
    assert list(delta.dense) == ["model.embed_tokens.weight"] and delta.base is not None
    delta.save_pretrained(tmp_path / "tune", model)

    fresh = _tied_llama()
    loaded = sift.SparseDelta.from_pretrained(tmp_path / "tune")
    loaded.apply_(fresh)
    with torch.no_grad():
        assert torch.equal(fresh(ids).logits, tuned)
    loaded.remove_(fresh)
    with torch.no_grad():
        assert torch.equal(fresh.model.embed_tokens.weight, base_state["model.embed_tokens.weight"])

    sift.merge_and_save(_tied_llama(), loaded, tmp_path / "merged")
    merged = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "merged")
    with torch.no_grad():
        assert torch.equal(merged(ids).logits, tuned)

    other = _tied_llama(seed=1)  # still refused: another base
    with pytest.raises(sift.DeltaError, match="another base model"):
        loaded.apply_(other)
