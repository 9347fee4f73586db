"""Markdown tables from a ``bench.py`` JSON result (as in ``benchmarks/README.md``).

Usage::

    python benchmarks/report.py benchmarks/results/bench-full-....json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cli import read_result  # noqa: E402

MiB = 1 << 20


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |"]
    lines.append(
        "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|"
    )
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def machine(result: dict[str, Any]) -> str:
    m = result["machine"]
    return (
        f"{m['cpu']}, {m['cores']} cores ({m['usable_cores']} usable), backend "
        f"{m['backend']}; jax {m['jax']}, jaxlib {m['jaxlib']}, optax {m['optax']}, "
        f"flax {m['flax']}, Python {m['python']}; load average "
        f"{result['load_average_before']} before, {result['load_average_after']} "
        f"after; {result['config']['repeats']} rounds; {result['date']}"
    )


def times(result: dict[str, Any]) -> str:
    rows = result["windows"]
    keys = sorted({(r["width"], r["k"]) for r in rows})
    names = list(dict.fromkeys(r["competitor"] for r in rows))
    cell = {(r["competitor"], r["width"], r["k"]): r for r in rows}
    header = ["x floor (ms/microbatch)"] + [f"{w}², k={k}" for w, k in keys]
    body = []
    for name in names:
        line = [name]
        for w, k in keys:
            r = cell.get((name, w, k))  # none for the norm test at k = 1
            line.append(
                f"{r['x_floor']:.2f} ({r['ms_per_microbatch']:.1f})" if r else "-"
            )
        body.append(line)
    return _table(header, body)


def _at_largest_k(
    result: dict[str, Any],
) -> tuple[int, list[int], list[str], dict[tuple[str, int], dict[str, Any]]]:
    """The windows rows at the largest k: ``(k, widths, competitors, cell)``,
    ``cell[(competitor, width)]`` the row."""
    k = max(result["config"]["ks"])
    rows = [r for r in result["windows"] if r["k"] == k]
    widths = sorted({r["width"] for r in rows})
    names = list(dict.fromkeys(r["competitor"] for r in rows))
    return k, widths, names, {(r["competitor"], r["width"]): r for r in rows}


def against_optax(result: dict[str, Any]) -> str:
    """Ratio to optax.MultiSteps at the largest k, one column per size."""
    k, widths, names, cell = _at_largest_k(result)
    header = [f"x optax.MultiSteps, k={k}"] + [f"{w}²" for w in widths]
    body = [
        [name] + [f"{cell[(name, w)]['x_optax_multisteps']:.2f}" for w in widths]
        for name in names
    ]
    return _table(header, body)


def memory(result: dict[str, Any]) -> str:
    _, widths, names, cell = _at_largest_k(result)
    header = ["temp: x P (x adam's)"] + [f"{w}²" for w in widths] + ["state/P"]
    body = []
    for name in names:
        line = [name]
        for w in widths:
            r, adam = cell[(name, w)], cell[("adam", w)]
            line.append(
                f"{r['temp_bytes'] / r['param_bytes']:.2f} "
                f"({r['temp_bytes'] / adam['temp_bytes']:.2f})"
            )
        line.append(f"{r['state_bytes'] / r['param_bytes']:.2f}")
        body.append(line)
    return _table(header, body)


def faults(result: dict[str, Any]) -> str:
    """Minor page faults per microbatch at the largest k, one column per size
    (results that predate the figure have none: an empty string)."""
    k, widths, names, cell = _at_largest_k(result)
    if not cell or any("minor_faults_per_microbatch" not in r for r in cell.values()):
        return ""
    header = [f"page faults per microbatch, k={k}"] + [f"{w}²" for w in widths]
    body = [
        [name]
        + [f"{cell[(name, w)]['minor_faults_per_microbatch']:,.0f}" for w in widths]
        for name in names
    ]
    return _table(header, body)


def microbatching(result: dict[str, Any]) -> str:
    body = [
        [
            r["variant"],
            f"{r['ms_per_batch']:.1f}",
            f"{r['x_full_batch']:.2f}",
            f"{r['temp_bytes'] / MiB:.1f}",
        ]
        for r in result["microbatching"]
    ]
    return _table(["variant", "ms/batch", "x full batch", "temp MiB"], body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("result", type=Path, help="a JSON result of bench.py")
    result = read_result(parser, parser.parse_args().result, "bench")
    print(machine(result))
    print()
    print(times(result))
    print()
    print(against_optax(result))
    print()
    print(memory(result))
    print()
    faults_table = faults(result)
    if faults_table:
        print(faults_table)
        print()
    print(microbatching(result))


if __name__ == "__main__":
    main()
