"""A reference model for the whole state machine of MaskedMultiSteps.

Hypothesis drives random sequences of microbatches (ordinary, NaN and inf
gradients; counts that are zero, negative, fractional, huge, non-finite or of
odd dtypes; ``value`` present or absent) through a wrapper configured with a
skip function or none, a fixed or a scheduled window size, ``update`` or the
fused ``apply_gradients``, eagerly or under ``jit``. After every step the
library's state and output are compared with a plain-Python float64 model of
the documented semantics (``MaskedMultiSteps`` and ``masked_multistep._checks``):

* a count in bfloat16 or float16 is a ``TypeError`` (by dtype, also under
  ``jit``), the state untouched;
* a count is valid when finite and non-negative; a concrete invalid count raises
  ``ValueError``, a traced one is skipped and counted in ``num_invalid_counts``,
  as is one that would overflow the window's float32 token total (the full
  window then closes on it);
* a count-0 microbatch always counts toward its window (the skip function's
  verdict and state are ignored for it); a microbatch with tokens that the skip
  function rejects is as if it never happened;
* a window closes on its ``k``-th counted microbatch, ``k`` the schedule at the
  current gradient step (rounded, NaN counts as 1); it applies the inner update
  (here ``sgd(1.0)``: minus the token-weighted mean) if it saw tokens and its
  mean is finite, counts it in ``num_nonfinite_windows`` if the mean is not,
  and returns zeros otherwise;
* ``value`` is token-averaged over the microbatches that pass one; an inner
  optimizer that requires ``value=`` (here an ``sgd(1.0)`` that records it)
  receives that average, NaN if no microbatch of the window passed one;
* ``close_window=True`` closes the window on its microbatch whatever ``k``
  says, also where that microbatch is skipped or its traced count invalid
  (a concrete invalid count still raises first).

The expected params and updates are those of ``sgd(1.0)``: minus the window's
token-weighted mean gradient. Tolerances are float32's (1e-5 relative).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule

import masked_multistep as mm

PARAMS = {"w": jnp.zeros(3, jnp.float32), "b": jnp.zeros((), jnp.float32)}
# Calls without `value=` to an inner step that needs it are part of the
# model (a window without one is held); the wrapper warns about each.
pytestmark = pytest.mark.filterwarnings("ignore:The inner optimizer needs `value=`")

# Window sizes: a fixed k, or a schedule of the gradient step whose values the
# wrapper sanitizes (2.6 rounds to 3, NaN counts as 1).
_CYCLE = jnp.array([2.0, 1.0, 3.0, 2.6, jnp.nan, 1.4], jnp.float32)
SCHEDULES = {
    "fixed3": (3, lambda step: 3),
    "cycle": (
        lambda step: _CYCLE[step % 6],
        lambda step: [2, 1, 3, 3, 1, 1][step % 6],
    ),
}

# Counts as (how the count is passed, its value), in three groups drawn about
# equally often: ordinary counts, odd dtypes, and invalid or huge ones (two huge
# float32 counts in one window overflow its token total). Under jit only jax
# arrays are passed: jax.jit's own conversion narrows a host int64 before the
# library sees it.
ORDINARY = [("float32", v) for v in (0, 1, 2.5, 0.25, 7)] + [
    ("int32", v) for v in (0, 1, 5)
]
ODD_DTYPES = [
    ("int32", 2**31 - 1),
    ("uint8", 0),
    ("uint8", 200),
    ("int8", 100),
    ("int16", 3),
    ("uint16", 65535),
    ("uint32", 3),
    ("uint32", 2**32 - 1),
    ("bfloat16", 257),  # 256 in bfloat16: refused (a TypeError), like all below
    ("bfloat16", 0.5),
    ("float16", 0),
    ("float16", 65504),
]
SPECIAL = [
    ("float32", -1),
    ("float32", math.nan),
    ("float32", math.inf),
    ("int32", -2),
    ("int8", -3),
    ("bfloat16", math.nan),
    ("float16", -math.inf),
    ("float32", 1e30),
    ("float32", 3e38),
    ("float32", 2e38),
    ("bfloat16", 3e38),
]
HOST_COUNTS = [
    ("np.int64", 2**32 + 5),
    ("np.int64", 3),
    ("np.int64", -4),
    ("np.uint64", 2**63 + 1),
    ("python", 4),
    ("python", 1.5),
    ("python", 2**70),
    ("python", -1),
]


# Under jit every (configuration, count dtype, value present) is a compile: the
# 16-bit integers, which take the same path as the 8- and 32-bit ones, are left
# to the eager machine to keep the compiles few.
_EAGER_ONLY = ("int16", "uint16")


def _count_strategy(jit):
    groups = [ORDINARY, ODD_DTYPES, SPECIAL] + ([] if jit else [HOST_COUNTS])
    if jit:
        groups = [[c for c in group if c[0] not in _EAGER_ONLY] for group in groups]
    return st.one_of(*[st.sampled_from(group) for group in groups])


def _make_count(kind, value):
    if kind == "python":
        return value
    if kind == "np.int64":
        return np.int64(value)
    if kind == "np.uint64":
        return np.uint64(value)
    return jnp.array(value, dtype=kind)


def _count_value(count):
    """The count's value as a float64 (what the model weighs with)."""
    if isinstance(count, (int, float)):
        return float(count)
    if isinstance(count, np.generic):
        return float(int(count))
    return float(np.asarray(count).astype(np.float64))


_FINITE = st.floats(-10, 10, width=32, allow_subnormal=False)
_GRAD_KINDS = ["ordinary", "ordinary", "ordinary", "nan", "inf", "-inf"]


@st.composite
def _grads(draw):
    w = np.array(draw(st.lists(_FINITE, min_size=3, max_size=3)), np.float32)
    b = np.float32(draw(_FINITE))
    kind = draw(st.sampled_from(_GRAD_KINDS))
    if kind != "ordinary":
        special = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf}[kind]
        where = draw(st.integers(0, 3))
        if where == 3:
            b = np.float32(special)
        else:
            w[where] = special
    return {"w": w, "b": np.asarray(b)}


def _sgd_that_needs_value():
    """``sgd(1.0)`` that, like ``reduce_on_plateau``, requires ``value=``."""

    def init(params):
        del params
        return {"value": jnp.zeros([], jnp.float32)}

    def update(updates, state, params=None, *, value):
        del state, params
        return jax.tree.map(jnp.negative, updates), {"value": value}

    return optax.GradientTransformationExtraArgs(init, update)


# One wrapper and one jitted step per configuration, shared by all examples, so
# that each (configuration, count dtype, value present) compiles once.
_WRAPPERS = {}


def _wrapper(skip, schedule, fused, needs_value, jit):
    key = (skip, schedule, fused, needs_value, jit)
    if key not in _WRAPPERS:
        tx = mm.MaskedMultiSteps(
            _sgd_that_needs_value() if needs_value else optax.sgd(1.0),
            SCHEDULES[schedule][0],
            should_skip_update_fn=optax.skip_not_finite if skip else None,
        )
        step = tx.apply_gradients if fused else tx.update
        _WRAPPERS[key] = (tx, jax.jit(step) if jit else step)
    return _WRAPPERS[key]


class Model:
    """The documented semantics, in float64 (counts summed in float32, as stated)."""

    def __init__(self, skip, k_of_step, needs_value=False):
        self.skip, self.k_of_step = skip, k_of_step
        self.needs_value = needs_value
        self.mini_step = self.gradient_step = 0
        self.num_invalid_counts = self.num_nonfinite_windows = 0
        self.updated = False
        self.skip_state = (False, 0)
        self.inner_value = 0.0  # the `value` the inner optimizer last received
        self.params = {"w": np.zeros(3), "b": np.zeros(())}
        self._reset_window()

    def _reset_window(self):
        self.acc_count = np.float32(0)  # float32, as the state keeps it
        self.value_count = np.float32(0)
        self.weight = 0.0
        self.weighted = {"w": np.zeros(3), "b": np.zeros(())}
        self.value_weight = self.value_sum = 0.0

    def mean(self):
        return {k: v / self.weight for k, v in self.weighted.items()}

    def step(self, grads, count, value, *, eager, close=False):
        """Folds in one microbatch; returns the update (None: zeros) or raises."""
        c = _count_value(count)
        c32 = np.float32(c)
        valid = math.isfinite(c) and c >= 0
        if not valid and eager:
            raise ValueError("invalid concrete count")
        with np.errstate(over="ignore"):
            fits = valid and bool(np.isfinite(self.acc_count + c32))
        verdict = None
        if self.skip:
            bad = sum(int(np.sum(~np.isfinite(g))) for g in grads.values())
            verdict = (bad > 0, bad)
        self.updated = False
        if not fits:
            self.num_invalid_counts += 1
            if verdict is not None:
                self.skip_state = verdict
            if not valid:
                return self._close_window() if close else None
            # A usable count the window's total cannot take: the full window
            # closes on it, with the tokens it holds.
            return self._close_window()
        if c32 == 0:
            counted = True  # an empty microbatch counts, whatever the skip fn says
        else:
            if verdict is not None:
                self.skip_state = verdict
            counted = verdict is None or not verdict[0]
        if not counted:
            return self._close_window() if close else None
        if c32 > 0:
            self.acc_count = self.acc_count + c32
            self.weight += c
            with np.errstate(invalid="ignore"):  # inf - inf is NaN here too
                for key, g in grads.items():
                    self.weighted[key] = self.weighted[key] + c * g.astype(np.float64)
            if value is not None:
                self.value_count = self.value_count + c32
                self.value_weight += c
                self.value_sum += c * float(value)
        k = self.k_of_step(self.gradient_step)
        if self.mini_step < k - 1 and not close:
            self.mini_step += 1
            return None
        return self._close_window()

    def _close_window(self):
        """Closes the window: returns its update (None: zeros)."""
        update = None
        if self.acc_count > 0:
            mean = self.mean()
            # The window's token-weighted loss over the microbatches that
            # passed one; NaN if none did. An inner optimizer that needs it
            # never sees a NaN: the window is held, like a non-finite mean.
            window_value = (
                self.value_sum / self.value_weight if self.value_weight else math.nan
            )
            if all(np.all(np.isfinite(m)) for m in mean.values()) and not (
                self.needs_value and math.isnan(window_value)
            ):
                update = {key: -m for key, m in mean.items()}
                self.inner_value = window_value
                self.params = {key: self.params[key] + update[key] for key in update}
                self.gradient_step += 1
                self.updated = True
            else:
                self.num_nonfinite_windows += 1
        self.mini_step = 0
        self._reset_window()
        return update


def _close(actual, expected, atol=1e-4):
    np.testing.assert_allclose(
        np.asarray(actual, np.float64), expected, rtol=1e-5, atol=atol
    )


class MaskedMultiStepsMachine(RuleBasedStateMachine):
    JIT = False

    def configure(self, skip, schedule, fused):
        """A wrapper with or without a skip function, a window schedule, and
        either `update` with sgd or the fused `apply_gradients` with an inner
        optimizer that requires `value=` (tied, to keep the compiles few)."""
        needs_value = fused
        self.fused, self.needs_value = fused, needs_value
        self.tx, self.step_fn = _wrapper(skip, schedule, fused, needs_value, self.JIT)
        self.state = self.tx.init(PARAMS)
        self.params = PARAMS
        self.model = Model(skip, SCHEDULES[schedule][1], needs_value)

    def check_microbatch(self, grads, count, value, close=False):
        """One `update` (or `apply_gradients`) call, checked against the model."""
        count = _make_count(*count)
        kwargs = {} if value is None else {"value": jnp.float32(value)}
        # Under jit, always passed (traced): one program for both values.
        if close or self.JIT:
            kwargs["close_window"] = jnp.asarray(close) if self.JIT else close
        jgrads = jax.tree.map(jnp.asarray, grads)
        if getattr(count, "dtype", None) in (jnp.bfloat16, jnp.float16):
            # Refused by dtype (already rounded past 256 or 2048), also traced.
            with pytest.raises(TypeError, match="holds whole numbers exactly"):
                self.step_fn(jgrads, self.state, self.params, count=count, **kwargs)
            self._check_state()
            return
        try:
            expected = self.model.step(
                grads, count, value, eager=not self.JIT, close=close
            )
        except ValueError:
            with pytest.raises(ValueError, match="`count` must"):
                self.step_fn(jgrads, self.state, self.params, count=count, **kwargs)
            self._check_state()
            return
        out, self.state = self.step_fn(
            jgrads, self.state, self.params, count=count, **kwargs
        )
        if self.fused:
            if expected is None:
                for new, old in zip(jax.tree.leaves(out), jax.tree.leaves(self.params)):
                    np.testing.assert_array_equal(new, old)
            self.params = out
            for key in PARAMS:
                _close(out[key], self.model.params[key], atol=1e-3)
        else:
            for key in PARAMS:
                assert out[key].dtype == jnp.float32
                if expected is None:
                    np.testing.assert_array_equal(out[key], 0.0)
                else:
                    _close(out[key], expected[key])
        self._check_state()

    def _check_state(self):
        s, m = self.state, self.model
        assert int(s.mini_step) == m.mini_step
        assert int(s.gradient_step) == m.gradient_step
        assert int(s.num_invalid_counts) == m.num_invalid_counts
        assert int(s.num_nonfinite_windows) == m.num_nonfinite_windows
        assert bool(s.updated) == m.updated == bool(self.tx.has_updated(s))
        assert s.acc_count.dtype == jnp.float32
        assert np.float32(s.acc_count) == m.acc_count
        assert np.float32(s.value_count) == m.value_count
        if m.acc_count > 0:
            for key, mean in m.mean().items():
                acc = np.asarray(s.acc_grads[key], np.float64)
                finite = np.isfinite(mean)
                _close(acc[finite], mean[finite])
                assert not np.any(np.isfinite(acc[~finite]))
        if m.value_count > 0:
            _close(s.acc_value, m.value_sum / m.value_weight)
        if self.needs_value:
            _close(s.inner_opt_state["value"], m.inner_value)
        if m.skip:
            should_skip, num_not_finite = m.skip_state
            assert bool(s.skip_state["should_skip"]) == should_skip
            assert int(s.skip_state["num_not_finite"]) == num_not_finite
        else:
            assert s.skip_state == ()


_VALUES = st.one_of(st.none(), _FINITE)
# `close_window=`: mostly absent (windows of k), now and then the data's end.
_CLOSES = st.sampled_from([False, False, False, False, False, True])


class JitMachine(MaskedMultiStepsMachine):
    JIT = True

    # Only the cycling schedule (a fixed k is its special case): every
    # configuration is a compile per count dtype.
    @initialize(skip=st.booleans(), fused=st.booleans())
    def setup(self, skip, fused):
        self.configure(skip, "cycle", fused)

    @rule(grads=_grads(), count=_count_strategy(jit=True), value=_VALUES, close=_CLOSES)
    def microbatch(self, grads, count, value, close):
        self.check_microbatch(grads, count, value, close)


class EagerMachine(MaskedMultiStepsMachine):
    JIT = False

    @initialize(
        skip=st.booleans(),
        schedule=st.sampled_from(sorted(SCHEDULES)),
        fused=st.booleans(),
    )
    def setup(self, skip, schedule, fused):
        self.configure(skip, schedule, fused)

    @rule(
        grads=_grads(), count=_count_strategy(jit=False), value=_VALUES, close=_CLOSES
    )
    def microbatch(self, grads, count, value, close):
        self.check_microbatch(grads, count, value, close)


TestUnderJit = JitMachine.TestCase
TestUnderJit.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)
TestEager = EagerMachine.TestCase
TestEager.settings = settings(max_examples=8, stateful_step_count=15, deadline=None)
