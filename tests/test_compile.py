"""torch.compile of a model trained by SparseAdamW: once the entries are chosen, the forward is one graph
and the backward one AOTAutograd graph, with the sparse backward (its weight-gradient part one opaque op)
and in hook mode; the compiled training step equals eager, gradient accumulation included."""

from __future__ import annotations

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

from sift import SparseAdamW
from sift.sparse_backward import _Route

transformers = pytest.importorskip("transformers")

VOCAB = 61
MODES = [pytest.param(True, id="sparse-backward"), pytest.param(False, id="hook-mode")]
FAMILIES = ["bert", "gpt2"]


def _tiny(family: str, layers: int = 2) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "bert":
        config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=24, num_hidden_layers=layers,
                                         num_attention_heads=4, intermediate_size=40, max_position_embeddings=32,
                                         num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        return transformers.BertForSequenceClassification(config)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=24, n_layer=layers, n_head=4, n_positions=32,
                                     num_labels=3, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=0,
                                     bos_token_id=1, eos_token_id=2)
    return transformers.GPT2ForSequenceClassification(config)


def _optimizer(model: torch.nn.Module, sparse_backward: bool) -> SparseAdamW:
    return SparseAdamW.for_model(model, density=0.05, lr=1e-2, compact_grads=True, update_in_backward=False,
                                 sparse_backward=sparse_backward)


def _batch(step: int, n: int = 4, length: int = 7) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"input_ids": torch.randint(1, VOCAB, (n, length), generator=g),
            "labels": torch.randint(0, 3, (n,), generator=g)}


def _train(model, opt, steps: range, micro: int = 1) -> None:
    for step in steps:
        opt.zero_grad()
        for part in zip(*(v.chunk(micro) for v in _batch(step).values())):
            (model(input_ids=part[0], labels=part[1]).loss / micro).backward()
        opt.step()


class _CountingBackend:
    """aot_eager that counts the forward and backward graphs AOTAutograd compiles."""

    def __init__(self):
        self.forward = self.backward = 0

        def forward(gm, _):
            self.forward += 1
            return make_boxed_func(gm.forward)

        def backward(gm, _):
            self.backward += 1
            return make_boxed_func(gm.forward)

        self.backend = aot_autograd(fw_compiler=forward, bw_compiler=backward)


def _assert_same_training(model_a, opt_a, model_b, opt_b, atol=1e-6):
    checked = 0
    for (name, p), q in zip(model_a.named_parameters(), model_b.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=atol, msg=name)
        sa, sb = opt_a.state.get(p, {}), opt_b.state.get(q, {})
        assert sa.keys() == sb.keys(), name
        if "indices" in sa:
            assert torch.equal(sa["indices"], sb["indices"]), name
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(sb[key], sa[key], rtol=0, atol=atol, msg=f"{name}.{key}")
            checked += 1
    assert checked, "no selected weight was compared"


@pytest.mark.parametrize("sparse_backward", MODES)
@pytest.mark.parametrize("family", FAMILIES)
def test_after_selection_the_forward_is_one_graph_and_the_backward_adds_no_break(family, sparse_backward):
    """The sparse backward broke the graph at every sparse linear: its backward kept the optimizer's books."""
    model = _tiny(family)
    opt = _optimizer(model, sparse_backward)
    assert (getattr(opt, "sparse_backward_handle", None) is not None) == sparse_backward
    _train(model, opt, range(1))
    assert any("indices" in s for s in opt.state.values())
    batch = _batch(1)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(lambda ids, labels: model(input_ids=ids, labels=labels).loss)(*batch.values())
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), [r.reason for r in explained.break_reasons]

    def forward_backward(ids, labels):
        model(input_ids=ids, labels=labels).loss.backward()

    # A step compiled whole: dynamo breaks at `.backward()` itself (trace_autograd_ops is off) and nowhere
    # else; the eager backward's op kernel and hooks are not traced into graphs of their own.
    torch._dynamo.reset()
    explained = torch._dynamo.explain(forward_backward)(*batch.values())
    reasons = [r.reason for r in explained.break_reasons]
    assert explained.graph_count == 1 and len(reasons) == 1 and "Tensor.backward()" in reasons[0], reasons


@pytest.mark.parametrize("sparse_backward", MODES)
@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_training_equals_eager(family, sparse_backward):
    model_a, model_b = _tiny(family), _tiny(family)
    opt_a, opt_b = _optimizer(model_a, sparse_backward), _optimizer(model_b, sparse_backward)
    counting = _CountingBackend()
    torch._dynamo.reset()
    compiled = torch.compile(model_b, backend=counting.backend)
    _train(model_a, opt_a, range(1), micro=2)  # the selection step, compiled too
    _train(compiled, opt_b, range(1), micro=2)
    _assert_same_training(model_a, opt_a, model_b, opt_b)

    calls = []
    add_weight_grad = _Route.add_weight_grad

    def counted(route, *args):
        calls.append(route)
        return add_weight_grad(route, *args)

    counting.forward = counting.backward = 0
    _Route.add_weight_grad = counted
    try:
        _train(model_a, opt_a, range(1, 4), micro=2)
        eager_calls, calls[:] = len(calls), []
        _train(compiled, opt_b, range(1, 4), micro=2)
    finally:
        _Route.add_weight_grad = add_weight_grad
    _assert_same_training(model_a, opt_a, model_b, opt_b)
    # The selection recompiled the model once (sparse backward) or not at all (hook mode): one forward
    # and one backward graph, and the compiled backward ran the sparse weight gradients as eager does.
    assert (counting.forward, counting.backward) == ((1, 1) if sparse_backward else (0, 0))
    layers = len(opt_b.sparse_backward_handle.modules) if sparse_backward else 0
    assert len(calls) == eager_calls == 3 * 2 * layers


def test_compiled_training_equals_eager_under_inductor():
    # One layer: building the C++ of its kernels is what Inductor costs here.
    model_a, model_b = _tiny("bert", layers=1), _tiny("bert", layers=1)
    opt_a, opt_b = _optimizer(model_a, True), _optimizer(model_b, True)
    _train(model_a, opt_a, range(1))
    _train(model_b, opt_b, range(1))  # selected eagerly: one compile, of the sparse backward
    torch._dynamo.reset()
    compiled = torch.compile(model_b, backend="inductor")
    _train(model_a, opt_a, range(1, 3), micro=2)
    _train(compiled, opt_b, range(1, 3), micro=2)
    _assert_same_training(model_a, opt_a, model_b, opt_b, atol=1e-5)


def test_compiled_update_in_backward_equals_eager():
    """Under update_in_backward the compiled backward adds every layer's part to its open buffer before the
    accumulators' pre-hooks step the weights, as eager does layer by layer."""
    model_a, model_b = _tiny("gpt2"), _tiny("gpt2")
    opt_a, opt_b = (SparseAdamW.for_model(m, density=0.05, lr=1e-2, compact_grads=True, update_in_backward=True,
                                          sparse_backward=True) for m in (model_a, model_b))
    _train(model_a, opt_a, range(1))
    _train(model_b, opt_b, range(1))
    torch._dynamo.reset()
    compiled = torch.compile(model_b, backend="aot_eager")
    _train(model_a, opt_a, range(1, 4))
    _train(compiled, opt_b, range(1, 4))
    _assert_same_training(model_a, opt_a, model_b, opt_b)
