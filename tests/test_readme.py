"""The Python snippets of README.md and docs/*.md run as written, so they cannot drift from the code."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```python\n(.*?)^```", flags=re.S | re.M)
# Code for several processes (a torchrun recipe, FSDP2 sharding, a DDP wrap) cannot run in one test
# process: it is compiled, not run. Any other snippet runs.
SEVERAL_PROCESSES = re.compile(r"torchrun|init_process_group|fully_shard\(|DistributedDataParallel\(")


def _snippets(page: pathlib.Path) -> list[str]:
    return FENCE.findall(page.read_text())


SNIPPETS = [(page, i, code) for page in PAGES for i, code in enumerate(_snippets(page))]
IDS = [f"{page.relative_to(ROOT)}-{i}" for page, i, _ in SNIPPETS]


def test_readme_has_snippets_and_the_two_commands():
    text = README.read_text()
    assert len(_snippets(README)) >= 2
    assert "pip install -e . && python -m sift.bench" in text
    assert "pip install -e '.[test]' && pytest" in text


def test_readme_is_short():
    size = len(README.read_bytes())
    assert size <= 15_000, f"README.md is {size} bytes; move material to docs/"


def test_every_docs_page_is_linked_and_every_link_resolves():
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # a web address
            assert (page.parent / target).exists(), f"{page.relative_to(ROOT)} links to missing {target}"
    linked = set(re.findall(r"\]\((docs/[\w-]+\.md)\)", README.read_text()))
    missing = [str(p.relative_to(ROOT)) for p in PAGES[1:] if str(p.relative_to(ROOT)) not in linked]
    assert not missing, f"README.md does not link {missing}"


def test_every_page_fence_is_closed():
    """A ```python fence left open would hide a snippet from the tests."""
    for page in PAGES:
        assert page.read_text().count("```") % 2 == 0, f"{page.relative_to(ROOT)} has an unclosed fence"


@pytest.mark.parametrize(("page", "index", "code"), SNIPPETS, ids=IDS)
def test_snippet_runs(page, index, code, tmp_path, monkeypatch):
    compiled = compile(code, f"{page}:snippet-{index}", "exec")
    if SEVERAL_PROCESSES.search(code):
        pytest.skip("code for several processes (torchrun, FSDP2, DDP): compiled, not run")
    monkeypatch.chdir(tmp_path)  # whatever a snippet writes next to it stays out of the checkout
    exec(compiled, {"__name__": f"snippet_{index}"})
