"""Gradient accumulation, side by side: time per microbatch and compiled memory.

Runs the competitors of ``steps.py`` interleaved in one process (round-robin
over repeated windows, after a warm-up window each), so that load from other
processes hits them alike, and reports per model size and window length ``k``:

* the median time per microbatch (the time of a window of ``k`` microbatches,
  divided by ``k``);
* its ratio to the floor (gradient plus a bare running-mean accumulate) and to
  ``optax.MultiSteps``: the median over rounds of the ratio within a round;
* compiled memory from ``jit(step).lower(...).compile().memory_analysis()``:
  temporary bytes, relative to the parameters' bytes; and the persistent
  optimizer state (the bytes of the step's carry less the params).

A second table compares in-jit microbatching (``mm.microbatched_value_and_grad``)
with one full-batch ``jax.value_and_grad`` on an activation-heavy batch.

Usage::

    python benchmarks/bench.py            # the full run (a few minutes)
    python benchmarks/bench.py --quick    # small sizes, under a minute
    python benchmarks/bench.py --out results.json

Results are written as JSON to ``benchmarks/results/`` unless ``--out`` says
otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import optax

import masked_multistep as mm

sys.path.insert(0, str(Path(__file__).resolve().parent))
import steps  # noqa: E402
from bench_cli import output_path, positive_int, positive_ints  # noqa: E402

MiB = 1 << 20
REFERENCE = "optax.MultiSteps"


# --------------------------------------------------------------------------- setup


def _commit() -> str | None:
    """The checkout's commit (``+`` if it has uncommitted changes), or None."""
    import subprocess

    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=here,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        return None
    return (head + ("+" if dirty else "")) or None


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on."""
    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    import jaxlib

    info = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "usable_cores": usable,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "optax": optax.__version__,
        "masked_multistep": mm.__version__,
        "commit": _commit(),
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "device_kind": jax.devices()[0].device_kind,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }
    try:
        import flax

        info["flax"] = flax.__version__
    except ImportError:
        info["flax"] = None
    return info


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def minor_faults() -> int:
    """This process's minor page faults so far (0 where not counted)."""
    try:
        import resource
    except ImportError:  # not on POSIX
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def memory_figures(compiled: Any) -> dict[str, int]:
    m = compiled.memory_analysis()
    return {
        "temp_bytes": int(m.temp_size_in_bytes),
        "argument_bytes": int(m.argument_size_in_bytes),
        "output_bytes": int(m.output_size_in_bytes),
        "alias_bytes": int(m.alias_size_in_bytes),
    }


class Runner:
    """A compiled competitor with its live (donated) carry and its batches."""

    def __init__(
        self,
        comp: steps.Competitor,
        params: Any,
        batches: list[Any],
        cache: dict[Any, Any],
    ):
        self.comp = comp
        self.carry = comp.init(params)
        self.batches = batches
        key = (comp.name, jax.tree.structure(params), batches[0]["x"].shape)
        # A step that does not depend on k compiles once; every k's row
        # reports that compile's time.
        if comp.k_independent and key in cache:
            self.compiled, self.compile_s = cache[key]
        else:
            t0 = time.perf_counter()
            self.compiled = (
                jax.jit(comp.step, donate_argnums=0)
                .lower(self.carry, batches[0])
                .compile()
            )
            self.compile_s = time.perf_counter() - t0
            cache[key] = self.compiled, self.compile_s
        self.memory = memory_figures(self.compiled)
        self.memory["state_bytes"] = steps.tree_bytes(comp.opt_state(self.carry))
        self.faults: list[int] = []

    def window(self) -> float:
        """Seconds for one window (``calls_per_window`` calls, all done).

        Also notes the window's minor page faults in ``self.faults``: a step
        whose scratch buffers are large enough for the allocator to map fresh
        memory on every call pays for touching it (XLA:CPU with glibc's
        malloc, buffers above its mmap threshold), which shows in its time.
        """
        carry = self.carry
        faults = minor_faults()
        t0 = time.perf_counter()
        for batch in self.batches:
            carry = self.compiled(carry, batch)
        jax.block_until_ready(carry)
        elapsed = time.perf_counter() - t0
        self.faults.append(minor_faults() - faults)
        self.carry = carry
        return elapsed


def interleave(
    runners: dict[str, Any],
    repeats: int,
    before: Callable[[], None] = lambda: None,
) -> dict[str, list[float]]:
    """Round-robin windows: one warm-up each, then ``repeats`` rounds (of
    anything with a ``window() -> seconds`` method, a :class:`Runner` here).

    The rounds' orders are a balanced Latin square (:func:`round_orders`):
    every competitor takes every place in a round, and follows every other
    one, as often as the others over a cycle of rounds (a place may matter:
    the first after another's large allocations, say); the order depends
    only on the round, the same in every process. ``before`` runs, untimed,
    before every window (several processes: a barrier, so that no window's
    time includes waiting for a process that is still finishing the previous
    competitor's).
    """
    for r in runners.values():
        before()
        r.window()
    times: dict[str, list[float]] = {name: [] for name in runners}
    names = list(runners)
    orders = round_orders(len(names))
    for i in range(repeats):
        for j in orders[i % len(orders)]:
            before()
            times[names[j]].append(runners[names[j]].window())
    return times


def round_orders(n: int) -> list[list[int]]:
    """A balanced Latin square of ``n`` competitors (Williams 1949): rows in
    which each takes each place once and directly follows each other one
    equally often (``n`` rows for an even ``n``, ``2n`` for an odd one)."""
    if n == 0:
        return [[]]
    base = [0]
    for j in range(1, n):
        base.append((j + 1) // 2 if j % 2 else n - j // 2)
    rows = [[(b + r) % n for b in base] for r in range(n)]
    return rows if n % 2 == 0 else rows + [row[::-1] for row in rows]


def median_ratio(a: list[float], b: list[float]) -> float:
    """The median over rounds of each round's ratio (paired: the two ran in
    the same round), not the ratio of the two medians."""
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def ratio_range(a: list[float], b: list[float]) -> list[float]:
    """The smallest and largest of the rounds' ratios: their spread."""
    ratios = [x / y for x, y in zip(a, b, strict=True)]
    return [min(ratios), max(ratios)]


# ------------------------------------------------------------------- windows


def bench_windows(
    width: int, ks: list[int], repeats: int, layers: int = 4, biases: bool = False
) -> list[dict[str, Any]]:
    workload = steps.Workload(width=width, layers=layers, biases=biases)
    rows = []
    cache: dict[Any, Any] = {}
    for k in ks:
        # A competitor that has no window of k microbatches sits this k out.
        made = (make(workload, k) for make in steps.WINDOW_COMPETITORS)
        comps = [comp for comp in made if comp is not None]
        runners = {}
        for comp in comps:
            if comp.calls_per_window == 1 and k > 1:
                # The same microbatches as the loops', in one batch.
                batches = [workload.window_batch(k)]
            else:
                batches = [workload.batch(i) for i in range(k)]
            runners[comp.name] = Runner(comp, workload.params(), batches, cache)
        times = interleave(runners, repeats)
        per_mb = {name: [t / k for t in ts] for name, ts in times.items()}
        for name, r in runners.items():
            base = r.comp.baseline
            rows.append(
                {
                    "width": width,
                    "layers": workload.layers,
                    "biases": workload.biases,
                    "num_params": workload.num_params,
                    "param_bytes": workload.param_bytes,
                    "k": k,
                    "competitor": name,
                    "ms_per_microbatch": 1e3 * statistics.median(per_mb[name]),
                    "ms_per_microbatch_min": 1e3 * min(per_mb[name]),
                    "ms_per_microbatch_all": [1e3 * t for t in per_mb[name]],
                    # The timed windows' (the warm-up's is the runner's first).
                    "minor_faults_per_microbatch": statistics.median(
                        f / k for f in r.faults[1:]
                    ),
                    "x_floor": median_ratio(per_mb[name], per_mb["floor"]),
                    "x_floor_range": ratio_range(per_mb[name], per_mb["floor"]),
                    "x_optax_multisteps": median_ratio(per_mb[name], per_mb[REFERENCE]),
                    # The same step without window statistics.
                    "x_without_stats": (
                        median_ratio(per_mb[name], per_mb[base]) if base else None
                    ),
                    "x_without_stats_range": (
                        ratio_range(per_mb[name], per_mb[base]) if base else None
                    ),
                    "baseline": base,
                    "compile_s": r.compile_s,
                    **r.memory,
                }
            )
        print(
            f"  width {width}, k={k:<3d} done (load {load_average()})",
            file=sys.stderr,
            flush=True,
        )
    return rows


def memory_checks(
    rows: list[dict[str, Any]], workload: steps.Workload, k: int
) -> dict[str, Any]:
    """The deterministic memory claims for one size: temporary bytes of each
    step, and the persistent state of MaskedMultiSteps taken apart."""
    width = workload.width
    figures = {
        r["competitor"]: r["temp_bytes"]
        for r in rows
        if (r["width"], r["k"]) == (width, k)
    }
    params = workload.params()
    tx = mm.MaskedMultiSteps(optax.adam(steps.LEARNING_RATE), k)
    state = tx.init(params)
    inner = steps.tree_bytes(optax.adam(steps.LEARNING_RATE).init(params))
    acc = steps.tree_bytes(state.acc_grads)
    big = {"inner_opt_state", "acc_grads"}
    scalars = sum(
        steps.tree_bytes(getattr(state, f)) for f in state._fields if f not in big
    )
    return {
        "width": width,
        "k": k,
        "temp_bytes": figures,
        "state_bytes": steps.tree_bytes(state),
        "inner_state_bytes": inner,
        "accumulator_bytes": acc,
        "scalar_bytes": scalars,
    }


# --------------------------------------------------------------- microbatching


def bench_microbatching(
    width: int, rows: int, splits: list[int], repeats: int
) -> list[dict[str, Any]]:
    """Full-batch ``value_and_grad`` against ``microbatched_value_and_grad``."""
    workload = steps.Workload(width=width, rows=rows)
    params = workload.params()
    batch = workload.batch(0)
    fns = {
        "value_and_grad (full batch)": jax.value_and_grad(
            workload.loss_fn, has_aux=True
        )
    }
    for m in splits:
        fns[f"microbatched, {m} microbatches"] = mm.microbatched_value_and_grad(
            workload.loss_fn, m
        )
    compiled, memory = {}, {}
    for name, fn in fns.items():
        compiled[name] = jax.jit(fn).lower(params, batch).compile()
        memory[name] = memory_figures(compiled[name])

    def once(name):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled[name](params, batch))
        return time.perf_counter() - t0

    for name in fns:
        once(name)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name in fns:
            times[name].append(once(name))
    full = next(iter(fns))
    out = []
    for name in fns:
        out.append(
            {
                "width": width,
                "rows": rows,
                "variant": name,
                "ms_per_batch": 1e3 * statistics.median(times[name]),
                "ms_per_batch_min": 1e3 * min(times[name]),
                "x_full_batch": median_ratio(times[name], times[full]),
                **memory[name],
            }
        )
    return out


# -------------------------------------------------------------------- output


def fmt_size(width: int, layers: int, num_params: int, biases: bool = False) -> str:
    return f"{layers}x{width}²{'+b' if biases else ''} ({num_params / 1e6:.1f}M)"


def print_window_table(rows: list[dict[str, Any]]) -> None:
    header = (
        f"{'params':>16} {'k':>3}  {'competitor':<34} {'ms/mb':>8} {'x floor':>8} "
        f"{'x optax':>8} {'temp MiB':>8} {'temp/P':>7} {'state/P':>8} "
        f"{'arg MiB':>7} {'out MiB':>7} {'alias MiB':>9} {'faults/mb':>9}"
    )
    print(header)
    print("-" * len(header))
    last = None
    for r in rows:
        key = (r["width"], r["k"])
        if last is not None and key != last:
            print()
        last = key
        size = fmt_size(
            r["width"], r["layers"], r["num_params"], r.get("biases", False)
        )
        print(
            f"{size:>16} {r['k']:>3}  "
            f"{r['competitor']:<34} {r['ms_per_microbatch']:>8.2f} "
            f"{r['x_floor']:>8.2f} {r['x_optax_multisteps']:>8.2f} "
            f"{r['temp_bytes'] / MiB:>8.1f} {r['temp_bytes'] / r['param_bytes']:>7.2f} "
            f"{r['state_bytes'] / r['param_bytes']:>8.2f} "
            f"{r['argument_bytes'] / MiB:>7.1f} {r['output_bytes'] / MiB:>7.1f} "
            f"{r['alias_bytes'] / MiB:>9.1f} "
            f"{r.get('minor_faults_per_microbatch', float('nan')):>9.0f}"
        )


def print_summary(rows: list[dict[str, Any]]) -> None:
    """x floor per competitor, one column per (size, k)."""
    keys = sorted({(r["width"], r["k"]) for r in rows})
    names = list(dict.fromkeys(r["competitor"] for r in rows))
    cell = {(r["competitor"], r["width"], r["k"]): r["x_floor"] for r in rows}
    head = f"{'x floor':<34}" + "".join(f" {f'{w}/k={k}':>10}" for w, k in keys)
    print(head)
    print("-" * len(head))
    for name in names:
        # "-" where a competitor has no row (the norm test at k = 1).
        print(
            f"{name:<34}"
            + "".join(
                f" {cell[name, w, k]:>10.2f}" if (name, w, k) in cell else f" {'-':>10}"
                for w, k in keys
            )
        )


def print_stats_cost(rows: list[dict[str, Any]]) -> None:
    """Time and scratch memory of each step with window statistics (or the
    norm test), against the same step without them."""
    by_key = {(r["competitor"], r["width"], r["k"]): r for r in rows}
    for r in rows:
        if r.get("x_without_stats") is None:
            continue
        base = by_key[(r["baseline"], r["width"], r["k"])]
        low, high = r["x_without_stats_range"]
        print(
            f"width {r['width']}, k={r['k']}: {r['competitor']:<34} "
            f"{r['x_without_stats']:.3f}x {r['baseline']} (rounds "
            f"{low:.2f}-{high:.2f}); temp "
            f"{(r['temp_bytes'] - base['temp_bytes']) / MiB:+.2f} MiB"
        )


def print_memory_checks(checks: list[dict[str, Any]]) -> None:
    for c in checks:
        t = c["temp_bytes"]
        adam = t["adam"]
        parts = ", ".join(f"{name} {b / adam:.2f}" for name, b in t.items())
        print(
            f"width {c['width']}, k={c['k']}: temp bytes / plain adam step's: {parts}"
        )
        total = c["inner_state_bytes"] + c["accumulator_bytes"] + c["scalar_bytes"]
        verdict = "ok" if total == c["state_bytes"] else "MISMATCH"
        print(
            f"  MaskedMultiSteps state {c['state_bytes']} B = inner adam "
            f"{c['inner_state_bytes']} + accumulator {c['accumulator_bytes']} + "
            f"scalars {c['scalar_bytes']} ({verdict})"
        )


def print_micro_table(rows: list[dict[str, Any]]) -> None:
    header = f"{'variant':<34} {'ms/batch':>9} {'x full':>7} {'temp MiB':>8}"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['variant']:<34} {r['ms_per_batch']:>9.2f} {r['x_full_batch']:>7.2f} "
            f"{r['temp_bytes'] / MiB:>8.1f}"
        )


# ---------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes, < 1 minute")
    p.add_argument("--out", type=output_path, help="JSON output path")
    p.add_argument("--widths", type=positive_ints, help="comma-separated matrix widths")
    p.add_argument("--ks", type=positive_ints, help="comma-separated window lengths k")
    p.add_argument(
        "--repeats", type=positive_int, help="timed rounds per configuration"
    )
    p.add_argument(
        "--layers", type=positive_int, default=4, help="the MLP's layers (default 4)"
    )
    p.add_argument(
        "--biases", action="store_true", help="a bias vector after each matrix"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.quick:
        widths, ks, repeats = [128, 256], [1, 4], 3
        micro = {"width": 128, "rows": 512, "splits": [1, 4]}
    else:
        widths, ks, repeats = [512, 1024, 2048], [1, 4, 8, 16], 7
        micro = {"width": 512, "rows": 2048, "splits": [1, 4, 16]}
    if args.widths is not None:
        widths = args.widths
    if args.ks is not None:
        ks = args.ks
    if args.repeats is not None:
        repeats = args.repeats

    info = machine_info()
    print(
        f"CPU: {info['cpu']} ({info['cores']} cores, {info['usable_cores']} usable); "
        f"backend {info['backend']} ({info['device_kind']}); jax {info['jax']}, "
        f"jaxlib {info['jaxlib']}, "
        f"optax {info['optax']}, flax {info['flax']}, python {info['python']}"
    )
    load_before = load_average()
    print(f"load average before: {load_before}")
    print(
        f"widths {widths}, {args.layers} layers"
        f"{' with biases' if args.biases else ''}, "
        f"k {ks}, {repeats} timed rounds (+1 warm-up), "
        f"{'TrainState' if steps.has_train_state() else 'tx.apply_gradients'} loop",
        flush=True,
    )
    t_start = time.perf_counter()

    window_rows = []
    for width in widths:
        window_rows += bench_windows(width, ks, repeats, args.layers, args.biases)
    checks = [
        memory_checks(
            window_rows, steps.Workload(w, args.layers, biases=args.biases), max(ks)
        )
        for w in widths
    ]
    micro_rows = bench_microbatching(
        micro["width"], micro["rows"], micro["splits"], repeats
    )
    load_after = load_average()
    elapsed = time.perf_counter() - t_start

    print()
    print("Time per microbatch (median), ratios (median over rounds), compiled memory")
    print(
        "P = the parameters' bytes; state = persistent optimizer state (no "
        "params); arg/out/alias: compiled argument, output and donated bytes"
    )
    print()
    print_window_table(window_rows)
    print()
    print_summary(window_rows)
    print()
    print_stats_cost(window_rows)
    print()
    print_memory_checks(checks)
    print()
    print(
        f"In-jit microbatching: {micro['rows']} rows x {micro['width']} tokens, "
        f"4 layers of {micro['width']}²; time per full batch"
    )
    print()
    print_micro_table(micro_rows)
    print()
    print(f"load average after: {load_after}; total {elapsed:.0f} s")

    result = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": info,
        "load_average_before": load_before,
        "load_average_after": load_after,
        "config": {
            "widths": widths,
            "ks": ks,
            "repeats": repeats,
            "layers": args.layers,
            "biases": args.biases,
            "quick": args.quick,
            "microbatching": micro,
        },
        "windows": window_rows,
        "memory_checks": checks,
        "microbatching": micro_rows,
        "elapsed_s": elapsed,
    }
    out = args.out
    if out is None:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        kind = "quick" if args.quick else "full"
        out = Path(__file__).resolve().parent / "results" / f"bench-{kind}-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1), encoding="utf-8")
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
