"""`SparseAdamW.for_model` changes nothing when it refuses, names the DDP wrap it cannot train under, leaves a
model that pickles, and a causal LM it prepared trains under the docs' DDP recipe (`sift.wrap_ddp`)."""

from __future__ import annotations

import pickle

import pytest
import torch

import sift
from sift import SparseAdamW
from conftest import gloo_rank, run_ranks

transformers = pytest.importorskip("transformers")


def _llama(seed: int = 0, tie: bool = False) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1,
                                      eos_token_id=2, tie_word_embeddings=tie)
    return transformers.LlamaForCausalLM(config)


def _ids(seed: int = 1, n: int = 4, seq: int = 7) -> torch.Tensor:
    return torch.randint(3, 64, (n, seq), generator=torch.Generator().manual_seed(seed))


def _snapshot(model: torch.nn.Module) -> dict:
    """Everything for_model may change: requires_grad, hooks, forwards and attributes, per param and module."""
    params = {name: (p.requires_grad, dict(p._post_accumulate_grad_hooks or {}), dict(p._backward_hooks or {}),
                     getattr(p, "_ddp_ignored", None), p.grad)
              for name, p in model.named_parameters()}
    modules = {name: (m.forward, dict(m._forward_hooks), dict(m._forward_pre_hooks), dict(m._backward_hooks),
                      sorted(m.__dict__))
               for name, m in model.named_modules()}
    return {"params": params, "modules": modules,
            "ignored": getattr(model, "_ddp_params_and_buffers_to_ignore", None)}


def _replaced_forward(model: torch.nn.Module) -> torch.nn.Module:
    layer = model.model.layers[1].self_attn.q_proj
    own = layer.forward
    layer.forward = lambda x: own(x)  # another wrapper's patch, as a tracer or adapter library leaves it
    return model


REFUSALS = [
    pytest.param(_replaced_forward, dict(), "already has its forward replaced", id="replaced-forward"),
    pytest.param(_replaced_forward, dict(sparse_backward=True), "already has its forward replaced",
                 id="replaced-forward-explicit"),
    pytest.param(_replaced_forward, dict(memory="lowest"), "already has its forward replaced",
                 id="replaced-forward-lowest"),
    pytest.param(lambda m: m, dict(target_modules=["q_porj"]), "matches no module", id="bad-target-modules"),
    pytest.param(lambda m: m, dict(density=1.5), "density", id="bad-density"),
    pytest.param(lambda m: m, dict(dense_modules=["lm_head"], target_modules=["lm_head"]), "both sparse",
                 id="sparse-and-dense"),
]


@pytest.mark.parametrize(("prepare", "kwargs", "message"), REFUSALS)
def test_a_refused_for_model_leaves_the_model_exactly_as_it_was(prepare, kwargs, message):
    """for_model used to freeze params and hook grads before the sparse backward refused a replaced forward."""
    model = prepare(_llama())
    before = _snapshot(model)
    with pytest.raises(ValueError, match=message):
        SparseAdamW.for_model(model, **{"density": 0.1, **kwargs})
    assert _snapshot(model) == before


@pytest.fixture
def one_process_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("flag", ["sparse_backward", "compact_grads", "update_in_backward"])
def test_an_explicit_compact_mode_on_a_ddp_wrapped_model_names_the_wrap(flag, one_process_group):
    """sparse_backward=True on a DDP-wrapped model was refused telling the caller to leave compact_grads unset."""
    model = _llama()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    before = _snapshot(model)
    with pytest.raises(ValueError, match=f"{flag}=True on a model already wrapped in DistributedDataParallel") as err:
        SparseAdamW.for_model(ddp, density=0.1, **{flag: True})
    assert "before wrapping it in DDP" in str(err.value) and "compact_grads unset" not in str(err.value)
    assert _snapshot(model) == before


def test_a_model_routed_through_the_sparse_backward_pickles():
    """A model for_model routed through the sparse backward failed to pickle (its forward was a bound method)."""
    model = _llama()
    opt = SparseAdamW.for_model(model, density=0.1, lr=1e-2)
    assert opt.sparse_backward_handle.modules
    for step in range(2):  # past the selection: the routes compute the sparse gradient
        model(_ids(step), labels=_ids(step)).loss.backward()
        opt.step()
        opt.zero_grad()
    ids = _ids(9)
    with torch.no_grad():
        expected = model(ids).logits
    copy = pickle.loads(pickle.dumps(model))
    with torch.no_grad():
        assert torch.equal(copy(ids).logits, expected)
    routed = [name for name, m in copy.named_modules() if "_sift_route" in m.__dict__]
    assert routed == list(opt.sparse_backward_handle.modules)
    copy(ids, labels=ids).loss.backward()  # the copy's layers feed their own (copied) optimizer
    route = copy.model.layers[0].self_attn.q_proj._sift_route
    assert route.optimizer is not opt and route.weight is copy.model.layers[0].self_attn.q_proj.weight


STEPS = 3


def _global_batch(step: int) -> torch.Tensor:
    return _ids(100 + step, n=4, seq=9)


def _ddp_recipe_train(model, opt, rank: int, world: int) -> None:
    for step in range(STEPS):  # each rank its own slice of the global batch; the loss is a mean over its tokens
        ids = _global_batch(step)
        ids = ids[rank * len(ids) // world:(rank + 1) * len(ids) // world]
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()


def _result(model, opt) -> dict[str, torch.Tensor]:
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    state.update({f"{n}.indices": opt.indices_of(p) for n, p in model.named_parameters()
                  if "indices" in opt.state.get(p, {})})
    return state


def _ddp_recipe(rank: int, world: int, memory: str, out: str) -> None:
    model = _llama(seed=rank)  # different weights per rank: the wrap starts every rank from rank 0's
    opt = SparseAdamW.for_model(model, density=0.1, lr=1e-2, memory=memory)
    net = sift.wrap_ddp(model)
    assert isinstance(net, torch.nn.parallel.DistributedDataParallel) == (memory == "plain")
    _ddp_recipe_train(net, opt, rank, world)
    torch.save(_result(model, opt), f"{out}.{rank}")


@gloo_rank
def _ddp_recipe_low(rank: int, world: int, out: str) -> None:
    _ddp_recipe(rank, world, "low", out)


@gloo_rank
def _ddp_recipe_plain(rank: int, world: int, out: str) -> None:
    _ddp_recipe(rank, world, "plain", out)


@pytest.mark.parametrize("memory", ["low", "plain"])
def test_the_ddp_recipe_trains_a_causal_lm_as_one_process_on_the_global_batch(tmp_path, memory):
    """DDP refused to wrap a causal LM after for_model: its only trained params, the sparse weights, were ignored."""
    ranks = run_ranks({"low": _ddp_recipe_low, "plain": _ddp_recipe_plain}[memory], 2, tmp_path)
    model = _llama(seed=0)
    opt = SparseAdamW.for_model(model, density=0.1, lr=1e-2, memory=memory)
    _ddp_recipe_train(model, opt, 0, 1)
    expected = _result(model, opt)
    assert any(name.endswith(".indices") for name in expected)
    for got in ranks:
        assert got.keys() == expected.keys()
        for name, value in expected.items():
            if name.endswith(".indices"):
                assert torch.equal(got[name], value), name
            else:
                torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)
    assert all(torch.equal(a, b) for a, b in zip(ranks[0].values(), ranks[1].values()))
