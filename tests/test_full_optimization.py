"""What must hold of the programs as a user's compile, in processes of their own.

The suite compiles its own programs with LLVM's optimizations off
(``tests/conftest.py``); the machine code, and so the last bit of a float (a
fused multiply-add), may differ from a user's. A program compared with itself
gives the same bits either way; two programs claimed to give the same bits
(the updates with the statistics on and off, the running mean and
``optax.MultiSteps``'s) are checked here again as a user's programs compile.
Where the session compiles with XLA:CPU's legacy emitters (``make test``), the
tests that assert a compiled program's kernels or memory (marked
``default_emitters``) run here, with its default emitters, at the suite's own
optimization level (a program's HLO, and so its kernels and buffers, are the
same at every level).
"""

import pathlib
import subprocess
import sys

import pytest
from _helpers import FULL_OPTIMIZATION, LEGACY_EMITTERS, session_free_env

TESTS = pathlib.Path(__file__).resolve().parent
CLAIMS = [
    "test_stats.py::test_statistics_never_change_the_updates",
    "test_stats.py::test_statistics_never_change_the_updates_with_non_finite_windows",
    "test_invariants.py::test_window_statistics_never_change_the_updates_under_any_window_rule",
    "test_invariants.py::test_scaling_every_count_by_an_integer_leaves_the_updates_bit_identical",
    "test_optax_parity.py::test_equal_counts_running_mean_is_optax_multisteps_bit_for_bit",
    "test_leaf_stats.py::test_the_leaves_add_up_to_the_window_and_the_totals_are_kept_as_without_them",
]

pytestmark = pytest.mark.slow


def _pytest(
    *args: str, settings: dict[str, str], workers: int = 0
) -> subprocess.CompletedProcess:
    """pytest in a new session, without this one's settings but ``settings``
    (with pytest-xdist's ``workers`` where given)."""
    xdist = ["-n", str(workers)] if workers else ["-p", "no:xdist"]
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        + [*xdist, *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**session_free_env(), **settings},
        cwd=TESTS.parent,
    )


def _in_a_process_of_their_own(
    node_ids: list[str], *, full_optimization: bool, passed: str = " passed"
) -> None:
    """Runs the tests in a new session, without this one's settings: at LLVM's
    default optimization where ``full_optimization``, else at the suite's own,
    and with XLA:CPU's default emitters either way."""
    settings = {FULL_OPTIMIZATION: "1"} if full_optimization else {}
    run = _pytest(*node_ids, settings=settings)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert passed in run.stdout and "skipped" not in run.stdout, run.stdout[-2000:]


def test_programs_claimed_bit_identical_are_so_at_the_default_optimization():
    _in_a_process_of_their_own(
        [str(TESTS / claim) for claim in CLAIMS], full_optimization=True
    )


def test_compiled_kernels_and_memory_hold_with_the_default_emitters(
    default_emitters_tests,
):
    if not default_emitters_tests:
        pytest.skip(
            "none was left to it: this session compiles with XLA:CPU's default "
            "emitters (they ran in it), or none was selected"
        )
    _in_a_process_of_their_own(
        default_emitters_tests,
        full_optimization=False,
        passed=f"{len(default_emitters_tests)} passed",
    )


def test_a_session_with_the_legacy_emitters_refuses_them_alone():
    run = _pytest(
        "--collect-only",
        str(TESTS / "test_small_leaves.py"),
        settings={LEGACY_EMITTERS: "1"},
    )
    if "legacy emitters" not in run.stdout + run.stderr:  # a jaxlib without them
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
        return
    assert run.returncode == pytest.ExitCode.USAGE_ERROR, run.stderr[-2000:]
    assert "select tests/test_full_optimization.py::" in run.stderr, run.stderr


def test_under_xdist_the_refusal_reaches_the_user_as_each_tests_failure():
    # A worker's usage error reached the controller as an INTERNALERROR
    # without its message.
    run = _pytest(
        str(TESTS / "test_small_leaves.py"),
        settings={LEGACY_EMITTERS: "1"},
        workers=1,
    )
    if "legacy emitters" not in run.stdout + run.stderr:  # a jaxlib without them
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
        return
    assert run.returncode == pytest.ExitCode.TESTS_FAILED, run.stdout[-2000:]
    assert "INTERNALERROR" not in run.stdout + run.stderr, run.stdout[-2000:]
    assert "select tests/test_full_optimization.py::" in run.stdout, run.stdout
