"""Every process builds the same wrapper: a check at ``init`` across processes.

JAX's multi-process model runs the same program on every process. A wrapper
built with different arguments on different processes (a different ``k``, say)
would not fail: with ``reduction=mm.deferred(...)`` its windows would pair one
process's first ``k₀`` microbatches with another's first ``k₁``, and the
processes' parameters would silently drift apart. So when ``init`` builds a
state of global arrays that span every process, the processes compare a digest
of the wrapper's ``repr`` and the state's layout (one small all-gather, once),
and all of them raise the same error when they differ.

What the digest covers is what ``repr`` shows (the window rules, the dtypes,
the reduction, the statistics' options, the inner optimizer's name) and the
state's tree structure, shapes and dtypes. Hyperparameters the ``repr`` does
not show (an ``optax.adam`` learning rate) and functions of the same name
differing in what they compute are not compared.
"""

from __future__ import annotations

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


def describe(tx: Any, state: Any) -> str:
    """The text the processes compare: ``repr(tx)`` (addresses left out) and
    the layout of ``state``."""
    shown = re.sub(r" at 0x[0-9a-fA-F]+", "", repr(tx))
    leaves, treedef = jax.tree.flatten(state)
    layout = [(np.shape(x), str(jax.numpy.result_type(x))) for x in leaves]
    return f"{shown}\n{treedef}\n{layout}"


def check_same_across_processes(text: str, what: str) -> None:
    """Raises ``ValueError`` on every process unless all of them hold the same
    ``text``. Every process must call this."""
    from jax.experimental import multihost_utils

    mine = np.frombuffer(hashlib.sha256(text.encode()).digest(), np.uint8)
    every = np.asarray(multihost_utils.process_allgather(mine))
    differ = [i for i, row in enumerate(every) if not np.array_equal(row, mine)]
    if differ:
        me = jax.process_index()
        raise ValueError(
            f"{what}: the processes built different wrappers or states; process "
            f"{me} has {text.splitlines()[0]}, and process(es) {differ} have "
            "something else (a different repr or state layout). Every process "
            "must build the same MaskedMultiSteps with the same arguments: with "
            "different window rules their windows would pair different "
            "microbatches and their parameters drift apart silently"
        )
