"""Test configuration: 8 CPU devices for the SPMD tests, strict numerics."""

import atexit
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile

import jax
import pytest
from _helpers import FULL_OPTIMIZATION, LEGACY_EMITTERS, TESTS_XLA_FLAGS
from hypothesis import settings

# Must happen before any JAX backend is created.
jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_rank_promotion", "raise")

# The suite is compile-bound: its own programs compile with LLVM's
# optimizations off, which takes about a seventh off its time. XLA reads
# XLA_FLAGS once, when the backend starts; the variable is then put back, so
# the processes that tests start (notebooks, the demo, the two-process runs)
# compile as a user's programs do. The programs' HLO, fusions and memory
# (`memory_analysis()`) are the same either way; the machine code differs, and
# so may the last bit of a float (a fused multiply-add): a process whose
# results a test compares bit for bit with its own gets TESTS_XLA_FLAGS, and
# the claims that two programs give the same bits (statistics on or off, ...)
# are checked again at the default level (tests/test_full_optimization.py,
# which sets FULL_OPTIMIZATION).
#
# XLA:CPU's fusion emitters (jaxlib 0.10's default) take two fifths of the
# suite's compile time. Its legacy emitters compile faster, into other kernels
# (a lone reduction is not wrapped in a fusion; a few scalar operations fuse
# otherwise). `make test` asks for them (LEGACY_EMITTERS) where this jaxlib has
# them (newer ones have only the fusion emitters, and XLA aborts on a flag it
# does not know): the suite then runs in about two thirds of the time, and the
# tests that assert a compiled program's kernels or memory (marked
# `default_emitters`) run in a session of their own with the default emitters
# (tests/test_full_optimization.py): they see the programs a user compiles.
_OPT_FLAG = "--xla_backend_optimization_level"
_LEGACY_FLAG = "--xla_cpu_use_fusion_emitters=false"
_LEGACY_KNOWN = f"{LEGACY_EMITTERS}_KNOWN"  # the probe's answer, for the workers
_USER_XLA_FLAGS = os.environ.get("XLA_FLAGS")


def _xla_knows_legacy_emitters() -> bool:
    if _LEGACY_KNOWN not in os.environ:
        probe = subprocess.run(
            [sys.executable, "-c", "import jax; jax.devices()"],
            env={**os.environ, "XLA_FLAGS": _LEGACY_FLAG},
            capture_output=True,
            check=False,
        )
        os.environ[_LEGACY_KNOWN] = "1" if probe.returncode == 0 else ""
    return bool(os.environ[_LEGACY_KNOWN])


if _OPT_FLAG in (_USER_XLA_FLAGS or "") or os.environ.get(FULL_OPTIMIZATION):
    LEGACY = False
    os.environ[TESTS_XLA_FLAGS] = _USER_XLA_FLAGS or ""
else:
    LEGACY = bool(os.environ.get(LEGACY_EMITTERS)) and _xla_knows_legacy_emitters()
    extra = f"{_OPT_FLAG}=0 {_LEGACY_FLAG}" if LEGACY else f"{_OPT_FLAG}=0"
    os.environ[TESTS_XLA_FLAGS] = f"{_USER_XLA_FLAGS or ''} {extra}".strip()
    os.environ["XLA_FLAGS"] = os.environ[TESTS_XLA_FLAGS]
    jax.devices()
    if _USER_XLA_FLAGS is None:
        del os.environ["XLA_FLAGS"]
    else:
        os.environ["XLA_FLAGS"] = _USER_XLA_FLAGS

# One persistent compilation cache per test session, shared by the xdist
# workers (they inherit the folder through the environment) and removed when
# the process that made it exits. Many tests compile the same programs again
# (eager `lax.cond`s recompile on every call, a state machine's examples rebuild
# the same wrappers): a hit reads the executable XLA compiled before instead of
# compiling it again. It is the same executable, and a hit still counts as a
# compile for `jax.monitoring` (the compile-counting tests see no difference).
_CACHE_ENV = "MASKED_MULTISTEP_TESTS_COMPILATION_CACHE"
if not os.environ.get(_CACHE_ENV):
    os.environ[_CACHE_ENV] = tempfile.mkdtemp(prefix="masked-multistep-jax-cache-")
    atexit.register(shutil.rmtree, os.environ[_CACHE_ENV], ignore_errors=True)
jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE_ENV])
# A size limit makes jax lock the folder around each read and write (with
# `filelock`, in the `dev` extra): unlocked, one worker could read an entry the
# other is still writing ("Error reading persistent compilation cache entry",
# an error here).
if importlib.util.find_spec("filelock") is not None:
    jax.config.update("jax_compilation_cache_max_size", 1 << 40)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)

# In CI the property tests draw the same examples on every run (reproducible
# verdicts); elsewhere they explore new ones each time.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.load_profile("ci" if os.environ.get("CI") else "default")


_DEFAULT_EMITTERS = pytest.StashKey[list[str]]()
_REFUSED = pytest.StashKey[str]()
# The test that runs them where the session compiles with the legacy emitters.
_RUNS_THEM = (
    "tests/test_full_optimization.py"
    "::test_compiled_kernels_and_memory_hold_with_the_default_emitters"
)


@pytest.hookimpl(trylast=True)  # after `-k` and `-m` have deselected theirs
def pytest_collection_modifyitems(config, items):
    # The long-running tests first (a stable sort: the rest keep their order),
    # so that pytest-xdist's workers start them early instead of one worker
    # finishing a notebook alone at the end.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    marked = [i for i in items if i.get_closest_marker("default_emitters")]
    if not LEGACY or not marked:
        return
    if not any(i.nodeid == _RUNS_THEM for i in items):
        refusal = (
            f"{len(marked)} selected tests assert a compiled program's kernels or "
            f"memory, and this session compiles with XLA:CPU's legacy emitters "
            f"({LEGACY_EMITTERS} is set): select {_RUNS_THEM} too, which runs "
            f"them with the default emitters, or unset {LEGACY_EMITTERS}"
        )
        if not hasattr(config, "workerinput"):
            raise pytest.UsageError(refusal)
        # A pytest-xdist worker's usage error reaches its controller as an
        # INTERNALERROR without the message: each such test fails with it.
        config.stash[_REFUSED] = refusal
        return
    config.hook.pytest_deselected(items=marked)
    items[:] = [i for i in items if not i.get_closest_marker("default_emitters")]
    config.stash[_DEFAULT_EMITTERS] = [i.nodeid for i in marked]


def pytest_runtest_setup(item):
    if (refusal := item.config.stash.get(_REFUSED, None)) and item.get_closest_marker(
        "default_emitters"
    ):
        pytest.fail(refusal, pytrace=False)


@pytest.fixture
def default_emitters_tests(request) -> list[str]:
    """The tests needing XLA:CPU's default emitters that this session left out
    (it compiles with the legacy emitters), for a session of their own."""
    return request.config.stash.get(_DEFAULT_EMITTERS, [])
