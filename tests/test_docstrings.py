"""Every `>>>` example in the package's docstrings runs and prints what it shows."""

import doctest
import importlib
import pkgutil

import pytest

import sift

# The benchmark suites' docstrings describe command lines, not Python sessions.
MODULES = sorted(info.name for info in pkgutil.walk_packages(sift.__path__, "sift.")
                 if not info.name.startswith("sift.bench") and not info.name.endswith("__main__"))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, report=True)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} failed (printed above)"
