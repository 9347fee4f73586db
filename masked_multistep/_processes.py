"""Every process builds the same wrapper: a check at ``init`` across processes.

JAX's multi-process model runs the same program on every process. A wrapper
built with different arguments on different processes (a different ``k``, say)
would not fail: with ``reduction=mm.deferred(...)`` its windows would pair one
process's first ``k₀`` microbatches with another's first ``k₁``, and the
processes' parameters would silently drift apart. So when ``init`` builds a
state of global arrays that span every process, the processes compare a digest
of the wrapper's ``repr`` and the state's layout (one small all-gather, once),
and all of them raise the same error when they differ, naming the first part
that differs as each process holds it (up to five more small all-gathers, on
that path only). Every process must
therefore call ``init`` (as JAX's multi-process model asks of every computation on
global arrays): one that does not leaves the others waiting in the
all-gather. A state built under ``jit`` (``jax.jit(tx.init)(params)``) is not
compared.

What the digest covers is what ``repr`` shows (the window rules, the dtypes,
the reduction, the statistics' options, the inner optimizer's name) and the
path, shape and dtype of each leaf of the state. Hyperparameters the ``repr`` does
not show (an ``optax.adam`` learning rate) and functions of the same name
differing in what they compute are not compared.
"""

from __future__ import annotations

import collections
import hashlib
from typing import Any

import jax
import jax.core
import numpy as np

from masked_multistep._checks import without_addresses


def _process_indices(leaf: Any) -> set[int]:
    """The processes whose devices hold ``leaf`` (none for a traced or host value)."""
    if not isinstance(leaf, jax.Array) or isinstance(leaf, jax.core.Tracer):
        return set()
    return {d.process_index for d in leaf.sharding.device_set}


def spans_every_process(tree: Any) -> bool:
    """Whether some leaf of ``tree`` is a concrete array on devices of every
    process (so every process takes part in computing it, and can take part in
    the check). A mesh over some of the processes only is not checked: the
    others would not join the all-gather."""
    n = jax.process_count()
    if n == 1:
        return False
    return any(len(_process_indices(x)) == n for x in jax.tree.leaves(tree))


def describe(tx: Any, state: Any) -> tuple[str, str]:
    """What the processes compare: ``repr(tx)`` (addresses left out) and the
    layout of ``state``, each leaf's path, shape and dtype (not the tree's own
    text, which shows the functions a node holds by their addresses)."""
    shown = without_addresses(repr(tx))
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    layout = "\n".join(
        f"{jax.tree_util.keystr(path)}: {jax.numpy.result_type(x)}{list(np.shape(x))}"
        for path, x in leaves
    )
    return shown, layout


def check_same_across_processes(
    texts: tuple[str, ...], what: str, allgather: Any = None
) -> None:
    """Raises ``ValueError`` on every process unless all of them hold the same
    ``texts`` (``describe``'s), naming the first part that differs (an
    argument of the wrapper's ``repr``, a leaf of the state) as each process
    holds it. Every process must call this. (``allgather``: jax's
    ``process_allgather`` unless given.)"""
    if allgather is None:
        from jax.experimental import multihost_utils

        allgather = multihost_utils.process_allgather
    held = collections.Counter(d.process_index for d in jax.devices())
    if len(set(held.values())) > 1:
        # jax's all-gather across processes (and its arrays spanning them)
        # would fail with a reshape error of its own.
        counts = ", ".join(f"process {p}: {n}" for p, n in sorted(held.items()))
        raise ValueError(
            f"{what}: the processes hold different numbers of devices ({counts}); "
            "the check that every process built the same wrapper, an "
            "all-gather across them (as jax's `process_allgather` lays it out), "
            "needs the same number on each: make the devices each process sees "
            "(`jax_num_cpu_devices` on CPUs) alike, or build the state under "
            "`jit`, which skips the check (`jax.jit(tx.init)(params)`)"
        )
    mine = np.stack([_digest(t) for t in texts])
    every = np.asarray(allgather(mine))
    differ = [i for i, rows in enumerate(every) if not np.array_equal(rows, mine)]
    if not differ:
        return
    which = [
        name
        for k, name in enumerate(_NAMES)
        if any(not np.array_equal(every[i][k], mine[k]) for i in differ)
    ]
    raise ValueError(
        f"{what}: the processes built different wrappers or states: "
        f"process(es) {differ} built a different {' and '.join(which)} than "
        f"process {jax.process_index()}, whose wrapper is {texts[0]}. "
        f"{_first_difference(texts, allgather)}Every process must build the "
        "same MaskedMultiSteps with the same arguments, for params of the same "
        "shapes and dtypes: otherwise their windows pair different microbatches "
        "(other window rules) or their states do not line up, and their "
        "parameters drift apart silently"
    )


_NAMES = ("wrapper (its repr)", "state layout")
_SHOWN = 160  # bytes of a differing part that each process shows the others


def _digest(text: str) -> np.ndarray:
    return np.frombuffer(hashlib.sha256(text.encode()).digest(), np.uint8)


def _parts(text: str, kind: int) -> list[str]:
    """A wrapper's ``repr`` as its arguments (split at top-level commas), a
    state layout as its leaves (lines)."""
    if kind == 1:
        return text.split("\n")
    head, _, body = text.partition("(")
    body = body.removesuffix(")")
    parts, depth, start = [head], 0, 0
    for i, c in enumerate(body):
        depth += c in "([{"
        depth -= c in ")]}"
        if c == "," and depth == 0:
            parts.append(body[start:i].strip())
            start = i + 1
    parts.append(body[start:].strip())
    return parts


def _first_difference(texts: tuple[str, ...], allgather: Any) -> str:
    """Where the processes' ``texts`` first differ, with each process's
    version: two all-gathers a text until one differs, a third for that part
    (every process takes each step together: the decisions are read from what
    was gathered, the same on every process)."""
    for kind, text in enumerate(texts[: len(_NAMES)]):
        parts = _parts(text, kind)
        lengths = np.asarray(allgather(np.array([len(parts)], np.int32)))
        longest = int(lengths.max())
        digests = np.zeros((longest, 32), np.uint8)
        digests[: len(parts)] = [_digest(p) for p in parts]
        every = np.asarray(allgather(digests))
        same = (every == every[:1]).all(axis=(0, 2))
        if same.all():
            continue
        j = int(np.argmin(same))
        part = parts[j] if j < len(parts) else "(nothing)"
        raw = np.zeros(_SHOWN, np.uint8)
        data = part.encode()[:_SHOWN]
        raw[: len(data)] = np.frombuffer(data, np.uint8)
        shown = np.asarray(allgather(raw))
        versions = "; ".join(
            f"process {p}: {bytes(row).rstrip(bytes(1)).decode(errors='replace')}"
            for p, row in enumerate(shown)
        )
        noun = "argument" if kind == 0 else "leaf"
        return f"The first {noun} that differs in the {_NAMES[kind]}: {versions}. "
    return ""
