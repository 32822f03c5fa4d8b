"""House rules of the package's layout: imports point one way (no cycles), and no module is huge."""

from __future__ import annotations

import ast
import pathlib

REPO = pathlib.Path(__file__).resolve().parent.parent
# Package directory -> its dotted name: triton_kernels/ is installed as sift.triton_kernels (setup.py).
PACKAGES = {REPO / "sift": "sift", REPO / "triton_kernels": "sift.triton_kernels"}
NATIVE = {"sift._C"}  # the C++ extension: a leaf, imports nothing of the package
MAX_LINES = 600


def module_files() -> dict[str, pathlib.Path]:
    """Every module of the package by dotted name (a package by its name, for its __init__.py)."""
    modules = {}
    for root, dotted in PACKAGES.items():
        for path in sorted(root.rglob("*.py")):
            parts = [dotted, *path.relative_to(root).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, type_checking: bool = False):
    """Every Import/ImportFrom anywhere in the tree (function bodies too), but not under `if TYPE_CHECKING:`
    unless `type_checking`."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _type_checking_only(node) and not type_checking:
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def import_graph(type_checking: bool = False) -> dict[str, set[str]]:
    """module -> the sift modules it imports, relative imports and `from pkg import submodule` resolved."""
    modules = module_files()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _imports(ast.parse(path.read_text(), str(path)), type_checking):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:
                    base = package.split(".")
                    base = base[:len(base) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module
                # `from sift import _ops` imports the submodule; `from sift import SparseAdamW` the package.
                targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules.keys() | NATIVE else source
                           for alias in node.names]
            for target in targets:
                if target in NATIVE:
                    continue
                # `import sift.optim.core` names the deepest module that exists.
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path [a, b, ..., a], or None when the graph is acyclic."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_graph_sees_function_level_and_relative_imports():
    graph = import_graph()
    assert "sift._ops" in graph["sift.optim.core"]
    assert "sift.optim.core" in graph["sift.optim"]
    assert "sift.triton_kernels._checks" in graph["sift.triton_kernels.delta"]  # `from ._checks import`
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


# The optimizer, the deltas, the target planning and the routes, as floors: each may import the floors
# below it only, so none is a circle with another even through a function-level or TYPE_CHECKING import.
FLOORS = {"sift.optim": "sift.optim", "sift.delta": "sift.delta", "sift.targets": "sift.targets",
          "sift.sparse_backward": "sift.sparse_backward", "sift.quantized": "sift.quantized",
          "sift._params": "sift._params"}


def _floor(module: str) -> str | None:
    return next((floor for prefix, floor in FLOORS.items() if module == prefix or module.startswith(prefix + ".")),
                None)


def test_the_optimizer_deltas_targets_and_routes_import_one_way():
    graph: dict[str, set[str]] = {floor: set() for floor in FLOORS.values()}
    for module, targets in import_graph(type_checking=True).items():
        if (floor := _floor(module)) is None:
            continue
        graph[floor] |= {t for t in map(_floor, targets) if t is not None and t != floor}
    cycle = find_cycle(graph)
    assert cycle is None, "import circle between floors: " + " -> ".join(cycle)


def test_no_module_reads_the_optimizers_private_attributes():
    """The optimizer's parts are public members of named parts; a module that reaches into another's private
    attribute of the optimizer (as the seven mixins did) is a shared private."""
    import re

    optimizer = r"(?:opt|optimizer|self\.opt|self\.optimizer|self\._sparse_optimizer\(\))"
    reach = re.compile(rf"\b{optimizer}\.(_[a-z]\w*)|getattr\({optimizer}, \"(_[a-z]\w*)\"")
    torch_own = {"_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks", "_is_overflow",
                 "_trainer_checked"}  # torch's and accelerate's, and trainer_check.py's mark (written there alone)
    found = [f"{path.relative_to(REPO)}: {name}" for path in (REPO / "sift").rglob("*.py")
             for names in reach.findall(path.read_text()) for name in names if name and name not in torch_own]
    assert not found, found
    from sift.optim import SparseAdamW

    assert SparseAdamW.__bases__ == (__import__("torch").optim.Optimizer,)


def test_no_module_over_600_lines():
    sizes = {name: len(path.read_text().splitlines()) for name, path in module_files().items()}
    too_long = {name: n for name, n in sizes.items() if n > MAX_LINES}
    assert not too_long, f"modules over {MAX_LINES} lines: {too_long}"
