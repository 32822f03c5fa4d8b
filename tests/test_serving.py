"""ServedDeltas on a tiny random Llama: every row of a mixed batch gets what its fine-tune applied in place
(`apply_`) alone gives, rows on the base the base's bits, greedy generation with left padding follows
each row's fine-tune through the decode steps, and refusals (unknown name, another base, dense parts,
a weight no linear layer owns) change nothing."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import served_and_applied

from sift import DeltaError, ServedDeltas, SparseDelta
from sift.delta import DeltaEntry

transformers = pytest.importorskip("transformers")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# One rule for every dtype (the low-precision rule): a served row's error against the fine-tune's fp64
# forward is at most RATIO x the in-place fine-tune's own error in that dtype, plus ULPS units of the
# dtype's epsilon at the logits' magnitude. Served rows round the base product before the delta's term is
# added (one more rounding per hooked layer): in fp32 that is ~1e-7 relative per layer (measured: served
# and in-place logits within 2.5e-6), in bf16/fp16 about one unit of the output per layer.
RATIO, ULPS = 2, 4
EPS = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}
VOCAB = 97


def _base(dtype=torch.float32, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return transformers.LlamaForCausalLM(config).to(dtype).eval()


def _fine_tune(model: torch.nn.Module, seed: int, density: float = 0.05, scale: float = 0.3,
               only: str | None = None) -> SparseDelta:
    """A sparse fine-tune of every linear layer (or those whose name contains `only`)."""
    gen = torch.Generator().manual_seed(seed)
    tuned = copy.deepcopy(model)
    with torch.no_grad():
        for name, m in tuned.named_modules():
            if isinstance(m, torch.nn.Linear) and (only is None or only in name):
                mask = torch.rand(m.weight.shape, generator=gen) < density
                m.weight += (mask * torch.randn(m.weight.shape, generator=gen) * scale).to(m.weight.dtype)
    return SparseDelta.from_diff(model, tuned, density=1.0)


def _empty(model: torch.nn.Module) -> SparseDelta:
    """A delta with no entry at all, fingerprinted with the model."""
    return SparseDelta.from_diff(model, model, density=1.0)


def _ids(rows: int = 5, length: int = 7, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))


def _hooks(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) for m in model.modules())


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_each_row_gets_its_fine_tune_and_base_rows_their_bits(dtype):
    base = _base(dtype)
    deltas = {"a": _fine_tune(base, 1), "b": _fine_tune(base, 2, only="mlp"), "empty": _empty(base)}
    served = ServedDeltas(base)
    for name, d in deltas.items():
        served.load_delta(name, d)
    assert served.list_deltas() == ["a", "b", "empty"]
    rows = ["a", None, "b", "a", "empty", None]
    ids = _ids(len(rows))
    with torch.no_grad():
        plain = base(ids).logits
        got = served(ids, delta_names=rows).logits
        own = {}
        for name, d in deltas.items():
            d.apply_(base)
            own[name] = (base(ids).logits, copy.deepcopy(base).double()(ids).logits)
            d.remove_(base)
    assert torch.equal(base(ids).logits, plain), "serving changed the base"
    for r, name in enumerate(rows):
        if name in (None, "empty"):
            assert torch.equal(got[r], plain[r]), f"row {r} ({name}) is not the base's bits"
            continue
        applied, truth = own[name][0][r].double(), own[name][1][r]
        err, applied_err = (got[r].double() - truth).abs().max(), (applied - truth).abs().max()
        atol = ULPS * EPS[dtype] * truth.abs().max()
        assert err <= RATIO * applied_err + atol, f"row {r}: {err:.3g} > {RATIO} x {applied_err:.3g} + {atol:.3g}"
        assert not torch.equal(got[r], plain[r])
        if dtype == torch.float32:
            assert (got[r].double() - applied).abs().max() < 1e-5
    # The rows' context ends with the call: the same model serves the base again.
    assert torch.equal(base(ids).logits, plain)


def test_one_delta_on_every_row_equals_the_fine_tune_and_all_none_is_the_base():
    base = _base()
    d = _fine_tune(base, 3)
    served = ServedDeltas(base)
    served.load_delta("d", d)
    ids = _ids(3)
    with torch.no_grad():
        plain = base(ids).logits
        with served.rows([None, None, None]):
            assert torch.equal(base(ids).logits, plain)
        with served.rows(["d"] * 3):
            got = base(ids).logits
        d.apply_(base)
        want = base(ids).logits
        d.remove_(base)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def _padded_prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """Four prompts of 3 to 6 tokens, left-padded with 0."""
    gen = torch.Generator().manual_seed(4)
    lengths = [6, 3, 5, 4]
    ids = torch.zeros(4, 6, dtype=torch.long)
    mask = torch.zeros(4, 6, dtype=torch.long)
    for r, n in enumerate(lengths):
        ids[r, 6 - n:] = torch.randint(3, VOCAB, (n,), generator=gen)
        mask[r, 6 - n:] = 1
    return ids, mask


def test_greedy_generation_of_a_mixed_batch_equals_each_fine_tunes_own():
    base = _base()
    deltas = {"a": _fine_tune(base, 5, scale=0.6), "b": _fine_tune(base, 6, scale=0.6)}
    served = ServedDeltas(base)
    for name, d in deltas.items():
        served.load_delta(name, d)
    ids, mask = _padded_prompts()
    rows = ["a", "b", None, "a"]
    kwargs = {"attention_mask": mask, "max_new_tokens": 10, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        got = served.generate(ids, delta_names=rows, **kwargs)
        own = {None: base.generate(ids, **kwargs)}
        for name, d in deltas.items():
            d.apply_(base)
            own[name] = base.generate(ids, **kwargs)
            d.remove_(base)
    for r, name in enumerate(rows):
        assert torch.equal(got[r], own[name][r]), f"row {r} ({name})"
    # The fine-tunes generate differently from each other and from the base: the test can fail.
    assert not torch.equal(own["a"][0], own[None][0]) and not torch.equal(own["a"][1], own["b"][1])


def test_beams_and_samples_follow_their_row():
    """generate's expanded rows (num_return_sequences) keep their prompt's delta."""
    base = _base()
    d = _fine_tune(base, 7, scale=0.6)
    served = ServedDeltas(base)
    served.load_delta("d", d)
    ids, mask = _padded_prompts()
    kwargs = {"attention_mask": mask, "max_new_tokens": 6, "num_beams": 2, "num_return_sequences": 2,
              "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        got = served.generate(ids, delta_names=["d", None, None, "d"], **kwargs)
        plain = base.generate(ids, **kwargs)
        d.apply_(base)
        tuned = base.generate(ids, **kwargs)
        d.remove_(base)
    assert got.shape[0] == 8 and not torch.equal(tuned[:2], plain[:2])
    for r, want in enumerate([tuned, plain, plain, tuned]):
        assert torch.equal(got[2 * r : 2 * r + 2], want[2 * r : 2 * r + 2]), f"row {r}"


def test_load_from_a_fine_tune_directory_and_unload(tmp_path):
    base = _base()
    a, b = _fine_tune(base, 8), _fine_tune(base, 9, only="self_attn")
    a.save_pretrained(tmp_path / "a", base)
    served = ServedDeltas(base)
    served.load_delta("a", str(tmp_path / "a"))
    served.load_delta("b", b)
    ids = _ids(2)
    with torch.no_grad():
        both = served(ids, delta_names=["a", "b"]).logits
        served.unload_delta("a")
        assert served.list_deltas() == ["b"]
        only_b = served(ids, delta_names=[None, "b"]).logits
        torch.testing.assert_close(only_b[1], both[1], rtol=0, atol=0)
        assert torch.equal(only_b[0], base(ids).logits[0])
        with pytest.raises(KeyError, match="no delta named 'a'"):
            served(ids, delta_names=["a", None])
        served.unload_delta("b")
    assert served.list_deltas() == [] and _hooks(base) == 0


# ---------------------------------------------------------------------------------------
# Refusals: a clear error, and nothing changes (deltas, hooks, the rows served).
# ---------------------------------------------------------------------------------------

def _refused(served: ServedDeltas, model: torch.nn.Module, error, match: str, call) -> None:
    before, hooks = served.list_deltas(), _hooks(model)
    weights = {n: p.clone() for n, p in model.state_dict().items()}
    with pytest.raises(error, match=match):
        call()
    assert served.list_deltas() == before and _hooks(model) == hooks
    assert all(torch.equal(p, weights[n]) for n, p in model.state_dict().items())


def test_refusals_change_nothing(tmp_path):
    base = _base()
    served = ServedDeltas(base)
    served.load_delta("a", _fine_tune(base, 10, only="mlp"))
    ids = _ids(2)
    with torch.no_grad():
        want = served(ids, delta_names=["a", None]).logits
    other = _base(seed=1)
    _refused(served, base, DeltaError, "made for another base model",
             lambda: served.load_delta("other", _fine_tune(other, 11)))
    _refused(served, base, DeltaError, "already loaded", lambda: served.load_delta("a", _fine_tune(base, 12)))
    dense_norm = _fine_tune(base, 13)
    dense_norm.dense["model.norm.weight"] = base.model.norm.weight.detach().clone() + 1
    _refused(served, base, DeltaError, "model.norm.weight: a dense part of a LlamaRMSNorm .* cannot be served per row",
             lambda: served.load_delta("dense_norm", dense_norm))
    embed = _fine_tune(base, 14)
    w = base.model.embed_tokens.weight
    embed.entries["model.embed_tokens.weight"] = DeltaEntry(tuple(w.shape), w.dtype,
                                                            torch.tensor([3], dtype=torch.int32), torch.tensor([0.5]))
    _refused(served, base, DeltaError, r"model.embed_tokens.weight: only linear layers' weights .*\(Embedding.weight\)",
             lambda: served.load_delta("embed", embed))
    norm = _fine_tune(base, 15)
    norm.entries["model.norm.weight"] = DeltaEntry((32,), torch.float32, torch.tensor([1], dtype=torch.int32),
                                                   torch.tensor([0.5]))
    _refused(served, base, DeltaError, "LlamaRMSNorm.weight", lambda: served.load_delta("norm", norm))
    _refused(served, base, KeyError, "no delta named 'b'", lambda: served(ids, delta_names=["a", "b"]))
    _refused(served, base, KeyError, "no delta named 'b'", lambda: served.unload_delta("b"))
    _refused(served, base, RuntimeError, "the batch has 2 rows, but 3 delta names",
             lambda: served(ids, delta_names=["a", None, None]))
    with served.rows(["a", None]):
        _refused(served, base, RuntimeError, "while rows are being served", lambda: served.unload_delta("a"))
    with torch.no_grad():
        assert torch.equal(served(ids, delta_names=["a", None]).logits, want)


def test_served_model_compiles_whole():
    """torch.compile(fullgraph=True) of the hooked model (the op, C++ on CPU, one node of the graph) gives the
    eager bits for two assignments of rows, and the base's bits outside `rows`."""
    base = _base()
    served = ServedDeltas(base)
    served.load_delta("a", _fine_tune(base, 16))
    served.load_delta("b", _fine_tune(base, 17, only="mlp"))
    ids = _ids(3)
    with torch.no_grad():
        torch._dynamo.reset()
        compiled = torch.compile(base, backend="aot_eager", fullgraph=True)
        for rows in (["a", None, "b"], ["b", "b", None]):
            want = served(ids, delta_names=rows).logits
            with served.rows(rows):
                assert torch.equal(compiled(ids).logits, want), rows
        assert torch.equal(compiled(ids).logits, base(ids).logits)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_switch_to_puts_one_delta_in_place_and_back(dtype):
    """switch_to: the weights apply_ gives each delta, bit for bit, one after the other, then the base's."""
    base = _base(dtype)
    deltas = {"a": _fine_tune(base, 18), "b": _fine_tune(base, 19, only="self_attn")}
    served, original, want = served_and_applied(base, deltas)
    for name in ("a", "b", "a", None):
        served.switch_to(name)
        assert served.in_place == name
        expected = original if name is None else want[name]
        assert all(torch.equal(p, expected[n]) for n, p in base.state_dict().items()), name
    assert not all(torch.equal(want["a"][n], want["b"][n]) for n in original)


def _small_steps(model: torch.nn.Module, seed: int, density: float = 0.05) -> SparseDelta:
    """A fine-tune moving 5% of each linear weight by at most a quarter of itself: every increment is exact in
    a 16-bit weight's dtype, as every step of at most half its weight is."""
    gen = torch.Generator().manual_seed(seed)
    tuned = copy.deepcopy(model)
    with torch.no_grad():
        for m in tuned.modules():
            if isinstance(m, torch.nn.Linear):
                mask = torch.rand(m.weight.shape, generator=gen) < density
                scale = 1 + mask * (torch.rand(m.weight.shape, generator=gen) - 0.5) / 2
                m.weight.copy_((m.weight.float() * scale).to(m.weight.dtype))
    return SparseDelta.from_diff(model, tuned, density=1.0)


def _bank_bytes(delta: SparseDelta, value_bytes: int) -> int:
    """Per [R, C] weight with entries, packed: a low byte and a value per entry, the unary buckets (a set bit
    per entry and a clear one per 256 positions) in 8-byte words, an int32 pointer per 32 rows and one more."""
    return sum(e.nnz * (1 + value_bytes) + 8 * -(-(e.nnz + -(-e.shape[0] * e.shape[1] // 256)) // 64)
               + (-(-e.shape[0] // 32) + 1) * 4 for e in delta.entries.values() if e.nnz)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_held_bytes_are_the_banks_and_16_bit_increments_stay_16_bit(dtype):
    """A fine-tune of small steps holds 3 bytes an entry over a 16-bit base (5 over fp32) plus its packed buckets;
    a delta whose increments need fp32 widens the banks it shares, changing no served bit, and its unload
    narrows them back; switch_to gives apply_'s bits from the 16-bit banks."""
    base = _base(dtype)
    small, wide = _small_steps(base, 30), _fine_tune(base, 31)
    served, original, want = served_and_applied(base, {"small": small})
    own = 4 if dtype == torch.float32 else 2
    assert served.held_bytes("small") == _bank_bytes(small, own)
    rows, ids = ["small", None, "small"], _ids(3)
    with torch.no_grad():
        narrow_rows = served(ids, delta_names=rows).logits
        served.load_delta("wide", wide)
        assert served.held_bytes("small") == _bank_bytes(small, 4)
        assert served.held_bytes("wide") == _bank_bytes(wide, 4)
        assert torch.equal(served(ids, delta_names=rows).logits, narrow_rows)
        served.unload_delta("wide")
    assert served.held_bytes("small") == _bank_bytes(small, own)
    assert not torch.equal(narrow_rows[0], base(ids).logits[0])
    served.switch_to("small")
    assert all(torch.equal(p, want["small"][n]) for n, p in base.state_dict().items())
    served.switch_to(None)
    assert all(torch.equal(p, original[n]) for n, p in base.state_dict().items())
    served.close()


def test_unloading_another_delta_while_one_is_in_place_keeps_the_switch_whole():
    """Regression: unhooking the layers only the unloaded delta touched shifted the saved base values of the
    delta in place onto the wrong layers, so the next switch refused them."""
    base = _base()
    deltas = {"attn": _fine_tune(base, 40, only="self_attn"), "mlp": _fine_tune(base, 41, only="mlp")}
    served, original, want = served_and_applied(base, deltas)
    hooked = _hooks(base)
    served.switch_to("attn")
    served.unload_delta("mlp")
    assert _hooks(base) < hooked
    assert all(torch.equal(p, want["attn"][n]) for n, p in base.state_dict().items())
    served.switch_to(None)
    assert all(torch.equal(p, original[n]) for n, p in base.state_dict().items())
    served.close()


def test_while_a_delta_is_in_place_rows_loads_and_its_unload_are_refused():
    base = _base()
    served = ServedDeltas(base)
    served.load_delta("a", _fine_tune(base, 20, only="mlp"))
    _refused(served, base, KeyError, "no delta named 'b'", lambda: served.switch_to("b"))
    with served.rows(["a", None]):
        _refused(served, base, RuntimeError, "while rows are being served", lambda: served.switch_to("a"))
    served.switch_to("a")
    _refused(served, base, RuntimeError, "'a' is applied in place", lambda: served.load_delta("b", _empty(base)))
    _refused(served, base, RuntimeError, "it is applied in place", lambda: served.unload_delta("a"))
    with pytest.raises(RuntimeError, match="cannot serve rows while 'a' is applied in place"), served.rows(["a", None]):
        pass
    served.close()
    assert served.in_place is None and served.list_deltas() == [] and _hooks(base) == 0


def test_gpt2_conv1d_layers_are_served():
    """transformers' Conv1D keeps W as [in, out]: its entries serve output row `out`, input column `in`."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=24, n_layer=2, n_head=4, n_positions=32)
    base = transformers.GPT2LMHeadModel(config).eval()
    deltas = {"a": _fine_tune_conv1d(base, 21), "b": _fine_tune_conv1d(base, 22)}
    served = ServedDeltas(base)
    for name, d in deltas.items():
        served.load_delta(name, d)
    rows, ids = ["b", None, "a"], _ids(3)
    with torch.no_grad():
        got = served(ids, delta_names=rows).logits
        plain = base(ids).logits
        for r, name in enumerate(rows):
            if name is None:
                assert torch.equal(got[r], plain[r])
                continue
            deltas[name].apply_(base)
            want = base(ids).logits[r]
            deltas[name].remove_(base)
            assert (got[r] - want).abs().max() < 1e-5 and not torch.equal(got[r], plain[r])


def _fine_tune_conv1d(model: torch.nn.Module, seed: int) -> SparseDelta:
    gen = torch.Generator().manual_seed(seed)
    tuned = copy.deepcopy(model)
    with torch.no_grad():
        for m in tuned.modules():
            if type(m).__name__ == "Conv1D":
                mask = torch.rand(m.weight.shape, generator=gen) < 0.05
                m.weight += mask * torch.randn(m.weight.shape, generator=gen)
    return SparseDelta.from_diff(model, tuned, density=1.0)


@pytest.mark.parametrize("backend", ["torch", "cpp", "triton"])
def test_every_backend_serves_the_same_rows(backend):
    """The hooks run the op on the backend asked for (Triton through the interpreter on CPU)."""
    from conftest import cpp_available, triton_available

    if (backend == "cpp" and not cpp_available()) or (backend == "triton" and not triton_available()):
        pytest.skip(f"{backend} unavailable here")
    base = _base()
    d = _fine_tune(base, 23)
    served = ServedDeltas(base, backend=backend)
    served.load_delta("d", d)
    ids = _ids(3)
    with torch.no_grad():
        got = served(ids, delta_names=[None, "d", "d"]).logits
        plain = base(ids).logits
        d.apply_(base)
        want = base(ids).logits
        d.remove_(base)
    assert torch.equal(got[0], plain[0])
    assert (got[1:] - want[1:]).abs().max() < 1e-5 and not torch.equal(got[1:], plain[1:])
