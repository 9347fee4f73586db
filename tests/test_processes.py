"""The check at ``init`` that every process built the same wrapper and state,
in one process: ``process_allgather`` returns another process's digests."""

import re

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.experimental import multihost_utils

import masked_multistep as mm
from masked_multistep import _processes


def _digests(monkeypatch, texts):
    """What a process with ``texts`` contributes to the all-gather."""
    sent = []
    monkeypatch.setattr(
        multihost_utils, "process_allgather", lambda x: sent.append(x) or x[None]
    )
    _processes.check_same_across_processes(texts, "init")
    return sent[0]


@pytest.mark.parametrize(
    ("k", "params", "differs"),
    [
        (2, {"w": jnp.zeros(4)}, "state layout"),  # the same repr, another shape
        (2, {"w": jnp.zeros(3, jnp.bfloat16)}, "state layout"),  # adam's moments: bf16
        (3, {"w": jnp.zeros(3)}, "wrapper (its repr)"),  # the same layout, k
    ],
    ids=["shape", "dtype", "k"],
)
def test_init_check_names_what_differs(monkeypatch, k, params, differs):
    tx = mm.MaskedMultiSteps(optax.adam(0.1), 2)
    mine = _processes.describe(tx, tx.init({"w": jnp.zeros(3)}))
    other = mm.MaskedMultiSteps(optax.adam(0.1), k)
    theirs = _digests(monkeypatch, _processes.describe(other, other.init(params)))
    monkeypatch.setattr(
        multihost_utils, "process_allgather", lambda x: np.stack([x, theirs])
    )
    with pytest.raises(
        ValueError,
        match=rf"process\(es\) \[1\] built a different {re.escape(differs)} than",
    ):
        _processes.check_same_across_processes(mine, "init")
    # The same wrapper for the same params: no error.
    monkeypatch.setattr(
        multihost_utils, "process_allgather", lambda x: np.stack([x, x])
    )
    _processes.check_same_across_processes(mine, "init")


def test_init_check_tells_inner_optimizers_of_one_layout_apart(monkeypatch):
    # sgd and clip-then-scale both keep empty states: only the repr, which
    # names the inner optimizer's transformations, tells them apart.
    params = {"w": jnp.zeros(3)}
    tx = mm.MaskedMultiSteps(optax.sgd(0.1), 2)
    other = mm.MaskedMultiSteps(optax.chain(optax.clip(1.0), optax.scale(-0.1)), 2)
    assert "inner=chain(identity, scale)" in repr(tx)
    assert "inner=chain(clip, scale)" in repr(other)
    mine = _processes.describe(tx, tx.init(params))
    theirs_texts = _processes.describe(other, other.init(params))
    assert mine[1] == theirs_texts[1]  # the same state layout
    theirs = _digests(monkeypatch, theirs_texts)
    monkeypatch.setattr(
        multihost_utils, "process_allgather", lambda x: np.stack([x, theirs])
    )
    with pytest.raises(ValueError, match=r"different wrapper \(its repr\) than"):
        _processes.check_same_across_processes(mine, "init")


def test_processes_holding_different_numbers_of_devices_are_named(monkeypatch):
    # jax's all-gather failed with "cannot reshape array of size 3 into shape
    # (2,1)" for a process of one device beside one of two.
    class Device:
        def __init__(self, process_index):
            self.process_index = process_index

    tx = mm.MaskedMultiSteps(optax.sgd(0.1), 2)
    texts = _processes.describe(tx, tx.init({"w": jnp.zeros(3)}))
    monkeypatch.setattr(
        _processes.jax, "devices", lambda: [Device(0), Device(1), Device(1)]
    )
    with pytest.raises(
        ValueError,
        match=r"MaskedMultiSteps\.init: the processes hold different numbers of "
        r"devices \(process 0: 1, process 1: 2\)",
    ):
        _processes.check_same_across_processes(texts, "MaskedMultiSteps.init")
