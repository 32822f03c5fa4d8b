"""`SparseAdamW.for_model`: which params of real transformers models it trains, and how."""

from __future__ import annotations

import math

import pytest
import torch

import sift
from sift import SparseAdamW

transformers = pytest.importorskip("transformers")


def _bert(num_labels: int = 2) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=48, num_labels=num_labels)
    return transformers.BertForSequenceClassification(config)


def _gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_embd=24, n_layer=2, n_head=4, n_positions=32, num_labels=2,
                                     bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.GPT2ForSequenceClassification(config)


def _llama_gqa() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, num_labels=3, pad_token_id=0,
                                      bos_token_id=1, eos_token_id=2)
    return transformers.LlamaForSequenceClassification(config)


MODELS = {"bert": _bert, "gpt2": _gpt2, "llama-gqa": _llama_gqa}
# The expected names, written out per family (independent of the matching code).
EXPECTED_SPARSE = {
    "bert": [f"bert.encoder.layer.{i}.attention.{m}.weight" for i in range(2)
             for m in ("self.query", "self.key", "self.value", "output.dense")],
    "gpt2": [f"transformer.h.{i}.attn.{m}.weight" for i in range(2) for m in ("c_attn", "c_proj")],
    "llama-gqa": [f"model.layers.{i}.self_attn.{m}.weight" for i in range(2)
                  for m in ("q_proj", "k_proj", "v_proj", "o_proj")],
}
EXPECTED_DENSE = {"bert": ["classifier.weight", "classifier.bias"], "gpt2": ["score.weight"],
                  "llama-gqa": ["score.weight"]}


def _batch(model: torch.nn.Module, n: int = 4, seq: int = 7) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    labels = torch.arange(n) % model.config.num_labels
    # Token 0 is GPT-2's / Llama's pad token here; keep it out so every row has a last token.
    return {"input_ids": torch.randint(3, 64, (n, seq), generator=gen), "labels": labels}


def _snapshot(model: torch.nn.Module) -> dict[str, tuple[torch.Tensor, bool]]:
    return {n: (p.detach().clone(), p.requires_grad) for n, p in model.named_parameters()}


def _assert_untouched(model: torch.nn.Module, before: dict[str, tuple[torch.Tensor, bool]]) -> None:
    for name, p in model.named_parameters():
        assert p.requires_grad == before[name][1], name
        assert torch.equal(p.detach(), before[name][0]), name
        assert p.grad is None and not p._post_accumulate_grad_hooks, name


@pytest.mark.parametrize("family", list(MODELS))
def test_for_model_picks_exactly_the_attention_weights_and_the_head(family):
    model = MODELS[family]()
    opt = SparseAdamW.for_model(model, density=0.05, lr=1e-2)
    names = [n for n, _ in model.named_parameters()]
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained == set(EXPECTED_SPARSE[family]) | set(EXPECTED_DENSE[family])
    groups = {g["name"]: g for g in opt.param_groups}
    assert set(groups["sparse"]["param_names"]) == set(EXPECTED_SPARSE[family])
    assert groups["sparse"]["density"] == 0.05
    assert set(groups["dense"]["param_names"]) == set(EXPECTED_DENSE[family])
    assert groups["dense"]["density"] == 1.0
    params = dict(model.named_parameters())
    for group in opt.param_groups:  # labels and tensors agree
        assert all(params[n] is p for n, p in zip(group["param_names"], group["params"]))
    frozen = set(names) - trained
    assert frozen and all(not params[n].requires_grad for n in frozen)


@pytest.mark.parametrize("family", list(MODELS))
def test_the_default_entries_are_a_random_mask_drawn_by_each_weights_name(family):
    """for_model's default (the chat board's choice): each sparse weight's entries are the seeded draw keyed by its
    name, whatever the batch; only they move."""
    from sift._rules import random_entries

    picked = []
    for other in (0, 1):
        model = MODELS[family]()
        opt = SparseAdamW.for_model(model, density=0.05)
        assert (opt.selection, opt.param_groups[0]["lr"]) == ("random", 1e-2)
        before = _snapshot(model)
        model(**_batch(model, n=4 + 2 * other, seq=7 - other)).loss.backward()  # another batch
        opt.step()
        params = dict(model.named_parameters())
        chosen = {}
        for name in EXPECTED_SPARSE[family]:
            p = params[name]
            idx = opt.indices_of(p).long()
            k = math.ceil(0.05 * p.numel())
            assert torch.equal(idx, random_entries(0, name, 0, p.numel(), k, p.device).long()), name
            moved = (p.detach() != before[name][0]).reshape(-1)
            outside = torch.ones_like(moved)
            outside[idx] = False
            assert moved[idx].any() and not moved[outside].any(), name
            chosen[name] = idx
        picked.append(chosen)
    assert all(torch.equal(picked[0][n], picked[1][n]) for n in picked[0])


@pytest.mark.parametrize("family", list(MODELS))
def test_backward_leaves_frozen_grads_none_and_a_step_moves_only_chosen_entries(family):
    model = MODELS[family]()
    # SIFT's rule, whose choice is checked against the dense grads (the default's random mask: test_selection).
    opt = SparseAdamW.for_model(model, density=0.05, lr=1e-2, memory="plain", selection="magnitude")
    before = _snapshot(model)
    model(**_batch(model)).loss.backward()
    params = dict(model.named_parameters())
    for name, p in params.items():
        trained = name in EXPECTED_SPARSE[family] or name in EXPECTED_DENSE[family]
        assert (p.grad is not None) == trained, name
    opt.step()
    for name, p in params.items():
        moved = (p.detach() != before[name][0]).reshape(-1)
        if name in EXPECTED_SPARSE[family]:
            idx = opt.state[p]["indices"].long()
            assert idx.numel() == math.ceil(0.05 * p.numel()), name
            # The top-|grad| entries, against a plain torch top-k of the gradient.
            expected = torch.topk(p.grad.abs().reshape(-1), idx.numel()).indices.sort().values
            assert torch.equal(idx, expected), name
            outside = torch.ones_like(moved)
            outside[idx] = False
            assert moved[idx].any() and not moved[outside].any(), name
        elif name in EXPECTED_DENSE[family]:
            assert moved.all(), name
        else:
            assert not moved.any(), name


def test_gqa_key_value_weights_keep_their_narrower_shape():
    model = _llama_gqa()
    opt = SparseAdamW.for_model(model, density=0.1)
    model(**_batch(model)).loss.backward()
    opt.step()
    k_proj = model.model.layers[0].self_attn.k_proj.weight
    assert k_proj.shape == (16, 32)  # 2 KV heads of 8 against 4 query heads
    assert opt.state[k_proj]["indices"].numel() == math.ceil(0.1 * 16 * 32)


def test_lm_head_is_trained_only_when_named():
    """Behaviour change: an untied lm_head was trained densely by default (131M params and about 1 GB of AdamW
    state for a 7B Llama), a tied one not at all. Now neither is, unless named in dense_modules, and the summary
    says what became of it."""
    torch.manual_seed(0)
    tied = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_embd=24, n_layer=1, n_head=4,
                                                                n_positions=32, bos_token_id=0, eos_token_id=0))
    opt = SparseAdamW.for_model(tied)
    assert [g["name"] for g in opt.param_groups] == ["sparse"]
    assert not tied.lm_head.weight.requires_grad
    assert "lm_head: frozen (tied to the input embeddings" in sift.trainable_summary(tied, opt)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=40, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    untied = transformers.LlamaForCausalLM(config)
    opt = SparseAdamW.for_model(untied)
    assert [g["name"] for g in opt.param_groups] == ["sparse"]
    assert not untied.lm_head.weight.requires_grad
    assert "lm_head: frozen (pretrained; name it in dense_modules" in sift.trainable_summary(untied, opt)
    opt = SparseAdamW.for_model(untied, dense_modules=["lm_head"])
    dense = next(g for g in opt.param_groups if g["name"] == "dense")
    assert dense["param_names"] == ["lm_head.weight"]
    assert not untied.model.embed_tokens.weight.requires_grad
    assert "lm_head: trained (dense)" in sift.trainable_summary(untied, opt)


@pytest.mark.parametrize(
    "targets, expected",
    [
        pytest.param(r".*layer\.0\.attention\.self\.(query|value)", ["bert.encoder.layer.0.attention.self.query.weight",
                     "bert.encoder.layer.0.attention.self.value.weight"], id="one-regex-string"),
        pytest.param(["intermediate.dense", r"bert\.encoder\.layer\.1\.attention\.self\.k\w+"],
                     ["bert.encoder.layer.0.intermediate.dense.weight",
                      "bert.encoder.layer.1.intermediate.dense.weight",
                      "bert.encoder.layer.1.attention.self.key.weight"], id="name-and-regex-list"),
        pytest.param(["bert.encoder.layer.1.attention.self.query"],
                     ["bert.encoder.layer.1.attention.self.query.weight"], id="full-name"),
    ],
)
def test_custom_target_modules(targets, expected):
    model = _bert()
    opt = SparseAdamW.for_model(model, target_modules=targets)
    sparse = next(g for g in opt.param_groups if g["name"] == "sparse")
    assert sorted(sparse["param_names"]) == sorted(expected)
    # A plain name matches whole trailing components: "intermediate.dense" leaves "attention.output.dense" alone.
    assert all(p.requires_grad == (n in expected or n.startswith("classifier")) for n, p in model.named_parameters())


def test_dense_modules_override_and_empty_targets():
    model = _bert()
    opt = SparseAdamW.for_model(model, target_modules=[], dense_modules=["classifier", "pooler"])
    assert [g["name"] for g in opt.param_groups] == ["dense"]
    assert sorted(opt.param_groups[0]["param_names"]) == ["bert.pooler.dense.bias", "bert.pooler.dense.weight",
                                                          "classifier.bias", "classifier.weight"]


def test_kwargs_pass_through_to_the_optimizer():
    model = _bert()
    opt = SparseAdamW.for_model(model, density=0.02, lr=3e-3, selection="random", weight_decay=0.1,
                                compact_grads=True, max_grad_norm=0.5, select_steps=2, state="lean",
                                betas=(0.8, 0.9), seed=7)
    assert (opt.selection, opt.compact_grads, opt.max_grad_norm, opt.select_steps, opt.state_layout, opt.seed) == \
        ("random", True, 0.5, 2, "lean", 7)
    for group in opt.param_groups:
        assert group["lr"] == 3e-3 and group["weight_decay"] == 0.1 and group["betas"] == (0.8, 0.9)


def test_compact_grads_mode_frees_target_grads():
    model = _bert()
    opt = SparseAdamW.for_model(model, density=0.05, compact_grads=True)
    model(**_batch(model)).loss.backward()
    opt.step()
    assert all(p.grad is None for n, p in model.named_parameters() if n in EXPECTED_SPARSE["bert"])
    assert all(opt.state[p]["indices"].numel() > 0 for n, p in model.named_parameters() if n in EXPECTED_SPARSE["bert"])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        pytest.param(dict(target_modules=["qurey"]), r"'qurey' matches no module.*nearest module names: \['query'",
                     id="no-match"),
        pytest.param(dict(target_modules=r"nothing\..*"), r"matches no module", id="regex-no-match"),
        pytest.param(dict(dense_modules=["classifer"]), r"dense_modules entry 'classifer'.*'classifier'",
                     id="dense-no-match"),
        pytest.param(dict(target_modules=["query"], dense_modules=["attention"]), r"both sparse.*and dense",
                     id="sparse-and-dense"),
        pytest.param(dict(target_modules=["word_embeddings"]), r"not: bert\.embeddings\.word_embeddings \(Embedding\)",
                     id="embedding-target"),
        pytest.param(dict(target_modules=["attention.output.LayerNorm"]), r"linear layers with a 2-D weight",
                     id="layernorm-target"),
        pytest.param(dict(density=0.0), r"density must be in \(0, 1\]", id="density-zero"),
        pytest.param(dict(density=1.5), r"density must be in \(0, 1\]", id="density-above-one"),
        pytest.param(dict(selection="no-such-rule"), r"selection", id="bad-selection"),
        pytest.param(dict(weight_decay=-1.0), r"weight_decay", id="bad-optimizer-kwarg"),
    ],
)
def test_errors_leave_the_model_untouched(kwargs, message):
    model = _bert()
    model.bert.pooler.dense.weight.requires_grad_(False)  # a state for_model would change
    before = _snapshot(model)
    with pytest.raises(ValueError, match=message):
        SparseAdamW.for_model(model, **kwargs)
    _assert_untouched(model, before)


def test_unknown_family_asks_for_target_modules():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    before = _snapshot(model)
    with pytest.raises(ValueError, match="pass target_modules"):
        SparseAdamW.for_model(model)
    _assert_untouched(model, before)
    opt = SparseAdamW.for_model(model, target_modules=["0"], dense_modules=["2"], density=0.25)
    assert [g["param_names"] for g in opt.param_groups] == [["0.weight"], ["2.weight", "2.bias"]]
    assert not model[0].bias.requires_grad


def test_family_detected_by_names_without_config():
    wrapper = torch.nn.ModuleDict({"body": _bert().bert})  # no config, no head
    opt = SparseAdamW.for_model(wrapper)
    assert [g["name"] for g in opt.param_groups] == ["sparse"]
    assert sorted(opt.param_groups[0]["param_names"]) == sorted("body." + n.removeprefix("bert.")
                                                                for n in EXPECTED_SPARSE["bert"])


def _summary_rows(table: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()[2:] if line.startswith("|")]


def test_trainable_summary_counts_planned_then_real_state():
    model = _bert()
    opt = SparseAdamW.for_model(model, density=0.05)
    rows = {r[0]: r for r in _summary_rows(sift.trainable_summary(model, opt, by="param"))}
    query = rows["bert.encoder.layer.0.attention.self.query.weight"]
    assert query[1:] == ["[32, 32]", "sparse", f"{math.ceil(0.05 * 1024)} (pending)", "0"]
    assert rows["classifier.weight"][2:4] == ["dense", "64"]
    assert rows["bert.encoder.layer.0.attention.self.query.bias"][2:] == ["frozen", "0", "0"]
    rule = 'Sparse entries (those not given by set_indices): a random mask (selection="random", seed 0)'
    assert rule in sift.trainable_summary(model, opt)
    other = _bert()
    top = SparseAdamW.for_model(other, density=0.05, selection="magnitude", select_steps=2)
    assert 'top-|grad| of each weight over 2 step(s) (selection="magnitude"' in sift.trainable_summary(other, top)
    model(**_batch(model)).loss.backward()
    opt.step()
    table = sift.trainable_summary(model, opt, by="param")
    rows = _summary_rows(table)
    by_name = {r[0]: r for r in rows}
    params = dict(model.named_parameters())
    for name in EXPECTED_SPARSE["bert"]:
        state = opt.state[params[name]]
        nbytes = sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))
        assert by_name[name][3:] == [f"{state['indices'].numel():,}", f"{nbytes:,}"]
    total = rows[-1]
    entries = 8 * math.ceil(0.05 * 1024) + 66
    n_all = sum(p.numel() for p in model.parameters())
    assert total[3] == f"**{entries:,}** ({100 * entries / n_all:.3g}% of all)"
    assert total[4] == f"**{int(opt.state_bytes()['state_bytes']):,}**"
    per_row = sum(int(r[4].replace(",", "")) for r in rows[:-1])
    assert per_row == int(opt.state_bytes()["state_bytes"])


def test_trainable_summary_by_kind_merges_layers_and_reads_torch_optimizers():
    model = _bert()
    opt = SparseAdamW.for_model(model, density=0.05)
    rows = {r[0]: r for r in _summary_rows(sift.trainable_summary(model, opt))}
    assert rows["bert.encoder.layer.*.attention.self.key.weight (x2)"][3] == f"{2 * math.ceil(0.05 * 1024)} (pending)"
    head = torch.optim.AdamW(model.classifier.parameters())
    model(**_batch(model)).loss.backward()
    head.step()
    rows = _summary_rows(sift.trainable_summary(model, head, by="param"))
    # torch AdamW: exp_avg and exp_avg_sq (fp32) plus a 0-d fp32 step per param.
    assert rows[-1][4] == f"**{(64 + 2) * 8 + 2 * 4:,}**"
    with pytest.raises(ValueError, match="by must be"):
        sift.trainable_summary(model, opt, by="layer")


pytest.importorskip("accelerate")


def _train_args(output_dir, **kwargs):
    defaults = dict(per_device_train_batch_size=4, learning_rate=1e-2, max_grad_norm=0.5, report_to=[],
                    use_cpu=True, logging_steps=1, save_strategy="no", seed=0, data_seed=0, max_steps=2)
    return transformers.TrainingArguments(output_dir=str(output_dir), **{**defaults, **kwargs})


def _tiny_train_data(n: int = 16) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(0, 64, (10,), generator=gen), "labels": int(i % 2)} for i in range(n)]


def test_trainer_with_target_modules_trains_only_the_targets(tmp_path):
    from sift.integrations.hf import SparseTrainer

    model = _bert()
    before = _snapshot(model)
    trainer = SparseTrainer(model=model, args=_train_args(tmp_path), train_dataset=_tiny_train_data(), density=0.05,
                            target_modules=["query", "value"], selection="random")
    trainer.train()
    opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    assert isinstance(opt, SparseAdamW) and opt.selection == "random"
    sparse = {f"bert.encoder.layer.{i}.attention.self.{m}.weight" for i in range(2) for m in ("query", "value")}
    for name, p in model.named_parameters():
        moved = (p.detach() != before[name][0]).reshape(-1)
        if name in sparse:
            idx = opt.state[p]["indices"].long()
            outside = torch.ones_like(moved)
            outside[idx] = False
            assert moved.any() and not moved[outside].any(), name
        elif name.startswith("classifier"):
            assert moved.all(), name
        else:
            assert not p.requires_grad and not moved.any(), name


def test_trainer_with_target_modules_takes_given_indices(tmp_path):
    from sift.integrations.hf import SparseTrainer

    model = _bert()
    name = "bert.encoder.layer.1.attention.self.key.weight"
    given = {name: torch.tensor([0, 5, 33, 1000])}
    trainer = SparseTrainer(model=model, args=_train_args(tmp_path), train_dataset=_tiny_train_data(),
                            target_modules=["key"], indices=given)
    trainer.train()
    opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    assert torch.equal(opt.state[dict(model.named_parameters())[name]]["indices"].long(), given[name])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        pytest.param(dict(target_modules=["qurey"]), "matches no module", id="no-match"),
        pytest.param(dict(target_modules=["key"], indices={"bert.encoder.layer.0.attention.self.query.weight":
                                                            torch.tensor([0])}),
                     "not target weights", id="indices-outside-targets"),
    ],
)
def test_trainer_target_errors_before_touching_the_model(tmp_path, kwargs, message):
    from sift.integrations.hf import SparseTrainer

    model = _bert()
    before = _snapshot(model)
    with pytest.raises(ValueError, match=message):
        SparseTrainer(model=model, args=_train_args(tmp_path), train_dataset=_tiny_train_data(), **kwargs)
    _assert_untouched(model, before)


def test_trainable_summary_and_planned_entries_read_the_lean_state():
    """Lean params (indices_low, no `indices`) were shown as still pending after their first step."""
    from sift.targets import planned_entries

    model = _bert()
    opt = SparseAdamW.for_model(model, density=0.05, state="lean")
    k = math.ceil(0.05 * 1024)
    entries = 8 * k + 66
    assert planned_entries(opt) == entries
    model(**_batch(model)).loss.backward()
    opt.step()
    rows = _summary_rows(sift.trainable_summary(model, opt, by="param"))
    by_name = {r[0]: r for r in rows}
    params = dict(model.named_parameters())
    for name in EXPECTED_SPARSE["bert"]:
        state = opt.state[params[name]]
        assert "indices" not in state and opt.indices_of(params[name]).numel() == k
        nbytes = sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))
        assert by_name[name][2:] == ["sparse", f"{k:,}", f"{nbytes:,}"]
    assert rows[-1][3].startswith(f"**{entries:,}**")
    assert sum(int(r[4].replace(",", "")) for r in rows[:-1]) == int(opt.state_bytes()["state_bytes"])
    assert planned_entries(opt) == entries
