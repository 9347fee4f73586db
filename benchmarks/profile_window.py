"""Where a window's time goes: the device's busy time against the host's, per
microbatch, from a profile (``jax.profiler``) of each step.

Runs ``steps.py``'s floor, the ``TrainState`` step and the plain loop (each
with and without window statistics) on the reference workload, a few windows
each under ``jax.profiler.trace``, and reads the profile with
``jax.profiler.ProfileData`` (no other tool): per microbatch, the host's time
for the window (what the step costs), the device's kernels and their busy
time, and the share of the window the device sat idle. On a GPU an idle share
well above the floor's is time the device waits for the host: for a window
conditional run from the host, each microbatch's copy of its predicate
(see ``benchmarks/README.md``, "On GPU: timings"); for many small arrays in
the state, their handling on every call. On a CPU backend (no device plane in
the profile) only the host's times are printed.

Usage::

    python benchmarks/profile_window.py                 # 4 x 2048², k = 8
    python benchmarks/profile_window.py --width 256 --windows 2
    python benchmarks/profile_window.py --xplane run.xplane.pb   # keep the profile
"""

from __future__ import annotations

import argparse
import glob
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cli import output_path, positive_int  # noqa: E402

MAKES = (
    "floor",
    "train_state",
    "train_state_stats",
    "masked_multisteps",
    "masked_multisteps_stats",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--width", type=positive_int, default=2048, help="matrix width")
    p.add_argument("--k", type=positive_int, default=8, help="window length")
    p.add_argument("--windows", type=positive_int, default=3, help="profiled windows")
    p.add_argument("--xplane", type=output_path, help="keep the profile here")
    return p.parse_args(argv)


def _merged_busy(spans: list[tuple[float, float]]) -> float:
    """The time covered by ``spans`` (start, end), overlaps counted once."""
    busy, end = 0.0, float("-inf")
    for start, stop in sorted(spans):
        if stop <= end:
            continue
        busy += stop - max(start, end)
        end = stop
    return busy


def window_figures(xplane: str, k: int) -> dict[str, list[dict[str, float]]]:
    """Per competitor, per profiled window: ``host_ms`` (the window's time on
    the host, per microbatch) and, where the profile has a device plane,
    ``busy_ms`` (kernels and copies running, per microbatch), ``idle`` (the
    share of the window the device ran nothing) and ``kernels`` (per
    microbatch)."""
    from jax.profiler import ProfileData

    data = ProfileData.from_file(xplane)
    windows = []
    device_spans: list[tuple[float, float]] = []
    for plane in data.planes:
        if plane.name.startswith("/host:"):
            for line in plane.lines:
                for e in line.events:
                    if " window " in e.name:
                        windows.append((e.name, e.start_ns, e.end_ns))
        elif plane.name.startswith("/device:"):
            for line in plane.lines:
                if line.name.startswith("Stream"):
                    device_spans += [(e.start_ns, e.end_ns) for e in line.events]
    out: dict[str, list[dict[str, float]]] = {}
    for name, start, end in sorted(windows, key=lambda w: w[1]):
        figures = {"host_ms": (end - start) / 1e6 / k}
        if device_spans:
            inside = [(a, min(b, end)) for a, b in device_spans if start <= a < end]
            busy = _merged_busy(inside)
            figures.update(
                busy_ms=busy / 1e6 / k,
                idle=1 - busy / (end - start),
                kernels=len(inside) / k,
            )
        out.setdefault(name.rsplit(" window ", 1)[0], []).append(figures)
    return out


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    args = parse_args(argv)
    import jax
    import steps

    workload = steps.Workload(width=args.width)
    batches = [workload.batch(i) for i in range(args.k)]
    runs: list[list[Any]] = []
    for make in MAKES:
        comp = getattr(steps, make)(workload, args.k)
        step = jax.jit(comp.step, donate_argnums=0)
        carry = comp.init(workload.params())
        for batch in batches:  # compiled, warm
            carry = step(carry, batch)
        runs.append([comp.name, step, jax.block_until_ready(carry)])
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp):
            for run in runs:
                name, step, carry = run
                for i in range(args.windows):
                    with jax.profiler.TraceAnnotation(f"{name} window {i}"):
                        for batch in batches:
                            carry = step(carry, batch)
                        carry = jax.block_until_ready(carry)
                run[2] = carry
        (xplane,) = glob.glob(f"{tmp}/**/*.xplane.pb", recursive=True)
        figures = window_figures(xplane, args.k)
        if args.xplane:
            args.xplane.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(xplane, args.xplane)
    device = jax.devices()[0].device_kind
    print(
        f"{device}; 4 x {args.width}², k = {args.k}; medians of {args.windows} "
        "profiled windows (the profiler slows the host), per microbatch"
    )
    medians = {
        name: {f: statistics.median(w[f] for w in ws) for f in ws[0]}
        for name, ws in figures.items()
    }
    for name, m in medians.items():
        line = f"  {name:<34} host {m['host_ms']:7.3f} ms"
        if "busy_ms" in m:
            line += (
                f"  device busy {m['busy_ms']:7.3f} ms  idle {m['idle']:4.0%}"
                f"  kernels {m['kernels']:5.1f}"
            )
        print(line)
    if not any("busy_ms" in m for m in medians.values()):
        print("  (no device plane in the profile: host times only)")
    return medians


if __name__ == "__main__":
    main()
