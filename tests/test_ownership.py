"""House rule: each datum of `SparseAdamW` has one owner. A module assigns (or mutates in place: item
assignment, `pop`, `append`, `clear`, `update`, ...) an attribute of one of the optimizer's parts only if it is
that part's module, an attribute of the optimizer only if it is the optimizer's (core.py, and checkpoint.py
which holds its state_dict and copy functions), and a param's state (`opt.state[p]`, directly or through a local
name) only if it is the optimizer's or the entries' (state.py). Another module asks the owner, through a method
named for what it does. And a part reads the settings it was built with (`self.settings`), never back off the
optimizer."""

from __future__ import annotations

import ast
import pathlib

import pytest

from sift.optim import SparseAdamW
from sift.optim.settings import NAMES as SETTING_NAMES

REPO = pathlib.Path(__file__).resolve().parent.parent
OPTIMIZER = "optimizer"
OPTIMIZER_MODULES = {"sift.optim.core", "sift.optim.checkpoint"}
# Names a module calls the optimizer by; inside the optimizer's own class, `self` is it too.
OPTIMIZER_NAMES = {"opt", "optimizer"}
# One param's state, `opt.state[p]`: its entries belong to the entries part (state.py) and the optimizer's modules.
STATE = "state[p]"
MUTATORS = {"pop", "popitem", "append", "extend", "insert", "remove", "clear", "update", "add", "discard",
            "setdefault"}
# Attributes of the optimizer another module may set: the documented public settings (a property hands each to
# the part that owns it), and marks that belong to someone else (accelerate's overflow flag; the Trainer check's).
OPEN = {("sift.integrations.hf", "grad_scaler"), ("sift.integrations.hf", "_is_overflow"),
        ("sift.optim.trainer_check", "_trainer_checked")}


def part_owners(parts=SparseAdamW.PARTS) -> dict[str, str]:
    """Each part's name -> the module that defines its class (its owner)."""
    return {name: cls.__module__ for name, cls in parts}


def _is_in_place(name: str) -> bool:
    """A tensor method that writes its tensor (`add_`, `copy_`, `zero_`), not a dunder."""
    return name.endswith("_") and not name.startswith("_")


class _Writes(ast.NodeVisitor):
    """Every write of `<optimizer or part>.attr` in a module: (whose, attr, line)."""

    def __init__(self, parts: set[str]) -> None:
        self.parts = parts
        self.found: list[tuple[str, str, int]] = []
        self.self_is_optimizer = False
        self.aliases: list[dict[str, str]] = [{}]

    def whose(self, node: ast.AST) -> str | None:
        """OPTIMIZER, a part's name, or None for anything else."""
        if isinstance(node, ast.Name):
            if node.id in OPTIMIZER_NAMES or (node.id == "self" and self.self_is_optimizer):
                return OPTIMIZER
            return self.aliases[-1].get(node.id)
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id == "self" and node.attr in OPTIMIZER_NAMES:
                return OPTIMIZER  # a part's (or a route's) `self.opt`
            if node.attr in self.parts and self.whose(node.value) == OPTIMIZER:
                return node.attr
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr == "_sparse_optimizer":
            return OPTIMIZER
        # `opt.state[p]`, `opt.state.get(p, {})`, `opt.state.setdefault(p, {})`: one param's state.
        if isinstance(node, ast.Subscript) and self.is_state_map(node.value):
            return STATE
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr in ("get", "setdefault") and self.is_state_map(node.func.value):
            return STATE
        return None

    def is_state_map(self, node: ast.AST) -> bool:
        """`<optimizer>.state`, the map of every param's state."""
        return isinstance(node, ast.Attribute) and node.attr == "state" and self.whose(node.value) == OPTIMIZER

    def written(self, target: ast.AST, through: bool = False) -> None:
        """Record a write of `target` (`through`: a mutator call or an item assignment reached it, so a local
        name standing for a param's state counts)."""
        if isinstance(target, (ast.Tuple, ast.List)):
            for element in target.elts:
                self.written(element)
            return
        while isinstance(target, ast.Subscript):  # `x.y[i] = ...`, `x.y[i][j] = ...` write x.y
            if self.whose(target) == STATE:  # `opt.state[p][key] = ...`, `opt.state[p] = ...`
                self.found.append((STATE, "", target.lineno))
                return
            target, through = target.value, True
        if isinstance(target, ast.Name) and through and self.whose(target) == STATE:  # `st[key] = ...`
            self.found.append((STATE, "", target.lineno))
        elif isinstance(target, ast.Attribute) and (whose := self.whose(target.value)) is not None:
            self.found.append((whose, target.attr, target.lineno))

    def state_root(self, node: ast.AST) -> bool:
        """`opt.state[p]` or a tensor in it (`opt.state[p]["exp_avg"]`, `st["exp_avg"][0]`)."""
        while isinstance(node, ast.Subscript) and self.whose(node) != STATE:
            node = node.value
        return self.whose(node) == STATE

    def alias(self, name: ast.AST, value: ast.AST) -> None:
        """`name = value`: a local name for the optimizer, a part, a param's state or one of its tensors (an
        in-place op through `m = st["exp_avg"]` writes the state as `st["exp_avg"].add_()` does)."""
        if isinstance(name, ast.Name) and (whose := self.whose(value)) is not None:
            self.aliases[-1][name.id] = whose
        elif isinstance(name, ast.Name) and isinstance(value, ast.Subscript) and self.state_root(value):
            self.aliases[-1][name.id] = STATE
        elif isinstance(name, ast.Tuple) and isinstance(value, ast.Tuple) and len(name.elts) == len(value.elts):
            for element, part in zip(name.elts, value.elts):
                self.alias(element, part)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        outer = self.self_is_optimizer
        self.self_is_optimizer = any(ast.unparse(base).split(".")[-1] in ("Optimizer", "SparseAdamW")
                                     for base in node.bases)
        self.generic_visit(node)
        self.self_is_optimizer = outer

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self.aliases.append({})
        # `grads = self.opt.grads` makes `grads.x = ...` a write of the part, and `st = self.opt.state[p]` makes
        # `st["exp_avg"] = ...` a write of p's state: aliases first, wherever bound.
        for inner in ast.walk(node):
            if isinstance(inner, ast.Assign) and len(inner.targets) == 1:
                self.alias(inner.targets[0], inner.value)
            elif isinstance(inner, ast.For) and isinstance(inner.iter, ast.Call) and \
                    isinstance(inner.iter.func, ast.Attribute) and self.is_state_map(inner.iter.func.value):
                # `for p, st in opt.state.items()`, `for st in opt.state.values()`
                target = inner.target
                if inner.iter.func.attr == "items" and isinstance(target, ast.Tuple) and len(target.elts) == 2:
                    target = target.elts[1]
                if inner.iter.func.attr in ("items", "values") and isinstance(target, ast.Name):
                    self.aliases[-1][target.id] = STATE
        self.generic_visit(node)
        self.aliases.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Assign(self, node: ast.Assign) -> None:
        for target in node.targets:
            self.written(target)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self.written(node.target)
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self.written(node.target)
        self.generic_visit(node)

    def visit_Delete(self, node: ast.Delete) -> None:
        for target in node.targets:
            self.written(target)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in MUTATORS:
            self.written(func.value, through=True)
        elif isinstance(func, ast.Attribute) and _is_in_place(func.attr) and \
                isinstance(func.value, (ast.Subscript, ast.Name)) and self.state_root(func.value):
            # `st["score"].add_(x)`, `m = st["exp_avg"]; m.mul_(b)`: an in-place op on a tensor of a param's state
            # writes that state.
            self.found.append((STATE, "", node.lineno))
        elif isinstance(func, ast.Name) and func.id in ("setattr", "delattr") and len(node.args) >= 2:
            whose = self.whose(node.args[0])
            if whose is not None:
                attr = node.args[1].value if isinstance(node.args[1], ast.Constant) else "?"
                self.found.append((whose, str(attr), node.lineno))
        self.generic_visit(node)


def foreign_writes(source: str, module: str, owners: dict[str, str]) -> list[str]:
    """The writes in `source` (the text of `module`) of another owner's attribute, as "module:line: whose.attr"."""
    visitor = _Writes(set(owners))
    visitor.visit(ast.parse(source))
    bad = []
    for whose, attr, line in visitor.found:
        if whose == OPTIMIZER:
            allowed = module in OPTIMIZER_MODULES or (module, attr) in OPEN
        elif whose == STATE:
            allowed = module in OPTIMIZER_MODULES or module == owners["entries"]
        else:
            allowed = module == owners[whose]
        if not allowed:
            bad.append(f"{module}:{line}: {whose}" + (f".{attr}" if attr else ""))
    return bad


def _modules() -> dict[str, pathlib.Path]:
    modules = {}
    for path in sorted((REPO / "sift").rglob("*.py")):
        parts = ["sift", *path.relative_to(REPO / "sift").with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def test_no_module_writes_another_owners_attribute():
    owners = part_owners()
    found = [bad for module, path in _modules().items()
             for bad in foreign_writes(path.read_text(), module, owners)]
    assert not found, "written outside the owner's module (call a method of the owner):\n" + "\n".join(found)


PLANTED = {
    "assignment": "class Reselector:\n    def commit(self):\n        self.opt.grads.sharded_plans_final = False\n",
    "item": "def f(opt, p):\n    opt.grads.compact[p] = None\n",
    "nested item": "def f(self, p, kept):\n    self.opt.grads.compact[p][kept] = 0.0\n",
    "mutator": "class Selector:\n    def gather(self, p):\n        self.opt.amp.scaled_compact.add(p)\n",
    "pop": "def f(self, p):\n    held = self.opt.selector.clipped.pop(p, None)\n",
    "alias": "def f(self, p):\n    grads = self.opt.grads\n    grads.ready.add(p)\n",
    "augmented": "def f(optimizer):\n    optimizer.steps.kernel_cache[0] += 1\n",
    "setattr": "def f(self):\n    setattr(self.opt.memory, 'auto', True)\n",
    "the optimizer": "class MemoryPolicy:\n    def drop(self):\n        self.opt.update_in_backward = False\n",
    "from the optimizer's class": "class SparseAdamW(torch.optim.Optimizer):\n    def zero_grad(self):\n"
                                  "        self.grads.ready.clear()\n",
    "a param's state": "def f(self, p, s):\n    self.opt.state[p]['score'] = s\n",
    "a param's state, by name": "def f(self, p):\n    st = self.opt.state[p]\n    st['exp_avg'] = None\n",
    "a param's state, by name, nested": "def f(self, p, fresh):\n    st = self.opt.state[p]\n"
                                        "    st['exp_avg'][fresh] = 0.0\n",
    "a param's state, by name, mutator": "def f(self, p):\n    st = self.opt.state.get(p, {})\n    st.update(step=0)\n",
    "a param's state, by name, pop": "def f(opt, p):\n    st = opt.state[p]\n    st.pop('reselect_score', None)\n",
    "a param's state, in place": "def f(self, p, s):\n    st = self.opt.state[p]\n    st['score'].add_(s)\n",
    "a param's state, in a pair": "def f(self, p, r):\n    st, old = self.opt.state[p], r.indices\n"
                                  "    st['delta_indices'] = old\n",
    "a param's state, through one of its tensors": "def f(self, p, b):\n    m = self.opt.state[p]['exp_avg']\n"
                                                  "    m.mul_(b)\n",
    "a param's state, into one of its tensors": "def f(opt, p, fresh):\n    idx = opt.state[p]['delta_indices']\n"
                                                "    idx[fresh] = 0\n",
    "a param's state, in a loop": "def f(self):\n    for p, st in self.opt.state.items():\n        st.clear()\n",
}


@pytest.mark.parametrize("case", list(PLANTED))
def test_the_check_finds_a_planted_write(case):
    assert foreign_writes(PLANTED[case], "sift.optim.reselection", part_owners()), case


def test_the_check_lets_owners_and_their_own_state_be():
    owners = part_owners()
    own = ("class GradRoutes:\n    def end_step(self, p):\n        self.ready.clear()\n        self.compact[p] = None\n"
           "        self.opt.grads.ready.add(p)\n")
    assert foreign_writes(own, "sift.optim.hooks", owners) == []
    # A tensor's attribute, a group's entry and a local dict are nobody's part.
    other = "def f(opt, p, group, d):\n    p.grad = None\n    group['lr'] = 1.0\n    d.clear()\n    x = opt.state[p]\n"
    assert foreign_writes(other, "sift.optim.selection", owners) == []
    # Reading a param's state through a local name is no write; the entries' module writes it.
    read = ("def f(self, p):\n    st = self.opt.state.get(p, {})\n    n = st.get('selection_calls', 0) + 1\n"
            "    m = st['exp_avg']\n    return m * 2, m.sum()\n")
    assert foreign_writes(read, "sift.optim.selection", owners) == []
    entries = ("class EntryState:\n    def count(self, p, n):\n        st = self.opt.state[p]\n"
               "        st['selection_calls'] = n\n")
    assert foreign_writes(entries, owners["entries"], owners) == []
    assert foreign_writes(entries, "sift.optim.selection", owners)
    assert foreign_writes("def f(opt):\n    opt.select_steps = 2\n", "sift.optim.core", owners) == []
    assert foreign_writes("def f(opt):\n    opt.select_steps = 2\n", "sift.optim.clip", owners)


# The optimizer's attributes over data a part owns (they change while training, so they are no settings): the owner
# to ask instead.
OWNED_VIEWS = {"update_in_backward": "memory.update_in_backward", "process_group": "grads.process_group",
               "grad_scaler": "amp.scaler", "loss_scaled": "amp.loss_scaled"}


class _SettingReads(_Writes):
    """Every read of a setting (or of an owned datum, `OWNED_VIEWS`) back off the optimizer: `opt.seed`,
    `self.opt.compact_grads`, `getattr(opt, "selection")`; and a part's `self.opt.settings` (its own are
    `self.settings`). A function given the optimizer alone reads `optimizer.settings.x`."""

    def __init__(self, parts: set[str]) -> None:
        super().__init__(parts)
        self.reads: list[tuple[str, int]] = []

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if isinstance(node.ctx, ast.Load) and (node.attr in SETTING_NAMES or node.attr in OWNED_VIEWS) and \
                self.whose(node.value) == OPTIMIZER:
            self.reads.append((node.attr, node.lineno))
        elif node.attr == "settings" and isinstance(node.value, ast.Attribute) and \
                isinstance(node.value.value, ast.Name) and node.value.value.id == "self" and \
                self.whose(node.value) == OPTIMIZER:
            self.reads.append(("settings", node.lineno))
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        if isinstance(node.func, ast.Name) and node.func.id == "getattr" and len(node.args) >= 2 and \
                isinstance(node.args[1], ast.Constant) and \
                (node.args[1].value in SETTING_NAMES or node.args[1].value in OWNED_VIEWS) and \
                self.whose(node.args[0]) == OPTIMIZER:
            self.reads.append((node.args[1].value, node.lineno))
        super().visit_Call(node)


def settings_read_back(source: str, module: str, owners: dict[str, str]) -> list[str]:
    """The reads in `source` (the text of `module`) of a setting off the optimizer, as "module:line: name (read
    ...)"."""
    visitor = _SettingReads(set(owners))
    visitor.visit(ast.parse(source))
    bad = []
    for name, line in visitor.reads:
        instead = (OWNED_VIEWS[name] if name in OWNED_VIEWS else "self.settings" if name == "settings" else
                   f"settings.{name}")
        bad.append(f"{module}:{line}: {name} (read {instead})")
    return bad


def test_no_part_module_reads_a_setting_back_off_the_optimizer():
    """Every module of sift.optim but the optimizer's own class (core.py, which keeps the settings' public views)."""
    owners = part_owners()
    found = [bad for module, path in _modules().items()
             if module.startswith("sift.optim.") and module != "sift.optim.core"
             for bad in settings_read_back(path.read_text(), module, owners)]
    assert not found, "read back off the optimizer (parts read self.settings, or ask the owner):\n" + "\n".join(found)


PLANTED_READS = {
    "a setting": "class Selector:\n    def choose(self):\n        return self.opt.selection\n",
    "by the optimizer's name": "def f(optimizer):\n    return optimizer.compact_grads\n",
    "by an alias": "def f(self):\n    o = self.opt\n    return o.max_grad_norm\n",
    "by getattr": "def f(self):\n    return getattr(self.opt, 'sharded_selection', 'global')\n",
    "an owned datum": "class Steps:\n    def f(self):\n        return self.opt.update_in_backward\n",
    "the optimizer's settings from a part": "class Steps:\n    def f(self):\n"
                                            "        return self.opt.settings.backend\n",
}


@pytest.mark.parametrize("case", list(PLANTED_READS))
def test_the_check_finds_a_planted_setting_read(case):
    assert settings_read_back(PLANTED_READS[case], "sift.optim.steps", part_owners()), case


def test_the_check_lets_a_parts_own_settings_be():
    owners = part_owners()
    own = ("class Steps:\n    def f(self, p):\n"
           "        return self.settings.backend, self.opt.memory.update_in_backward, self.opt.state[p]\n")
    assert settings_read_back(own, "sift.optim.steps", owners) == []
    # A function given the optimizer alone reads its settings object; a param group's entry is no setting.
    given = "def f(optimizer, group):\n    return optimizer.settings.compact_grads, group['density']\n"
    assert settings_read_back(given, "sift.optim.clip", owners) == []


def test_the_settings_are_one_object_every_part_reads_and_a_load_hands_on():
    """The optimizer's settings attributes are read-only views of `opt.settings`, which every part holds; a load
    adopts the checkpoint's selection settings and state layout in the optimizer and in every part alike."""
    import torch

    w = torch.nn.Parameter(torch.randn(4, 4))
    opt = SparseAdamW([w], density=0.25, select_steps=2, selection="saliency", seed=7, max_grad_norm=0.5,
                      compact_grads=True, state="lean", sharded_selection="per_shard", backend="torch")
    assert {name: getattr(opt, name) for name in SETTING_NAMES} == \
        {name: getattr(opt.settings, name) for name in SETTING_NAMES} == \
        dict(select_steps=2, selection="saliency", seed=7, max_grad_norm=0.5, compact_grads=True,
             state_layout="lean", sharded_selection="per_shard", backend="torch")
    assert all(getattr(opt, name).settings is opt.settings for name, _ in opt.PARTS)
    with pytest.raises(AttributeError):
        opt.seed = 3
    other = SparseAdamW([torch.nn.Parameter(w.detach().clone())], density=0.25)
    other.load_state_dict(opt.state_dict())
    assert (other.select_steps, other.selection, other.seed, other.state_layout, other.sharded_selection) == \
        (2, "saliency", 7, "lean", "per_shard")
    assert (other.compact_grads, other.max_grad_norm, other.backend) == (False, None, None)  # the mode stays
    assert all(getattr(other, name).settings is other.settings for name, _ in other.PARTS)
