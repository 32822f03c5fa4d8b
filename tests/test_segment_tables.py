"""Lifetime of the Triton SparseAdamW launch tables, and what pickles and copies of the optimizer carry."""

from __future__ import annotations

import copy
import gc
import pickle
import socket
import warnings
import weakref

import pytest
import torch

from sift import SparseAdamW, _ops
from sift.triton_kernels import _segments
from conftest import TOLERANCES, requires_triton

DEVICES = [
    pytest.param("cpu", id="cpu-interpreter", marks=requires_triton),
    pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
]
SHAPES = [(37, 29), (513,), (3, 5, 7)]


def _kernel_module():
    from sift.triton_kernels import sparse_adamw

    return sparse_adamw


def _params(seed: int, shapes, device: str) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(device)) for s in shapes]


def _set_grads(params, seed: int) -> None:
    """Gradients written into the existing `.grad` tensors (their addresses stay) or new ones."""
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        g = torch.randn(p.shape, generator=gen).to(p.device)
        if p.grad is None:
            p.grad = g
        else:
            p.grad.copy_(g)


def _segment_tables(opt: SparseAdamW) -> list[torch.Tensor]:
    km = _kernel_module()
    return [t for t in km.owner_tables(opt.steps.kernel_cache) if t.shape[1] == km.N_COLS]


def _assert_same_steps(opt: SparseAdamW, ref: SparseAdamW) -> None:
    rtol, atol = TOLERANCES[torch.float32]
    for p, r in zip(opt.param_groups[0]["params"], ref.param_groups[0]["params"]):
        torch.testing.assert_close(p, r, rtol=rtol, atol=atol)
        for key in ("exp_avg", "exp_avg_sq", "delta", "step"):
            torch.testing.assert_close(opt.state[p][key], ref.state[r][key], rtol=rtol, atol=atol, msg=key)


def _pair(seed: int, shapes, device: str, **kwargs) -> tuple[SparseAdamW, SparseAdamW]:
    """A Triton optimizer and the torch reference on copies of the same params."""
    params = _params(seed, shapes, device)
    refs = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = SparseAdamW(params, lr=1e-2, density=0.2, backend="triton", **kwargs)
    ref = SparseAdamW(refs, lr=1e-2, density=0.2, backend="torch", **kwargs)
    return opt, ref


def _step_both(opt: SparseAdamW, ref: SparseAdamW, seed: int) -> None:
    _set_grads(opt.param_groups[0]["params"], seed)
    _set_grads(ref.param_groups[0]["params"], seed)
    opt.step()
    ref.step()


@pytest.mark.parametrize("device", DEVICES)
def test_tables_live_as_long_as_their_optimizer(device):
    """A global 32-entry LRU freed the table a captured graph reads once 32 other tables were built."""
    opt, ref = _pair(0, SHAPES, device)
    _step_both(opt, ref, seed=1)
    tables = _kernel_module().owner_tables(opt.steps.kernel_cache)
    assert len(tables) == 2  # one segment table, one block table
    alive = [weakref.ref(t) for t in tables]
    del tables
    others = []
    for seed in range(1, 42):
        (p,) = _params(seed, [(seed + 2, 3)], device)
        other = SparseAdamW([p], lr=1e-2, density=0.5, backend="triton")
        _set_grads([p], seed)
        other.step()
        others.append(other)
    assert all(r() is not None for r in alive), "another optimizer's tables freed this one's"
    _step_both(opt, ref, seed=2)  # gradients written in place: the same tables serve the step
    assert [id(t) for t in _kernel_module().owner_tables(opt.steps.kernel_cache)] == [id(r()) for r in alive]
    _assert_same_steps(opt, ref)
    del opt
    gc.collect()
    assert all(r() is None for r in alive), "the tables outlived their optimizer"


@pytest.mark.parametrize("device", DEVICES)
def test_owner_keeps_one_table_per_param_set(device):
    """A new param set or moved gradient replaces the owner's table instead of adding one."""
    opt, ref = _pair(3, SHAPES, device)
    _step_both(opt, ref, seed=1)
    (first,) = _segment_tables(opt)
    first_alive = weakref.ref(first)
    del first
    # A moved gradient (the old one still alive, so the address must differ) rebuilds the table.
    kept = [p.grad for p in opt.param_groups[0]["params"]]
    for p in opt.param_groups[0]["params"]:
        p.grad = torch.empty_like(p)
    _step_both(opt, ref, seed=2)
    del kept
    gc.collect()
    assert first_alive() is None and len(_segment_tables(opt)) == 1
    # A param without a gradient leaves the launch: the smaller set replaces the table.
    for group in (opt, ref):
        group.param_groups[0]["params"][1].grad = None
    opt.step()
    ref.step()
    (smaller,) = _segment_tables(opt)
    assert smaller.shape[0] == len(SHAPES) - 1
    _step_both(opt, ref, seed=3)
    (whole,) = _segment_tables(opt)
    assert whole.shape[0] == len(SHAPES)
    _assert_same_steps(opt, ref)


@requires_triton
def test_direct_call_keeps_no_table(monkeypatch):
    """Without a table_cache the launcher builds the tables for the call and keeps none."""
    km = _kernel_module()
    built = []

    def recording_build(*args, **kwargs):
        tables = real_build(*args, **kwargs)
        built.extend(weakref.ref(t) for t in (tables.table, tables.blocks))
        return tables

    real_build = km._build_tables
    monkeypatch.setattr(km, "_build_tables", recording_build)
    params = _params(5, SHAPES, "cpu")
    gen = torch.Generator().manual_seed(6)
    indices = [torch.sort(torch.randperm(p.numel(), generator=gen)[: p.numel() // 3 + 1]).values for p in params]
    inputs = [params, [torch.randn(p.shape, generator=gen) for p in params], indices,
              *([torch.rand(i.numel(), generator=gen) * 0.01 for i in indices] for _ in range(3)), [],
              [torch.tensor(4.0) for _ in params]]
    expected = copy.deepcopy(inputs)
    kwargs = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.01, maximize=False, compact_grads=False)
    with torch.no_grad():
        km.sparse_adamw_(*inputs, **kwargs)
        _ops.sparse_adamw_ref(*expected, **kwargs)
    gc.collect()
    assert len(built) == 2 and all(r() is None for r in built)
    rtol, atol = TOLERANCES[torch.float32]
    for group in (0, 3, 4, 5):
        for got, want in zip(inputs[group], expected[group]):
            torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


@requires_triton
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")])
def test_table_columns_hold_what_their_names_say(dtype):
    km = _kernel_module()
    gen = torch.Generator().manual_seed(8)
    shapes = [(37, 29), (1,), (1025,)]
    params = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    indices = [torch.sort(torch.randperm(p.numel(), generator=gen)[: p.numel() // 2 + 1]).values.int()
               for p in params]
    state = [[torch.zeros(i.numel()) for i in indices] for _ in range(3)]
    bases = [p.reshape(-1)[i.long()].clone() for p, i in zip(params, indices)] if dtype != torch.float32 else []
    steps = [torch.tensor(1.0) for _ in params]
    grads = [torch.randn(p.shape, generator=gen).to(dtype) for p in params]
    table_cache: dict = {}
    km.sparse_adamw_(params, grads, indices, *state, bases, steps, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                     weight_decay=0.0, maximize=False, compact_grads=False, block=512, table_cache=table_cache)
    table, blocks = km.owner_tables(table_cache)
    assert table.shape == (len(shapes), km.N_COLS) and blocks.shape[1] == km.N_BLOCK_COLS
    column = lambda t, col: t[:, int(col)].tolist()  # noqa: E731  (the names are tl.constexpr)
    addresses = lambda tensors: [t.data_ptr() for t in tensors]  # noqa: E731
    assert column(table, km.COL_NUMEL) == [i.numel() for i in indices]
    for col, tensors in ((_segments.COL_PARAM, params), (_segments.COL_GRAD, grads), (km.COL_INDICES, indices),
                         (_segments.COL_EXP_AVG, state[0]), (_segments.COL_EXP_AVG_SQ, state[1]),
                         (km.COL_DELTA, state[2]), (_segments.COL_STEP, steps)):
        assert column(table, col) == addresses(tensors)
    assert column(table, km.COL_BASE) == (addresses(bases) if bases else [0] * len(shapes))
    want_blocks = [(t, s) for t, i in enumerate(indices) for s in range(0, i.numel(), 512)]
    assert list(zip(column(blocks, km.BLOCK_COL_TENSOR), column(blocks, km.BLOCK_COL_START))) == want_blocks


@pytest.mark.gpu
def test_captured_step_survives_other_tables_and_an_eager_step_with_moved_grads():
    """The table a captured graph reads stays alive when its slot moves on and 40 other tables are built."""
    params = _params(0, SHAPES, "cuda")
    refs = [torch.nn.Parameter(p.detach().clone()) for p in params]
    lr = torch.tensor(1e-2, device="cuda")
    opt = SparseAdamW(params, lr=lr, density=0.2)
    ref = SparseAdamW(refs, lr=1e-2, density=0.2, backend="torch")
    _step_both(opt, ref, seed=1)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        opt.step()  # warm-up on the side stream
    torch.cuda.current_stream().wait_stream(stream)
    ref.step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    # An eager step with moved gradients replaces the slot's table; the captured one must stay.
    static = [p.grad for p in params]
    for p in params:
        p.grad = p.grad.clone()
    opt.step()
    ref.step()
    for p, g in zip(params, static):
        p.grad = g
    others = [SparseAdamW([p], lr=1e-2, density=0.5) for p in _params(9, [(n + 2, 3) for n in range(41)], "cuda")]
    for other in others:
        _set_grads(other.param_groups[0]["params"], 4)
        other.step()
    for _ in range(3):
        graph.replay()
        ref.step()
    torch.cuda.synchronize()
    _assert_same_steps(opt, ref)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pickle_round_trip(opt: SparseAdamW) -> SparseAdamW:
    return pickle.loads(pickle.dumps(opt))


@pytest.mark.parametrize("copier", [pytest.param(copy.deepcopy, id="deepcopy"),
                                    pytest.param(_pickle_round_trip, id="pickle")])
def test_pickle_and_deepcopy_drop_the_process_group_with_a_warning(copier):
    """pickle.dumps and copy.deepcopy of a SparseAdamW holding a process_group raised TypeError."""
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch.distributed is not built into this torch")
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{_free_port()}")
    try:
        (w,) = _params(0, [(13, 11)], "cpu")
        opt = SparseAdamW([w], lr=1e-2, density=0.2, compact_grads=True, process_group=dist.group.WORLD)
        w.square().sum().backward()
        opt.step()
        with pytest.warns(UserWarning, match="no process_group"):
            clone = copier(opt)
        assert clone.process_group is None and opt.process_group is dist.group.WORLD
        assert clone.steps.kernel_cache == {}
        (cw,) = clone.param_groups[0]["params"]
        for key in ("indices", "exp_avg", "exp_avg_sq", "delta", "step"):
            assert torch.equal(clone.state[cw][key], opt.state[w][key]), key
        # The copy hooks its own param: a backward fills its compact gradient.
        cw.square().sum().backward()
        assert cw.grad is None and clone.compact_grad(cw) is not None
    finally:
        dist.destroy_process_group()


@requires_triton
def test_copy_builds_its_own_tables_and_steps_like_the_original():
    opt, ref = _pair(2, SHAPES, "cpu")
    _step_both(opt, ref, seed=1)
    assert _kernel_module().owner_tables(opt.steps.kernel_cache)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no process group: nothing to warn about
        clone = copy.deepcopy(opt)
    assert clone.steps.kernel_cache == {}
    _step_both(clone, ref, seed=2)
    _assert_same_steps(clone, ref)
    own = {id(t) for t in _kernel_module().owner_tables(clone.steps.kernel_cache)}
    assert own and own.isdisjoint(id(t) for t in _kernel_module().owner_tables(opt.steps.kernel_cache))


@pytest.mark.parametrize("copier", [copy.deepcopy, lambda o: pickle.loads(pickle.dumps(o))], ids=["deepcopy", "pickle"])
def test_copies_keep_every_setting_of_the_original(copier):
    """sharded_selection was not carried: a copy of a per-shard optimizer selected globally."""
    w = torch.nn.Parameter(torch.randn(4, 4))
    opt = SparseAdamW([w], density=0.25, sharded_selection="per_shard", select_steps=2, selection="saliency",
                      seed=7, max_grad_norm=0.5)
    clone = copier(opt)
    assert (clone.sharded_selection, clone.select_steps, clone.selection, clone.seed, clone.max_grad_norm) == \
        ("per_shard", 2, "saliency", 7, 0.5)
    from sift.optim.checkpoint import PICKLED

    for name in PICKLED:
        assert getattr(clone, name) == getattr(opt, name), name
