"""The layout of `sift.delta`: one data class with plain functions around it, and imports inside the
package pointing one way. Every import counts: module level, inside a function, under TYPE_CHECKING."""

from __future__ import annotations

import ast
import pathlib

import torch

REPO = pathlib.Path(__file__).resolve().parent.parent
DELTA = REPO / "sift" / "delta"


def _module_name(path: pathlib.Path, root: pathlib.Path, package: str) -> str:
    parts = [package, *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_import_graph(root: pathlib.Path, package: str) -> dict[str, set[str]]:
    """module -> the modules of `package` (the directory `root`) it imports anywhere in its source.

    `from pkg import name` counts as importing the submodule `pkg.name` when one exists, else `pkg`;
    relative imports are resolved against the importing module's package.
    """
    paths = {_module_name(p, root, package): p for p in sorted(root.rglob("*.py"))}
    graph: dict[str, set[str]] = {name: set() for name in paths}
    for name, path in paths.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = here.split(".")
                    source = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in paths else source for a in node.names]
            else:
                continue
            for target in targets:
                # `import pkg.mod.attr` names the deepest module that exists.
                while target and target not in paths:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path [a, b, ..., a], or None when the graph is a DAG."""
    on_path: list[str] = []
    done: set[str] = set()

    def visit(node: str) -> list[str] | None:
        on_path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt in on_path:
                return on_path[on_path.index(nxt):] + [nxt]
            if nxt not in done and (cycle := visit(nxt)):
                return cycle
        on_path.pop()
        done.add(node)
        return None

    for node in sorted(graph):
        if node not in done and (cycle := visit(node)):
            return cycle
    return None


def mixin_classes(root: pathlib.Path) -> list[str]:
    """`file: ClassName` for every class defined under `root` whose name ends in Mixin."""
    return [f"{path.relative_to(root)}: {node.name}" for path in sorted(root.rglob("*.py"))
            for node in ast.walk(ast.parse(path.read_text(), str(path)))
            if isinstance(node, ast.ClassDef) and node.name.endswith("Mixin")]


def _fake_package(tmp_path: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    root = tmp_path / "fake"
    root.mkdir()
    for name, text in files.items():
        (root / name).write_text(text)
    return root


def test_the_checker_finds_a_cycle_hidden_in_type_checking_and_function_imports(tmp_path):
    root = _fake_package(tmp_path, {
        "__init__.py": "from fake.data import Data\n",
        "data.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from fake.ops import run\n",
        "ops.py": "def run():\n    from . import data\n",
        "leaf.py": "import os\n",
    })
    graph = package_import_graph(root, "fake")
    assert graph == {"fake": {"fake.data"}, "fake.data": {"fake.ops"}, "fake.ops": {"fake.data"}, "fake.leaf": set()}
    assert find_cycle(graph) == ["fake.data", "fake.ops", "fake.data"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_checker_finds_a_mixin(tmp_path):
    root = _fake_package(tmp_path, {"parts.py": "class FileMixin:\n    pass\n\n\nclass Delta(FileMixin):\n    pass\n"})
    assert mixin_classes(root) == ["parts.py: FileMixin"]


def test_sift_delta_imports_form_a_dag():
    graph = package_import_graph(DELTA, "sift.delta")
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle inside sift.delta: " + " -> ".join(cycle)
    # The functions sit below the data class: none of them reaches up to it.
    for functions in ("application", "construction", "storage", "directory", "merging", "contents"):
        assert "sift.delta.sparse_delta" not in graph[f"sift.delta.{functions}"], functions


def test_sift_delta_has_no_mixins():
    assert mixin_classes(DELTA) == []


def test_the_functions_make_the_class_they_are_given(tmp_path):
    """The constructors below the data class are handed the class to make: a subclass gets its own."""
    from sift.delta import SparseDelta

    class Tagged(SparseDelta):
        pass

    delta = Tagged.from_diff({"w": torch.zeros(5)}, {"w": torch.arange(5.0)}, density=0.4)
    assert type(delta) is Tagged
    delta.save(tmp_path / "d.safetensors")
    assert type(Tagged.load(tmp_path / "d.safetensors")) is Tagged
    delta.save_pretrained(tmp_path / "dir")
    assert type(Tagged.from_pretrained(tmp_path / "dir")) is Tagged
