"""Every process builds the same wrapper: a check at ``init`` across processes.

JAX's multi-process model runs the same program on every process. A wrapper
built with different arguments on different processes (a different ``k``, say)
would not fail: with ``reduction=mm.deferred(...)`` its windows would pair one
process's first ``k₀`` microbatches with another's first ``k₁``, and the
processes' parameters would silently drift apart. So when ``init`` builds a
state of global arrays that span every process, the processes compare a digest
of the wrapper's ``repr`` and the state's layout (one small all-gather, once),
and all of them raise the same error when they differ. Every process must
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
import re
from typing import Any

import jax
import jax.core
import numpy as np


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
    shown = re.sub(r" at 0x[0-9a-fA-F]+", "", repr(tx))
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    layout = "\n".join(
        f"{jax.tree_util.keystr(path)}: {jax.numpy.result_type(x)}{list(np.shape(x))}"
        for path, x in leaves
    )
    return shown, layout


def check_same_across_processes(texts: tuple[str, ...], what: str) -> None:
    """Raises ``ValueError`` on every process unless all of them hold the same
    ``texts`` (``describe``'s). Every process must call this."""
    from jax.experimental import multihost_utils

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
            "(`jax_num_cpu_devices` on CPUs) alike"
        )
    mine = np.stack(
        [np.frombuffer(hashlib.sha256(t.encode()).digest(), np.uint8) for t in texts]
    )
    every = np.asarray(multihost_utils.process_allgather(mine))
    differ = [i for i, rows in enumerate(every) if not np.array_equal(rows, mine)]
    if differ:
        which = [
            name
            for k, name in enumerate(("wrapper (its repr)", "state layout"))
            if any(not np.array_equal(every[i][k], mine[k]) for i in differ)
        ]
        raise ValueError(
            f"{what}: the processes built different wrappers or states: "
            f"process(es) {differ} built a different {' and '.join(which)} than "
            f"process {jax.process_index()}, whose wrapper is {texts[0]}. Every "
            "process must build the same MaskedMultiSteps with the same "
            "arguments, for the same params: with different window rules "
            "their windows would pair different microbatches and their "
            "parameters drift apart silently"
        )
