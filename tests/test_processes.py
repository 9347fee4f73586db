"""The check at ``init`` that every process built the same wrapper and state,
in one process: ``process_allgather`` returns another process's digests."""

import threading

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.experimental import multihost_utils

import masked_multistep as mm
from masked_multistep import _processes


def _two_processes(*texts):
    """Each process's error (or None) where two processes, threads here, check
    ``texts[0]`` and ``texts[1]``, all-gathering through each other."""
    barrier = threading.Barrier(2)
    slots, errors = [None, None], [None, None]

    def gather_for(p):
        def gather(x):
            slots[p] = np.asarray(x)
            barrier.wait(timeout=30)
            out = np.stack(slots)
            barrier.wait(timeout=30)
            return out

        return gather

    def run(p):
        try:
            _processes.check_same_across_processes(texts[p], "init", gather_for(p))
        except ValueError as err:
            errors[p] = str(err)

    threads = [threading.Thread(target=run, args=(p,)) for p in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return errors


@pytest.mark.parametrize(
    ("k", "params", "differs", "first"),
    [
        (  # the same repr, another shape
            2,
            {"w": jnp.zeros(4)},
            "state layout",
            "The first leaf that differs in the state layout: process 0: "
            ".inner_opt_state[0].mu['w']: float32[3]; process 1: "
            ".inner_opt_state[0].mu['w']: float32[4]",
        ),
        (  # adam's moments: bf16
            2,
            {"w": jnp.zeros(3, jnp.bfloat16)},
            "state layout",
            "process 1: .inner_opt_state[0].mu['w']: bfloat16[3]",
        ),
        (  # the same layout, k
            3,
            {"w": jnp.zeros(3)},
            "wrapper (its repr)",
            "The first argument that differs in the wrapper (its repr): process 0: "
            "every_k_schedule=2; process 1: every_k_schedule=3.",
        ),
    ],
    ids=["shape", "dtype", "k"],
)
def test_init_check_names_what_differs(monkeypatch, k, params, differs, first):
    tx = mm.MaskedMultiSteps(optax.adam(0.1), 2)
    mine = _processes.describe(tx, tx.init({"w": jnp.zeros(3)}))
    other = mm.MaskedMultiSteps(optax.adam(0.1), k)
    theirs = _processes.describe(other, other.init(params))
    errors = _two_processes(mine, theirs)
    for p, error in enumerate(errors):
        assert f"process(es) [{1 - p}] built a different {differs} than" in error
        # Each process names the first difference as every process holds it.
        assert first in error, error
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
    errors = _two_processes(mine, theirs_texts)
    assert "different wrapper (its repr) than" in errors[0]
    assert "process 0: inner=chain(identity, scale); process 1: " in errors[0]


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
