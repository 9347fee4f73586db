"""The docstring examples of the public API run as a user pastes them.

pytest's doctests run with the defining module's globals in scope, so an
example may lean on a private helper or an import it never shows. Here each
public name's examples run in a namespace that holds nothing but what they
import themselves.
"""

import doctest
import inspect

import pytest

import masked_multistep as mm


def _examples():
    finder = doctest.DocTestFinder(recurse=True, exclude_empty=True)
    seen = set()
    for name in mm.__all__:
        obj = getattr(mm, name)
        if not (inspect.isclass(obj) or callable(obj)):
            continue
        for test in finder.find(obj, name, globs={}):
            if test.examples and test.name not in seen:
                seen.add(test.name)
                yield pytest.param(test, id=test.name)


@pytest.mark.parametrize("test", list(_examples()))
def test_public_docstring_example_runs_on_its_own(test):
    test.globs = {}
    runner = doctest.DocTestRunner(
        optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    )
    runner.run(test, out=lambda s: None)
    failures = runner.summarize(verbose=False).failed
    if failures:
        report = []
        runner = doctest.DocTestRunner(
            optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
        )
        runner.run(test, out=report.append)
        pytest.fail("".join(report))
