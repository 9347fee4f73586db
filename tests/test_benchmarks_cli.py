"""The benchmark scripts refuse bad flags and foreign results when they start.

A malformed ``--widths``, a zero ``--repeats`` or an unwritable ``--out`` used
to surface as a traceback, or after minutes of benchmarking, or not at all (an
empty list ran the defaults); ``report.py`` and ``bench_dp.py --markdown``
failed with a ``KeyError`` on the other script's result.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def run(script, *args):
    return subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
    )


# bench_dp.py parses its flags before importing jax; bench.py (which imports it
# first, a second per run) shares the same checks: two cases run it too.
@pytest.mark.parametrize(
    "args, message, scripts",
    [
        (["--widths", "64,"], "argument --widths: not an integer: ''", ["bench_dp.py"]),
        (
            ["--widths="],
            "argument --widths: an empty list",
            ["bench_dp.py", "bench.py"],
        ),
        (["--ks", "1,0"], "argument --ks: must be >= 1, got 0", ["bench_dp.py"]),
        (
            ["--repeats", "0"],
            "argument --repeats: must be >= 1, got 0",
            ["bench_dp.py"],
        ),
        (["--out", "TMP"], "is a directory: name a file", ["bench_dp.py", "bench.py"]),
        (["--out", "TMP/file/r.json"], "/file' is a file", ["bench_dp.py"]),
    ],
)
def test_bad_flags_are_usage_errors(args, message, scripts, tmp_path):
    (tmp_path / "file").write_text("")
    args = [a.replace("TMP", str(tmp_path)) for a in args]
    for script in scripts:
        proc = run(script, *args)
        assert proc.returncode == 2, (script, proc.stderr)
        assert message in proc.stderr
        assert "Traceback" not in proc.stderr


def test_each_result_is_rendered_by_its_own_script(tmp_path):
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"windows": [], "machine": {}, "memory_checks": []}))
    dp = tmp_path / "dp.json"
    dp.write_text(json.dumps({"windows": [], "machine": {}, "allreduce": []}))
    cut = tmp_path / "cut.json"
    cut.write_text('{"windows": [{"wid')
    cases = [
        ("report.py", [dp], "render it with benchmarks/bench_dp.py --markdown"),
        ("bench_dp.py", ["--markdown", bench], "render it with benchmarks/report.py"),
        ("report.py", [cut], "not JSON, or cut short"),
        ("report.py", [tmp_path / "missing.json"], "cannot read it"),
        ("report.py", [tmp_path], "cannot read it"),
    ]
    for script, args, message in cases:
        proc = run(script, *args)
        assert proc.returncode == 2, (script, args, proc.stderr)
        assert message in proc.stderr and "Traceback" not in proc.stderr


def test_bench_compile_times_every_competitor_and_counts_its_kernels(capsys):
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import bench_compile
    finally:
        sys.path.pop(0)
    rows = bench_compile.main(["--leaves", "4", "--repeats", "1"])
    by_name = {row["competitor"]: row for row in rows}
    assert set(by_name) == set(bench_compile.competitors())
    assert by_name[bench_compile.REFERENCE]["compile_ratio"] == 1.0
    for row in rows:
        assert row["trace_s"] > 0 and row["compile_s"] > 0 and row["fusions"] > 0
    # The wrapper's per-leaf work is more kernels than optax.MultiSteps' (its
    # running mean and finiteness test), and the statistics add more.
    fusions = {name: row["fusions"] for name, row in by_name.items()}
    assert fusions["MaskedMultiSteps update"] > fusions[bench_compile.REFERENCE]
    assert (
        fusions["MaskedMultiSteps apply_gradients+stats"]
        > fusions["MaskedMultiSteps apply_gradients"]
    )
    assert "4 leaves" in capsys.readouterr().out


def test_bench_gpu_program_without_the_cuda_plugin_says_what_to_install():
    # CI has no CUDA plugin: the script stops with a hint, not a traceback.
    proc = run("bench_gpu_program.py", "--width", "64")
    if proc.returncode == 0:  # a machine with jax's CUDA plugin installed
        assert "x floor" in proc.stdout
        return
    assert proc.returncode == 1, proc.stderr
    assert "install jax's CUDA plugin" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bench_gpu_programs_flax_steps_train_like_the_plain_loop():
    # bench_gpu_program.py only compiles its steps (for a GPU, where CI has
    # none): here they run on the CPU, through two windows of 3 microbatches.
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import bench_gpu_program
        import steps
    finally:
        sys.path.pop(0)
    import jax
    import numpy as np

    workload = steps.Workload(width=16)
    finals = {}
    for make in (steps.masked_multisteps, *bench_gpu_program.FLAX_COMPETITORS):
        comp = make(workload, 3)
        carry = comp.init(workload.params())
        step = jax.jit(comp.step, donate_argnums=0)
        for i in range(6):
            carry = step(carry, workload.batch(i))
        state = comp.opt_state(carry)
        finals[comp.name] = (carry, state)
        # Windows closed: two of 3 microbatches, or some of about 3's tokens.
        closed = int(state.gradient_step)
        assert closed == 2 if "token" not in comp.name else closed >= 1, comp.name
    # NNX's optimizer takes the same steps as the plain optax loop.
    (params, _), _ = finals["MaskedMultiSteps update"]
    nnx_carry, _ = finals["nnx.Optimizer.update"]
    nnx_params = [x for x in jax.tree.leaves(nnx_carry) if x.shape == (16, 16)]
    for ours, theirs in zip(jax.tree.leaves(params), nnx_params[:4], strict=True):
        np.testing.assert_array_equal(ours, theirs)


def test_gpu_session_script_parses_and_its_flags_are_bench_pys():
    """``benchmarks/gpu_session.sh`` runs where no one can fix it mid-run (one
    prepared call on a lent GPU): its shell parses and every ``bench.py``
    argument list it passes is accepted."""
    script = BENCHMARKS / "gpu_session.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import bench
    finally:
        sys.path.remove(str(BENCHMARKS))
    lists = [
        line.split("=(", 1)[1].rstrip(")").split()
        for line in script.read_text().splitlines()
        if line.strip().startswith(("reference=(", "table=("))
    ]
    assert len(lists) == 4, lists
    for args in lists:
        parsed = bench.parse_args(args)
        assert parsed.widths and parsed.ks and parsed.repeats, args


def test_every_window_competitor_builds_at_k_1_or_sits_it_out(capsys):
    # `make bench` and `make bench-quick` time k = 1: the norm test, which
    # decides on two microbatches or more, has no window of one (it raised,
    # and the benchmark stopped); its cell reads "—".
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import bench
        import report
        import steps
    finally:
        sys.path.pop(0)
    workload = steps.Workload(width=8)
    made = {make.__name__: make(workload, 1) for make in steps.WINDOW_COMPETITORS}
    assert made.pop("masked_multisteps_norm_test") is None
    assert all(comp is not None for comp in made.values()), made
    assert steps.masked_multisteps_norm_test(workload, 2) is not None
    rows = [
        {"competitor": name, "width": 8, "k": k, "x_floor": 1.0}
        for name, k in [("floor", 1), ("floor", 2), ("norm test", 2)]
    ]
    bench.print_summary(rows)
    assert capsys.readouterr().out.splitlines()[-1].split() == [
        "norm", "test", "—", "1.00"
    ]  # fmt: skip
    result = {"windows": [{**r, "ms_per_microbatch": 0.5} for r in rows]}
    assert "| norm test | — | 1.00 (0.5) |" in report.times(result)
