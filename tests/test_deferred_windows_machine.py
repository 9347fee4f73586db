"""The deferred reduction's window rules, statistics, checkpoints and device
moves against a float64 model, on 8 CPU devices.

Hypothesis drives random sequences of steps through jitted ``tx.update`` (or
``tx.apply_gradients``) of ``MaskedMultiSteps(sgd(1.0), ...,
reduction=mm.deferred(mesh, "data"), window_stats=True)``:

* a microbatch: every device's own gradient and float32 count, stacked along
  the device axis as ``mm.per_device_value_and_grad`` returns them (counts 0,
  fractional, now and then negative or NaN; gradients zero or NaN where a
  device holds no tokens, rarely NaN or inf where it does), ``value=`` absent,
  a scalar or per device, and now and then ``close_window=True``;
* a checkpoint round trip: ``flax.serialization`` msgpack bytes restored
  against ``tx.init(params)`` and put onto the template's shardings (README
  "Checkpointing");
* a move of the window in progress onto another number of devices (8, 4, 3)
  or onto one device without ``reduction=``, either way, with
  ``mm.from_device_count`` (in memory, or through msgpack bytes restored
  against ``mm.device_count_target``).

The window rules are those the deferred mode supports (README "Data parallel at
scale", "Windows by tokens"): a fixed ``k`` or a schedule of the step (the
devices agree at the window's end only), a constant token budget with or
without ``every_k_schedule`` as a cap, a budget of the tokens seen, and
``mm.token_budget(..., by="gradient_step", max_microbatches=...)`` whose
schedule returns NaN, negative and inf values, one with
``optax.skip_not_finite`` (the devices agree on every microbatch's count).

After every step the library is compared with a plain-Python float64 model of
the documented semantics: every device's share of a microbatch is a small
batch of its own for the statistics; an invalid count drops that device's
share (window of ``k``, tallied when the window closes) or skips the whole
microbatch (token budgets, skip function, tallied at once); the updates (minus
the window's token mean), ``state.updated``, the counters, the window's
per-device token totals (regrouped as ``⌊d·D′/D⌋`` on a move), and every field
of ``mm.window_stats``.
"""

from __future__ import annotations

import atexit
import collections
import math
import os

import _window_model as wm
import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import masked_multistep as mm

NDEV = 8
# README "Checkpointing": on AxisType.Auto axes "a step takes host arrays as
# they are, but replicated" (a compile more per program: exploration only).
HOST_RESTORES = bool(os.environ.get("DEFERRED_FUZZ_HOST_RESTORES"))
LOCAL = 0  # one device, no reduction=
# DEFERRED_FUZZ_FULL=1 (exploration): every value mode in every configuration
# and 4 devices too; by default one value mode per configuration but "k3"'s
# (each mode is a compile per layout) and 8, 3 or one device.
FULL = bool(os.environ.get("DEFERRED_FUZZ_FULL"))
LAYOUTS = (8, 4, 3, LOCAL) if FULL else (8, 3, LOCAL)
KEYS = ("b", "w")
F32, F32_MAX = wm.F32, wm.F32_MAX
AUTO = jax.sharding.AxisType.Auto

# --- window rules -------------------------------------------------------------

_SEEN_BUDGET = lambda seen: jnp.where(  # noqa: E731
    seen < 30.0, 10.0, jnp.where(seen < 100.0, 20.5, 40.0)
)
_STEP_BUDGETS = jnp.array([15.0, jnp.nan, 10.5, jnp.inf, -2.0, 24.0], jnp.float32)
_STEP_BUDGET = lambda step: _STEP_BUDGETS[step % 6]  # noqa: E731
_K_CYCLE = jnp.array([2, 4], jnp.int32)
_K_SCHEDULE = lambda step: _K_CYCLE[step % 2]  # noqa: E731


def _const(x):
    return lambda _: x


# name: (MaskedMultiSteps kwargs, model spec). Model spec: k (fn of the
# gradient step), budget (("const", b) | ("seen", fn) | ("step", fn)), cap
# (max_microbatches), stats, decay, skip, apply (apply_gradients, params
# followed).
CONFIGS = {
    "k3": (
        dict(every_k_schedule=3, window_stats=True, stats_decay=0.5),
        dict(k=_const(3), stats=True, decay=0.5),
    ),
    "ksched_apply": (
        dict(every_k_schedule=_K_SCHEDULE, window_stats=True),
        dict(k=lambda s: int(_K_CYCLE[s % 2]), stats=True, apply=True),
    ),
    "k2_nostats": (dict(every_k_schedule=2), dict(k=_const(2))),
    "tok20_cap4": (
        dict(tokens_per_window=20.0, every_k_schedule=4, window_stats=True),
        dict(budget=("const", 20.0), k=_const(4), stats=True),
    ),
    "tok_frac_apply": (
        dict(tokens_per_window=12.3, window_stats=True, stats_decay=0.0),
        dict(budget=("const", 12.3), stats=True, decay=0.0, apply=True),
    ),
    "seen": (
        dict(tokens_per_window=_SEEN_BUDGET, every_k_schedule=5, window_stats=True),
        dict(budget=("seen", _SEEN_BUDGET), k=_const(5), stats=True),
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
    # Window rules that keep no state, which from_device_count lets stand in
    # for each other (the window carried as from_other_settings carries it).
    "k4_plain": (
        dict(every_k_schedule=4, window_stats=True),
        dict(k=_const(4), stats=True),
    ),
    "tok20_plain": (
        dict(tokens_per_window=20.0, window_stats=True),
        dict(budget=("const", 20.0), stats=True),
    ),
    "skip_k3": (
        dict(
            every_k_schedule=3,
            should_skip_update_fn=optax.skip_not_finite,
            window_stats=True,
        ),
        dict(k=_const(3), stats=True, skip=True),
    ),
}
_ALL_VALUES = ("none", "scalar", "per_device")
VALUE_MODES = {
    "k3": _ALL_VALUES,
    "ksched_apply": ("none",),
    "k2_nostats": ("per_device",),
    "tok20_cap4": ("per_device",),
    "tok_frac_apply": ("scalar",),
    "seen": ("none",),
    "step_budget": ("per_device",),
    "k4_plain": ("per_device",),
    "tok20_plain": ("per_device",),
    "skip_k3": ("scalar",),
}
_ACTIVE = os.environ.get("DEFERRED_FUZZ_CONFIGS")
CONFIG_NAMES = sorted(_ACTIVE.split(",") if _ACTIVE else CONFIGS)


_PLAIN = {"k4_plain": "tok20_plain", "tok20_plain": "k4_plain"}


def _layout(spec, ndev):
    if ndev == LOCAL:
        return "local"
    return "synced" if ("budget" in spec or spec.get("skip")) else "window"


# --- the model ----------------------------------------------------------------


class Model:
    """The documented semantics in float64 (token totals exact: the counts
    drawn are multiples of 1/4 and their sums stay far below 2²⁴)."""

    def __init__(self, spec, ndev):
        self.spec = spec
        self.ndev = ndev
        self.params = {"w": np.zeros(3), "b": np.zeros(())}
        self.param_atol = 1e-5
        self.gradient_step = self.mini_step = 0
        self.num_invalid = self.num_nonfinite = 0
        self.updated = False
        self.seen = 0.0
        self.windows = 0
        self.last = dict(
            tokens=0.0,
            K=0,
            loss=None,
            g2=math.nan,
            S=0.0,
            err_g2=0.0,
            err_S=0.0,
            loss_abs=0.0,
        )
        self.ema = dict(var=0.0, true=0.0, weight=0.0, err_var=0.0, err_true=0.0)
        self._reset_window()

    @property
    def layout(self):
        return _layout(self.spec, self.ndev)

    def _reset_window(self):
        n = max(self.ndev, 1)
        self.shares = []  # (n, grads, value or None)
        self.dev_counts = [0.0] * n
        self.dev_invalid = [0] * n  # the per-window layout's pending tallies
        self.gmax2 = 0.0

    # The window's figures.
    def total(self):
        """The window's token total as float32 keeps it (inf: past its range)."""
        with np.errstate(all="ignore"):
            return float(F32(sum(n for n, _, _ in self.shares)))

    def mean(self):
        N = self.total()
        with np.errstate(all="ignore"):
            return {
                k: sum(n * np.asarray(g[k], np.float64) for n, g, _ in self.shares) / N
                for k in KEYS
            }

    def so_far(self):
        N = self.total()
        K = len(self.shares)
        with np.errstate(all="ignore"):
            Q = 0.0
            for n, g, _ in self.shares:
                Q = wm.f32_range(Q + wm.f32_range(n * wm.sq(g)))
            g2 = wm.sq(self.mean()) if N > 0 else math.nan
            S = Q - N * g2 if N > 0 else 0.0
        if N > 0 and math.isfinite(S):
            S = max(S, 0.0)
        err_g2, err_S = wm.rounding_errors(
            K, N, g2 if N > 0 else 0.0, Q if math.isfinite(Q) else 0.0, self.gmax2
        )
        return K, g2, S, err_g2, err_S

    def loss(self):
        vs = [(n, v) for n, _, v in self.shares if v is not None]
        if not vs:
            return None, 0.0, 0.0
        w = sum(n for n, _ in vs)
        return sum(n * v for n, v in vs) / w, max(abs(v) for _, v in vs), w

    # The rules.
    def _rule_closes(self):
        spec, step = self.spec, self.gradient_step
        done = False
        if "k" in spec:
            done |= self.mini_step >= spec["k"](step)
        if "cap" in spec:
            done |= self.mini_step >= spec["cap"](step)
        if "budget" in spec:
            kind, b = spec["budget"]
            if kind == "const":
                budget = wm.round_up_f32(float(b))
            elif kind == "seen":
                budget = wm.sanitized_budget(b(jnp.float32(self.seen)))
            else:
                budget = wm.sanitized_budget(b(jnp.int32(step)))
            N = self.total()
            done |= N > 0 and N >= budget
        return done

    def step(self, counts, grads, values, close):
        """One microbatch: ``counts``, ``grads`` (a dict of (D, ...) arrays, or
        one device's), ``values`` (None or one per device). Returns the
        update (None: zeros)."""
        self.updated = False
        D = max(self.ndev, 1)
        per_dev = [
            {k: np.asarray(grads[k], np.float64)[d] for k in KEYS} for d in range(D)
        ]
        bad = [not (math.isfinite(c) and c >= 0) for c in counts]
        layout = self.layout
        if layout in ("local", "synced"):
            if any(bad):
                self.num_invalid += 1
                return self._close(forced_only=True) if close else None
            with np.errstate(all="ignore"):
                mb_total = F32(sum(counts))
                overflows = not np.isfinite(F32(F32(self.total()) + mb_total))
            if not np.isfinite(mb_total):
                # The microbatch's own global count past float32: a bad count
                # ("a bad count (or a total that does not fit count_dtype) ...
                # skips the microbatch on every device"), no close.
                COVERAGE["overflow/microbatch"] += 1
                self.num_invalid += 1
                return self._close(forced_only=True) if close else None
            if overflows:
                # "a count that would overflow the window's running total ...
                # skips its microbatch ... and the full window closes on it"
                COVERAGE["overflow/skipped"] += 1
                self.num_invalid += 1
                return self._close(forced_only=True)
            if self.spec.get("skip") and any(
                c > 0 and not all(np.all(np.isfinite(g[k])) for k in KEYS)
                for c, g in zip(counts, per_dev)
            ):
                return self._close(forced_only=True) if close else None
        for d in range(D):
            with np.errstate(all="ignore"):
                dev_over = not np.isfinite(
                    F32(F32(self.dev_counts[d]) + F32(counts[d]))
                )
            if bad[d] or dev_over:
                COVERAGE["overflow/device"] += dev_over and not bad[d]
                self.dev_invalid[d] += 1
                continue
            c = counts[d]
            if c > 0:
                self.dev_counts[d] = float(F32(F32(self.dev_counts[d]) + F32(c)))
                v = None if values is None else float(values[d])
                gd = per_dev[d]
                self.shares.append((c, gd, v))
                finite = [gd[k][np.isfinite(gd[k])] for k in KEYS]
                big = max(
                    (float(np.max(np.abs(f))) for f in finite if f.size), default=0.0
                )
                self.gmax2 = max(self.gmax2, 4 * big**2)
        self.mini_step += 1
        rule = self._rule_closes()
        if rule or close:
            return self._close(forced_only=not rule)
        return None

    def _close(self, forced_only):
        self.update_atol = 1e-5 * (1 + math.sqrt(self.gmax2))
        N = self.total()
        update = None
        if math.isinf(N):
            # "a window whose combined total does not fit count_dtype ... is
            # dropped whole when it closes (no update, one invalid count)";
            # it completes, "its tokens and microbatches 0".
            COVERAGE["overflow/dropped"] += 1
            self.num_invalid += sum(self.dev_invalid) + 1
            self.shares = []
            if self.spec.get("stats"):
                self._record()
            self.mini_step = 0
            self._reset_window()
            return None
        if N > 0:
            mean = self.mean()
            if all(np.all(np.isfinite(m)) for m in mean.values()):
                update = {k: -m for k, m in mean.items()}
                self.params = {k: self.params[k] + update[k] for k in KEYS}
                self.param_atol += self.update_atol
                self.gradient_step += 1
                self.updated = True
            else:
                self.num_nonfinite += 1
        if N > 0 or not forced_only:
            self.seen += N
            if self.spec.get("stats"):
                self._record()
        self.num_invalid += sum(self.dev_invalid)
        self.mini_step = 0
        self._reset_window()
        return update

    def _record(self):
        K, g2, S, err_g2, err_S = self.so_far()
        loss, loss_abs, _ = self.loss()
        wm.record_window(
            self,
            dict(
                tokens=self.total(),
                K=K,
                loss=loss,
                g2=g2,
                S=S,
                err_g2=err_g2,
                err_S=err_S,
                loss_abs=loss_abs,
            ),
        )

    def _regrouped(self, new_ndev):
        D, D2 = max(self.ndev, 1), max(new_ndev, 1)
        counts = [0.0] * D2
        for d in range(D):
            j = (d * D2) // D if self.ndev != LOCAL else 0
            with np.errstate(all="ignore"):
                counts[j] = float(F32(F32(counts[j]) + F32(self.dev_counts[d])))
        return counts

    def refuses_move(self, new_ndev, new_spec=None):
        """A window whose combined total is past float32 (the per-window
        layout drops it when it closes) moves only where every new device's
        total fits (observed; the same devices continue bit for bit)."""
        if not math.isinf(self.total()):
            return False
        COVERAGE["overflow/move"] += 1
        if _layout(new_spec or self.spec, new_ndev) != "window":
            return True
        return any(math.isinf(c) for c in self._regrouped(new_ndev))

    # A move onto another number of devices (README "Checkpointing").
    def move(self, new_ndev):
        old = self.ndev
        D, D2 = max(old, 1), max(new_ndev, 1)
        counts, invalid = [0.0] * D2, [0] * D2
        for d in range(D):
            j = (d * D2) // D if old != LOCAL else 0
            with np.errstate(all="ignore"):
                counts[j] = float(F32(F32(counts[j]) + F32(self.dev_counts[d])))
            invalid[j] += self.dev_invalid[d]
        self.ndev = new_ndev
        self.dev_counts = counts
        self.dev_invalid = invalid
        if self.layout != "window":  # tallied at once outside the per-window layout
            self.num_invalid += sum(self.dev_invalid)
            self.dev_invalid = [0] * D2


# --- comparisons --------------------------------------------------------------


def check_stats(model, stats):
    last = model.last
    assert wm.f(stats.tokens) == float(last["tokens"]), (
        "tokens",
        stats.tokens,
        last["tokens"],
    )
    assert int(stats.microbatches) == last["K"], ("K", stats.microbatches, last["K"])
    assert int(stats.windows) == model.windows, (
        "windows",
        stats.windows,
        model.windows,
    )
    seen = float(stats.tokens_seen)
    if model.seen > F32_MAX:
        assert seen > 1e38, ("tokens_seen", seen, model.seen)
    else:
        assert abs(seen - model.seen) <= 1e-7 * model.seen, (
            "tokens_seen",
            seen,
            model.seen,
        )
    wm.check_window_figures(model, stats)


# --- the library's side ---------------------------------------------------------

PARAMS = {"w": jnp.zeros(3, jnp.float32), "b": jnp.zeros((), jnp.float32)}
_MESHES, _TXS, _STEPS = {}, {}, {}

COVERAGE = collections.Counter()
if os.environ.get("DEFERRED_FUZZ_COVERAGE"):
    atexit.register(
        lambda: print("\n".join(f"{k}: {v}" for k, v in sorted(COVERAGE.items())))
    )


def _mesh(n):
    if n not in _MESHES:
        _MESHES[n] = jax.make_mesh(
            (n,), ("data",), axis_types=(AUTO,), devices=jax.devices()[:n]
        )
    return _MESHES[n]


def _tx(name, ndev):
    key = (name, ndev)
    if key not in _TXS:
        reduction = None if ndev == LOCAL else mm.deferred(_mesh(ndev), "data")
        _TXS[key] = mm.MaskedMultiSteps(
            optax.sgd(1.0), **CONFIGS[name][0], reduction=reduction
        )
    return _TXS[key]


def _params_on(ndev, params):
    if ndev == LOCAL:
        return jax.device_put(params, jax.devices()[0])
    return jax.device_put(params, NamedSharding(_mesh(ndev), P()))


def _step_fn(name, ndev, vmode):
    key = (name, ndev, vmode)
    if key not in _STEPS:
        tx = _tx(name, ndev)
        apply = CONFIGS[name][1].get("apply", False)

        def step(grads, state, params, count, close, value=None):
            kwargs = {} if vmode == "none" else {"value": value}
            if apply:
                return tx.apply_gradients(
                    grads, state, params, count=count, close_window=close, **kwargs
                )
            return tx.update(
                grads, state, params, count=count, close_window=close, **kwargs
            )

        _STEPS[key] = jax.jit(step)
    return _STEPS[key]


def _shardings(tree):
    return jax.tree.map(lambda x: x.sharding, tree)


# --- strategies -----------------------------------------------------------------

_COUNTS = st.sampled_from(
    [0.0] * 12
    + [1.0, 2.0, 3.0, 5.0, 0.25, 0.5, 2.5, 7.0, 1.0, 2.0]
    + [-1.0, math.nan, math.inf]
)
_UNIT = st.floats(-1, 1, width=32, allow_subnormal=False)


@st.composite
def _MB(draw):
    counts = draw(st.lists(_COUNTS, min_size=NDEV, max_size=NDEV))
    # Mostly valid microbatches: one invalid count in any of 8 devices skips
    # the whole microbatch where the devices agree on every one.
    if draw(st.integers(0, 3)) > 0:
        counts = [c if (math.isfinite(c) and c >= 0) else 0.0 for c in counts]
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    # Now and then counts past float32's range once added up (README: a
    # window whose total does not fit count_dtype).
    if draw(st.integers(0, 11)) == 0:
        for d in rng.choice(NDEV, size=int(rng.integers(1, 4)), replace=False):
            counts[d] = float(rng.choice([1e38, 2e38, 3e38]))
    noise = rng.uniform(-1, 1, size=(NDEV, 4)).astype(np.float32)
    values = rng.uniform(-5, 5, size=NDEV).astype(np.float32).tolist()
    scale = draw(st.sampled_from([0.0, 0.01, 1.0, 10.0]))
    empty = draw(st.sampled_from(["zeros", "nan"]))
    special = draw(st.sampled_from([None] * 30 + [np.nan, np.inf, 1e20]))
    where = int(rng.integers(0, 4 * NDEV))
    vmode = draw(st.sampled_from(["none", "scalar", "per_device"]))
    close = draw(st.sampled_from([False] * 7 + [True]))
    return dict(
        counts=counts,
        noise=noise,
        scale=scale,
        empty=empty,
        special=special,
        where=where,
        vmode=vmode,
        values=values,
        close=close,
    )


class DeferredWindowsMachine(RuleBasedStateMachine):
    @initialize(
        name=st.sampled_from(CONFIG_NAMES),
        ndev=st.sampled_from([8, 8, 4] if FULL else [8]),
        base=st.lists(
            st.floats(-3, 3, width=32, allow_subnormal=False), min_size=4, max_size=4
        ),
    )
    def setup(self, name, ndev, base):
        self.name, self.ndev = name, ndev
        self.spec = CONFIGS[name][1]
        self.params = _params_on(ndev, PARAMS)
        self.state = _tx(name, ndev).init(PARAMS)
        self.base = np.array(base, np.float32)
        self.model = Model(self.spec, ndev)
        self.trace = [f"setup({name!r}, ndev={ndev})"]

    def _microbatch(self, mb):
        D = max(self.ndev, 1)
        counts = [float(F32(c)) for c in mb["counts"][:D]]
        flat = (self.base[None] + F32(mb["scale"]) * mb["noise"][:D]).astype(np.float32)
        if mb["special"] is not None and mb["where"] < 4 * D:
            flat.reshape(-1)[mb["where"]] = mb["special"]
        for d in range(D):
            if not counts[d] > 0:  # 0/0 where a device holds no tokens
                flat[d] = 0.0 if mb["empty"] == "zeros" else np.nan
        modes = _ALL_VALUES if FULL else VALUE_MODES[self.name]
        vmode = mb["vmode"] if mb["vmode"] in modes else modes[0]
        if self.ndev == LOCAL and vmode == "per_device":
            vmode = "scalar"
        values = None
        if vmode == "scalar":
            values = [float(F32(mb["values"][0]))] * D
        elif vmode == "per_device":
            values = [float(F32(v)) for v in mb["values"][:D]]
            if mb["empty"] == "nan":  # a device without tokens: 0/0
                values = [v if c > 0 else math.nan for v, c in zip(values, counts)]
        grads = {"b": flat[:, 0], "w": flat[:, 1:]}
        close = mb["close"]
        self.trace.append(
            f"microbatch(counts={counts}, grads={flat.tolist()}, vmode={vmode!r}, "
            f"values={values}, close={close})"
        )
        if self.ndev == LOCAL:
            g = {k: jnp.asarray(v[0]) for k, v in grads.items()}
            c = jnp.float32(counts[0])
            v = jnp.float32(values[0]) if values is not None else None
        else:
            data = NamedSharding(_mesh(self.ndev), P("data"))
            g = jax.device_put(grads, data)
            c = jax.device_put(np.asarray(counts, np.float32), data)
            if vmode == "per_device":
                v = jax.device_put(np.asarray(values, np.float32), data)
            elif vmode == "scalar":
                v = jnp.float32(values[0])
            else:
                v = None
        fn = _step_fn(self.name, self.ndev, vmode)
        out, self.state = fn(g, self.state, self.params, c, jnp.asarray(close), v)
        before = (
            self.model.windows,
            self.model.num_invalid,
            sum(self.model.dev_invalid),
            len(self.model.shares),
        )
        expected = self.model.step(counts, grads, values, close)
        lay = self.model.layout
        COVERAGE[f"steps/{lay}"] += 1
        if self.model.windows > before[0]:
            COVERAGE[f"windows/{lay}"] += 1
            if self.model.last["K"] >= 2:
                COVERAGE[f"windows_K2/{lay}"] += 1
            if close:
                COVERAGE[f"forced/{lay}"] += 1
            if self.model.last["loss"] is not None:
                COVERAGE[f"loss/{lay}"] += 1
        elif close:
            COVERAGE[f"forced_empty/{lay}"] += 1
        if (
            self.model.num_invalid > before[1]
            or sum(self.model.dev_invalid) > before[2]
        ):
            COVERAGE[f"invalid/{lay}"] += 1
        if expected is not None:
            COVERAGE[f"updates/{lay}"] += 1
        if self.model.ema["weight"] > 0:
            COVERAGE[f"ema/{lay}"] += 1
        if self.spec.get("apply"):
            self.params = out
            for k in KEYS:
                np.testing.assert_allclose(
                    np.asarray(out[k], np.float64),
                    self.model.params[k],
                    rtol=1e-5,
                    atol=self.model.param_atol,
                    err_msg=f"params[{k!r}]",
                )
        else:
            for k in KEYS:
                got = np.asarray(out[k], np.float64)
                if expected is None:
                    np.testing.assert_array_equal(got, 0.0, err_msg=f"updates[{k!r}]")
                else:
                    np.testing.assert_allclose(
                        got,
                        expected[k],
                        rtol=1e-5,
                        atol=self.model.update_atol,
                        err_msg=f"updates[{k!r}]",
                    )
        self.check()

    @rule(mb=_MB())
    def microbatch(self, mb):
        self._microbatch(mb)

    @rule(mb=_MB())
    def microbatch_b(self, mb):
        self._microbatch(mb)

    @rule(mb=_MB())
    def microbatch_c(self, mb):
        self._microbatch(mb)

    @rule(mb=_MB())
    def microbatch_d(self, mb):
        self._microbatch(mb)

    @rule(mb=_MB())
    def microbatch_e(self, mb):
        self._microbatch(mb)

    @rule(put=st.booleans())
    def checkpoint(self, put):
        self.trace.append(f"checkpoint(put={put})")
        COVERAGE[
            f"checkpoint/{self.model.layout}/pending={bool(self.model.shares)}"
        ] += 1
        template = _tx(self.name, self.ndev).init(PARAMS)
        restored = flax.serialization.from_bytes(
            template, flax.serialization.to_bytes(self.state)
        )
        if put or not HOST_RESTORES:
            restored = jax.device_put(restored, _shardings(template))
        assert jax.tree.structure(restored) == jax.tree.structure(self.state)
        for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(self.state)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        self.state = restored
        self.check()

    @rule(new=st.sampled_from(LAYOUTS), through_bytes=st.booleans())
    def move(self, new, through_bytes):
        self.trace.append(f"move({new}, through_bytes={through_bytes})")
        template = _tx(self.name, new).init(PARAMS)

        def deferred_like():
            return template if new != LOCAL else _tx(self.name, 1).init(PARAMS)

        if not self._moved(template, new, None, through_bytes, deferred_like):
            return
        pending = bool(self.model.shares)
        COVERAGE[f"move/{self.model.layout}->{_layout(self.spec, new)}/{pending=}"] += 1
        self.model.move(new)
        self.check()

    @precondition(lambda self: self.name in _PLAIN)
    @rule(new=st.sampled_from(LAYOUTS), through_bytes=st.booleans())
    def move_and_switch(self, new, through_bytes):
        """from_device_count onto the other stateless window rule."""
        other = _PLAIN[self.name]
        self.trace.append(
            f"move_and_switch({other!r}, {new}, through_bytes={through_bytes})"
        )
        after = _layout(CONFIGS[other][1], new)
        pending = bool(self.model.shares)
        COVERAGE[f"switch/{self.model.layout}->{after}/{pending=}"] += 1
        template = _tx(other, new).init(PARAMS)

        def deferred_like():
            return _tx(self.name, 1).init(PARAMS)

        spec = CONFIGS[other][1]
        if not self._moved(template, new, spec, through_bytes, deferred_like):
            return
        self.name, self.spec = other, spec
        self.model.spec = self.spec
        self.model.move(new)
        self.check()

    def _moved(self, template, new, new_spec, through_bytes, deferred_like):
        """The state moved onto ``template`` (``new`` devices), restored from
        msgpack bytes first where ``through_bytes`` (against
        ``mm.device_count_target`` of ``deferred_like()``, a deferred template
        of the saved rule); False where the model says the move is refused,
        after checking that it is."""
        saved = self.state
        if through_bytes:
            data = flax.serialization.to_bytes(saved)
            if self.ndev == LOCAL:
                target = _tx(self.name, LOCAL).init(PARAMS)
            else:
                target = mm.device_count_target(deferred_like(), self.ndev)
            saved = flax.serialization.from_bytes(target, data)
        if self.model.refuses_move(new, new_spec):
            # A new device's token total (or the one device's) past float32:
            # from_device_count "Raises ValueError if ... the restored counts,
            # per device or the window's, are negative, not finite".
            COVERAGE["overflow/move_refused"] += 1
            with pytest.raises(ValueError):
                mm.from_device_count(saved, template)
            return False
        self.state = mm.from_device_count(saved, template)
        assert jax.tree.structure(self.state) == jax.tree.structure(template)
        self.ndev = new
        self.params = _params_on(new, self.params)
        return True

    def check(self):
        s, m = self.state, self.model
        assert int(s.mini_step) == m.mini_step, (
            "mini_step",
            int(s.mini_step),
            m.mini_step,
        )
        assert int(s.gradient_step) == m.gradient_step, (
            "gradient_step",
            int(s.gradient_step),
            m.gradient_step,
        )
        assert int(s.num_invalid_counts) == m.num_invalid, (
            "num_invalid_counts",
            int(s.num_invalid_counts),
            m.num_invalid,
        )
        assert int(s.num_nonfinite_windows) == m.num_nonfinite, (
            "num_nonfinite_windows",
            int(s.num_nonfinite_windows),
            m.num_nonfinite,
        )
        assert bool(s.updated) == m.updated == bool(mm.has_updated(s)), (
            "updated",
            bool(s.updated),
            m.updated,
        )
        layout = m.layout
        _, _, vtokens = m.loss()
        if layout == "window":
            # "Then the state's acc_count, acc_value and value_count stay 0"
            assert float(s.acc_value) == 0.0 and float(s.value_count) == 0.0, (
                "acc_value/value_count",
                s.acc_value,
                s.value_count,
            )
        else:
            with np.errstate(all="ignore"):
                assert float(s.value_count) == float(F32(vtokens)), (
                    "value_count",
                    float(s.value_count),
                    vtokens,
                )
        if layout == "local":
            assert float(s.acc_count) == m.total(), (
                "acc_count",
                s.acc_count,
                m.total(),
            )
        else:
            counts = np.asarray(s.reduction_state.counts, np.float64)
            assert counts.tolist() == m.dev_counts, (
                "per-device counts",
                counts.tolist(),
                m.dev_counts,
            )
            if layout == "window":
                assert float(s.acc_count) == 0.0, ("acc_count", s.acc_count)
                invalid = np.asarray(s.reduction_state.invalid).tolist()
                assert invalid == m.dev_invalid, (
                    "per-device invalid",
                    invalid,
                    m.dev_invalid,
                )
            else:
                assert float(s.acc_count) == m.total(), (
                    "acc_count",
                    s.acc_count,
                    m.total(),
                )
        if m.spec.get("stats"):
            check_stats(m, mm.window_stats(s))

    def teardown(self):
        if os.environ.get("DEFERRED_FUZZ_TRACE"):
            print("\n".join(self.trace))


TestDeferredWindows = DeferredWindowsMachine.TestCase
TestDeferredWindows.settings = settings(
    max_examples=int(os.environ.get("DEFERRED_FUZZ_EXAMPLES", 6)),
    stateful_step_count=int(os.environ.get("DEFERRED_FUZZ_STEPS", 30)),
    deadline=None,
    derandomize=not os.environ.get("DEFERRED_FUZZ_RANDOM"),
    **(
        dict(phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target])
        if os.environ.get("DEFERRED_FUZZ_NOSHRINK")
        else {}
    ),
)
