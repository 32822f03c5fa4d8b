"""A fine-tune in one call (`sift.from_pretrained(base, directory)`, `sift.from_pretrained(directory)`), switched
off exactly (`sift.disabled`), and the errors that name the models when a delta meets another architecture."""

from __future__ import annotations

import json
import re
import shutil
import warnings

import pytest
import torch
from torch import nn

import sift
from sift import SparseDelta

transformers = pytest.importorskip("transformers")
HUB_NAME = "org/tiny-llama"  # a base "on the Hub": the tests map it to a local folder, never to the network
IDS = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6], [5, 3, 5, 8, 9, 7, 9, 3]])


def _llama(seed: int = 0):
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return transformers.LlamaForCausalLM(config).eval()


def _tuned_copy(model, seed: int = 1):
    """The model with every floating-point weight moved a little: a stand-in for a fine-tune."""
    tuned = _llama()
    tuned.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in tuned.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return tuned


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


@pytest.fixture
def base_folder(tmp_path):
    folder = tmp_path / "base"
    _llama().save_pretrained(folder)
    return folder


def _load(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder).eval()


def _fine_tune(base_folder, directory, **save_kwargs):
    """A delta made on the base loaded from `base_folder`, saved to `directory`; the in-place tuned logits."""
    base = _load(base_folder)
    delta = SparseDelta.from_diff(base, _tuned_copy(base), density=0.3)
    delta.save_pretrained(directory, base, **save_kwargs)
    delta.apply_(base)
    return _logits(base)


def test_onto_a_given_base_in_one_call_gives_the_in_place_logits_bit_for_bit(base_folder, tmp_path):
    with pytest.warns(UserWarning, match="local folder"):
        tuned = _fine_tune(base_folder, tmp_path / "tune")
    model = sift.from_pretrained(_load(base_folder), tmp_path / "tune")
    assert torch.equal(_logits(model), tuned)


def test_from_the_directory_alone_loads_the_recorded_local_base(base_folder, tmp_path):
    with pytest.warns(UserWarning, match=r"base_model='org/name'"):
        tuned = _fine_tune(base_folder, tmp_path / "tune")
    config = json.loads((tmp_path / "tune" / "sift_config.json").read_text())["base_model"]
    assert config["name_or_path"] == str(base_folder) and config["local"] is True
    assert config["model_class"] == "LlamaForCausalLM" and config["model_type"] == "llama"
    model = sift.from_pretrained(tmp_path / "tune")
    assert type(model).__name__ == "LlamaForCausalLM"
    assert torch.equal(_logits(model), tuned)
    with sift.disabled(model):
        assert torch.equal(_logits(model), _logits(_load(base_folder)))


def test_a_hub_base_is_recorded_by_name_and_loaded_by_it(base_folder, tmp_path, monkeypatch):
    real = transformers.LlamaForCausalLM.from_pretrained.__func__
    asked = []

    def from_hub(cls, name, *args, **kwargs):
        asked.append(name)
        return real(cls, base_folder if name == HUB_NAME else name, *args, **kwargs)

    base = _load(base_folder)
    base.config._name_or_path = HUB_NAME  # as transformers sets it for a model from the Hub
    delta = SparseDelta.from_diff(base, _tuned_copy(base), density=0.3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a Hub name: nothing to warn about
        delta.save_pretrained(tmp_path / "tune", base)
    config = json.loads((tmp_path / "tune" / "sift_config.json").read_text())["base_model"]
    assert config["name_or_path"] == HUB_NAME and config["local"] is False
    delta.apply_(base)
    monkeypatch.setattr(transformers.LlamaForCausalLM, "from_pretrained", classmethod(from_hub))
    model = sift.from_pretrained(tmp_path / "tune")
    assert asked == [HUB_NAME]
    assert torch.equal(_logits(model), _logits(base))


def _hub_cache(base_folder, cache, commit: str = "0123456789abcdef0123456789abcdef01234567"):
    """`cache` laid out as huggingface_hub's download cache holding `HUB_NAME` at `commit` (refs/main)."""
    repo = cache / ("models--" + HUB_NAME.replace("/", "--"))
    shutil.copytree(base_folder, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return commit


def test_a_hub_base_resolves_through_the_hub_cache_by_its_recorded_name(base_folder, tmp_path, monkeypatch):
    """The base named as transformers names a Hub model (its name set by transformers itself, not by the test)
    is found again by that name through the Hub's cache, offline."""
    huggingface_hub = pytest.importorskip("huggingface_hub")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # no request, not even a HEAD
    _hub_cache(base_folder, tmp_path / "hub")
    hub = {"cache_dir": str(tmp_path / "hub"), "local_files_only": True}
    base = transformers.AutoModelForCausalLM.from_pretrained(HUB_NAME, **hub).eval()
    delta = SparseDelta.from_diff(base, _tuned_copy(base), density=0.3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a Hub name: nothing to warn about
        delta.save_pretrained(tmp_path / "tune", base)
    config = json.loads((tmp_path / "tune" / "sift_config.json").read_text())["base_model"]
    assert (config["name_or_path"], config["local"]) == (HUB_NAME, False)
    delta.apply_(base)
    model = sift.from_pretrained(tmp_path / "tune", **hub)
    assert model.config.name_or_path == HUB_NAME
    assert torch.equal(_logits(model), _logits(base))
    with pytest.raises(FileNotFoundError, match=re.escape(repr(HUB_NAME))):  # not in that cache: named, with the fix
        sift.from_pretrained(tmp_path / "tune", cache_dir=str(tmp_path / "empty"), local_files_only=True)


def test_save_pretrained_records_the_hub_name_it_is_given_for_a_local_base(base_folder, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _fine_tune(base_folder, tmp_path / "tune", base_model=HUB_NAME)
    config = json.loads((tmp_path / "tune" / "sift_config.json").read_text())["base_model"]
    assert config["name_or_path"] == HUB_NAME and config["local"] is False


def test_a_missing_base_is_named_with_how_to_pass_it(base_folder, tmp_path):
    with pytest.warns(UserWarning):
        _fine_tune(base_folder, tmp_path / "tune")
    shutil.rmtree(base_folder)
    with pytest.raises(FileNotFoundError) as err:
        sift.from_pretrained(tmp_path / "tune")
    message = str(err.value)
    assert str(base_folder) in message and "sift.from_pretrained(base_model," in message and "base_model=" in message
    with pytest.raises(FileNotFoundError, match="'org/missing'.*sift.from_pretrained\\(base_model,"):
        sift.from_pretrained(tmp_path / "tune", base_model="org/missing", local_files_only=True)


def test_a_fine_tune_that_names_no_base_says_so(tmp_path):
    delta = SparseDelta.from_diff(nn.Linear(4, 3), nn.Linear(4, 3), density=0.5)
    delta.save_pretrained(tmp_path / "tune")
    with pytest.raises(FileNotFoundError, match="does not name its base model"):
        sift.from_pretrained(tmp_path / "tune")


def test_loading_options_with_a_given_base_are_refused(base_folder, tmp_path):
    with pytest.warns(UserWarning):
        _fine_tune(base_folder, tmp_path / "tune")
    with pytest.raises(TypeError, match="dtype"):
        sift.from_pretrained(_load(base_folder), tmp_path / "tune", dtype=torch.bfloat16)


def test_the_model_card_loads_with_import_sift_and_the_one_call(base_folder, tmp_path):
    _fine_tune(base_folder, tmp_path / "tune", base_model=HUB_NAME)
    card = (tmp_path / "tune" / "README.md").read_text()
    assert "import sift" in card
    assert 'model = sift.from_pretrained("path/to/this/directory")  # loads org/tiny-llama' in card
    assert 'sift.from_pretrained(base_model, "path/to/this/directory")' in card
    assert "with sift.disabled(model):" in card


# --- sift.disabled -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_disabled_gives_the_base_then_the_tuned_outputs_bit_for_bit(dtype):
    base = _llama().to(dtype)
    plain = _logits(base)
    tuned_model = _tuned_copy(_llama()).to(dtype)
    first = SparseDelta.from_diff(base, tuned_model, density=0.2)
    second = 0.5 * SparseDelta.from_diff(base, tuned_model, density=0.4)  # overlaps the first's entries
    head = SparseDelta(base=None, dense={"lm_head.weight": tuned_model.lm_head.weight.detach().clone()})
    for delta in (first, second, head):
        delta.apply_(base)
    weights = {n: p.clone() for n, p in base.state_dict().items()}
    tuned = _logits(base)
    assert not torch.equal(tuned, plain)
    with sift.disabled(base) as model:
        assert model is base and torch.equal(_logits(base), plain)
        with sift.disabled(base):  # nested: still off
            assert torch.equal(_logits(base), plain)
        assert torch.equal(_logits(base), plain)
    assert torch.equal(_logits(base), tuned)
    assert all(torch.equal(p, weights[n]) for n, p in base.state_dict().items())
    head.remove_(base)  # the deltas come off as before
    second.remove_(base)
    first.remove_(base)
    assert torch.equal(_logits(base), plain)


def test_disabled_restores_the_tuned_weights_when_the_block_raises():
    base = _llama()
    SparseDelta.from_diff(base, _tuned_copy(base), density=0.3).apply_(base)
    tuned = _logits(base)
    with pytest.raises(KeyError):
        with sift.disabled(base):
            raise KeyError("inside")
    assert torch.equal(_logits(base), tuned)


def test_apply_and_remove_are_refused_inside_disabled():
    base = _llama()
    delta = SparseDelta.from_diff(base, _tuned_copy(base), density=0.3)
    delta.apply_(base)
    other = SparseDelta.from_diff(base, _tuned_copy(base, seed=2), density=0.1)
    with sift.disabled(base):
        with pytest.raises(sift.DeltaError, match="switched off"):
            delta.remove_(base)
        with pytest.raises(sift.DeltaError, match="switched off"):
            other.apply_(base, stack=True)
    delta.remove_(base)


# --- quantized bases through the same calls ------------------------------------------------------------------


def _quantized_pair(kind: str):
    """A two-layer bitsandbytes MLP (4-bit NF4 or LLM.int8()) and its 16-bit source, on the CPU."""
    bnb = pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    source = nn.Sequential(nn.Linear(40, 24), nn.Tanh(), nn.Linear(24, 9))

    def layer(n_in, n_out):
        if kind == "int8":
            return bnb.nn.Linear8bitLt(n_in, n_out, has_fp16_weights=False)
        return bnb.nn.Linear4bit(n_in, n_out, compute_dtype=torch.float32, quant_type="nf4")

    def quantized():
        model = nn.Sequential(layer(40, 24), nn.Tanh(), layer(24, 9))
        model.load_state_dict(source.state_dict())
        return model.to("cpu")  # bitsandbytes quantizes on the move

    return quantized


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_a_quantized_base_takes_the_fine_tune_through_the_same_call_and_switches_off(kind, tmp_path):
    quantized = _quantized_pair(kind)
    model = quantized()
    opt = sift.SparseAdamW.for_model(model, density=0.1, lr=1e-2, target_modules=["0", "2"])
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(6, 40, generator=gen), torch.randn(6, 9, generator=gen)
    for _ in range(3):
        (model(x) - y).square().mean().backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        tuned = model(x)
    SparseDelta.from_optimizer(opt, model).save_pretrained(tmp_path / "tune", model)

    bare = quantized()
    with torch.no_grad():
        plain = bare(x)
    fresh = sift.from_pretrained(quantized(), tmp_path / "tune")
    with torch.no_grad():
        assert torch.equal(fresh(x), tuned) and not torch.equal(tuned, plain)
        with sift.disabled(fresh):
            assert torch.equal(fresh(x), plain)
        assert torch.equal(fresh(x), tuned)

    again = quantized()
    delta = SparseDelta.from_pretrained(tmp_path / "tune")
    delta.apply_(again)  # apply_ takes a quantized base too
    with torch.no_grad():
        assert torch.equal(again(x), tuned)
        delta.remove_(again)
        assert torch.equal(again(x), plain)
    assert not hasattr(again[0], "sift_delta")


# --- errors in one paragraph ---------------------------------------------------------------------------------


def test_a_delta_for_another_architecture_says_which_models_in_its_first_line():
    """A Llama delta applied to a GPT-2 listed one line per weight and never named the model it was made for."""
    llama = _llama()
    llama.config._name_or_path = HUB_NAME
    delta = SparseDelta.from_diff(llama, _tuned_copy(llama), density=0.3)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4,
                                                                bos_token_id=0, eos_token_id=0))
    gpt2.config._name_or_path = "org/tiny-gpt2"
    before = {n: p.clone() for n, p in gpt2.state_dict().items()}
    with pytest.raises(sift.DeltaError) as err:
        delta.apply_(gpt2)
    lines = str(err.value).splitlines()
    assert lines[0].startswith("cannot apply the sparse delta: it was made for 'org/tiny-llama' (LlamaForCausalLM), "
                               "and the given model is 'org/tiny-gpt2' (GPT2LMHeadModel)")
    assert len(lines) <= 4, lines
    assert any(re.fullmatch(r"  - \d+ of the delta's 21 weights are not in the model: model\.embed_tokens\.weight; "
                            r"[^;]+; [^;]+; and \d+ more", line) for line in lines), lines
    assert all(torch.equal(p, before[n]) for n, p in gpt2.state_dict().items())


def test_a_delta_read_from_its_directory_names_its_recorded_base(base_folder, tmp_path):
    _fine_tune(base_folder, tmp_path / "tune", base_model=HUB_NAME)
    other = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4,
                                                                 bos_token_id=0, eos_token_id=0))
    with pytest.raises(sift.DeltaError, match=r"^cannot apply the sparse delta: it was made for 'org/tiny-llama' "
                                              r"\(LlamaForCausalLM\), and the given model is a GPT2LMHeadModel"):
        sift.from_pretrained(other, tmp_path / "tune")
