"""Checkpointing mid-window and resuming in a fresh process is bit-identical.

The state of :class:`MaskedMultiSteps` is a NamedTuple of arrays, including the
pending window (``acc_grads``, ``acc_count``, ``mini_step``). It round-trips
through orbax's ``StandardCheckpointer`` and through ``flax.serialization`` with
a template from ``tx.init`` (here via ``TrainState.create``), and training
continues exactly as if it had never stopped.
"""

import os
import pathlib
import subprocess
import sys
import textwrap

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from _helpers import TESTS_XLA_FLAGS
from flax import serialization

import masked_multistep as mm

K = 3  # microbatches per window
NUM_MICROBATCHES = 9
SAVE_AFTER = 4  # one microbatch into the second window
# Tokens per sequence for each microbatch (2 sequences of up to 5 tokens):
# skewed, with the first microbatch after the resume point empty.
LENGTHS = [[5, 5], [1, 0], [3, 4], [2, 5], [0, 0], [5, 1], [4, 4], [0, 1], [5, 5]]
MODEL = nn.Dense(2)


def batch(i):
    """Microbatch `i`: inputs, targets and mask, the same in every process."""
    rng = np.random.default_rng(i)
    x = rng.normal(size=(2, 5, 3)).astype(np.float32)
    y = rng.normal(size=(2, 5, 2)).astype(np.float32)
    mask = np.arange(5)[None, :] < np.array(LENGTHS[i])[:, None]
    return jnp.asarray(x), jnp.asarray(y), jnp.asarray(mask)


def fresh_state():
    """The initial state; also the restore template."""
    params = MODEL.init(jax.random.key(0), jnp.zeros((1, 5, 3)))["params"]
    tx = mm.MaskedMultiSteps(optax.adamw(0.05, weight_decay=0.1), every_k_schedule=K)
    return mm.TrainState.create(apply_fn=MODEL.apply, params=params, tx=tx)


@jax.jit
def train_step(state, x, y, mask):
    def loss_fn(params):
        per_token = jnp.sum((state.apply_fn({"params": params}, x) - y) ** 2, -1)
        return mm.masked_mean(per_token, mask)

    (loss, count), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    return state.apply_gradients(grads=grads, count=count, value=loss)


def run(state, start, stop):
    for i in range(start, stop):
        state = train_step(state, *batch(i))
    return state


def leaves(state):
    """Every array of the state (params and optimizer state), as numpy."""
    return [np.asarray(x) for x in jax.tree.leaves((state.params, state.opt_state))]


def abstract(state):
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, state)


_RESUME = """
import sys
sys.path.insert(0, {tests_dir!r})
import jax
jax.config.update("jax_num_cpu_devices", 8)  # as in the test process
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import serialization
import masked_multistep as mm
import test_checkpoint as t

ckpt_dir = {ckpt_dir!r}
template = t.fresh_state()
restored = {{}}
checkpointer = ocp.StandardCheckpointer()
restored["orbax"] = checkpointer.restore(ckpt_dir + "/orbax", t.abstract(template))
checkpointer.close()
with open(ckpt_dir + "/state.msgpack", "rb") as f:
    restored["flax"] = serialization.from_bytes(template, f.read())

out = {{}}
for name, state in restored.items():
    assert isinstance(state, mm.TrainState), type(state)
    assert isinstance(state.opt_state, mm.MaskedMultiStepsState), type(state.opt_state)
    assert int(state.opt_state.mini_step) == t.SAVE_AFTER % t.K, state.opt_state
    state = t.run(state, t.SAVE_AFTER, t.NUM_MICROBATCHES)
    for j, leaf in enumerate(t.leaves(state)):
        out[f"{{name}}_{{j}}"] = leaf
    out[f"{{name}}_step"] = np.asarray(state.step)
np.savez(ckpt_dir + "/resumed.npz", **out)
"""


def test_resume_mid_window_in_a_fresh_process_is_bit_identical(tmp_path):
    state = run(fresh_state(), 0, SAVE_AFTER)
    # The checkpoint holds a pending, partly accumulated window.
    assert int(state.opt_state.mini_step) == 1
    assert int(state.opt_state.acc_count) > 0
    assert int(state.gradient_step) == 1

    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "orbax", state)
    checkpointer.wait_until_finished()
    checkpointer.close()
    (tmp_path / "state.msgpack").write_bytes(serialization.to_bytes(state))

    # The uninterrupted run continues from the live state.
    final = run(state, SAVE_AFTER, NUM_MICROBATCHES)
    assert int(final.gradient_step) == NUM_MICROBATCHES // K
    expected = leaves(final)

    script = tmp_path / "resume.py"
    script.write_text(
        textwrap.dedent(_RESUME).format(
            tests_dir=str(pathlib.Path(__file__).parent), ckpt_dir=str(tmp_path)
        ),
        encoding="utf-8",
    )
    # (Compiled as this process compiles: bit for bit.)
    env = {**os.environ, "XLA_FLAGS": os.environ[TESTS_XLA_FLAGS]}
    result = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-4000:]

    resumed = np.load(tmp_path / "resumed.npz")
    for name in ("orbax", "flax"):
        assert int(resumed[f"{name}_step"]) == NUM_MICROBATCHES
        for j, want in enumerate(expected):
            got = resumed[f"{name}_{j}"]
            assert got.dtype == want.dtype and got.shape == want.shape, (name, j)
            assert np.array_equal(got, want), (name, j, got, want)


def test_a_checkpoint_restored_without_a_target_says_so_to_every_converter(tmp_path):
    # Orbax without a target gives plain dicts and lists: the converters took
    # them for a state held by name and blamed the template ("the template
    # must come from `tx.init(params)` ...") where the template was right.
    params = {"w": jnp.zeros(3)}
    tx = mm.MaskedMultiSteps(optax.adam(0.1), 3)
    _, state = tx.update({"w": jnp.ones(3)}, tx.init(params), params, count=2)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "c", {"opt_state": state})
        checkpointer.wait_until_finished()
        raw = checkpointer.restore(tmp_path / "c")["opt_state"]
    budget = mm.MaskedMultiSteps(optax.adam(0.1), tokens_per_window=8)
    saved_0_1 = {name: raw[name] for name in mm.STATE_0_1_FIELDS}
    for convert in (
        lambda: mm.from_other_settings(raw, budget.init(params)),
        lambda: mm.from_device_count(raw, tx.init(params)),
        lambda: mm.from_state_0_1(saved_0_1, tx.init(params)),
    ):
        with pytest.raises(
            ValueError,
            match=r"built of plain dicts and lists .* restored without a target.*"
            r"restore against the target",
        ):
            convert()


def test_a_pickled_state_names_the_module_every_version_has():
    # The class is defined in `_state`; a pickle names `_multisteps`, where
    # versions before that defined it (and which still exports it), so that
    # it loads with them too, and theirs load here.
    import pickle

    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 2)
    params = {"w": jnp.zeros(2)}
    _, state = tx.update({"w": jnp.ones(2)}, tx.init(params), params, count=3)
    blob = pickle.dumps(state)
    assert b"masked_multistep._multisteps" in blob and b"_state" not in blob
    loaded = pickle.loads(blob)
    assert type(loaded) is mm.MaskedMultiStepsState
    jax.tree.map(np.testing.assert_array_equal, loaded, state)
