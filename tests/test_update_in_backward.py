"""SparseAdamW(update_in_backward=True): each sparse weight is stepped inside backward, as soon as its
gradient is complete, and training equals the step()-time update of the same mode."""

from __future__ import annotations

import copy

import pytest
import torch

import sift
from sift import SparseAdamW
from sift._index import entries_for, top_k_positions

transformers = pytest.importorskip("transformers")

VOCAB = 97
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
STATES = ["exact", "lean"]
# Bitwise where both sides compute the same numbers. With clipping the reference's norm is summed in
# another order (fp32: close), and in bf16 it scales the bf16 dense gradient (one more rounding than
# the mode's fp32 compact gradient).
EXACT = dict(rtol=0, atol=0)
CLIPPED = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=2e-2, atol=1e-3)}


def _mlp(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(13, 29), torch.nn.Tanh(), torch.nn.Linear(29, 7)).to(dtype)


def _mlp_optimizer(model: torch.nn.Module, **kwargs) -> SparseAdamW:
    weights = [model[0].weight, model[2].weight]
    biases = [model[0].bias, model[2].bias]
    return SparseAdamW([{"params": weights}, {"params": biases, "density": 1.0}], lr=1e-2, density=0.1, **kwargs)


def _mlp_backward(model: torch.nn.Module, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(5, 13, generator=g).to(model[0].weight.dtype)
    model(x).float().square().mean().backward()


def _tiny_llama(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=24, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=40, num_labels=3, pad_token_id=0)
    return transformers.LlamaForSequenceClassification(config).to(dtype)


def _llama_backward(model: torch.nn.Module, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(1, VOCAB, (3, 7), generator=g)
    labels = torch.randint(0, 3, (3,), generator=g)
    model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels).loss.backward()


def _clip_by_hand(opt: SparseAdamW, max_norm: float) -> None:
    """Per-tensor clipping written out: each gradient the next step uses scaled to norm <= max_norm on its own
    (a sparse weight's over its chosen entries: the compact buffer, or grad[entries] of the dense grad)."""

    def coef(values: torch.Tensor) -> torch.Tensor:
        norm = values.double().square().sum().sqrt()
        return torch.clamp(max_norm / (norm + 1e-6), max=1.0).float()

    for group in opt.param_groups:
        for p in group["params"]:
            compact = opt.compact_grad(p) if opt.compact_grads else None  # plain mode returns a copy
            if compact is not None:
                compact.mul_(coef(compact))
                continue
            if p.grad is None:
                continue
            if group["density"] >= 1.0:
                p.grad.mul_(coef(p.grad).to(p.grad.dtype))
                continue
            state = opt.state.get(p, {})
            if "indices" in state or "indices_low" in state:
                entries = opt.indices_of(p).long()
            else:  # the selecting step: the entries it will choose (top |grad|, lower index on ties)
                entries = top_k_positions(p.grad.abs().float().reshape(-1),
                                          max(1, entries_for(group["density"], p.numel()))).long()
            p.grad.mul_(coef(p.grad.reshape(-1)[entries].float()).to(p.grad.dtype))


def _assert_same(model_a, opt_a, model_b, opt_b, tol: dict[str, float] = EXACT) -> None:
    exact = tol == EXACT
    for (name, p), q in zip(model_a.named_parameters(), model_b.parameters()):
        torch.testing.assert_close(p, q, **tol, msg=name)
        sa, sb = opt_a.state.get(p, {}), opt_b.state.get(q, {})
        assert sa.keys() == sb.keys(), name
        for key, value in sa.items():
            if not isinstance(value, torch.Tensor):
                assert value == sb[key], f"{name}.{key}"
            elif key == "residual" and not exact:
                continue  # sub-ulp digits of the weight: a slightly different update moves them anywhere
            elif value.dtype in (torch.int16, torch.int32, torch.int64) or exact:
                assert torch.equal(value, sb[key]), f"{name}.{key}"
            else:
                torch.testing.assert_close(value.float(), sb[key].float(), **tol, msg=f"{name}.{key}")


def _step_side_by_side(model, opt, ref_model, ref, backward, steps, clip, tol):
    """Update in backward (`opt`) against the step()-time update (`ref`, clipped by hand), compared every step."""
    for step in range(steps):
        backward(model, step)
        backward(ref_model, step)
        if clip is not None:
            _clip_by_hand(ref, clip)
        opt.step()
        ref.step()
        opt.zero_grad()
        ref.zero_grad()
        _assert_same(model, opt, ref_model, ref, tol)


@pytest.mark.parametrize("clip", [None, 0.05], ids=["no-clip", "clip-per-tensor"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("state", STATES)
def test_hook_mode_equals_the_plain_step(state, dtype, clip):
    model, ref_model = _mlp(dtype), _mlp(dtype)
    opt = _mlp_optimizer(model, state=state, compact_grads=True, update_in_backward=True, max_grad_norm=clip)
    ref = _mlp_optimizer(ref_model, state=state)
    _step_side_by_side(model, opt, ref_model, ref, _mlp_backward, 4, clip, EXACT if clip is None else CLIPPED[dtype])
    assert all(float(opt.state[p]["step"]) == 4 for p in (model[0].weight, model[2].weight))


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
@pytest.mark.parametrize("clip", [None, 0.5], ids=["no-clip", "clip-per-tensor"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("state", STATES)
def test_sparse_backward_equals_its_step_time_update(state, dtype, clip, checkpointing):
    model, ref_model = _tiny_llama(dtype), _tiny_llama(dtype)
    opt = SparseAdamW.for_model(model, density=0.1, lr=1e-2, sparse_backward=True, state=state,
                                update_in_backward=True, max_grad_norm=clip)
    ref = SparseAdamW.for_model(ref_model, density=0.1, lr=1e-2, sparse_backward=True, state=state)
    if checkpointing:
        for m in (model, ref_model):
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    _step_side_by_side(model, opt, ref_model, ref, _llama_backward, 3, clip, EXACT if clip is None else CLIPPED[dtype])


def test_weights_change_inside_backward_and_no_compact_buffer_survives():
    model = _tiny_llama(torch.float32)
    opt = SparseAdamW.for_model(model, density=0.1, lr=1e-2, compact_grads=True, update_in_backward=True)
    sparse = [p for g in opt.param_groups if g["density"] < 1.0 for p in g["params"]]
    _llama_backward(model, 0)
    opt.step()  # selection (and the first update) happen in step()
    opt.zero_grad()
    before = [p.detach().clone() for p in sparse]
    _llama_backward(model, 1)
    # Stepped during backward: changed before step(), no dense grad, no per-weight compact buffer.
    assert all(not torch.equal(b, p) for b, p in zip(before, sparse))
    assert all(p.grad is None and opt.compact_grad(p) is None for p in sparse)
    assert opt.grads.compact == {}
    ks = [opt.indices_of(p).numel() for p in sparse]
    assert [t.numel() for t in opt.grads.scratch.values()] == [max(ks)]
    assert opt.state_bytes()["compact_grad_bytes"] == 4 * max(ks) < 4 * sum(ks)
    after_backward = [p.detach().clone() for p in sparse]
    opt.step()  # only the dense groups: the sparse weights are not stepped twice
    assert all(torch.equal(a, p) for a, p in zip(after_backward, sparse))
    assert all(float(opt.state[p]["step"]) == 2 for p in sparse)


@pytest.mark.parametrize("sparse_backward", [False, True], ids=["hook", "sparse-backward"])
@pytest.mark.parametrize("selected", [False, True], ids=["before-selection", "after-selection"])
def test_a_second_backward_before_step_raises(sparse_backward, selected):
    """Gradient accumulation would step each weight once per micro-batch: it must raise instead. Before the
    selection (nothing stepped in backward yet) the backward completes and step() refuses, changing nothing: an
    error inside the backward left FSDP2's layers unsharded."""
    model = _tiny_llama(torch.float32)
    opt = SparseAdamW.for_model(model, density=0.1, lr=1e-2, compact_grads=True, sparse_backward=sparse_backward,
                                update_in_backward=True)
    if selected:
        _llama_backward(model, 0)
        opt.step()
        opt.zero_grad()
    _llama_backward(model, 1)
    snapshot = {id(p): p.detach().clone() for p in model.parameters()}
    state = copy.deepcopy(opt.state_dict())
    if selected:
        with pytest.raises(RuntimeError, match="update_in_backward"):
            _llama_backward(model, 2)
    else:
        _llama_backward(model, 2)
        with pytest.raises(RuntimeError, match="update_in_backward"):
            opt.step()
        assert repr(opt.state_dict()) == repr(state)
    sparse = [p for g in opt.param_groups if g["density"] < 1.0 for p in g["params"]]
    assert all(torch.equal(snapshot[id(p)], p) for p in sparse)
    opt.zero_grad()


def test_bad_combinations_are_clear_errors():
    w = torch.nn.Parameter(torch.randn(6, 5))
    with pytest.raises(ValueError, match="leave compact_grads unset"):
        SparseAdamW([w], update_in_backward=True, compact_grads=False)
    assert SparseAdamW([w], update_in_backward=True).compact_grads  # implied
    with pytest.raises(ValueError, match="update_in_backward=True does not support a process_group"):
        SparseAdamW([w], compact_grads=True, update_in_backward=True, process_group=object())
    with pytest.raises(TypeError, match="update_in_backward must be a bool"):
        SparseAdamW([w], compact_grads=True, update_in_backward=1)
    with pytest.raises(ValueError, match="needs compact_grads=True"):
        SparseAdamW.for_model(_tiny_llama(torch.float32), sparse_backward=True, compact_grads=False,
                              update_in_backward=True)
    opt = SparseAdamW([w], density=0.5, compact_grads=True, update_in_backward=True)
    w.square().sum().backward()
    grad = w.grad.clone()
    with pytest.raises(RuntimeError, match="clip_grad_norm_ cannot clip an optimizer with update_in_backward"):
        sift.clip_grad_norm_(opt, 1.0)
    assert torch.equal(w.grad, grad) and not opt.state[w]


@pytest.mark.parametrize("state", STATES)
def test_state_dict_round_trip(state):
    model = _tiny_llama(torch.bfloat16)
    opt = SparseAdamW.for_model(model, density=0.1, lr=1e-2, sparse_backward=True, state=state,
                                update_in_backward=True)
    for step in range(2):
        _llama_backward(model, step)
        opt.step()
        opt.zero_grad()
    model_b = _tiny_llama(torch.bfloat16)
    model_b.load_state_dict(model.state_dict())
    opt_b = SparseAdamW.for_model(model_b, density=0.1, lr=1e-2, sparse_backward=True, state=state,
                                  update_in_backward=True)
    opt_b.load_state_dict(opt.state_dict())
    assert opt_b.grads.compact == {}
    for step in range(2, 4):
        for m, o in ((model, opt), (model_b, opt_b)):
            _llama_backward(m, step)
            o.step()
            o.zero_grad()
    _assert_same(model, opt, model_b, opt_b)


# Weights used more than once in a forward: each pattern builds (model, sparse params, dense params) and
# runs one backward of a step.
def _linear_twice():
    torch.manual_seed(0)
    model = torch.nn.Linear(11, 11)
    return model, [model.weight], [model.bias]


def _linear_twice_backward(model, step):
    x = torch.randn(6, 11, generator=torch.Generator().manual_seed(step))
    model(torch.tanh(model(x))).square().mean().backward()


def _gpt2_tied():
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=24, n_layer=2, n_head=4,
                                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config)
    assert model.lm_head.weight is model.transformer.wte.weight
    sparse = [model.transformer.wte.weight] + [b.attn.c_attn.weight for b in model.transformer.h]
    dense = [b.attn.c_attn.bias for b in model.transformer.h]
    return model, sparse, dense


def _gpt2_backward(model, step):
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(step))
    model(input_ids=ids, labels=ids).loss.backward()


def _albert_shared():
    torch.manual_seed(0)
    config = transformers.AlbertConfig(vocab_size=VOCAB, embedding_size=16, hidden_size=24, num_hidden_layers=3,
                                       num_attention_heads=4, intermediate_size=40, num_labels=3,
                                       classifier_dropout_prob=0.0)
    model = transformers.AlbertForSequenceClassification(config)
    layer = model.albert.encoder.albert_layer_groups[0].albert_layers[0]
    attention = layer.attention
    sparse = [attention.query.weight, attention.key.weight, attention.value.weight, attention.dense.weight,
              layer.ffn.weight]
    return model, sparse, [model.classifier.weight, model.classifier.bias]


def _albert_backward(model, step):
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(1, VOCAB, (3, 7), generator=g)
    model(input_ids=ids, labels=torch.randint(0, 3, (3,), generator=g)).loss.backward()


SHARED = {"linear-twice": (_linear_twice, _linear_twice_backward), "gpt2-tied": (_gpt2_tied, _gpt2_backward),
          "albert-shared": (_albert_shared, _albert_backward)}


@pytest.mark.parametrize("state", STATES)
@pytest.mark.parametrize("sparse_backward", [False, True], ids=["hook", "sparse-backward"])
@pytest.mark.parametrize("pattern", list(SHARED))
def test_a_weight_used_twice_steps_once_on_its_whole_gradient(pattern, sparse_backward, state):
    """Regression: with the sparse backward each use of a shared weight stepped it on its own partial
    gradient, then the next use raised. The weight now steps once per backward, after all its uses, and
    equals the step()-time update."""
    build, backward = SHARED[pattern]

    def make(update_in_backward):
        model, sparse, dense = build()
        opt = SparseAdamW([{"params": sparse}, {"params": dense, "density": 1.0}], lr=1e-2, density=0.1,
                          compact_grads=True, state=state, update_in_backward=update_in_backward)
        if sparse_backward:
            handle = sift.enable_sparse_backward(model, opt)
            assert handle.modules
        return model, opt

    (model, opt), (ref_model, ref) = make(True), make(False)
    _step_side_by_side(model, opt, ref_model, ref, backward, 4, None, dict(rtol=0, atol=1e-6))
    sparse = opt.param_groups[0]["params"]
    assert all(float(opt.state[p]["step"]) == 4 for p in sparse)
    assert opt.grads.open == {}
