"""The sparse backward path: after selection each sparse linear weight gets its gradient only at
its chosen entries (no dense weight gradient), and training equals the dense-backward hook mode."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import sift
from sift import SparseAdamW

transformers = pytest.importorskip("transformers")

VOCAB = 97


def _tiny(family: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    if family == "bert":
        config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=24, num_hidden_layers=2, num_attention_heads=4,
                                         intermediate_size=40, num_labels=3, hidden_dropout_prob=0.0,
                                         attention_probs_dropout_prob=0.0)
        return transformers.BertForSequenceClassification(config)
    if family == "gpt2":
        config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=24, n_layer=2, n_head=4, n_positions=32, num_labels=3,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=0,
                                         bos_token_id=1, eos_token_id=2)
        return transformers.GPT2ForSequenceClassification(config)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=24, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=40, num_labels=3, pad_token_id=0)
    return transformers.LlamaForSequenceClassification(config)


def _batch(step: int, n: int = 4, length: int = 7) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"input_ids": torch.randint(1, VOCAB, (n, length), generator=g),
            "attention_mask": torch.ones(n, length, dtype=torch.long),
            "labels": torch.randint(0, 3, (n,), generator=g)}


def _train(model, opt, steps: int, micro: int = 1, clip: float | None = None, start: int = 0,
           autocast: bool = False) -> None:
    model.train()
    for step in range(start, start + steps):
        batch = _batch(step)
        opt.zero_grad()
        for i in range(micro):
            part = {k: v.chunk(micro)[i] for k, v in batch.items()}
            # Autocast around forward and backward only: its weight-cast cache must not outlive a step.
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = model(**part).loss / micro
            loss.backward()
        if clip is not None:
            sift.clip_grad_norm_(opt, clip)
        opt.step()


def _assert_same_training(model_a, opt_a, model_b, opt_b, rtol=1e-5, atol=1e-6):
    for (name, p), q in zip(model_a.named_parameters(), model_b.parameters()):
        torch.testing.assert_close(p, q, rtol=rtol, atol=atol, msg=name)
        sa, sb = opt_a.state.get(p, {}), opt_b.state.get(q, {})
        assert sa.keys() == sb.keys(), name
        if "indices" in sa:
            assert torch.equal(sa["indices"], sb["indices"]), name
            for key in ("exp_avg", "exp_avg_sq", "delta"):
                torch.testing.assert_close(sa[key], sb[key], rtol=rtol, atol=atol, msg=f"{name}.{key}")


@pytest.mark.parametrize("family", ["bert", "gpt2", "llama"])
@pytest.mark.parametrize("micro, clip", [(1, None), (2, 0.5)], ids=["one-batch", "accumulate-clip"])
def test_sparse_backward_trains_like_the_dense_backward(family, micro, clip):
    model_a, model_b = _tiny(family), _tiny(family)
    opt_a = SparseAdamW.for_model(model_a, density=0.1, lr=1e-2, compact_grads=True)
    opt_b = SparseAdamW.for_model(model_b, density=0.1, lr=1e-2, sparse_backward=True)
    # Q, K, V, O of two layers; GPT-2 fuses Q, K, V into c_attn.
    assert len(opt_b.sparse_backward_handle.modules) == (4 if family == "gpt2" else 8)
    for step in range(4):
        _train(model_a, opt_a, 1, micro=micro, clip=clip, start=step)
        _train(model_b, opt_b, 1, micro=micro, clip=clip, start=step)
        _assert_same_training(model_a, opt_a, model_b, opt_b)
    assert all(p.grad is None for p in model_b.parameters() if p in opt_b.state and "indices" in opt_b.state[p])


class _WatchAllocations(TorchDispatchMode):
    """Records the shape of every new (non-view) tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = torch.utils._pytree.tree_leaves((args, kwargs))
        seen = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else [out]:
            # A view or an in-place result shares an input's storage; a new tensor does not.
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                self.shapes.append((str(func), tuple(t.shape)))
        return out


@pytest.mark.parametrize("family", ["bert", "gpt2", "llama"])
def test_no_weight_shaped_tensor_after_selection(family):
    model = _tiny(family)
    opt = SparseAdamW.for_model(model, density=0.1, lr=1e-2, sparse_backward=True)
    _train(model, opt, 1)  # selection (dense gradients, as documented)
    sparse_shapes = {tuple(p.shape) for p in opt.state if "indices" in opt.state[p]}
    other_shapes = {tuple(p.shape) for p in model.parameters() if p.requires_grad and "indices" not in opt.state.get(p, {})}
    watched = sparse_shapes - other_shapes  # a dense head's gradient may share a shape: not a sparse weight's
    assert watched, "the model must have a sparse weight shape to watch"
    watch = _WatchAllocations()
    with watch:
        _train(model, opt, 2, start=1)
    offenders = [(op, shape) for op, shape in watch.shapes if shape in watched]
    assert not offenders, offenders[:5]


def _llama_pair(checkpointing: bool):
    model_a, model_b = _tiny("llama"), _tiny("llama")
    if checkpointing:
        for m in (model_a, model_b):
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt_a = SparseAdamW.for_model(model_a, density=0.1, lr=1e-2, compact_grads=True)
    opt_b = SparseAdamW.for_model(model_b, density=0.1, lr=1e-2, sparse_backward=True)
    return model_a, opt_a, model_b, opt_b


def test_gradient_checkpointing_matches_the_dense_backward():
    model_a, opt_a, model_b, opt_b = _llama_pair(checkpointing=True)
    _train(model_a, opt_a, 3, micro=2)
    _train(model_b, opt_b, 3, micro=2)
    _assert_same_training(model_a, opt_a, model_b, opt_b)


def test_autocast_compact_gradients_match_the_dense_backward():
    """bf16 autocast: the op sums bf16 products in fp32, the dense path rounds dW to bf16 first,
    so the compact gradients agree to bf16 precision of the gradient's scale, not bit for bit."""
    model_a, opt_a, model_b, opt_b = _llama_pair(checkpointing=False)
    _train(model_a, opt_a, 1, micro=2, autocast=True)  # selection: both from the same dense gradient
    _train(model_b, opt_b, 1, micro=2, autocast=True)
    _assert_same_training(model_a, opt_a, model_b, opt_b, rtol=0, atol=0)
    for model, opt in ((model_a, opt_a), (model_b, opt_b)):
        opt.zero_grad()
        for i in range(2):
            part = {k: v.chunk(2)[i] for k, v in _batch(1).items()}
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(**part).loss / 2
            loss.backward()
    checked = 0
    for p, q in zip(model_a.parameters(), model_b.parameters()):
        if "indices" in opt_a.state.get(p, {}):
            ga, gb = opt_a.compact_grad(p), opt_b.compact_grad(q)
            torch.testing.assert_close(gb, ga, rtol=0, atol=2e-2 * float(ga.abs().max()))
            checked += 1
    assert checked == 8


def test_torch_compile_of_the_model_matches_eager():
    model_a, model_b = _tiny("bert"), _tiny("bert")
    opt_a = SparseAdamW.for_model(model_a, density=0.1, lr=1e-2, sparse_backward=True)
    opt_b = SparseAdamW.for_model(model_b, density=0.1, lr=1e-2, sparse_backward=True)
    torch._dynamo.reset()
    compiled = torch.compile(model_b, backend="aot_eager")
    _train(model_a, opt_a, 3)
    _train(compiled, opt_b, 3)
    _assert_same_training(model_a, opt_a, model_b, opt_b)


def test_handle_remove_restores_the_dense_backward():
    model = _tiny("bert")
    opt = SparseAdamW.for_model(model, density=0.1, lr=1e-2, sparse_backward=True)
    _train(model, opt, 1)
    opt.sparse_backward_handle.remove()
    assert all("forward" not in m.__dict__ for m in model.modules())
    _train(model, opt, 1, start=1)  # hook mode gathers from dense gradients again
    assert all(p.grad is None for p in opt.state if "indices" in opt.state[p])


def test_for_model_again_takes_the_layers_over_from_the_earlier_optimizer():
    """Calling for_model twice on one model (its default enables the sparse backward) raised "enabled twice",
    after the first call's freezing had changed the model; the second optimizer now owns every routed layer."""
    model = _tiny("bert")
    first = SparseAdamW.for_model(model, density=0.1, lr=1e-2)
    second = SparseAdamW.for_model(model, density=0.1, lr=1e-2, target_modules=["query"])
    routed = [m for m in model.modules() if "_sift_route" in m.__dict__]
    assert routed and all(m._sift_route.optimizer is second for m in routed)
    assert {id(m.weight) for m in routed} == {id(p) for g in second.param_groups if g["density"] < 1 for p in g["params"]}


def test_enable_sparse_backward_bad_input():
    model = _tiny("bert")
    q = model.bert.encoder.layer[0].attention.self.query
    plain = SparseAdamW([q.weight], density=0.1)
    with pytest.raises(ValueError, match="compact_grads=True"):
        sift.enable_sparse_backward(model, plain)
    opt = SparseAdamW([q.weight], density=0.1, compact_grads=True)
    with pytest.raises(ValueError, match="not a module of the model"):
        sift.enable_sparse_backward(model, opt, modules=["bert.nope"])
    with pytest.raises(ValueError, match="is a LayerNorm, not nn.Linear"):
        sift.enable_sparse_backward(model, opt, modules=["bert.embeddings.LayerNorm"])
    with pytest.raises(ValueError, match="not in a sparse group"):
        sift.enable_sparse_backward(model, opt, modules=["bert.encoder.layer.0.attention.self.key"])
    handle = sift.enable_sparse_backward(model, opt)
    assert list(handle.modules) == ["bert.encoder.layer.0.attention.self.query"]
    q.forward = lambda x: x  # someone else's forward is never replaced
    with pytest.raises(ValueError, match="replaced by something other than sift"):
        sift.enable_sparse_backward(model, opt)
    with pytest.raises(ValueError, match="needs compact_grads=True"):
        SparseAdamW.for_model(_tiny("bert"), sparse_backward=True, compact_grads=False)


def test_a_gradient_for_other_inputs_leaves_the_compact_gradients_alone():
    """Regression: `torch.autograd.grad(loss, inputs=[x])` (a gradient penalty) ran the sparse backward's
    weight product into the compact buffers, so the next backward's step used that gradient twice."""
    model, ref = _tiny("llama"), _tiny("llama")
    opt = SparseAdamW.for_model(model, density=0.1, lr=1e-2, sparse_backward=True)
    ref_opt = SparseAdamW.for_model(ref, density=0.1, lr=1e-2, sparse_backward=True)
    _train(model, opt, 1)
    _train(ref, ref_opt, 1)
    opt.zero_grad()
    ref_opt.zero_grad()
    x = model.get_input_embeddings()(_batch(7)["input_ids"]).detach().requires_grad_(True)
    torch.autograd.grad(model(inputs_embeds=x).logits.square().sum(), [x])
    assert all(opt.compact_grad(p) is None for g in opt.param_groups if g["density"] < 1.0 for p in g["params"])
    for m, o in ((model, opt), (ref, ref_opt)):
        m(**_batch(1)).loss.backward()
        o.step()
    _assert_same_training(model, opt, ref, ref_opt)
