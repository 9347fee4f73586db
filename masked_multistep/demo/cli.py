"""Command line of ``python -m masked_multistep.demo``."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Any

__all__ = ["main", "build_parser", "REQUIREMENTS"]

# What the demo needs beyond the package: the `demo` extra in setup.cfg.
REQUIREMENTS = ("flax", "matplotlib", "tqdm")

INSTALL_HINT = (
    "From a checkout of masked_multistep: `make demo` (installs into .venv and runs "
    'the demo), or `pip install -e ".[demo]"`; elsewhere: `pip install '
    + " ".join(REQUIREMENTS)
    + "`."
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m masked_multistep.demo",
        description=(
            "Train a tiny causal LM on padded, masked, length-skewed microbatches "
            "three ways (full batch, optax.MultiSteps, mm.MaskedMultiSteps) and "
            "compare each accumulated gradient with the full-batch gradient."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps")
    parser.add_argument(
        "--microbatches", type=int, default=4, help="microbatches per batch (k)"
    )
    parser.add_argument(
        "--batch-size", type=int, default=32, help="sequences per batch"
    )
    parser.add_argument(
        "--skew",
        type=float,
        default=1.0,
        help="length skew between microbatches: 0 = random, 1 = sorted by length",
    )
    parser.add_argument("--seed", type=int, default=0, help="data and init seed")
    parser.add_argument(
        "--out", default="demo-output", help="directory for the PNG and JSON"
    )
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parses and checks the flags; bad values exit with status 2 and one line."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    if args.microbatches < 1:
        parser.error(f"--microbatches must be >= 1, got {args.microbatches}")
    if args.batch_size < 1:
        parser.error(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.batch_size % args.microbatches:
        parser.error(
            f"--batch-size ({args.batch_size}) must be divisible by --microbatches "
            f"({args.microbatches})"
        )
    if not 0.0 <= args.skew <= 1.0:
        parser.error(f"--skew must be between 0 and 1, got {args.skew}")
    if not 0 <= args.seed < 2**32:  # jax.random.key keeps a seed's low 32 bits
        parser.error(f"--seed must be in [0, 2**32), got {args.seed}")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        parser.error(f"--out must be a directory, got the file {args.out!r}")
    problem = unwritable(args.out)
    if problem:  # said now, not after the training
        parser.error(f"--out {args.out!r}: {problem}")
    return args


def unwritable(out: str) -> str | None:
    """Why the directory ``out`` could not be written or created, if it could not.

    Creates nothing: the nearest existing ancestor must be a directory this
    process may write into.
    """
    path = os.path.abspath(out)
    if os.path.isdir(path):
        return None if os.access(path, os.W_OK | os.X_OK) else "not writable"
    parent = os.path.dirname(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"cannot be created: {parent!r} is a file"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot be created in {parent!r} (not writable)"
    return None


def missing_requirements() -> list[str]:
    """The modules of ``REQUIREMENTS`` that cannot be imported, with the reason.

    Each is imported (the demo needs all of them anyway), so a package that is
    installed but broken is reported too.
    """
    missing = []
    for name in REQUIREMENTS:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as err:
            missing.append(name if err.name == name else f"{name} ({err})")
    return missing


def main(argv: list[str] | None = None) -> int:
    """Runs the demo; returns the exit status."""
    args = parse_args(argv)
    # Checked before anything runs, so that a missing plotting library does not
    # surface only after the training.
    missing = missing_requirements()
    if missing:
        print(
            f"python -m masked_multistep.demo needs the `demo` extra "
            f"({', '.join(REQUIREMENTS)}); missing: {', '.join(missing)}.\n"
            f"{INSTALL_HINT}",
            file=sys.stderr,
        )
        return 1
    # Imported here so that `--help` and bad flags answer at once.
    from tqdm import tqdm

    from masked_multistep.demo import report, train

    config = train.Config(
        steps=args.steps,
        microbatches=args.microbatches,
        batch_size=args.batch_size,
        skew=args.skew,
        seed=args.seed,
    )
    # The bar starts after `train_all` has compiled every step function, so its
    # rate and time estimate are those of training, not of compilation.
    print("compiling the three runs' steps...", file=sys.stderr, flush=True)
    results = train.train_all(
        config, progress=lambda n: tqdm(range(n), desc="training", unit="step")
    )
    summary = report.summarize(
        config, results, train.token_counts(config), train.mean_batch_tokens(config)
    )
    # The files first, so that what the training produced is kept whatever the
    # printing does; the table is printed even where they cannot be written.
    try:
        paths = report.write(summary, args.out)
    finally:
        print(printable(report.format_table(summary), sys.stdout))
    for path in paths:
        print(printable(f"wrote {path}", sys.stdout))
    return 0


# The table's symbols, spelled in ASCII for a stream that cannot write them.
_ASCII = str.maketrans({"‖": "|", "−": "-"})


def printable(text: str, stream: Any) -> str:
    """``text`` as ``stream``'s encoding can write it.

    Standard output is not always UTF-8: a Windows console redirected to a file
    writes the ANSI code page (cp1252 in Western locales has no ``‖`` or ``−``),
    as does a terminal under a Latin-1 locale. There the table's symbols are spelled in
    ASCII (``‖g − g_full‖`` as ``|g - g_full|``) and any other character the
    encoding lacks becomes ``?``, instead of a ``UnicodeEncodeError`` after the
    training.

    >>> import io
    >>> cp1252 = io.TextIOWrapper(io.BytesIO(), encoding="cp1252")
    >>> printable("‖g − g_full‖ / ‖g_full‖", cp1252)
    '|g - g_full| / |g_full|'
    >>> printable("‖g − g_full‖", io.TextIOWrapper(io.BytesIO(), encoding="utf-8"))
    '‖g − g_full‖'
    """
    encoding = getattr(stream, "encoding", None)
    if not isinstance(encoding, str):  # io.StringIO's is None
        encoding = "utf-8"
    try:
        text.encode(encoding)
        return text
    except (UnicodeEncodeError, LookupError):
        pass
    text = text.translate(_ASCII)
    try:
        return text.encode(encoding, errors="replace").decode(encoding)
    except LookupError:  # an encoding Python does not know: ASCII is safe
        return text.encode("ascii", errors="replace").decode("ascii")
