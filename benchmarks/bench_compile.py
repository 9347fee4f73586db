"""Start-up cost, side by side: the time to trace and to compile one train step.

A model with many parameter leaves pays the optimizer's per-leaf work once per
compilation. This script builds the same train step (a tanh MLP of
``leaves / 2`` layers, a weight and a bias each, 32 wide; gradient, then the
optimizer) with each competitor, and times ``jax.jit(step).lower(...)`` (the
trace) and ``.compile()`` (XLA) afresh in every round (a new function, so no
cache is hit), interleaved, and reports the medians, the median of their
ratios to ``optax.MultiSteps`` within a round, and the compiled program's
fusions (the fused kernels XLA:CPU generates code for, a deterministic
figure; dots, copies and other unfused instructions are not counted).

Usage::

    python benchmarks/bench_compile.py                       # 50 and 200 leaves
    python benchmarks/bench_compile.py --leaves 400 --repeats 5
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax

import masked_multistep as mm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cli import positive_int, positive_ints  # noqa: E402

WIDTH, ROWS, K = 32, 16, 4
REFERENCE = "optax.MultiSteps"


def competitors() -> dict[str, Callable[[], tuple[Any, Callable[..., Any]]]]:
    """Each competitor: a function returning ``(tx, apply)``, where ``apply(tx,
    grads, state, params, count)`` returns ``(params, state)``."""

    def update(tx, grads, state, params, count):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    def counted(tx, grads, state, params, count):
        updates, state = tx.update(grads, state, params, count=count)
        return optax.apply_updates(params, updates), state

    def fused(tx, grads, state, params, count):
        return tx.apply_gradients(grads, state, params, count=count)

    adam = optax.adam(1e-3)
    return {
        "adam (no accumulation)": lambda: (adam, update),
        REFERENCE: lambda: (optax.MultiSteps(adam, K), update),
        "MaskedMultiSteps update": lambda: (mm.MaskedMultiSteps(adam, K), counted),
        "MaskedMultiSteps apply_gradients": lambda: (
            mm.MaskedMultiSteps(adam, K),
            fused,
        ),
        "MaskedMultiSteps apply_gradients+stats": lambda: (
            mm.MaskedMultiSteps(adam, K, window_stats=True),
            fused,
        ),
        "MaskedMultiSteps apply_gradients+leaf stats": lambda: (
            mm.MaskedMultiSteps(adam, K, per_leaf_stats=True),
            fused,
        ),
    }


def workload(leaves: int) -> tuple[Any, Callable[..., Any], tuple[Any, Any]]:
    layers = max(1, leaves // 2)
    params = {
        f"layer{i:03d}": {"w": jnp.eye(WIDTH) * 0.9, "b": jnp.zeros(WIDTH)}
        for i in range(layers)
    }

    def loss(params, x, mask):
        for i in range(layers):
            layer = params[f"layer{i:03d}"]
            x = jnp.tanh(x @ layer["w"] + layer["b"][None, :])
        per_row = jnp.mean(x**2, axis=-1)
        return mm.masked_mean(per_row, mask)

    batch = (jnp.ones((ROWS, WIDTH)), jnp.ones(ROWS))
    return params, loss, batch


def measure(leaves: int, make: Callable[[], Any]) -> dict[str, float]:
    """Trace and compile times of one competitor's step, and its fusions."""
    params, loss, (x, mask) = workload(leaves)
    tx, apply = make()
    state = tx.init(params)

    def step(params, state, x, mask):  # a new function: no cache is hit
        (_, count), grads = jax.value_and_grad(loss, has_aux=True)(params, x, mask)
        return apply(tx, grads, state, params, count)

    start = time.perf_counter()
    lowered = jax.jit(step).lower(params, state, x, mask)
    traced = time.perf_counter()
    compiled = lowered.compile()
    done = time.perf_counter()
    fusions = len(re.findall(r"= [^=\n]*\bfusion\(", compiled.as_text()))
    return {"trace_s": traced - start, "compile_s": done - traced, "fusions": fusions}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--leaves",
        type=positive_ints,
        default=[50, 200],
        help="comma-separated numbers of parameter leaves (default 50,200)",
    )
    p.add_argument("--repeats", type=positive_int, default=3, help="rounds (default 3)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    makers = competitors()
    print(
        f"jax {jax.__version__}, backend {jax.default_backend()}; "
        f"{args.repeats} rounds, medians; ratios against {REFERENCE}",
        flush=True,
    )
    for make in makers.values():  # warm-up: jax's own first-use costs
        measure(2, make)
    rows = []
    width = max(map(len, makers))
    for leaves in args.leaves:
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in makers}
        for _ in range(args.repeats):
            for name, make in makers.items():  # interleaved: load hits all alike
                runs[name].append(measure(leaves, make))
        print(f"\n{leaves} leaves")
        print(f"{'':{width}s} {'trace':>13s} {'compile':>15s} {'fusions':>8s}")
        for name, measured in runs.items():
            row = {"leaves": leaves, "competitor": name}
            for key in ("trace_s", "compile_s"):
                row[key] = statistics.median(r[key] for r in measured)
                # The median of the ratios within a round, as bench.py takes
                # them: a slow round of the reference alone does not move it.
                row[key.replace("_s", "_ratio")] = statistics.median(
                    r[key] / ref[key]
                    for r, ref in zip(measured, runs[REFERENCE], strict=True)
                )
            row["fusions"] = measured[0]["fusions"]
            rows.append(row)
            print(
                f"{name:{width}s} {row['trace_s']:6.2f} s {row['trace_ratio']:4.2f}x "
                f"{row['compile_s']:7.2f} s {row['compile_ratio']:4.2f}x "
                f"{row['fusions']:8d}"
            )
    return rows


if __name__ == "__main__":
    main()
