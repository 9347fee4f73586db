"""Command-line checks shared by the benchmark scripts.

Bad flags are usage errors when the script starts (exit status 2, one line
naming the flag), not tracebacks minutes into a run.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any, NoReturn

# What tells the two kinds of result apart, and what renders each.
RESULT_KINDS = {
    "bench": ("memory_checks", "benchmarks/report.py RESULT.json"),
    "bench_dp": ("allreduce", "benchmarks/bench_dp.py --markdown RESULT.json"),
}


def positive_int(text: str) -> int:
    """An integer >= 1 (an argparse ``type``)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def positive_ints(text: str) -> list[int]:
    """A comma-separated, non-empty list of integers >= 1 (an argparse ``type``)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty list")
    return [positive_int(item.strip()) for item in text.split(",")]


def output_path(text: str) -> Path:
    """A JSON file to write at the end of the run: checked at its start.

    Its directory is created now (results go to a directory of their own).
    """
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory: name a file")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise argparse.ArgumentTypeError(f"{str(parent)!r} is a file")
            break
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise argparse.ArgumentTypeError(
            f"cannot create the directory {str(path.parent)!r} ({err.strerror})"
        ) from None
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{str(path.parent)!r} is not writable")
    return path


def read_result(parser: argparse.ArgumentParser, path: Path, kind: str) -> Any:
    """The JSON result at ``path`` written by ``kind`` (a ``RESULT_KINDS`` key)."""

    def fail(message: str) -> NoReturn:
        parser.error(f"{path}: {message}")

    try:
        result = json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        fail(f"cannot read it ({err.strerror})")
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        fail(f"not JSON, or cut short ({err})")
    if not isinstance(result, dict) or "windows" not in result:
        fail("not a result of benchmarks/bench.py or benchmarks/bench_dp.py")
    for other, (key, renders) in RESULT_KINDS.items():
        if other != kind and key in result:
            fail(f"a {other}.py result: render it with {renders}")
    if RESULT_KINDS[kind][0] not in result:
        fail(f"not a result of benchmarks/{kind}.py")
    return result
