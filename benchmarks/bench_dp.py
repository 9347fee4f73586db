"""Data parallel across processes: one gradient reduction per window, or one per
microbatch.

Two processes on 127.0.0.1 (``jax.distributed``, gloo CPU collectives, 1 CPU
device each) train the optimizer-dominated MLP of ``steps.py`` on a global
2-device mesh, every process feeding its own rows of each microbatch. Side by
side in one run (round-robin over windows, after a warm-up window each), per
model size and window length ``k``:

* **per-microbatch reduction**: the library as used without a reduction mode:
  ``jax.value_and_grad`` under ``jit`` with automatic sharding (the compiler
  all-reduces every microbatch's gradient) and ``MaskedMultiSteps(adam, k)``'s
  ``apply_gradients``;
* **deferred**: ``mm.per_device_value_and_grad`` (each device's own gradient)
  and ``MaskedMultiSteps(adam, k, reduction=mm.deferred(mesh, "data"))``'s
  ``apply_gradients``: one token-weighted all-reduce per window;
* **deferred + statistics**: the same with ``window_stats=True`` (each
  device's microbatch a small batch of the noise scale; the statistics' sums
  join the window's one all-reduce);
* **one reduction, by hand**: the deferred step written out without the
  wrapper (per-device running means, one token-weighted all-reduce and an adam
  update at the window's end; no checks): what the reduction alone costs;
* **floor**: every process trains its own replica on its own rows
  (``MaskedMultiSteps(adam, k).apply_gradients`` on its one device), with no
  cross-process communication at all;
* **accumulate only**: the per-device gradients into per-device running means,
  nothing else (no optimizer, no reduction);
* **one all-reduce** of the parameters' bytes alone (a sum over the device axis),
  timed in the same rounds as the competitors.

Per competitor it prints the time per microbatch (window time / k on the
slowest process of each round, as a synchronous job runs; median over rounds),
its ratio to the per-microbatch reduction (median of the ratios within
each round), and, read from the compiled HLO, the cross-device reductions and
bytes per window. Params and optimizer state are donated.

Usage::

    python benchmarks/bench_dp.py           # two sizes, k = 1, 4, 8, 16 (~2 min)
    python benchmarks/bench_dp.py --quick   # smoke test (1-2 min)
    python benchmarks/bench_dp.py --malloc default  # glibc's allocator defaults
    python benchmarks/bench_dp.py --markdown RESULT.json  # a result's table

The parent process starts the two workers, relays process 0's output and
writes its JSON result to ``benchmarks/results/`` (or ``--out``). The last line
reads ``dp: deferred X.XX× per-microbatch reduction (k=8, 4x1024²)`` when
width 1024 and k = 8 are among the runs (as by default).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from bench_cli import output_path, positive_int, positive_ints, read_result  # noqa: E402

NUM_PROCESSES = 2
REFERENCE = "per-microbatch reduction"
DEFERRED = "deferred"
BY_HAND = "one reduction, by hand"
ALLREDUCE = "one all-reduce"
HEADLINE = (1024, 8)
WORKER_TIMEOUT_S = 900
# One compute thread per process: each process stands for a one-core host, and
# the two do not oversubscribe the machine's cores (with XLA's default thread
# pools, 2 processes x 2 threads share 2 cores and timings scatter far more).
WORKER_XLA_FLAGS = "--xla_cpu_multi_thread_eigen=false"
# glibc hands every large temporary (a step's gradient-sized scratch buffers,
# the all-reduce's operands and result) back to the OS when it is freed and
# maps it afresh on the next step, so every step page-faults it in again; on a
# virtual machine that costs more than the all-reduce itself. Keeping freed
# memory in the process (what a long-running trainer wants anyway) applies to
# every competitor alike. It holds for this benchmark's buffers, below 64 MiB,
# not for larger ones: with these settings bench.py's 2048² rows still fault
# optax.MultiSteps' 96 MiB of scratch in on every call (most likely glibc's
# thread arenas, whose heaps hold at most 64 MiB, mapping a larger request
# afresh). `--malloc default` leaves glibc's defaults.
KEEP_FREED_MEMORY = {
    "MALLOC_MMAP_THRESHOLD_": str(2**31 - 1),
    "MALLOC_TRIM_THRESHOLD_": str(2**32 - 1),
    "MALLOC_TOP_PAD_": str(2**29),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke test, 1-2 min")
    p.add_argument("--out", type=output_path, help="JSON output path")
    p.add_argument("--widths", type=positive_ints, help="comma-separated matrix widths")
    p.add_argument("--ks", type=positive_ints, help="comma-separated window lengths k")
    p.add_argument(
        "--repeats", type=positive_int, help="timed rounds per configuration"
    )
    p.add_argument(
        "--malloc",
        choices=("keep", "default"),
        default="keep",
        help="keep freed memory in the worker processes (default), or glibc's defaults",
    )
    p.add_argument(
        "--markdown", type=Path, help="print a result JSON's tables as markdown"
    )
    p.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.markdown is not None:
        args.markdown = read_result(p, args.markdown, "bench_dp")
    return args


def config(args: argparse.Namespace) -> dict[str, Any]:
    if args.quick:
        widths, ks, repeats = [256, 1024], [1, 8], 2
    else:
        widths, ks, repeats = [512, 1024], [1, 4, 8, 16], 5
    if args.widths is not None:
        widths = args.widths
    if args.ks is not None:
        ks = args.ks
    if args.repeats is not None:
        repeats = args.repeats
    return {"widths": widths, "ks": ks, "repeats": repeats, "quick": args.quick}


# ------------------------------------------------------------------ worker side


def worker(args: argparse.Namespace) -> None:
    import jax

    jax.config.update("jax_num_cpu_devices", 1)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{args.port}",
        num_processes=NUM_PROCESSES,
        process_id=args.worker,
        initialization_timeout=120,
    )
    try:
        result = run(config(args))
        if jax.process_index() == 0:
            out = args.out
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(result, indent=1), encoding="utf-8")
    except BaseException:
        # A failed worker stops at once, its traceback written:
        # `jax.distributed.shutdown()` would wait at a barrier for the other
        # process, which waits in a collective for this one (a hang until the
        # parent's timeout, the cause lost).
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    jax.distributed.shutdown()


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    import bench
    import dp_steps
    import jax
    from jax.experimental import multihost_utils

    lead = jax.process_index() == 0

    def say(*a, **kw):
        if lead:
            print(*a, **kw, flush=True)

    info = dp_steps.machine_info()
    info["xla_flags"] = os.environ.get("XLA_FLAGS", "")
    info["malloc"] = {k: os.environ[k] for k in KEEP_FREED_MEMORY if k in os.environ}
    say(
        f"CPU: {info['cpu']} ({info['cores']} cores); {NUM_PROCESSES} processes x "
        f"{info['local_devices']} {info['backend']} device, gloo on 127.0.0.1; "
        f"jax {info['jax']}; XLA_FLAGS={info['xla_flags']!r}; freed memory "
        f"{'kept' if info['malloc'] else 'returned to the OS (glibc default)'}"
    )
    say(
        f"widths {cfg['widths']}, k {cfg['ks']}, {cfg['repeats']} timed rounds "
        "(+1 warm-up); load average before "
        f"{bench.load_average()}"
    )

    def barrier() -> None:
        # Every window starts on both processes together: otherwise the one
        # that finished the previous competitor's window first would time its
        # wait for the other at this window's first collective.
        multihost_utils.sync_global_devices("window")

    t_start = time.perf_counter()
    mesh = dp_steps.make_mesh()
    rows, allreduce = [], []
    for width in cfg["widths"]:
        workload = dp_steps.workload(width)
        for k in cfg["ks"]:
            runners = {
                comp.name: dp_steps.Runner(comp, mesh, workload, k)
                for comp in dp_steps.competitors(mesh, workload, k)
            }
            # The standalone all-reduce runs in the same rounds, so that the
            # bound floor + 1.1 t_allreduce / k can be taken within each round.
            timed = {**runners, ALLREDUCE: dp_steps.AllReduceRunner(mesh, workload, k)}
            times = slowest_process(
                bench.interleave(timed, cfg["repeats"], before=barrier)
            )
            per_mb = {name: [t / k for t in ts] for name, ts in times.items()}
            allreduce.append(
                {
                    "width": width,
                    "k": k,
                    "param_bytes": workload.param_bytes,
                    "ms": 1e3 * statistics.median(per_mb[ALLREDUCE]),
                    "ms_all": [1e3 * t for t in per_mb[ALLREDUCE]],
                }
            )
            for name, r in runners.items():
                rows.append(
                    {
                        "width": width,
                        "layers": workload.layers,
                        "num_params": workload.num_params,
                        "param_bytes": workload.param_bytes,
                        "k": k,
                        "competitor": name,
                        "ms_per_microbatch": 1e3 * statistics.median(per_mb[name]),
                        "ms_per_microbatch_all": [1e3 * t for t in per_mb[name]],
                        "x_per_microbatch": statistics.median(
                            a / b
                            for a, b in zip(
                                per_mb[name], per_mb[REFERENCE], strict=True
                            )
                        ),
                        **r.reductions,
                        "temp_bytes": r.temp_bytes,
                        "compile_s": r.compile_s,
                    }
                )
            say(f"  width {width}, k={k:<3d} done", file=sys.stderr)
    elapsed = time.perf_counter() - t_start
    result = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": info,
        "config": cfg,
        "windows": rows,
        "allreduce": allreduce,
        "load_average_after": bench.load_average(),
        "elapsed_s": elapsed,
    }
    if lead:
        report(result)
    return result


def slowest_process(times: dict[str, list[float]]) -> dict[str, list[float]]:
    """Each round's time on the slowest process.

    A synchronous data-parallel job finishes a window when its last process
    does, so every competitor, the floor included, is timed by the slowest
    process of each round (the processes of one machine do not run at the same
    speed: process 0 also serves the coordinator). Every process gets the same
    figures.
    """
    import numpy as np
    from jax.experimental import multihost_utils

    names = sorted(times)
    local = np.array([times[name] for name in names], dtype=np.float32)
    every = multihost_utils.process_allgather(local)  # (processes, names, rounds)
    slowest = np.asarray(every).max(axis=0)
    return {name: [float(t) for t in slowest[i]] for i, name in enumerate(names)}


def report(result: dict[str, Any]) -> None:
    import bench

    rows, allreduce = result["windows"], result["allreduce"]
    t_ar = {(a["width"], a["k"]): a for a in allreduce}
    print()
    print(
        "Time per microbatch (median over rounds), ratio to the per-microbatch "
        "reduction (median within rounds); reductions per window from the "
        "compiled HLO (all-reduce/reduce-scatter ops of at least 1 KiB, and all "
        "their bytes)"
    )
    print()
    header = (
        f"{'params':>15} {'k':>3}  {'competitor':<25} {'ms/mb':>7} {'x per-mb':>8} "
        f"{'reductions/window':>17} {'MiB/window':>10}"
    )
    print(header)
    print("-" * len(header))
    last = None
    for r in rows:
        key = (r["width"], r["k"])
        if last is not None and key != last:
            print()
        last = key
        size = bench.fmt_size(r["width"], r["layers"], r["num_params"])
        print(
            f"{size:>15} {r['k']:>3}  {r['competitor']:<25} "
            f"{r['ms_per_microbatch']:>7.2f} {r['x_per_microbatch']:>8.2f} "
            f"{r['reductions_per_window']:>17d} "
            f"{r['bytes_per_window'] / 2**20:>10.2f}"
        )
    print()
    for a in allreduce:
        print(
            f"one all-reduce of the params' bytes, {a['param_bytes'] / 2**20:.1f} MiB "
            f"(width {a['width']}, in the rounds of k={a['k']}): {a['ms']:.2f} ms"
        )
    print()
    cell = {(r["width"], r["k"], r["competitor"]): r for r in rows}
    ms = lambda w, k, name: cell[(w, k, name)]["ms_per_microbatch"]  # noqa: E731
    print(
        "deferred against floor + 1.1 t_allreduce / k, with t_allreduce the "
        "standalone all-reduce above, and (where k = 1 ran) the reduction's cost "
        "inside a step: per-microbatch reduction minus floor at k = 1"
    )
    for width, k in sorted({(r["width"], r["k"]) for r in rows}):
        floor, deferred = ms(width, k, "floor"), ms(width, k, DEFERRED)
        line = f"width {width}, k={k:<2d}: deferred {deferred:6.2f} ms/mb;"
        costs = {"standalone": t_ar[(width, k)]["ms"]}
        if (width, 1, REFERENCE) in cell:
            costs["in-step"] = ms(width, 1, REFERENCE) - ms(width, 1, "floor")
        by_hand = cell.get((width, k, BY_HAND), {}).get("ms_per_microbatch")
        for name, t in costs.items():
            bound = floor + 1.1 * t / k
            verdict = "within" if deferred <= bound else "ABOVE"
            line += (
                f" {name} {floor:.2f} + 1.1 x {t:.1f} / {k} = {bound:6.2f} ({verdict}"
            )
            if by_hand is not None:  # what the one reduction alone achieves
                line += f"; by hand {'within' if by_hand <= bound else 'ABOVE'}"
            line += ");"
        print(line.rstrip(";"))
    print()
    print(
        "deferred / (floor + 1.1 t_allreduce / k) within each round, the "
        "standalone all-reduce timed in the same round (median over rounds; "
        "<= 1.00 is within the bound)"
    )

    def to_bound(width: int, k: int, name: str) -> float:
        """Median over rounds of the competitor's time / the round's bound."""
        return statistics.median(
            t / (f + 1.1 * a / k)
            for t, f, a in zip(
                cell[(width, k, name)]["ms_per_microbatch_all"],
                cell[(width, k, "floor")]["ms_per_microbatch_all"],
                t_ar[(width, k)]["ms_all"],
                strict=True,
            )
        )

    for width, k in sorted({(r["width"], r["k"]) for r in rows}):
        line = f"width {width}, k={k:<2d}: deferred {to_bound(width, k, DEFERRED):.3f}"
        if (width, k, BY_HAND) in cell:
            line += f", by hand {to_bound(width, k, BY_HAND):.3f}"
        print(line)
    print()
    print("deferred against the same reduction written by hand (median within rounds)")
    for width, k in sorted({(r["width"], r["k"]) for r in rows}):
        if (width, k, BY_HAND) in cell:
            ratio = statistics.median(
                a / b
                for a, b in zip(
                    cell[(width, k, DEFERRED)]["ms_per_microbatch_all"],
                    cell[(width, k, BY_HAND)]["ms_per_microbatch_all"],
                    strict=True,
                )
            )
            print(
                f"width {width}, k={k:<2d}: deferred {ms(width, k, DEFERRED):6.2f}, "
                f"by hand {ms(width, k, BY_HAND):6.2f} ms/mb: {ratio:.2f}x"
            )
    width, k = HEADLINE
    if (width, k, "floor") in cell:
        print()
        model(cell[(width, k, "floor")])
    print()
    print(
        f"load average after: {result['load_average_after']}; total "
        f"{result['elapsed_s']:.0f} s"
    )


def markdown(result: dict[str, Any]) -> None:
    """The measured table as markdown: ms per microbatch (x per-microbatch)."""
    rows = result["windows"]
    keys = sorted({(r["width"], r["k"]) for r in rows})
    names = list(dict.fromkeys(r["competitor"] for r in rows))
    cell = {(r["width"], r["k"], r["competitor"]): r for r in rows}
    print(
        "| ms/microbatch (x per-microbatch) | "
        + " | ".join(f"{w}², k={k}" for w, k in keys)
        + " |"
    )
    print("|---|" + "---:|" * len(keys))
    for name in names:
        cells = [
            f"{cell[(w, k, name)]['ms_per_microbatch']:.1f} "
            f"({cell[(w, k, name)]['x_per_microbatch']:.2f})"
            for w, k in keys
        ]
        print(f"| {name} | " + " | ".join(cells) + " |")
    red = [
        f"{cell[(w, k, n)]['reductions_per_window']} / "
        f"{cell[(w, k, n)]['bytes_per_window'] / 2**20:.0f}"
        for w, k in keys
        for n in (REFERENCE, DEFERRED)
    ]
    print(
        "| reductions / MiB per window, per-microbatch | "
        + " | ".join(red[0::2])
        + " |"
    )
    print("| reductions / MiB per window, deferred | " + " | ".join(red[1::2]) + " |")
    for a in result["allreduce"]:
        # Results written before the all-reduce was timed per k have no "k".
        at_k = f", k={a['k']}" if "k" in a else ""
        print(
            f"\none all-reduce of {a['param_bytes'] / 2**20:.0f} MiB "
            f"(width {a['width']}{at_k}): {a['ms']:.1f} ms"
        )


MODEL_SIZES = {"1B": 1e9, "7B": 7e9}
MODEL_GBPS = (25, 100, 400)
MODEL_HOSTS = (8, 64)


def ring_allreduce_s(param_bytes: float, hosts: int, gbps: float) -> float:
    """Ring all-reduce time: 2 (N - 1) / N * P / bandwidth."""
    return 2 * (hosts - 1) / hosts * param_bytes / (gbps * 1e9 / 8)


def model(floor_row: dict[str, Any]) -> None:
    """A window's time on N hosts, deferred against per-microbatch reduction.

    Compute per microbatch is the floor measured here, scaled linearly with the
    number of parameters (same rows per device); float32 gradients.
    """
    k = floor_row["k"]
    rate = floor_row["ms_per_microbatch"] / 1e3 / floor_row["num_params"]
    print(
        f"Model: window of k={k} on N hosts; t_compute = the floor measured here "
        f"({floor_row['ms_per_microbatch']:.1f} ms for "
        f"{floor_row['num_params'] / 1e6:.1f}M params) scaled by P; float32 "
        "gradients; ring all-reduce 2(N-1)/N * 4P / bandwidth; deferred "
        "k*t_c + t_ar against k*(t_c + t_ar)"
    )
    header = (
        f"{'model':>5} {'Gb/s':>5} {'N':>3} {'t_c s':>7} {'t_ar s':>7} "
        f"{'t_ar/t_c':>8} {'deferred s':>10} {'per-mb s':>9} {'speed-up':>8}"
    )
    print(header)
    print("-" * len(header))
    for name, params in MODEL_SIZES.items():
        t_c = rate * params
        for gbps in MODEL_GBPS:
            for hosts in MODEL_HOSTS:
                t_ar = ring_allreduce_s(4 * params, hosts, gbps)
                deferred, per_mb = k * t_c + t_ar, k * (t_c + t_ar)
                print(
                    f"{name:>5} {gbps:>5} {hosts:>3} {t_c:>7.2f} {t_ar:>7.2f} "
                    f"{t_ar / t_c:>8.2f} {deferred:>10.2f} {per_mb:>9.2f} "
                    f"{per_mb / deferred:>7.2f}x"
                )


# ------------------------------------------------------------------ parent side


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(procs: list[subprocess.Popen], timeout_s: float) -> list[int | None]:
    """The workers' exit codes once all have exited, or as soon as one fails
    (the other would wait for it in a collective): ``None`` for one still
    running, also for every one still running after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        codes = [p.poll() for p in procs]
        if None not in codes or any(c not in (None, 0) for c in codes):
            return codes
        if time.monotonic() > deadline:
            return codes
        time.sleep(0.2)


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    del frame
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        worker(args)
        return 0
    if args.markdown is not None:
        markdown(args.markdown)
        return 0
    cfg = config(args)
    out = args.out
    if out is None:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        kind = "quick" if cfg["quick"] else "full"
        out = HERE / "results" / f"bench-dp-{kind}-{stamp}.json"
    port = _free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": WORKER_XLA_FLAGS}
    if args.malloc == "keep":
        env.update(KEEP_FREED_MEMORY)
    forwarded = [
        "--widths",
        ",".join(map(str, cfg["widths"])),
        "--ks",
        ",".join(map(str, cfg["ks"])),
        "--repeats",
        str(cfg["repeats"]),
    ] + (["--quick"] if cfg["quick"] else [])
    procs = []
    codes: list[int | None] = [None] * NUM_PROCESSES
    # SIGTERM (a supervisor's stop, `kill PID`) as an exception, so that the
    # `finally` below stops the workers too.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    out.parent.mkdir(parents=True, exist_ok=True)
    log = out.with_suffix(".worker1.log")
    try:
        for i in range(NUM_PROCESSES):
            cmd = [
                sys.executable,
                str(Path(__file__).resolve()),
                *forwarded,
                "--worker",
                str(i),
                "--port",
                str(port),
                "--out",
                str(out),
            ]
            if i == 0:
                procs.append(subprocess.Popen(cmd, env=env))
            else:
                with open(log, "wb") as f:
                    procs.append(subprocess.Popen(cmd, env=env, stdout=f, stderr=f))
        codes = _wait_for(procs, WORKER_TIMEOUT_S)
    finally:
        # Also where the parent is stopped (Ctrl-C, or SIGTERM, made an
        # exception above): the workers would run on for a whole benchmark.
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    if codes != [0] * NUM_PROCESSES:
        # Worker 0 wrote to this terminal; worker 1's output, in the locale's
        # encoding as it wrote it.
        err = log.read_text(encoding="locale", errors="replace") if log.exists() else ""
        if all(c in (None, 0) for c in codes):
            why = f"workers still running after {WORKER_TIMEOUT_S} s"
        else:  # (-9 for a worker stopped here after the other failed)
            why = f"worker exit codes {[p.returncode for p in procs]}"
        print(f"{why}; worker 1's output ({log}):\n{err[-4000:]}", file=sys.stderr)
        return 1
    result = json.loads(out.read_text(encoding="utf-8"))
    width, k = HEADLINE
    cell = {
        r["competitor"]: r
        for r in result["windows"]
        if (r["width"], r["k"]) == (width, k)
    }
    print(f"wrote {out}")
    if DEFERRED in cell:
        layers = cell[DEFERRED]["layers"]
        ratio = cell[DEFERRED]["x_per_microbatch"]
        print(
            f"dp: deferred {ratio:.2f}× per-microbatch reduction "
            f"(k={k}, {layers}x{width}²)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
