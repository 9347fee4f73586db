"""The drop-ins against the plain optax loop, bit for bit.

Hypothesis drives one random sequence of microbatches through four ways of
training the same 2-layer MLP (2 → 4 → 1) with ``mm.MaskedMultiSteps(adam)``:

* the plain optax loop (the reference): ``updates, state = tx.update(grads,
  state, params, count=n, value=loss, close_window=c)`` then
  ``optax.apply_updates`` (README "Quickstart");
* linen: ``mm.TrainState.create(...)`` and ``state.apply_gradients(grads=...,
  count=n, value=loss, close_window=c)`` (README "Flax linen"; the wrapper's
  fused ``apply_gradients`` inside);
* NNX: ``nnx.Optimizer(model, tx, wrt=nnx.Param)`` and
  ``optimizer.update(model, grads, count=n, value=loss, close_window=c)`` with
  the gradients of ``nnx.grad`` (README "Flax NNX");
* equinox: ``tx.update(grads, state, eqx.filter(model, eqx.is_inexact_array),
  ...)`` with the gradients of ``eqx.filter_grad``, then
  ``eqx.apply_updates`` (README "Equinox"), on a module that also holds a
  function among its fields.

Every path gets the same mean gradients: the reference's (the gradient of a
linen forward pass at the reference's params, which every path is asserted to
share), handed to the NNX and equinox paths through their own gradient
transforms of ``Σ p·g`` (exactly ``g``), so that they arrive in each
framework's own structure. Counts are 0 (with NaN gradients and a NaN loss:
they must change nothing, which the reference also checks against zero
gradients), small whole numbers (int32 arrays) or small floats (float32
arrays, fractions included), with an occasional ``close_window=True``. Two
configurations, each compiled once per path: a fixed ``k = 3`` (whole
counts, no statistics), and a token budget (``tokens_per_window=6``) capped
by ``k = 4``, so that windows close on either rule, with
``window_stats=True`` (float counts). A checkpoint rule folds in a
microbatch, then round-trips each path's state through its recipe (README
"Checkpointing", "Equinox"), mostly mid-window: ``flax.serialization``
bytes of ``{"params", "opt_state"}`` restored against ``tx.init``, of the
``TrainState`` against a fresh ``TrainState.create``, NNX pure dicts
(``nnx.to_pure_dict``, ``nnx.replace_by_pure_dict``) put into a fresh
model and optimizer, ``eqx.tree_serialise_leaves`` into a fresh module and
``tx.init``; training then goes on from the restored states.

After every step: the params, each field of the wrapper's state
(``mm.find_state``; ``acc_grads`` only while the window holds tokens: after a
window closes it is scratch, README "Windows and the state", and the fused
``apply_gradients`` leaves another scratch than ``update``),
``mm.has_updated``, ``mm.window_stats``, each path's own counters
(``state.step``/``gradient_step``/``mini_step``, ``optimizer.step``,
``optimizer.opt_state.*``) are bit-identical across the paths, but for the
linen path's params, equal within the fused step's last-bit rounding.
"""

from __future__ import annotations

import io

import equinox as eqx
import flax.linen as nn
import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _helpers import assert_bit_identical
from flax import nnx
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

import masked_multistep as mm

# --- the model, in each framework, with the same params -----------------------

D_IN, WIDTH, TOKENS = 2, 4, 3


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = jax.nn.relu(nn.Dense(WIDTH, name="l0")(x))
        return nn.Dense(1, name="l1")(h)[..., 0]


class NNXMLP(nnx.Module):
    def __init__(self):
        self.l0 = nnx.Linear(D_IN, WIDTH, rngs=nnx.Rngs(0))
        self.l1 = nnx.Linear(WIDTH, 1, rngs=nnx.Rngs(0))


class EqxDense(eqx.Module):
    bias: jax.Array
    kernel: jax.Array


class EqxMLP(eqx.Module):
    l0: EqxDense
    l1: EqxDense
    activation: object = jax.nn.relu  # a function among the leaves


LINEN = LinenMLP()
# The params every path starts from: linen's layout, l0/l1 × bias/kernel (the
# leaf order of the NNX state and of the equinox module too).
PARAMS0 = LINEN.init(jax.random.key(0), jnp.zeros((TOKENS, D_IN)))["params"]
LAYERS, FIELDS = ("l0", "l1"), ("bias", "kernel")


def _new_nnx():
    model = NNXMLP()
    params = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(params, PARAMS0)
    nnx.update(model, params)
    return model


def _new_eqx():
    layers = (EqxDense(PARAMS0[k]["bias"], PARAMS0[k]["kernel"]) for k in LAYERS)
    return EqxMLP(*layers)


def _eqx_params(model):
    return {
        layer: {f: getattr(getattr(model, layer), f) for f in FIELDS}
        for layer in LAYERS
    }


def _dot(params, grads):
    """``Σ p·g``: its gradient with respect to ``params`` is ``grads``, exactly."""
    leaves = zip(jax.tree.leaves(params), jax.tree.leaves(grads), strict=True)
    return sum(jnp.sum(p * g) for p, g in leaves)


@jax.jit
def _mean_grads(params, x, y):
    """The microbatch's token-mean loss and gradient, by the linen model."""

    def loss(params):
        return jnp.mean((LINEN.apply({"params": params}, x) - y) ** 2)

    return jax.value_and_grad(loss)(params)


# --- configurations: window rules and the compiled steps of each path -------

# name: (MaskedMultiSteps keywords, the counts' kind: whole int32 or float32).
# Each configuration compiles four steps, most of the test's time: two cover
# a fixed k alone (without the window statistics) and a token budget capped
# by a fixed k (windows close on either; with the statistics).
CONFIGS = {
    "k3": (dict(every_k_schedule=3), "int"),
    "budget6_k4_stats": (
        dict(tokens_per_window=6.0, every_k_schedule=4, window_stats=True),
        "float",
    ),
}
COUNTS = {
    "int": [1, 0, 0, 0, 2, 3, 5],
    "float": [1.0, 0.0, 0.0, 0.0, 2.0, 3.0, 0.5, 2.25, 7.5],
}
_STEPS: dict[str, dict] = {}


@nnx.jit
def _nnx_step(model, optimizer, g, count, value, close):
    grads = nnx.grad(lambda m: _dot(nnx.state(m, nnx.Param), g))(model)
    optimizer.update(model, grads, count=count, value=value, close_window=close)


def _steps(name):
    """The configuration's wrapper and each path's step, jitted once."""
    if name not in _STEPS:
        tx = mm.MaskedMultiSteps(optax.adam(1e-2), **CONFIGS[name][0])

        @jax.jit
        def plain(params, state, g, count, value, close):
            updates, state = tx.update(
                g, state, params, count=count, value=value, close_window=close
            )
            return optax.apply_updates(params, updates), state

        @jax.jit
        def linen(state, g, count, value, close):
            return state.apply_gradients(
                grads=g, count=count, value=value, close_window=close
            )

        @eqx.filter_jit
        def equinox(model, state, g, count, value, close):
            grads = eqx.filter_grad(lambda m: _dot(_eqx_params(m), g))(model)
            updates, state = tx.update(
                grads,
                state,
                eqx.filter(model, eqx.is_inexact_array),
                count=count,
                value=value,
                close_window=close,
            )
            return eqx.apply_updates(model, updates), state

        nnx_model = _new_nnx()
        eqx_model = _new_eqx()
        start = dict(  # each path at its start, as `_fresh` copies it
            plain=(PARAMS0, tx.init(PARAMS0)),
            linen=mm.TrainState.create(apply_fn=LINEN.apply, params=PARAMS0, tx=tx),
            nnx=(nnx_model, nnx.Optimizer(nnx_model, tx, wrt=nnx.Param)),
            equinox=(eqx_model, tx.init(eqx.filter(eqx_model, eqx.is_inexact_array))),
        )
        _STEPS[name] = dict(plain=plain, linen=linen, equinox=equinox, start=start)
    return _STEPS[name]


def _nan_like(tree):
    return jax.tree.map(lambda a: jnp.full_like(a, jnp.nan), tree)


def _assert_same_state(name, want, got):
    """Field by field (leaves in order: the params' trees differ in kind);
    ``acc_grads`` only while the window holds tokens."""
    assert type(got) is type(want), (name, type(got))
    for field in want._fields:
        if field == "acc_grads" and float(want.acc_count) == 0:
            continue
        try:
            assert_bit_identical(
                jax.tree.leaves(getattr(want, field)),
                jax.tree.leaves(getattr(got, field)),
            )
        except AssertionError as err:
            raise AssertionError(f"{name}: state.{field} differs: {err}") from None


# --- the machine ---------------------------------------------------------------


class DropInsMachine(RuleBasedStateMachine):
    name = ""  # a key of CONFIGS: one machine per configuration, below

    @initialize()
    def setup(self):
        name = self.name
        self.kind = CONFIGS[name][1]
        self.steps = _steps(name)
        self._fresh()
        self.microbatches = 0

    def _fresh(self):
        """Every path at its start (also the templates of a restore): the
        immutable states shared, the NNX model and optimizer cloned."""
        start = self.steps["start"]
        self.params, self.state = start["plain"]
        self.train_state = start["linen"]
        self.nnx_model, self.nnx_opt = (nnx.clone(x) for x in start["nnx"])
        self.eqx_model, self.eqx_state = start["equinox"]

    @rule(
        data=st.integers(0, 2**16),
        draw_count=st.data(),
        close=st.sampled_from([False] * 6 + [True]),
    )
    def microbatch(self, data, draw_count, close):
        count = draw_count.draw(st.sampled_from(COUNTS[self.kind]), label="count")
        rng = np.random.default_rng(data)
        x = jnp.asarray(rng.normal(size=(TOKENS, D_IN)), jnp.float32)
        y = jnp.asarray(rng.normal(size=TOKENS), jnp.float32)
        value, grads = _mean_grads(self.params, x, y)
        if count == 0:  # an all-masked microbatch: 0/0
            value, grads = jnp.float32(jnp.nan), _nan_like(grads)
        n = jnp.int32(count) if self.kind == "int" else jnp.float32(count)
        close = jnp.asarray(close)
        s = self.steps
        before = (self.params, self.state)
        self.params, self.state = s["plain"](*before, grads, n, value, close)
        if count == 0:
            # The NaN gradients and loss change nothing: zeros give the same.
            zeros = jax.tree.map(jnp.zeros_like, grads)
            params, state = s["plain"](*before, zeros, n, jnp.float32(0), close)
            assert_bit_identical(params, self.params)
            _assert_same_state("count 0, zero gradients", self.state, state)
            for leaf in jax.tree.leaves((self.params, self.state.inner_opt_state)):
                assert np.isfinite(np.asarray(leaf)).all()
        self.train_state = s["linen"](self.train_state, grads, n, value, close)
        _nnx_step(self.nnx_model, self.nnx_opt, grads, n, value, close)
        self.eqx_model, self.eqx_state = s["equinox"](
            self.eqx_model, self.eqx_state, grads, n, value, close
        )
        self.microbatches += 1

    # Microbatches three times as often as checkpoints.
    @rule(data=st.integers(0, 2**16), draw_count=st.data(), close=st.just(False))
    def microbatch_b(self, data, draw_count, close):
        self.microbatch(data, draw_count, close)

    @rule(data=st.integers(0, 2**16), draw_count=st.data(), close=st.just(False))
    def microbatch_c(self, data, draw_count, close):
        self.microbatch(data, draw_count, close)

    @rule(data=st.integers(0, 2**16), draw_count=st.data())
    def checkpoint(self, data, draw_count):
        """A microbatch, then each path's state through its checkpoint
        recipe, into fresh templates (a resumed run's): mid-window unless
        that microbatch closed it."""
        self.microbatch(data, draw_count, close=False)
        saved = dict(
            plain=flax.serialization.to_bytes(
                {"params": self.params, "opt_state": self.state}
            ),
            linen=flax.serialization.to_bytes(self.train_state),
            nnx=flax.serialization.to_bytes(
                {
                    "model": nnx.to_pure_dict(nnx.state(self.nnx_model)),
                    "optimizer": nnx.to_pure_dict(nnx.state(self.nnx_opt)),
                }
            ),
        )
        event(f"{self.name}: checkpoint, {int(self.state.mini_step)} microbatches in")
        eqx_file = io.BytesIO()
        eqx.tree_serialise_leaves(eqx_file, (self.eqx_model, self.eqx_state))
        old = self._snapshot()
        self._fresh()

        plain = flax.serialization.from_bytes(
            {"params": self.params, "opt_state": self.state}, saved["plain"]
        )
        self.params, self.state = plain["params"], plain["opt_state"]
        self.train_state = flax.serialization.from_bytes(
            self.train_state, saved["linen"]
        )
        restored = flax.serialization.msgpack_restore(saved["nnx"])
        for obj, key in ((self.nnx_model, "model"), (self.nnx_opt, "optimizer")):
            template = nnx.state(obj)
            nnx.replace_by_pure_dict(template, restored[key])
            nnx.update(obj, template)
        eqx_file.seek(0)
        self.eqx_model, self.eqx_state = eqx.tree_deserialise_leaves(
            eqx_file, (self.eqx_model, self.eqx_state)
        )
        new = self._snapshot()
        for path in old:
            assert_bit_identical(old[path], new[path])

    def _snapshot(self):
        """Each path's params (canonical dicts) and wrapper state."""
        return dict(
            plain=(self.params, self.state),
            linen=(self.train_state.params, mm.find_state(self.train_state)),
            nnx=(
                nnx.to_pure_dict(nnx.state(self.nnx_model, nnx.Param)),
                mm.find_state(self.nnx_opt),
            ),
            equinox=(_eqx_params(self.eqx_model), self.eqx_state),
        )

    @invariant()
    def paths_agree(self):
        if not hasattr(self, "state"):
            return
        snap = jax.device_get(self._snapshot())  # one transfer
        params, state = snap.pop("plain")
        holders = dict(linen=self.train_state, nnx=self.nnx_opt, equinox=self.eqx_state)
        stats = CONFIGS[self.name][0].get("window_stats", False)
        for path, (p, s) in snap.items():
            try:
                # The fused `apply_gradients` (inside TrainState) may round the
                # params' last bit otherwise than `update` then
                # `optax.apply_updates`, where the compiler fuses the update's
                # last multiply with the add (README "Quickstart"; seen at LLVM's
                # default optimization, and with jax 0.12): compared within that
                # rounding, its state bit for bit.
                if path == "linen":
                    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(p)):
                        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)
                else:
                    assert_bit_identical(jax.tree.leaves(params), jax.tree.leaves(p))
            except AssertionError as err:
                raise AssertionError(f"{path}: params differ: {err}") from None
            _assert_same_state(path, state, s)
            updated = mm.has_updated(holders[path])
            assert bool(updated) == bool(state.updated), (path, updated)
            if stats:
                assert_bit_identical(
                    mm.window_stats(self.state), mm.window_stats(holders[path])
                )
        # Each path's own counters.
        ts, opt = self.train_state, self.nnx_opt
        assert int(ts.step) == int(opt.step[...]) == self.microbatches
        for field in ("gradient_step", "mini_step"):
            want = int(getattr(state, field))
            assert int(getattr(ts, field)) == want, (field, getattr(ts, field))
            assert int(getattr(opt.opt_state, field)[...]) == want, field
        assert_bit_identical(opt.opt_state.acc_count[...], state.acc_count)


_SETTINGS = settings(
    max_examples=6, stateful_step_count=25, deadline=None, derandomize=True
)


def _machine(name):
    machine = type(f"DropIns_{name}", (DropInsMachine,), {"name": name})
    case = machine.TestCase
    case.settings = _SETTINGS
    return case


TestK3 = _machine("k3")
TestBudget6K4Stats = _machine("budget6_k4_stats")
