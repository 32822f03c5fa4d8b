"""A delta goes back onto the base it was trained over, and only onto it: a causal LM whose lm_head is tied to
its input embeddings, trained densely through `dense_modules=["lm_head"]`; a 4-bit or int8 base, whose delta
also merges into the 16-bit model it was quantized from."""

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


def _source(seed: int) -> torch.nn.Module:
    """A 16-bit (fp32) MLP with odd shapes and a head that stays 16-bit."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(40, 24), torch.nn.Tanh(), torch.nn.Linear(24, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 5))


def _quantized(source: torch.nn.Module, quant_type: str) -> torch.nn.Module:
    """`source` with its first two layers quantized by bitsandbytes on the CPU (NF4, FP4 or LLM.int8())."""
    bnb = pytest.importorskip("bitsandbytes")

    def layer(n_in, n_out):
        if quant_type == "int8":
            return bnb.nn.Linear8bitLt(n_in, n_out, has_fp16_weights=False)
        return bnb.nn.Linear4bit(n_in, n_out, compute_dtype=torch.float32, quant_type=quant_type)

    model = torch.nn.Sequential(layer(40, 24), torch.nn.Tanh(), layer(24, 16), torch.nn.Tanh(), torch.nn.Linear(16, 5))
    model.load_state_dict(source.state_dict())
    return model.to("cpu")  # bitsandbytes quantizes on the move


@pytest.mark.parametrize("quant_type", ["nf4", "fp4", "int8"])
def test_a_quantized_fine_tunes_delta_is_refused_by_another_base_and_fits_its_own(quant_type, tmp_path):
    """A delta trained over a 4-bit base had no base check: it applied silently to an unrelated 16-bit model."""
    source = _source(seed=0)
    model = _quantized(source, quant_type)
    opt = SparseAdamW.for_model(model, density=0.1, lr=1e-2, target_modules=["0", "2"], dense_modules=["4"])
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        x, y = torch.randn(6, 40, generator=gen), torch.randn(6, 5, generator=gen)
        (model(x) - y).square().mean().backward()
        opt.step()
        opt.zero_grad()
    x = torch.randn(6, 40, generator=gen)
    with torch.no_grad():
        tuned = model(x)
    delta = sift.SparseDelta.from_optimizer(opt, model)
    assert delta.base is not None and sorted(delta.dense) == ["4.bias", "4.weight"]
    delta.save(tmp_path / "delta.safetensors")  # the tolerances travel with the fingerprint
    delta = sift.SparseDelta.load(tmp_path / "delta.safetensors")
    assert delta.base.tolerances.keys() == {"0.weight", "2.weight"}

    unrelated = _source(seed=1)  # same names, shapes and dtypes
    with pytest.raises(sift.DeltaError, match="another base model") as err:
        delta.apply_(unrelated)
    assert "0.weight" in str(err.value) or "0.bias" in str(err.value)
    with pytest.raises(sift.DeltaError, match="another base model"):
        sift.quantized.attach_delta_(_quantized(_source(seed=1), quant_type), delta)
    weights_only = sift.SparseDelta({n: delta[n] for n in ("0.weight", "2.weight")}, delta.base)
    with pytest.raises(sift.DeltaError, match="sampled base values differ"):  # the quantized weights alone tell
        weights_only.apply_(_source(seed=1))

    fresh = _quantized(_source(seed=0), quant_type)  # its own base, reloaded in 4 or 8 bits
    sift.quantized.attach_delta_(fresh, delta)
    with torch.no_grad():
        assert torch.equal(fresh(x), tuned)
    own = copy.deepcopy(source)  # the 16-bit model it was quantized from
    delta.apply_(own)
    assert torch.equal(own[4].weight, model[4].weight)
    weights_only.apply_(copy.deepcopy(source))
