"""The transformers Trainer under accelerate's FSDP2 plugin (`fsdp_version=2`) with sift, 2 gloo processes.

accelerate 1.15 turns FSDP on only for accelerator devices: on CPU (`use_cpu=True`) it keeps
DistributedType.MULTI_CPU, i.e. DDP, and the Trainer's `is_fsdp_enabled` stays False, whatever the FSDP
config says. These tests set the state accelerate sets on a GPU (DistributedType.FSDP and the plugin the
Trainer built from `fsdp_config`) before training, so that the GPU route runs here: the optimizer built
before `fully_shard`, accelerate swapping its params for the sharded ones, FSDP2 reduce-scattering.
Each run is compared with one process training on the global batches (the same Trainer, no FSDP), with
`average_tokens_across_devices=False`: by default the Trainer multiplies the loss by the number of processes
for models that take loss kwargs, and BERT's classification loss, a mean over the rank's own batch, would
come out (with its gradients) twice the one-process loss.
"""

from __future__ import annotations

import os

import pytest
import torch

from conftest import gloo_rank, run_ranks
from sift import SparseAdamW

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("torch.distributed.fsdp")

STEPS = 3
GLOBAL_BATCH = 4
DENSITY = 0.05
CASES = ["trainer", "sparse-trainer"]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=48, num_labels=2, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    return transformers.BertForSequenceClassification(config)


def _data() -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(0, 64, (10,), generator=gen), "labels": int(i % 2)} for i in range(16)]


def _trainer(case: str, output_dir: str, world: int, save_strategy: str = "no"):
    from sift.integrations.hf import SparseTrainer

    fsdp = dict(fsdp=True, fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["BertLayer"]}) if world > 1 \
        else {}
    args = transformers.TrainingArguments(
        output_dir=output_dir, per_device_train_batch_size=GLOBAL_BATCH // world, max_steps=STEPS, learning_rate=1e-2,
        max_grad_norm=1.0, report_to=[], save_strategy=save_strategy, save_steps=1, use_cpu=True, logging_steps=1, seed=0, data_seed=0,
        average_tokens_across_devices=False, **fsdp)
    model = _model()
    if case.startswith("trainer"):
        # A plain Trainer given a sift optimizer: built on the unsharded model, as the Trainer requires, in plain
        # mode (accelerate swaps its params for the shards; the compact modes' hooks would stay on the old ones).
        opt = SparseAdamW.for_model(model, density=DENSITY, lr=1e-2, memory="low" if case == "trainer-low" else "plain")
        trainer = transformers.Trainer(model=model, args=args, train_dataset=_data(), optimizers=(opt, None))
    else:
        trainer = SparseTrainer(model=model, args=args, train_dataset=_data(), density=DENSITY,
                                memory="plain" if world == 1 else "low")
    if world > 1:
        _force_fsdp(trainer)
    return trainer


def _force_fsdp(trainer) -> None:
    """What accelerate's state holds for FSDP2 on a GPU, which it never sets on CPU."""
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = trainer.accelerator.state
    assert state.distributed_type == DistributedType.MULTI_CPU and not trainer.is_fsdp_enabled
    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = FullyShardedDataParallelPlugin(**trainer.args.fsdp_plugin_args)
    trainer.is_fsdp_enabled = True


def _result(trainer) -> dict:
    """The whole params (gathered from the shards: collective) and the chosen entries of each weight."""
    from sift.optim.sharded import full_tensor, shard_offset

    opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    out = {"params": {}, "indices": {}, "sharded": False, "losses": [h["loss"] for h in trainer.state.log_history
                                                                       if "loss" in h]}
    for name, p in trainer.model.named_parameters():
        out["params"][name] = full_tensor(p.detach()).clone()
        if hasattr(p, "to_local"):
            out["sharded"] = True
        if "indices" in opt.state.get(p, {}):
            offset = shard_offset(p) if hasattr(p, "to_local") else 0
            out["indices"][name] = opt.indices_of(p).long() + offset
    return out


@gloo_rank
def _worker(rank: int, world: int, out: str) -> None:
    # accelerate reads the job from the launcher's variables; the process group is already up.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    results = {}
    for case in CASES:
        trainer = _trainer(case, f"{out}.{case}.{rank}", world)
        trainer.train()
        results[case] = _result(trainer)
        if case == "sparse-trainer":
            trainer.save_model(f"{out}.saved")  # collective: every rank gathers the k entries, rank 0 writes
    results["checkpoint refusal"], results["checkpoint moved"] = _refused(
        _trainer("sparse-trainer", f"{out}.checkpointing.{rank}", world, save_strategy="steps"), ValueError)
    results["refusal"], results["moved"] = _refused(_trainer("trainer-low", f"{out}.low.{rank}", world), RuntimeError)
    torch.save(results, f"{out}.{rank}")


def _refused(trainer, error: type) -> tuple[str | None, list[str]]:
    """Train, expecting `error`: its message (None if training went through) and the params that moved."""
    from sift.optim.sharded import full_tensor

    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    try:
        trainer.train()
        message = None
    except error as exc:
        message = str(exc)
    return message, [n for n, p in trainer.model.named_parameters()
                     if not torch.equal(full_tensor(p.detach()), before[n])]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    directory = tmp_path_factory.mktemp("trainer-fsdp")
    return str(directory / "result"), run_ranks(_worker, 2, directory)


@pytest.fixture(scope="module")
def ranks(run):
    return run[1]


@pytest.mark.parametrize("case", CASES)
def test_trainer_under_accelerate_fsdp2_equals_one_process(ranks, case, tmp_path):
    """Params, chosen entries (the whole weight's top-k) and losses equal one process on the global batches."""
    reference = _trainer(case, str(tmp_path), world=1)
    reference.train()
    want = _result(reference)
    for name, indices in want["indices"].items():
        joined = torch.cat([r[case]["indices"][name] for r in ranks if name in r[case]["indices"]])
        assert torch.equal(joined.sort().values, indices.sort().values), f"{name}: another selection"
    for rank, r in enumerate(ranks):
        got = r[case]
        assert got["sharded"], f"rank {rank}: the params were not sharded"
        assert sorted(got["params"]) == sorted(want["params"])
        for name, p in want["params"].items():
            torch.testing.assert_close(got["params"][name], p, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {rank} {name}: {m}")
        torch.testing.assert_close(got["losses"], want["losses"], rtol=1e-5, atol=1e-6)


def test_a_compact_mode_optimizer_whose_params_accelerate_replaced_is_refused(ranks):
    """memory="low" (hook mode, sparse backward) built before accelerate's fully_shard hooked the old params: the
    first step refuses, before any weight moves, rather than train the shards wrongly."""
    for rank, r in enumerate(ranks):
        assert r["refusal"] is not None and "was replaced after it was built" in r["refusal"], (rank, r["refusal"])
        assert r["moved"] == [], (rank, r["moved"])


def test_save_model_under_fsdp2_writes_the_fine_tune_gathered_from_the_shards(run):
    """save_model ran the delta's gathering on rank 0 alone (the Trainer calls _save on the main process):
    rank 0 waited on a collective the others never joined. Every rank now gathers, rank 0 writes; the
    directory applied to a fresh base model gives the trained params bit for bit."""
    from sift import SparseDelta

    out, ranks = run
    delta = SparseDelta.from_pretrained(f"{out}.saved")
    model = _model()
    delta.apply_(model)
    trained = ranks[0]["sparse-trainer"]["params"]
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), trained[name]), name
    assert delta.dense and delta.nnz == sum(i.numel() for r in ranks for i in r["sparse-trainer"]["indices"].values())


def test_checkpoints_under_fsdp2_are_refused_before_training(ranks):
    """torch's FSDP state-dict helpers would save the per-shard [k] optimizer tensors once, as if replicated."""
    for rank, r in enumerate(ranks):
        assert r["checkpoint refusal"] is not None and "save_strategy='no'" in r["checkpoint refusal"], rank
        assert r["checkpoint moved"] == [], (rank, r["checkpoint moved"])
