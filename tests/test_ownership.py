"""House rule: each datum of `SparseAdamW` has one owner. A module assigns (or mutates in place: item
assignment, `pop`, `append`, `clear`, `update`, ...) an attribute of one of the optimizer's parts only if it is
that part's module, and an attribute of the optimizer only if it is the optimizer's (core.py, and checkpoint.py
which holds its state_dict and copy functions). Another module asks the owner, through a method named for what
it does."""

from __future__ import annotations

import ast
import pathlib

import pytest

from sift.optim import SparseAdamW

REPO = pathlib.Path(__file__).resolve().parent.parent
OPTIMIZER = "optimizer"
OPTIMIZER_MODULES = {"sift.optim.core", "sift.optim.checkpoint"}
# Names a module calls the optimizer by; inside the optimizer's own class, `self` is it too.
OPTIMIZER_NAMES = {"opt", "optimizer"}
MUTATORS = {"pop", "popitem", "append", "extend", "insert", "remove", "clear", "update", "add", "discard",
            "setdefault"}
# Attributes of the optimizer another module may set: the documented public settings (a property hands each to
# the part that owns it), and marks that belong to someone else (accelerate's overflow flag; the Trainer check's).
OPEN = {("sift.integrations.hf", "grad_scaler"), ("sift.integrations.hf", "_is_overflow"),
        ("sift.optim.trainer_check", "_trainer_checked")}


def part_owners(parts=SparseAdamW.PARTS) -> dict[str, str]:
    """Each part's name -> the module that defines its class (its owner)."""
    return {name: cls.__module__ for name, cls in parts}


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
        return None

    def written(self, target: ast.AST) -> None:
        if isinstance(target, (ast.Tuple, ast.List)):
            for element in target.elts:
                self.written(element)
            return
        while isinstance(target, ast.Subscript):  # `x.y[i] = ...`, `x.y[i][j] = ...` write x.y
            target = target.value
        if isinstance(target, ast.Attribute) and (whose := self.whose(target.value)) is not None:
            self.found.append((whose, target.attr, target.lineno))

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        outer = self.self_is_optimizer
        self.self_is_optimizer = any(ast.unparse(base).split(".")[-1] in ("Optimizer", "SparseAdamW")
                                     for base in node.bases)
        self.generic_visit(node)
        self.self_is_optimizer = outer

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self.aliases.append({})
        # `grads = self.opt.grads` makes `grads.x = ...` a write of the part: aliases first, wherever bound.
        for inner in ast.walk(node):
            if isinstance(inner, ast.Assign) and len(inner.targets) == 1 and isinstance(inner.targets[0], ast.Name):
                if (whose := self.whose(inner.value)) is not None:
                    self.aliases[-1][inner.targets[0].id] = whose
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
            self.written(func.value)
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
        else:
            allowed = module == owners[whose]
        if not allowed:
            bad.append(f"{module}:{line}: {whose}.{attr}")
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
    assert foreign_writes("def f(opt):\n    opt.select_steps = 2\n", "sift.optim.core", owners) == []
    assert foreign_writes("def f(opt):\n    opt.select_steps = 2\n", "sift.optim.clip", owners)
