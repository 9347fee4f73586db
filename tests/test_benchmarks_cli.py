"""The benchmark scripts refuse bad flags and foreign results when they start.

A malformed ``--widths``, a zero ``--repeats`` or an unwritable ``--out`` used
to surface as a traceback, or after minutes of benchmarking, or not at all (an
empty list ran the defaults); ``report.py`` and ``bench_dp.py --markdown``
failed with a ``KeyError`` on the other script's result.
"""

import ast
import importlib
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


def _import_benchmarks(*names):
    """The scripts under benchmarks/ by module name (they import each other
    by name, as when run from that folder)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return [importlib.import_module(name) for name in names]
    finally:
        sys.path.pop(0)


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
    (tmp_path / "file").write_text("", encoding="utf-8")
    args = [a.replace("TMP", str(tmp_path)) for a in args]
    for script in scripts:
        proc = run(script, *args)
        assert proc.returncode == 2, (script, proc.stderr)
        assert message in proc.stderr
        assert "Traceback" not in proc.stderr


def test_each_result_is_rendered_by_its_own_script(tmp_path):
    bench = tmp_path / "bench.json"
    bench.write_text(
        json.dumps({"windows": [], "machine": {}, "memory_checks": []}),
        encoding="utf-8",
    )
    dp = tmp_path / "dp.json"
    dp.write_text(
        json.dumps({"windows": [], "machine": {}, "allreduce": []}), encoding="utf-8"
    )
    cut = tmp_path / "cut.json"
    cut.write_text('{"windows": [{"wid', encoding="utf-8")
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


@pytest.mark.default_emitters
def test_bench_compile_times_every_competitor_and_counts_its_kernels(capsys):
    (bench_compile,) = _import_benchmarks("bench_compile")
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
    bench_gpu_program, steps = _import_benchmarks("bench_gpu_program", "steps")
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
    script_text = script.read_text(encoding="utf-8")
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    (bench,) = _import_benchmarks("bench")
    lists = [
        line.split("=(", 1)[1].rstrip(")").split()
        for line in script.read_text(encoding="utf-8").splitlines()
        if line.strip().startswith(("reference=(", "table=(", "leaves=("))
    ]
    assert len(lists) == 6, lists
    for args in lists:
        parsed = bench.parse_args(args)
        assert parsed.widths and parsed.ks and parsed.repeats, args
    # And those of the other two scripts it runs.
    dispatch, profile = _import_benchmarks("bench_dispatch", "profile_window")
    for name, script in [("dispatch", dispatch), ("profile", profile)]:
        lists = [
            line.split("=(", 1)[1].rstrip(")").split()
            for line in script_text.splitlines()
            if line.strip().startswith(f"{name}=(")
        ]
        assert len(lists) == 2, lists
        for args in lists:
            script.parse_args(args)


def test_a_workload_with_biases_trains_with_every_competitor():
    # `bench.py --layers N --biases` (gpu_session.sh's many small leaves): a
    # bias vector after each matrix, which every competitor trains.
    import jax
    import jax.numpy as jnp

    bench, steps = _import_benchmarks("bench", "steps")
    args = bench.parse_args(["--widths", "8", "--layers", "3", "--biases"])
    workload = steps.Workload(8, args.layers, biases=args.biases)
    params = workload.params()
    assert sorted(params) == ["b0", "b1", "b2", "w0", "w1", "w2"]
    assert workload.num_params == sum(x.size for x in jax.tree.leaves(params))
    assert bench.fmt_size(8, 3, workload.num_params, True) == "3x8²+b (0.0M)"
    loss = lambda b: workload.loss_fn({**params, "b1": b}, workload.batch(0))[0]
    assert float(jnp.abs(jax.grad(loss)(params["b1"])).sum()) > 0
    for make in steps.WINDOW_COMPETITORS:
        comp = make(workload, 2)
        carry = comp.init(workload.params())
        if comp.calls_per_window == 1:
            carry = comp.step(carry, workload.window_batch(2))
        else:
            for i in range(2):
                carry = comp.step(carry, workload.batch(i))
        trained = [x for x in jax.tree.leaves(carry) if x.shape == (8,)]
        assert any(float(jnp.abs(x).sum()) > 0 for x in trained), comp.name


def test_every_window_competitor_builds_at_k_1_or_sits_it_out(capsys):
    # `make bench` and `make bench-quick` time k = 1: the norm test, which
    # decides on two microbatches or more, has no window of one (it raised,
    # and the benchmark stopped); its cell reads "-" (ASCII: the table is
    # printed before the results are written, on whatever stdout takes).
    bench, report, steps = _import_benchmarks("bench", "report", "steps")
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
    printed = capsys.readouterr().out
    assert printed.isascii(), printed
    assert printed.splitlines()[-1].split() == ["norm", "test", "-", "1.00"]
    result = {"windows": [{**r, "ms_per_microbatch": 0.5} for r in rows]}
    assert "| norm test | - | 1.00 (0.5) |" in report.times(result)


def test_ratios_are_medians_of_the_ratios_within_rounds():
    (bench,) = _import_benchmarks("bench")
    # Per round 2, 5, 2: the median ratio is 2 (the ratio of the medians, 3,
    # would let one slow round of the reference move it).
    assert bench.median_ratio([2.0, 10.0, 6.0], [1.0, 2.0, 3.0]) == 2.0


def test_window_rows_divide_by_k_and_take_each_ratio_against_its_reference(
    monkeypatch,
):
    bench, steps = _import_benchmarks("bench", "steps")

    class Timed:
        def __init__(self, comp, params, batches, cache):
            self.comp, self.compile_s, self.memory = comp, 0.0, {"temp_bytes": 0}
            # Page faults of the warm-up window, then of three timed ones.
            self.faults = [1000, 2, 8, 6]

    # Seconds per window of k = 2 microbatches, three rounds.
    windows = {"floor": [0.002, 0.004, 0.006], bench.REFERENCE: [0.008, 0.008, 0.012]}

    def interleave(runners, repeats):
        assert repeats == 3
        return {name: windows.get(name, [0.004, 0.008, 0.012]) for name in runners}

    monkeypatch.setattr(bench, "Runner", Timed)
    monkeypatch.setattr(bench, "interleave", interleave)
    rows = {r["competitor"]: r for r in bench.bench_windows(8, [2], 3)}
    assert set(rows) >= {"floor", "adam", bench.REFERENCE, "MaskedMultiSteps update"}
    floor, masked = rows["floor"], rows["MaskedMultiSteps update"]
    assert floor["ms_per_microbatch"] == pytest.approx(2.0)  # 4 ms / 2
    assert floor["ms_per_microbatch_min"] == pytest.approx(1.0)
    assert masked["ms_per_microbatch"] == pytest.approx(4.0)
    assert floor["x_floor"] == pytest.approx(1.0)
    assert masked["x_floor"] == pytest.approx(2.0)
    assert masked["x_floor_range"] == pytest.approx([2.0, 2.0])
    assert floor["x_floor_range"] == pytest.approx([1.0, 1.0])
    assert floor["x_optax_multisteps"] == pytest.approx(0.5)  # 0.25, 0.5, 0.5
    assert masked["x_optax_multisteps"] == pytest.approx(1.0)  # 0.5, 1, 1
    assert rows[bench.REFERENCE]["x_optax_multisteps"] == pytest.approx(1.0)
    stats = rows["MaskedMultiSteps update+stats"]
    assert stats["baseline"] == "MaskedMultiSteps update"
    assert stats["x_without_stats"] == pytest.approx(1.0)
    assert stats["x_without_stats_range"] == pytest.approx([1.0, 1.0])
    # Each round's ratio: the floor against optax.MultiSteps, 0.25 to 0.5.
    assert floor["x_optax_multisteps"] == pytest.approx(0.5)
    assert bench.ratio_range([1, 2, 3], [4, 4, 6]) == pytest.approx([0.25, 0.5])
    # The median of the timed windows' page faults, per microbatch.
    assert floor["minor_faults_per_microbatch"] == pytest.approx(3.0)


def test_bench_dp_stops_waiting_as_soon_as_a_worker_fails():
    # A worker that failed left the other waiting in a collective, and the
    # parent waited for both until its 15-minute timeout.
    import time

    (bench_dp,) = _import_benchmarks("bench_dp")
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    failing = [sys.executable, "-c", "raise SystemExit(3)"]
    procs = [subprocess.Popen(sleeper), subprocess.Popen(failing)]
    try:
        started = time.monotonic()
        codes = bench_dp._wait_for(procs, timeout_s=60)
        assert codes == [None, 3]
        assert time.monotonic() - started < 30
        ok = [sys.executable, "-c", "pass"]
        assert bench_dp._wait_for([subprocess.Popen(ok)], timeout_s=60) == [0]
        # Past the timeout: the ones still running are None.
        late = subprocess.Popen(sleeper)
        assert bench_dp._wait_for([late], timeout_s=0.5) == [None]
        late.kill()
        late.wait()
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_rounds_vary_each_competitors_place_and_predecessor():
    # The rounds were rotations of one order: every competitor took every
    # place, but followed the same one in all rounds but one.
    import collections

    (bench,) = _import_benchmarks("bench")
    order = []

    class Window:
        def __init__(self, name):
            self.name = name

        def window(self):
            order.append(self.name)
            return 1.0

    times = bench.interleave({n: Window(n) for n in "abc"}, repeats=6)
    assert order[:3] == list("abc")  # the warm-up windows
    rounds = [order[3 + 3 * i : 6 + 3 * i] for i in range(6)]
    assert rounds == [list(r) for r in ("abc", "bca", "cab", "cba", "acb", "bac")]
    assert times == dict.fromkeys("abc", [1.0] * 6)
    for n in range(1, 12):
        rows = bench.round_orders(n)
        places = collections.Counter((c, i) for r in rows for i, c in enumerate(r))
        follows = collections.Counter(p for r in rows for p in zip(r, r[1:]))
        assert all(sorted(r) == list(range(n)) for r in rows)
        assert len(places) == n * n and len(set(places.values())) == 1
        assert len(follows) == n * (n - 1) and len(set(follows.values())) <= 1


def _full_batch_adam(workload, full, learning_rate, windows=2):
    """``(params, grad)``: the workload's params after ``windows`` adam steps
    on ``full``'s token-mean gradient, and that gradient's function."""
    import jax
    import optax

    grad = jax.grad(lambda p: workload.loss_fn(p, full)[0])
    tx = optax.adam(learning_rate)
    params = workload.params()
    opt_state = tx.init(params)
    for _ in range(windows):
        updates, opt_state = tx.update(grad(params), opt_state, params)
        params = optax.apply_updates(params, updates)
    return params, grad


def test_the_window_competitors_close_one_window_per_k_calls_alike():
    # Every timed window holds one window's close, and the token-weighted
    # competitors, fed the same microbatches (the in-jit one as one batch),
    # train alike: as adam does on the full batch's token-mean gradient.
    bench, steps = _import_benchmarks("bench", "steps")
    import jax
    import numpy as np

    import masked_multistep as mm

    workload, k = steps.Workload(width=16), 3
    params, floor = {}, None
    for make in steps.WINDOW_COMPETITORS:
        comp = make(workload, k)
        if comp.calls_per_window == 1:
            batches = [workload.window_batch(k)]
        else:
            batches = [workload.batch(i) for i in range(k)]
        runner = bench.Runner(comp, workload.params(), batches, {})
        for _ in range(2):
            runner.window()
        carry = runner.carry
        params[comp.name] = getattr(carry, "params", None) or carry[0]
        state = comp.opt_state(carry)
        if comp.name == "floor":
            floor = state
            continue
        if comp.name in ("adam", "in-jit microbatched"):  # an update per call
            steps_taken = int(jax.tree.leaves(state)[0])
            assert steps_taken == 2 * comp.calls_per_window, comp.name
        elif comp.name == bench.REFERENCE:
            assert int(state.gradient_step) == 2
        else:
            assert int(mm.find_state(state).gradient_step) == 2, comp.name
    # The reference: adam on the full batch's token-mean gradient, two windows
    # of the same k microbatches.
    full = workload.window_batch(k)
    ref, grad = _full_batch_adam(workload, full, steps.LEARNING_RATE)
    masked = [name for name in params if "MaskedMultiSteps" in name or "Train" in name]
    assert len(masked) >= 5, masked
    for name in [*masked, "in-jit microbatched"]:
        for a, b in zip(
            jax.tree.leaves(params[name]), jax.tree.leaves(ref), strict=True
        ):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7, err_msg=name)
    # The floor's running mean, of the same k microbatches twice at the
    # initial params (it passes them through): the full batch's gradient.
    acc, total = floor
    tokens = sum(int(workload.batch(i)["mask"].sum()) for i in range(k))
    assert int(total) == 2 * tokens
    for a, b in zip(
        jax.tree.leaves(acc), jax.tree.leaves(grad(workload.params())), strict=True
    ):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7, err_msg="floor")
    # optax.MultiSteps weighs the microbatches alike: another update.
    assert not np.allclose(
        params[bench.REFERENCE]["w0"], params["MaskedMultiSteps update"]["w0"]
    )


def _bench_result():
    # x optax.MultiSteps at k = 1 and k = 4; scratch and state bytes (P = 1000).
    x_optax = {1: [0.9, 0.95, 1.0], 4: [0.25, 0.5, 1.0]}
    names = ["floor", "adam", "optax.MultiSteps"]
    memory = {
        "floor": (250, 1000),
        "adam": (500, 2000),
        "optax.MultiSteps": (1500, 3000),
    }
    rows = [
        {
            "width": 64,
            "k": k,
            "competitor": name,
            "ms_per_microbatch": 1.0,
            "x_floor": 1.0,
            "x_optax_multisteps": ratio,
            "temp_bytes": memory[name][0],
            "param_bytes": 1000,
            "state_bytes": memory[name][1],
        }
        for k, ratios in x_optax.items()
        for name, ratio in zip(names, ratios, strict=True)
    ]
    machine = dict.fromkeys(["cpu", "cores", "usable_cores", "backend", "jax"], "x")
    machine |= dict.fromkeys(["jaxlib", "optax", "flax", "python"], "x")
    return {
        "date": "today",
        "machine": machine,
        "load_average_before": [1.0],
        "load_average_after": [1.0],
        "config": {"widths": [64], "ks": [1, 4], "repeats": 3},
        "windows": rows,
        "memory_checks": [],
        "microbatching": [
            {
                "variant": "value_and_grad (full batch)",
                "ms_per_batch": 2.0,
                "x_full_batch": 1.0,
                "temp_bytes": 1 << 20,
            }
        ],
    }


def test_report_renders_a_bench_result_at_the_largest_k(tmp_path):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(_bench_result()), encoding="utf-8")
    proc = run("report.py", path)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "| x optax.MultiSteps, k=4 | 64² |" in out
    assert "| floor | 0.25 |" in out and "| adam | 0.50 |" in out
    # Scratch memory as a multiple of P and of adam's, and the state over P.
    assert "| floor | 0.25 (0.50) | 1.00 |" in out
    assert "| optax.MultiSteps | 1.50 (3.00) | 3.00 |" in out
    assert "| value_and_grad (full batch) | 2.0 | 1.00 | 1.0 |" in out
    assert "page faults" not in out  # the result predates them
    with_faults = _bench_result()
    for row in with_faults["windows"]:
        row["minor_faults_per_microbatch"] = 24628.0 if row["k"] == 4 else 1.0
    path.write_text(json.dumps(with_faults), encoding="utf-8")
    out = run("report.py", path).stdout
    assert "| page faults per microbatch, k=4 | 64² |" in out
    assert "| optax.MultiSteps | 24,628 |" in out


def test_memory_checks_say_whether_the_state_adds_up(capsys):
    (bench,) = _import_benchmarks("bench")
    check = {"width": 8, "k": 4, "temp_bytes": {"adam": 100, "floor": 50}}
    check |= {"inner_state_bytes": 20, "accumulator_bytes": 10, "scalar_bytes": 3}
    bench.print_memory_checks([{**check, "state_bytes": 33}])
    bench.print_memory_checks([{**check, "state_bytes": 34}])
    lines = capsys.readouterr().out.splitlines()
    assert "adam 1.00, floor 0.50" in lines[0]
    assert lines[1].endswith("(ok)") and lines[3].endswith("(MISMATCH)")


def _dp_result():
    k, width = 8, 1024
    times = {
        "per-microbatch reduction": [40.0, 40.0, 40.0],
        "deferred": [10.0, 12.0, 14.0],
        "one reduction, by hand": [9.0, 9.0, 9.0],
        "floor": [8.0, 8.0, 8.0],
    }
    reductions = {"per-microbatch reduction": (8, 128 << 20), "deferred": (1, 16 << 20)}
    rows = [
        {
            "width": width,
            "k": k,
            "competitor": name,
            "layers": 4,
            "num_params": 4 * width * width,
            "ms_per_microbatch": sorted(ts)[1],
            "ms_per_microbatch_all": ts,
            "x_per_microbatch": sorted(ts)[1] / 40.0,
            "reductions_per_window": reductions.get(name, (1, 16 << 20))[0],
            "bytes_per_window": reductions.get(name, (1, 16 << 20))[1],
        }
        for name, ts in times.items()
    ]
    allreduce = [
        {
            "width": width,
            "k": k,
            "param_bytes": 16 << 20,
            "ms": 16.0,
            "ms_all": [16.0] * 3,
        }
    ]
    return {
        "windows": rows,
        "allreduce": allreduce,
        "load_average_after": [1.0],
        "elapsed_s": 1.0,
    }


def test_bench_dp_markdown_puts_each_modes_reductions_in_its_row(capsys):
    (bench_dp,) = _import_benchmarks("bench_dp")
    bench_dp.markdown(_dp_result())
    out = capsys.readouterr().out
    assert "| per-microbatch reduction | 40.0 (1.00) |" in out
    assert "| reductions / MiB per window, per-microbatch | 8 / 128 |" in out
    assert "| reductions / MiB per window, deferred | 1 / 16 |" in out


def test_bench_dp_bound_amortizes_one_all_reduce_over_the_window(capsys):
    (bench_dp,) = _import_benchmarks("bench_dp")
    bench_dp.report(_dp_result())
    out = capsys.readouterr().out
    # Bound 8 + 1.1 x 16 / 8 = 10.2 ms: deferred 10, 12, 14 -> median 1.176;
    # by hand 9 -> 0.882.
    assert "width 1024, k=8 : deferred 1.176, by hand 0.882" in out
    assert "deferred  12.00, by hand   9.00 ms/mb: 1.33x" in out


def test_bench_dp_model_of_a_ring_all_reduce_and_the_deferred_speed_up(capsys):
    (bench_dp,) = _import_benchmarks("bench_dp")
    # 2 (N - 1) / N of the bytes at 25 Gb/s: 2 x 7/8 x 4 GB / 3.125 GB/s.
    assert bench_dp.ring_allreduce_s(4e9, 8, 25) == pytest.approx(2.24)
    k, params = 8, 4 * 1024 * 1024
    bench_dp.model({"k": k, "ms_per_microbatch": 10.0, "num_params": params})
    t_c = 10e-3 / params * 1e9  # the 1B model's compute per microbatch
    t_ar = 2.24  # 1B float32 params (4 GB), 25 Gb/s, 8 hosts
    speed_up = k * (t_c + t_ar) / (k * t_c + t_ar)
    lines = capsys.readouterr().out.splitlines()
    line = next(s for s in lines if s.split()[:3] == ["1B", "25", "8"])
    assert line.endswith(f"{speed_up:>7.2f}x") and speed_up > 1


def test_a_step_compiled_once_reports_that_compile_time_at_every_k():
    # The floor's step does not depend on k: it compiles once, and the row of
    # every k records that compile's time (a cache hit's lookup was ~0 s).
    bench, steps = _import_benchmarks("bench", "steps")
    workload = steps.Workload(width=8)
    batches, cache = [workload.batch(0)], {}
    first = bench.Runner(steps.floor(workload, 1), workload.params(), batches, cache)
    again = bench.Runner(steps.floor(workload, 4), workload.params(), batches, cache)
    assert again.compiled is first.compiled
    assert again.compile_s == first.compile_s > 0.0


def test_bench_gpu_program_at_k_1_leaves_out_the_norm_test(monkeypatch):
    # The norm test has no window of one microbatch (bench.py sits it out at
    # k = 1); bench_gpu_program.py compiles the other steps. The GPU target is
    # replaced by one CPU device so that this runs without jax's CUDA plugin.
    (bench_gpu_program,) = _import_benchmarks("bench_gpu_program")
    import jax
    import numpy as np

    from masked_multistep import _branch, _sq_norms

    # main() sets the form and the GPUs' reduction: restored after the test.
    monkeypatch.setattr(_branch, "FORM", _branch.FORM)
    monkeypatch.setattr(_sq_norms, "ONE_REDUCTION", _sq_norms.ONE_REDUCTION)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))
    cpu = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    monkeypatch.setattr(bench_gpu_program, "gpu_sharding", lambda: cpu)
    rows = bench_gpu_program.main(["--width", "8", "--k", "1"])
    names = [row["name"] for row in rows]
    assert names[0] == "floor"
    assert "MaskedMultiSteps update+norm test" not in names
    assert "MaskedMultiSteps update" in names and "optax.MultiSteps" in names
    for row in rows:  # a window of one: every microbatch closes it
        assert row["per_microbatch"] == row["closing"]


def test_the_dispatch_benchmark_prints_the_cost_per_scalar_leaf():
    result = run(
        "bench_dispatch.py", "--scalars", "2,4", "--width", "8", "--repeats", "2"
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line.split(":")[0].strip() for line in lines[1:4]] == [
        "N =   0",
        "N =   2",
        "N =   4",
    ]
    assert lines[-1].startswith("dispatch: ")
    assert lines[-1].endswith("(N = 0 to 4, least squares)")
    bad = run("bench_dispatch.py", "--scalars", "0")
    assert bad.returncode == 2 and "argument --scalars: must be >= 1" in bad.stderr


def test_the_window_profile_reads_device_time_from_a_profile(tmp_path):
    # A window of 2 microbatches, 8 µs on the host; on the device two
    # overlapping kernels (2-4 and 3-5 µs) and one on another stream (7-8):
    # busy 4 µs, idle half the window, 1.5 kernels per microbatch.
    from jax.profiler import ProfileData

    (profile_window,) = _import_benchmarks("profile_window")
    text = """
    planes {
      name: "/host:CPU"
      lines { name: "python3" timestamp_ns: 1000
        events { metadata_id: 1 offset_ps: 0 duration_ps: 8000000 } }
      event_metadata { key: 1 value { id: 1 name: "floor window 0" } }
    }
    planes {
      name: "/device:GPU:0"
      lines { name: "Stream #1(Compute)" timestamp_ns: 1000
        events { metadata_id: 1 offset_ps: 1000000 duration_ps: 2000000 }
        events { metadata_id: 1 offset_ps: 2000000 duration_ps: 2000000 }
        events { metadata_id: 1 offset_ps: 9000000 duration_ps: 1000000 } }
      lines { name: "Stream #2(Compute)" timestamp_ns: 1000
        events { metadata_id: 1 offset_ps: 6000000 duration_ps: 1000000 } }
      event_metadata { key: 1 value { id: 1 name: "a kernel" } }
    }
    """
    path = tmp_path / "profile.xplane.pb"
    path.write_bytes(ProfileData.text_proto_to_serialized_xspace(text))
    (figures,) = profile_window.window_figures(str(path), 2)["floor"]
    assert figures == pytest.approx(
        {"host_ms": 0.004, "busy_ms": 0.002, "idle": 0.5, "kernels": 1.5}
    )


def test_the_window_profile_runs_on_the_cpu():
    result = run("profile_window.py", "--width", "8", "--windows", "1")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("cpu; 4 x 8², k = 8")
    assert [line.split()[0] for line in lines[1:6]] == [
        "floor",
        "TrainState.apply_gradients",
        "TrainState.apply_gradients+stats",
        "MaskedMultiSteps",
        "MaskedMultiSteps",
    ]
    assert lines[-1] == "  (no device plane in the profile: host times only)"


def test_every_command_line_option_says_what_it_is():
    """Every ``add_argument`` of the scripts a user runs has a ``help=``:
    ``bench_gpu_program.py --help`` listed ``--width`` and ``--k`` bare."""
    root = BENCHMARKS.parent
    scripts = [
        *BENCHMARKS.glob("*.py"),
        *(root / "examples").glob("*.py"),
        root / "masked_multistep" / "demo" / "cli.py",
    ]
    bare = []
    for script in scripts:
        tree = ast.parse(script.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "add_argument"
                and not any(k.arg == "help" for k in node.keywords)
            ):
                bare.append(f"{script.relative_to(root)}:{node.lineno}")
    assert bare == []


def test_the_data_parallel_competitors_train_as_the_full_batch_does():
    # bench-dp times them against each other: each must do the work its row
    # claims. On this process's 8 CPU devices, two windows of the same k
    # global microbatches: adam on the full batch's token-mean gradient.
    dp_steps, steps = _import_benchmarks("dp_steps", "steps")
    import jax
    import numpy as np

    mesh, k = dp_steps.make_mesh(), 3
    workload = dp_steps.workload(16)
    batches = dp_steps.local_batches(mesh, workload, k)
    full = jax.tree.map(lambda *xs: np.concatenate(xs), *batches)
    ref, _ = _full_batch_adam(workload, full, steps.LEARNING_RATE)
    trained = []
    for comp in dp_steps.competitors(mesh, workload, k):
        if comp.name == "accumulate only":  # no optimizer: nothing to compare
            continue
        runner = dp_steps.Runner(comp, mesh, workload, k)
        for _ in range(2):
            runner.window()
        trained.append(comp.name)
        leaves = zip(
            jax.tree.leaves(runner.carry[0]), jax.tree.leaves(ref), strict=True
        )
        for a, b in leaves:
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7, err_msg=comp.name)
    assert len(trained) == len(dp_steps.COMPETITORS) - 1, trained
