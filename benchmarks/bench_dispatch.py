"""The host's cost of a compiled step's scalar leaves: time per call of one
jitted step whose donated carry holds 8 square float32 matrices and N scalars.

Each array of a jitted call's arguments and results costs the host work on
every call (flattening, buffer bookkeeping, donation); a step whose device work
is short (small models, GPUs) waits for it. The window statistics add 14
scalars to the wrapper's state (packed into three arrays, one per dtype): this
measures what such leaves cost on the machine at hand, interleaved
(round-robin over the N), medians, and the least-squares slope over the N.
Calls are dispatched asynchronously, so a call takes the longer of the host's
work and the device's: the slope is the host's where the device's work is the
shorter (an H100 at the default width; on a CPU, pass a small ``--width``,
such as 64, or the matrices' arithmetic hides it).

Usage::

    python benchmarks/bench_dispatch.py                  # N = 0, 16, 32, 64
    python benchmarks/bench_dispatch.py --scalars 14 --width 256
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cli import positive_int, positive_ints  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--scalars",
        type=positive_ints,
        default=[16, 32, 64],
        help="comma-separated counts of scalar leaves (each against none)",
    )
    p.add_argument("--width", type=positive_int, default=2048, help="matrix width")
    p.add_argument("--repeats", type=positive_int, default=30, help="timed rounds")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[int, float]:
    args = parse_args(argv)
    counts = sorted({0, *args.scalars})
    import jax
    import jax.numpy as jnp

    step = jax.jit(lambda c: jax.tree.map(lambda x: x + 1, c), donate_argnums=0)
    carries = {}
    for n in counts:
        matrices = [jnp.zeros((args.width, args.width)) for _ in range(8)]
        carry = (matrices, [jnp.zeros(()) for _ in range(n)])
        carries[n] = jax.block_until_ready(step(carry))  # compiled, warm
    times: dict[int, list[float]] = {n: [] for n in counts}
    for i in range(args.repeats):
        for n in counts[i % len(counts) :] + counts[: i % len(counts)]:
            carry = carries[n]
            t0 = time.perf_counter()
            for _ in range(8):
                carry = step(carry)
            carries[n] = jax.block_until_ready(carry)
            times[n].append((time.perf_counter() - t0) / 8)
    medians = {n: 1e6 * statistics.median(t) for n, t in times.items()}
    print(
        f"{jax.devices()[0].device_kind}; 8 x {args.width}² float32 "
        "+ N scalars, donated"
    )
    for n, us in medians.items():
        print(f"  N = {n:3d}: {us:8.1f} us per call")
    if len(counts) > 1:
        # The least-squares slope over every N, not two medians' difference.
        mean_n = statistics.fmean(counts)
        mean_t = statistics.fmean(medians.values())
        slope = sum((n - mean_n) * (medians[n] - mean_t) for n in counts) / sum(
            (n - mean_n) ** 2 for n in counts
        )
        print(
            f"dispatch: {slope:.2f} us per scalar leaf per call (N = 0 to "
            f"{counts[-1]}, least squares)"
        )
    return medians


if __name__ == "__main__":
    main()
