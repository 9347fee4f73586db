"""The claims that two programs give the same bits, at the default optimization.

The suite compiles its own programs with LLVM's optimizations off
(``tests/conftest.py``); the machine code, and so the last bit of a float (a
fused multiply-add), may differ from a user's. A program compared with itself
gives the same bits either way; two programs claimed to give the same bits
(the updates with the statistics on and off, the running mean and
``optax.MultiSteps``'s) are checked here again as a user's programs compile.
"""

import os
import pathlib
import subprocess
import sys

import pytest
from _helpers import FULL_OPTIMIZATION

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


def test_programs_claimed_bit_identical_are_so_at_the_default_optimization():
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "MASKED_"))
    }
    env[FULL_OPTIMIZATION] = "1"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:xdist",
            *(str(TESTS / claim) for claim in CLAIMS),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=TESTS.parent,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-2000:]
