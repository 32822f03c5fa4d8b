"""The README's Python snippets run as written, so they cannot drift from the code."""

from __future__ import annotations

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
SNIPPETS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_snippets_and_the_two_commands():
    text = README.read_text()
    assert len(SNIPPETS) >= 3
    assert "pip install -e . && python -m sift.bench" in text
    assert "pip install -e '.[test]' && pytest" in text


@pytest.mark.parametrize("code", SNIPPETS, ids=[f"snippet-{i}" for i in range(len(SNIPPETS))])
def test_readme_snippet_runs(code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # whatever a snippet writes next to it stays out of the checkout
    exec(compile(code, str(README), "exec"), {"__name__": "readme"})
