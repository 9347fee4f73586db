"""A reference model of the window rules, the window statistics, checkpoints
and settings switches of MaskedMultiSteps.

Hypothesis drives random sequences of three kinds of steps through a jitted
``update`` (inner optimizer ``sgd(1.0)``, two tiny leaves):

* a microbatch: gradients ``base + scale · noise`` (occasionally NaN or inf in
  one entry), a float32 count (0, fractional, occasionally NaN or negative:
  skipped under jit), with or without ``value=``, now and then
  ``close_window=True``;
* a checkpoint round trip of the state (``flax.serialization`` state dict or
  msgpack bytes, restored against ``tx.init(params)``);
* a settings switch, ``mm.from_other_settings(state, new_tx.init(params))``, to
  another of a fixed list of window rules: a fixed ``k``, a constant token
  budget (with or without ``every_k_schedule`` as a cap), a budget of the
  tokens seen, ``mm.token_budget(..., by="gradient_step",
  max_microbatches=...)`` whose schedule returns NaN, negative and inf values,
  the norm test with minimum and maximum budgets, with or without the window
  statistics and a skip function.

After every step the library is compared with a plain-Python float64 model of
the documented semantics (README "Windows by tokens", "Window statistics and
the critical batch size", "When the data ends mid-window", "Changing the
window rule or the statistics mid-run", the count contract; the docstrings of
``masked_multistep._windows``): the updates (minus the window's token mean),
``state.updated`` and ``mm.has_updated``, the counters, and every field of
``mm.window_stats``. The float32 rounding of ``S = Σ nᵢ‖gᵢ‖² − N‖ḡ‖²`` is
bounded generously; where the norm test's verdict or the sign of ``|G|²̂``
lies within that bound, the model follows the library (those cases are
counted, not checked).
"""

from __future__ import annotations

import math

import _window_model as wm
import flax.serialization
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
KEYS = ("b", "w")
F32, F32_MAX = wm.F32, wm.F32_MAX

# --- window rules: the library's arguments and the model's view of them -----

_SEEN_BUDGET = lambda seen: jnp.where(  # noqa: E731
    seen < 12.0, 4.0, jnp.where(seen < 40.0, 9.5, 20.0)
)
_STEP_BUDGETS = jnp.array([5.0, jnp.nan, 3.5, jnp.inf, -2.0, 8.0], jnp.float32)
_STEP_BUDGET = lambda step: _STEP_BUDGETS[step % 6]  # noqa: E731
_K_CYCLE = jnp.array([4, 7], jnp.int32)
_K_SCHEDULE = lambda step: _K_CYCLE[step % 2]  # noqa: E731


def _const(x):
    return lambda _: x


# name: (MaskedMultiSteps kwargs, model spec). Model spec keys: k (fn of the
# gradient step), budget (("const", b) | ("seen", fn) | ("step", fn)), cap
# (max_microbatches, fn of step), norm (θ, min_tokens, min_mb, max_tokens,
# max_mb fn or None), stats, decay, skip.
CONFIGS = {
    "k3": (dict(every_k_schedule=3, window_stats=True), dict(k=_const(3), stats=True)),
    "k2_nostats": (dict(every_k_schedule=2), dict(k=_const(2))),
    "tok6_cap4": (
        dict(
            tokens_per_window=6, every_k_schedule=4, window_stats=True, stats_decay=0.5
        ),
        dict(budget=("const", 6), k=_const(4), stats=True, decay=0.5),
    ),
    "tok_frac": (
        dict(tokens_per_window=0.3, every_k_schedule=3, window_stats=True),
        dict(budget=("const", 0.3), k=_const(3), stats=True),
    ),
    "seen": (
        dict(tokens_per_window=_SEEN_BUDGET, every_k_schedule=5),
        dict(budget=("seen", _SEEN_BUDGET), k=_const(5)),
    ),
    "step_budget": (
        dict(
            tokens_per_window=mm.token_budget(
                _STEP_BUDGET, by="gradient_step", max_microbatches=4
            ),
            window_stats=True,
        ),
        dict(budget=("step", _STEP_BUDGET), cap=_const(4), stats=True),
    ),
    "norm1": (
        dict(
            norm_test=mm.norm_test(0.5, min_microbatches=2, max_microbatches=6),
            stats_decay=0.0,
        ),
        dict(norm=(0.5, 0, 2, None, _const(6)), stats=True, decay=0.0),
    ),
    "norm2": (
        dict(
            norm_test=mm.norm_test(
                1.0, min_microbatches=3, min_tokens=4, max_tokens=30
            ),
            every_k_schedule=_K_SCHEDULE,
            stats_decay=0.5,
        ),
        dict(
            norm=(1.0, 4, 3, 30, None),
            k=lambda step: int(_K_CYCLE[step % 2]),
            stats=True,
            decay=0.5,
        ),
    ),
    "norm3": (
        dict(norm_test=0.3, tokens_per_window=15.0, window_stats=True),
        dict(norm=(0.3, 0, 1, None, None), budget=("const", 15.0), stats=True),
    ),
    "tok6_int32": (
        dict(
            tokens_per_window=6,
            every_k_schedule=4,
            window_stats=True,
            count_dtype=jnp.int32,
        ),
        dict(budget=("const", 6), k=_const(4), stats=True, int32=True),
    ),
    "skip_tok5": (
        dict(
            tokens_per_window=5,
            should_skip_update_fn=optax.skip_not_finite,
            window_stats=True,
        ),
        dict(budget=("const", 5), stats=True, skip=True),
    ),
}


def _reached(tokens: F32, budget: float) -> bool:
    return bool(tokens > 0) and float(tokens) >= budget


# --- the model --------------------------------------------------------------


class Model:
    """The documented semantics in float64 (token totals in float32, as kept)."""

    def __init__(self, spec):
        self.spec = spec
        self.params = {"w": np.zeros(3), "b": np.zeros(())}
        self.gradient_step = self.mini_step = 0
        self.num_invalid = self.num_nonfinite = 0
        self.updated = False
        self.seen = 0.0  # tokens of all completed windows
        self.ambiguous = 0
        self.param_atol = 1e-4
        self._reset_window()
        self._fresh_stats()

    # The open window.
    def _count_type(self):
        return np.int32 if self.spec.get("int32") else F32

    def _reset_window(self):
        self.acc_count = self._count_type()(0)
        self.weight = 0.0
        self.weighted = {"w": np.zeros(3), "b": np.zeros(())}
        self.value_count = self._count_type()(0)
        self.value_weight = self.value_sum = 0.0
        self.value_abs = 0.0
        self.K = 0  # microbatches with tokens
        self.Q = 0.0  # Σ nᵢ ‖gᵢ‖²
        self.gmax2 = 0.0  # the largest ‖gᵢ‖² (finite), for error bounds

    def _fresh_stats(self):
        self.windows = 0
        self.last = dict(
            tokens=self._count_type()(0),
            K=0,
            loss=None,
            g2=math.nan,
            S=0.0,
            err_g2=0.0,
            err_S=0.0,
            loss_abs=0.0,
        )
        self.ema = dict(var=0.0, true=0.0, weight=0.0, err_var=0.0, err_true=0.0)

    def tracks_seen(self, spec=None):
        spec = spec or self.spec
        return spec.get("stats", False) or spec.get("budget", (None,))[0] == "seen"

    def mean(self):
        with np.errstate(all="ignore"):
            return {k: v / self.weight for k, v in self.weighted.items()}

    def so_far(self):
        """(K, ‖ḡ‖², S, err_g2, err_S) of the open window."""
        N = self.acc_count
        g2 = wm.sq(self.mean()) if N > 0 else math.nan
        with np.errstate(all="ignore"):
            S = self.Q - float(N) * g2 if N > 0 else 0.0
        if N > 0 and math.isfinite(S):
            S = max(S, 0.0)
        err_g2, err_S = wm.rounding_errors(
            self.K, N, g2 if N > 0 else 0.0, self.Q, self.gmax2
        )
        return self.K, g2, S, err_g2, err_S

    # The rules.
    def _closes(self, lib_closed):
        spec, step = self.spec, self.gradient_step
        done = False
        if "k" in spec:
            done |= self.mini_step >= spec["k"](step)
        if "cap" in spec:
            done |= self.mini_step >= spec["cap"](step)
        if "budget" in spec:
            kind, b = spec["budget"]
            if kind == "const" and spec.get("int32"):
                budget = float(math.ceil(b))
            elif kind == "const":
                budget = wm.round_up_f32(float(b))
            elif kind == "seen":
                budget = wm.sanitized_budget(b(jnp.float32(self.seen)))
            else:
                budget = wm.sanitized_budget(b(jnp.int32(step)))
            done |= _reached(self.acc_count, budget)
        if "norm" in spec and not done:
            theta, min_tokens, min_mb, max_tokens, max_mb = spec["norm"]
            if max_tokens is not None and _reached(
                self.acc_count, wm.round_up_f32(max_tokens)
            ):
                done = True
            elif max_mb is not None and self.mini_step >= max_mb(step):
                done = True
            else:
                K, g2, S, err_g2, err_S = self.so_far()
                N = float(self.acc_count)
                started = K >= min_mb and (
                    min_tokens <= 0
                    or _reached(self.acc_count, wm.round_up_f32(min_tokens))
                )
                if (
                    K >= 2
                    and N > 0
                    and started
                    and math.isfinite(S)
                    and math.isfinite(g2)
                ):
                    var = S / (K - 1)
                    margin = theta**2 * N * g2 - var
                    err = err_S / (K - 1) + theta**2 * N * err_g2 + 1e-6 * abs(var)
                    if abs(margin) <= err:
                        self.ambiguous += 1
                        done = lib_closed  # within rounding: follow the library
                    else:
                        done = margin > 0
        return done

    def step(self, grads, count, value, close, lib_closed):
        """Folds in one microbatch; returns the update (None: zeros)."""
        self.updated = False
        c32 = self._count_type()(count) if math.isfinite(count) else F32(count)
        valid = math.isfinite(count) and count >= 0
        if not valid:  # traced under jit: skipped, counted
            self.num_invalid += 1
            return self._close(forced_only=True) if close else None
        bad = any(not np.all(np.isfinite(g)) for g in grads.values())
        counted = c32 == 0 or not (self.spec.get("skip") and bad)
        if not counted:
            return self._close(forced_only=True) if close else None
        if c32 > 0:
            c = float(c32)
            self.acc_count = self._count_type()(self.acc_count + c32)
            self.weight += c
            with np.errstate(all="ignore"):
                for k, g in grads.items():
                    self.weighted[k] = self.weighted[k] + c * np.asarray(g, np.float64)
                sq = wm.sq(grads)
                self.Q = wm.f32_range(self.Q + wm.f32_range(c * sq))
            # The running mean's rounding is of the gradients' size (a
            # float32 running mean of 1e20 over 1 token and 0 over 1e7 is off
            # by ~1e12 absolute, as a float32 update g − m is).
            finite = [np.asarray(g, np.float64)[np.isfinite(g)] for g in grads.values()]
            big = max((float(np.max(np.abs(f))) for f in finite if f.size), default=0.0)
            self.gmax2 = max(self.gmax2, 4 * big**2)
            self.K += 1
            if value is not None:
                self.value_count = self._count_type()(self.value_count + c32)
                self.value_weight += c
                self.value_sum += c * float(value)
                self.value_abs = max(self.value_abs, abs(float(value)))
        self.mini_step += 1
        rule = self._closes(lib_closed)
        if rule or close:
            return self._close(forced_only=not rule)
        return None

    def _close(self, forced_only):
        # The closing window's gradient scale: its update's rounding is of it.
        self.update_atol = 1e-5 * (1 + math.sqrt(self.gmax2))
        N = self.acc_count
        has_tokens = bool(N > 0)
        update = None
        if has_tokens:
            mean = self.mean()
            if all(np.all(np.isfinite(m)) for m in mean.values()):
                update = {k: -m for k, m in mean.items()}
                self.params = {k: self.params[k] + update[k] for k in update}
                self.param_atol += self.update_atol
                self.gradient_step += 1
                self.updated = True
            else:
                self.num_nonfinite += 1
        # A window that close_window alone closes without tokens completes none.
        if has_tokens or not forced_only:
            self.seen += float(N)
            if self.spec.get("stats"):
                self._record()
        self.mini_step = 0
        self._reset_window()
        return update

    def _record(self):
        K, g2, S, err_g2, err_S = self.so_far()
        N = self.acc_count
        loss = self.value_sum / self.value_weight if self.value_count > 0 else None
        wm.record_window(
            self,
            dict(
                tokens=N,
                K=K,
                loss=loss,
                g2=g2,
                S=S,
                err_g2=err_g2,
                err_S=err_S,
                loss_abs=self.value_abs,
                loss_tokens=self.value_count,
            ),
        )

    # Settings switch (README: "Changing the window rule or the statistics").
    def switch(self, new_spec, tokens_seen=None):
        """Returns False where the switch must be refused (a fractional token
        total into an integer count dtype)."""
        old_stats, new_stats = (
            self.spec.get("stats", False),
            new_spec.get("stats", False),
        )
        if new_spec.get("int32") and not self.spec.get("int32"):
            totals = [self.acc_count, self.value_count]
            if old_stats and new_stats:
                totals.append(self.last["tokens"])
                totals.append(self.last.get("loss_tokens", F32(0)))
            if any(float(t) != math.floor(float(t)) for t in totals):
                return False
        if not self.tracks_seen():
            self.seen = 0.0
        if tokens_seen is not None:
            self.seen = float(tokens_seen)
        if new_stats and not old_stats:
            self._fresh_stats()
            # The pending mean counts as one microbatch of its tokens.
            if self.acc_count > 0:
                self.Q = float(self.acc_count) * wm.sq(self.mean())
                self.K = 1
            else:
                self.Q, self.K = 0.0, 0
        self.spec = new_spec
        t = self._count_type()
        self.acc_count, self.value_count = t(self.acc_count), t(self.value_count)
        self.last["tokens"] = t(self.last["tokens"])
        self.last["loss_tokens"] = t(self.last.get("loss_tokens", 0))
        return True


# --- comparisons -------------------------------------------------------------


def check_stats(model, stats):
    last = model.last
    assert wm.f(stats.tokens) == float(last["tokens"]), (stats.tokens, last["tokens"])
    assert int(stats.microbatches) == last["K"], (stats.microbatches, last["K"])
    assert int(stats.windows) == model.windows, (stats.windows, model.windows)
    seen = float(stats.tokens_seen)
    assert abs(seen - model.seen) <= 1e-6 * model.seen, (seen, model.seen)
    wm.check_window_figures(model, stats)


# --- the machine -------------------------------------------------------------

_VALUE_MODE = {
    "k2_nostats": "always",
    "tok6_cap4": "never",
    "seen": "always",
    "step_budget": "never",
    "norm2": "always",
    "norm3": "never",
    "tok6_int32": "always",
    "skip_tok5": "never",
}
_STEPS = {}


def _step_fn(name):
    if name not in _STEPS:
        tx = mm.MaskedMultiSteps(optax.sgd(1.0), **CONFIGS[name][0])
        _STEPS[name] = (tx, jax.jit(tx.update))
    return _STEPS[name]


# Counts (float32, as jit keeps one program): mostly ordinary, zeros often, a
# fractional 0.1 whose float32 sums round, and now and then an invalid one.
_COUNTS = st.sampled_from(
    [0.0] * 4
    + [1.0, 2.0, 3.0, 5.0, 7.0, 0.25, 2.5, 0.1, 16.0, 1.0, 2.0, 4.0]
    + [-1.0, math.nan, 1e7, 3e7 + 2]
)
_UNIT = st.floats(-1, 1, width=32, allow_subnormal=False)


@st.composite
def _noise(draw):
    noise = np.array(draw(st.lists(_UNIT, min_size=4, max_size=4)), np.float32)
    scale = draw(st.sampled_from([0.0, 0.01, 1.0, 10.0]))
    # Non-finite entries, and a finite one whose square passes float32's range.
    special = draw(st.sampled_from([None] * 40 + [np.nan, np.inf, -np.inf, 1e20]))
    where = draw(st.integers(0, 3))
    return noise, scale, special, where


class WindowRulesMachine(RuleBasedStateMachine):
    @initialize(
        name=st.sampled_from(sorted(CONFIGS)),
        base=st.lists(
            st.floats(-3, 3, width=32, allow_subnormal=False), min_size=4, max_size=4
        ),
    )
    def setup(self, name, base):
        self.name = name
        self.tx, self.step_fn = _step_fn(name)
        self.state = self.tx.init(PARAMS)
        self.params = PARAMS
        self.base = np.array(base, np.float32)
        self.model = Model(CONFIGS[name][1])

    _MICROBATCH = dict(
        noise=_noise(),
        count=_COUNTS,
        value=st.one_of(st.none(), st.floats(-5, 5, width=32)),
        close=st.sampled_from([False] * 7 + [True]),
    )

    @rule(**_MICROBATCH)
    def microbatch(self, noise, count, value, close):
        # `value=` present or absent is a compile each: mixed in a few
        # configurations, always or never passed in the others.
        mode = _VALUE_MODE.get(self.name, "mixed")
        if mode == "never":
            value = None
        elif mode == "always" and value is None:
            value = 1.5
        noise, scale, special, where = noise
        flat = (self.base + F32(scale) * noise).astype(np.float32)
        if special is not None:
            flat[where] = special
        grads = {"b": flat[0].copy(), "w": flat[1:].copy()}
        kwargs = {} if value is None else {"value": jnp.float32(value)}
        updates, self.state = self.step_fn(
            jax.tree.map(jnp.asarray, grads),
            self.state,
            self.params,
            count=self._count(count),
            close_window=jnp.asarray(close),
            **kwargs,
        )
        self.params = optax.apply_updates(self.params, updates)
        lib_closed = int(self.state.mini_step) == 0
        if self.model.spec.get("int32"):
            count = -1.0 if math.isnan(count) else float(math.floor(count))
        expected = self.model.step(grads, count, value, close, lib_closed)
        for k in KEYS:
            got = np.asarray(updates[k], np.float64)
            if expected is None:
                np.testing.assert_array_equal(got, 0.0)
            else:
                np.testing.assert_allclose(
                    got, expected[k], rtol=1e-5, atol=self.model.update_atol
                )
        self.check()

    # Microbatches three times as often as checkpoints or switches.
    @rule(**_MICROBATCH)
    def microbatch_b(self, noise, count, value, close):
        self.microbatch(noise, count, value, close)

    @rule(**_MICROBATCH)
    def microbatch_c(self, noise, count, value, close):
        self.microbatch(noise, count, value, close)

    def _count(self, count):
        if self.model.spec.get("int32"):  # whole counts (NaN: an invalid -1)
            return jnp.int32(-1 if math.isnan(count) else math.floor(count))
        return jnp.float32(count)

    @rule(msgpack=st.booleans())
    def checkpoint(self, msgpack):
        template = self.tx.init(PARAMS)
        if msgpack:
            restored = flax.serialization.from_bytes(
                template, flax.serialization.to_bytes(self.state)
            )
        else:
            restored = flax.serialization.from_state_dict(
                template, flax.serialization.to_state_dict(self.state)
            )
        for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(self.state)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert jax.tree.structure(restored) == jax.tree.structure(self.state)
        self.state = restored
        self.check()

    @rule(
        name=st.sampled_from(sorted(CONFIGS)),
        tokens_seen=st.sampled_from([None] * 5 + [0, 7, 100, 2**24 + 1]),
    )
    def switch(self, name, tokens_seen):
        tx, step_fn = _step_fn(name)
        kwargs = {} if tokens_seen is None else {"tokens_seen": tokens_seen}
        if not self.model.switch(CONFIGS[name][1], **kwargs):
            with pytest.raises(ValueError):
                mm.from_other_settings(self.state, tx.init(PARAMS), **kwargs)
            return
        self.state = mm.from_other_settings(self.state, tx.init(PARAMS), **kwargs)
        self.tx, self.step_fn, self.name = tx, step_fn, name
        self.check()

    def check(self):
        s, m = self.state, self.model
        assert int(s.mini_step) == m.mini_step, (int(s.mini_step), m.mini_step)
        assert int(s.gradient_step) == m.gradient_step
        assert int(s.num_invalid_counts) == m.num_invalid
        assert int(s.num_nonfinite_windows) == m.num_nonfinite
        assert bool(s.updated) == m.updated == bool(mm.has_updated(s))
        assert s.acc_count.dtype == m._count_type()
        assert float(s.acc_count) == float(m.acc_count), (s.acc_count, m.acc_count)
        assert float(s.value_count) == float(m.value_count)
        for k in KEYS:
            np.testing.assert_allclose(
                np.asarray(self.params[k], np.float64),
                m.params[k],
                rtol=1e-5,
                atol=m.param_atol,
            )
        if m.spec.get("stats"):
            check_stats(m, mm.window_stats(s))

    def teardown(self):
        # The model follows the library only where the norm test's verdict
        # lies within float32's rounding: rare, or the test checks little.
        model = getattr(self, "model", None)
        assert model is None or model.ambiguous <= 1, model.ambiguous


TestWindowRules = WindowRulesMachine.TestCase
TestWindowRules.settings = settings(
    max_examples=15, stateful_step_count=30, deadline=None, derandomize=True
)
