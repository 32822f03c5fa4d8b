"""`for_model`'s `memory=` presets: the default is hook mode plus the sparse backward, the same result as
plain mode and as the explicit flags, on BERT, GPT-2 and Llama configs; "lowest" is the explicit lean state
with the update in backward; modes that cannot apply fall back with one log line; bad input is refused with
the model untouched."""

from __future__ import annotations

import logging

import pytest
import torch

import sift
from conftest import backward_and_step
from sift import SparseAdamW

transformers = pytest.importorskip("transformers")

TOL = dict(rtol=1e-5, atol=1e-6)  # the sparse backward sums each entry's gradient in another order


def _bert():
    config = transformers.BertConfig(vocab_size=61, hidden_size=24, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=40, max_position_embeddings=32, num_labels=3)
    return transformers.BertForSequenceClassification(config)


def _gpt2():
    config = transformers.GPT2Config(vocab_size=61, n_embd=24, n_layer=2, n_head=4, n_positions=32)
    return transformers.GPT2LMHeadModel(config)


def _llama():
    config = transformers.LlamaConfig(vocab_size=61, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    return transformers.LlamaForCausalLM(config)


MODELS = {"bert": _bert, "gpt2": _gpt2, "llama": _llama}


def _batch(family: str, step: int, micro: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + micro)
    ids = torch.randint(0, 61, (3, 9), generator=g)
    labels = torch.randint(0, 3, (3,), generator=g) if family == "bert" else ids
    return {"input_ids": ids, "labels": labels}


def _train(family: str, steps: int = 4, micro: int = 1, scaler=None, clip: float | None = None, **kwargs):
    torch.manual_seed(0)
    model = MODELS[family]()
    opt = SparseAdamW.for_model(model, density=0.05, lr=1e-2, **kwargs)
    for step in range(steps):
        for m in range(micro - 1):
            loss = model(**_batch(family, step, m)).loss
            (scaler.scale(loss) if scaler is not None else loss).backward()
        loss = model(**_batch(family, step, micro - 1)).loss
        if clip is None:
            backward_and_step(opt, loss, scaler)
        else:
            loss.backward()
            sift.clip_grad_norm_(opt, clip)
            opt.step()
        opt.zero_grad()
    return model, opt


def _params(model):
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("family", list(MODELS))
def test_the_default_is_hook_mode_with_the_sparse_backward_and_equals_plain_mode(family):
    model, opt = _train(family)
    assert opt.compact_grads and opt.state_layout == "exact" and not opt.update_in_backward
    assert opt.sparse_backward_handle is not None
    explicit, _ = _train(family, compact_grads=True, sparse_backward=True, state="exact")
    plain, _ = _train(family, memory="plain")
    for (name, p), q, r in zip(_params(model).items(), _params(explicit).values(), _params(plain).values()):
        assert torch.equal(p, q), name  # the default is exactly the explicit flags
        torch.testing.assert_close(p, r, **TOL, msg=name)  # and plain mode's result
    # After selection the default keeps no dense gradient of a sparse weight.
    model(**_batch(family, 9)).loss.backward()
    assert all(p.grad is None for group in opt.param_groups if group["density"] < 1.0 for p in group["params"])


@pytest.mark.parametrize("family", list(MODELS))
def test_lowest_is_the_lean_state_with_the_update_in_backward(family):
    model, opt = _train(family, memory="lowest")
    assert opt.state_layout == "lean" and opt.update_in_backward and opt.sparse_backward_handle is not None
    explicit, _ = _train(family, compact_grads=True, sparse_backward=True, state="lean", update_in_backward=True)
    for (name, p), q in zip(_params(model).items(), _params(explicit).values()):
        assert torch.equal(p, q), name


def test_plain_keeps_dense_gradients():
    model, opt = _train("bert", memory="plain")
    assert not opt.compact_grads and not hasattr(opt, "sparse_backward_handle")
    model(**_batch("bert", 9)).loss.backward()
    assert all(p.grad is not None for group in opt.param_groups for p in group["params"])


def test_an_explicit_flag_wins_over_the_preset():
    _, opt = _train("bert", steps=1, memory="lowest", state="exact")
    assert opt.state_layout == "exact" and opt.update_in_backward
    _, opt = _train("bert", steps=1, memory="lowest", update_in_backward=False)
    assert opt.state_layout == "lean" and not opt.update_in_backward
    _, opt = _train("bert", steps=1, compact_grads=False)
    assert not opt.compact_grads and not hasattr(opt, "sparse_backward_handle")


def test_lowest_under_clipping_drops_the_update_in_backward_with_one_log_line(caplog):
    with caplog.at_level(logging.WARNING, logger="sift"):
        _, opt = _train("bert", steps=1, memory="lowest", max_grad_norm=0.5)
    assert not opt.update_in_backward and opt.state_layout == "lean"
    assert [r.getMessage() for r in caplog.records if "update_in_backward" in r.getMessage()] == [
        "sift: memory='lowest' without update_in_backward: max_grad_norm clips over all weights, which cannot wait "
        "for one inside backward"]


@pytest.mark.parametrize("train, log", [(dict(micro=2), "micro-batches accumulate"),
                                         (dict(clip=0.05), "clip_grad_norm_")], ids=["accumulation", "clip"])
def test_lowest_drops_the_update_in_backward_on_the_first_step(caplog, train, log):
    """memory="lowest" would have raised at the second micro-batch of the selecting step, and refused
    `sift.clip_grad_norm_` (telling the caller to pass max_grad_norm, which the preset drops the update in backward
    for); before anything is selected it now trains as the lean state without the update in backward."""
    with caplog.at_level(logging.WARNING, logger="sift"):
        model, opt = _train("llama", memory="lowest", **train)
    assert not opt.update_in_backward
    assert sum(log in r.getMessage() for r in caplog.records) == 1
    explicit, _ = _train("llama", compact_grads=True, sparse_backward=True, state="lean", **train)
    for (name, p), q in zip(_params(model).items(), _params(explicit).values()):
        assert torch.equal(p, q), name


def test_lowest_under_a_grad_scaler_drops_the_update_in_backward_on_the_first_step(caplog):
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**6)
    with caplog.at_level(logging.WARNING, logger="sift"):
        model, opt = _train("gpt2", scaler=scaler, memory="lowest")
    assert not opt.update_in_backward
    assert sum("GradScaler" in r.getMessage() for r in caplog.records) == 1
    reference, _ = _train("gpt2", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**6), compact_grads=True,
                          sparse_backward=True, state="lean")
    for (name, p), q in zip(_params(model).items(), _params(reference).values()):
        assert torch.equal(p, q), name


def test_an_explicit_update_in_backward_still_refuses_accumulation():
    with pytest.raises(RuntimeError, match="one backward per step"):
        _train("bert", steps=1, micro=2, memory="lowest", update_in_backward=True)


def test_a_ddp_wrapped_model_trains_in_plain_mode_with_one_log_line(caplog, monkeypatch):
    """A model already wrapped in DDP cannot take the compact modes (DDP reduces .grad): the preset falls back."""
    torch.manual_seed(0)
    model = _bert()
    monkeypatch.setattr(torch.nn.parallel.DistributedDataParallel, "__init__", lambda self, module: None)
    wrapped = torch.nn.parallel.DistributedDataParallel(model)  # a stand-in: no process group is needed
    torch.nn.Module.__init__(wrapped)
    wrapped.module = model
    from sift.optim.memory import resolve_memory

    with caplog.at_level(logging.WARNING, logger="sift"):
        flags, auto = resolve_memory("lowest", wrapped, {})
    assert flags == dict(compact_grads=False, sparse_backward=False, state="lean", update_in_backward=False)
    assert not auto
    assert [r.getMessage() for r in caplog.records] == [
        "sift: memory='lowest' without update_in_backward, sparse_backward, compact_grads: the model is already "
        "wrapped in DistributedDataParallel (call for_model before wrapping it)"]


def test_a_bad_memory_value_is_refused_and_the_model_is_untouched():
    torch.manual_seed(0)
    model = _bert()
    before = {n: p.requires_grad for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match="memory must be one of 'low', 'lowest', 'plain', got 'least'"):
        SparseAdamW.for_model(model, memory="least")
    assert {n: p.requires_grad for n, p in model.named_parameters()} == before
    assert not any("forward" in m.__dict__ for m in model.modules())  # no sparse backward patched in


def test_trainer_default_matches_for_model_default(tmp_path):
    """SparseTrainer's memory default is for_model's: hook mode plus the sparse backward."""
    torch.manual_seed(0)
    model = _bert()
    args = transformers.TrainingArguments(str(tmp_path), report_to=[], use_cpu=True, max_grad_norm=0.0)
    from sift.integrations.hf import SparseTrainer

    trainer = SparseTrainer(model=model, args=args, density=0.05)
    opt = trainer.create_optimizer()
    assert opt.compact_grads and opt.sparse_backward_handle is not None and opt.state_layout == "exact"


@pytest.mark.parametrize("memory,gradient,state,steps", [("plain", "dense .grad", "exact", "step()"),
                                                          ("low", "sparse backward", "exact", "step()"),
                                                          ("lowest", "sparse backward", "lean", "backward")])
def test_each_weights_plan_says_how_the_preset_trains_it(memory, gradient, state, steps):
    model, opt = _train("bert", steps=1, memory=memory)
    plans = opt.plans()
    sparse = {n: p for n, p in plans.items() if p.trains == "entries"}
    assert sparse and all(n.endswith(("query.weight", "key.weight", "value.weight", "attention.output.dense.weight"))
                          for n in sparse)
    params = dict(model.named_parameters())
    for name, plan in sparse.items():
        assert (plan.gradient, plan.state, plan.steps) == (gradient, state, steps), name
        assert plan.entries == opt.indices_of(params[name]).numel()
    assert {p.gradient for n, p in plans.items() if p.trains == "dense"} == {"dense .grad"}
    if memory != "plain":  # the layers get their own forward back: the hooks gather the gradient instead
        opt.sparse_backward_handle.remove()
        assert {p.gradient for p in opt.plans().values() if p.trains == "entries"} == {"hook"}


def test_a_4_bit_layers_plan_is_its_delta():
    bnb = pytest.importorskip("bitsandbytes")
    model = torch.nn.Sequential(bnb.nn.Linear4bit(32, 16, compute_dtype=torch.float32), torch.nn.Linear(16, 4))
    model = model.to("cpu")
    opt = SparseAdamW.for_model(model, density=0.1, target_modules=["0"], dense_modules=["1"])
    plan = opt.plans()["0.sift_delta"]
    assert (plan.trains, plan.gradient, plan.entries) == ("4-bit delta", "4-bit backward", None)
    model(torch.randn(3, 32)).square().mean().backward()
    opt.step()
    assert opt.plans()["0.sift_delta"].entries == model[0]._sift_quantized.k
