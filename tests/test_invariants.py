"""Invariances of a window: microbatch order, splitting and merging, count scale;
its statistics against float64 references; statistics that never change an update.

The window's update is ``Σ nᵢ gᵢ / Σ nᵢ`` handed to the inner optimizer, a
function of the multiset of ``(nᵢ, gᵢ)`` that is homogeneous of degree 0 in the
counts. The running mean computes it in float32, so:

* permuting the microbatches of a window (count-0 ones with NaN gradients
  anywhere) changes the update, the loss and the statistics by rounding only;
* one microbatch of ``n`` tokens with mean gradient ``g`` and two of ``n₁`` and
  ``n₂ = n − n₁`` tokens whose token-weighted mean is ``g`` give the same
  update, bit for bit where both halves have gradient ``g`` and the split
  microbatch opens the window (the first one overwrites the mean, the second
  adds ``(g − g)/r = 0``), or one half holds no tokens;
* multiplying every count by an integer ``c`` (window totals below 2²⁴, where
  the ratio ``N/n`` is formed from exact float32 integers and rounds alike)
  leaves the updates, the inner state and the window's loss bit-identical;
  by a power of two, also every window statistic: ``grad_var_trace``,
  ``noise_scale`` and ``smoothed_noise_scale`` are multiplied by ``c`` exactly
  (they are in tokens), ``grad_sq_norm`` and ``true_grad_sq_norm`` unchanged,
  and the norm test closes the same windows.

Tolerances: each running-mean step rounds by at most about two float32 units
(eps = 2⁻²³) of the largest gradient element, so a window of ``K`` microbatches
is within ``4·K·eps·max|gᵢ|``; ``S = Σ nᵢ‖gᵢ‖² − N‖ḡ‖²`` is formed by a
subtraction whose rounding is bounded by a few eps of ``N·max‖gᵢ‖²``.

For random unequal counts (some empty, their gradients NaN) ``grad_sq_norm`` is
``‖ḡ‖²`` and ``grad_var_trace·(K − 1)`` is ``S = Σ nᵢ‖gᵢ − ḡ‖²`` of a float64
two-pass sum (with exactly two microbatches with tokens, the closed form
``n₁n₂/(n₁ + n₂)·‖g₁ − g₂‖²``) within those bounds, and the derived estimates
follow by their definitions. ``window_stats=True`` leaves every update and
every other state field bit-identical, under token budgets, a skip function and
the deferred reduction on 8 devices too.
"""

import functools
import operator

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import assert_bit_identical
from _recording import records_value
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import masked_multistep as mm

EPS = float(np.finfo(np.float32).eps)
K = 6  # microbatches per window
W = 3  # width of the parameter vector


def _each_row(run, in_axes=0):
    """``run`` on each row of the arguments whose ``in_axes`` entry is 0 (the
    others passed whole), one row after another through one compiled
    program, the results stacked: what a ``vmap`` returns, except that every
    row runs the very same instructions. (Under ``vmap`` XLA may compute
    rows in different vector lanes, some in a remainder loop with other
    rounding: jax 0.12.1's XLA:CPU rounds rows of the norm test's
    statistics apart by one unit, which comparisons of rows would read as
    the arithmetic's.)"""
    compiled = jax.jit(run)

    def rows(*args):
        axes = in_axes if isinstance(in_axes, tuple) else (in_axes,) * len(args)
        size = next(len(a) for a, axis in zip(args, axes) if axis == 0)
        outs = [
            compiled(*(a if axis is None else a[i] for a, axis in zip(args, axes)))
            for i in range(size)
        ]
        return jax.tree.map(lambda *xs: np.stack(xs), *outs)

    return rows


def _window_runner(tx, params, in_axes=0):
    """Each row a run of ``tx.update`` from ``tx.init`` over its microbatches
    ``(grads, counts, values)`` (:func:`_each_row`); every microbatch's
    updates and the final state."""

    def run(grads, counts, values):
        def body(state, x):
            g, n, v = x
            updates, state = tx.update(g, state, params, count=n, value=v)
            return state, updates

        state, updates = jax.lax.scan(body, tx.init(params), (grads, counts, values))
        return updates, state

    return _each_row(run, in_axes)


@functools.cache
def _one_window():
    params = jnp.zeros(W)
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), K, window_stats=True)
    return _window_runner(tx, params)


def _nan_where_empty(grads, counts):
    grads = grads.copy()
    grads[counts == 0] = np.nan  # an all-masked microbatch's 0/0
    return grads


_counts = st.lists(st.integers(0, 60) | st.just(0), min_size=K, max_size=K)


@settings(max_examples=40, deadline=None)
@given(
    counts=_counts,
    perm=st.permutations(range(K)),
    scale=st.floats(-3, 3),
    seed=st.integers(0, 2**16),
)
def test_the_window_does_not_depend_on_the_order_of_its_microbatches(
    counts, perm, scale, seed
):
    rng = np.random.default_rng(seed)
    counts = np.asarray(counts, np.float32)
    grads = 10.0**scale * (rng.normal(size=(K, W)) + rng.normal())
    grads = _nan_where_empty(grads.astype(np.float32), counts)
    values = rng.normal(size=K).astype(np.float32)
    perm = np.asarray(perm)
    updates, state = _one_window()(
        np.stack([grads, grads[perm]]),
        np.stack([counts, counts[perm]]),
        np.stack([values, values[perm]]),
    )
    a = jax.tree.map(lambda x: x[0], mm.window_stats(state))
    b = jax.tree.map(lambda x: x[1], mm.window_stats(state))
    assert float(a.tokens) == float(b.tokens) == counts.sum()
    assert int(a.microbatches) == int(b.microbatches) == np.count_nonzero(counts)
    assert bool(state.updated[0]) == bool(state.updated[1]) == (counts.sum() > 0)
    if counts.sum() == 0:
        assert not np.any(np.asarray(updates))
        return
    live = counts > 0
    g_max = float(np.abs(grads[live]).max())
    sq_max = float((grads[live].astype(np.float64) ** 2).sum(1).max())
    np.testing.assert_allclose(updates[0], updates[1], rtol=0, atol=4 * K * EPS * g_max)
    v_max = float(np.abs(values[live]).max())
    np.testing.assert_allclose(a.loss, b.loss, rtol=0, atol=4 * K * EPS * v_max)
    np.testing.assert_allclose(
        a.grad_sq_norm, b.grad_sq_norm, rtol=0, atol=8 * K * EPS * sq_max
    )
    if live.sum() >= 2:
        s_a, s_b = (float(x.grad_var_trace) * (live.sum() - 1) for x in (a, b))
        assert abs(s_a - s_b) <= 16 * EPS * counts.sum() * sq_max, (s_a, s_b)
    else:
        assert np.isnan(a.grad_var_trace) and np.isnan(b.grad_var_trace)


@functools.cache
def _split_runner():
    # One window of 5: four microbatches and an empty one, or the same four
    # with one of them split in two.
    params = jnp.zeros(W)
    return _window_runner(mm.MaskedMultiSteps(optax.sgd(1.0), 5), params)


@settings(max_examples=40, deadline=None)
@given(
    counts=st.lists(st.integers(0, 60), min_size=4, max_size=4),
    where=st.integers(0, 3),
    fraction=st.floats(0, 1),
    same=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_a_microbatch_split_in_two_or_merged_gives_the_same_update(
    counts, where, fraction, same, seed
):
    rng = np.random.default_rng(seed)
    grads = rng.normal(size=(4, W)).astype(np.float32)
    n = counts[where]
    n1 = int(round(fraction * n))
    n2 = n - n1
    g1 = grads[where].copy()
    g2 = g1 if same else rng.normal(size=W).astype(np.float32)
    if not same and n > 0:
        # The merged microbatch's mean gradient: the halves' token-weighted mean.
        merged = (n1 * g1.astype(np.float64) + n2 * g2.astype(np.float64)) / n
        grads[where] = merged.astype(np.float32)
    empty = np.full((1, W), np.nan, np.float32)
    whole_g = np.concatenate([grads, empty])
    whole_n = np.asarray(counts + [0], np.float32)
    split_g = np.concatenate([grads[:where], [g1, g2], grads[where + 1 :]])
    split_n = np.asarray(counts[:where] + [n1, n2] + counts[where + 1 :], np.float32)
    whole_g, split_g = (
        _nan_where_empty(whole_g, whole_n),
        _nan_where_empty(split_g, split_n),
    )
    updates, state = _split_runner()(
        np.stack([whole_g, split_g]),
        np.stack([whole_n, split_n]),
        np.zeros((2, 5), np.float32),
    )
    assert float(state.acc_count[0]) == float(state.acc_count[1]) == 0  # closed
    assert bool(state.updated[0]) == bool(state.updated[1]) == (sum(counts) > 0)
    if same and (where == 0 or n1 == 0 or n2 == 0):
        np.testing.assert_array_equal(updates[0], updates[1])
    else:
        g_max = float(np.abs(np.concatenate([grads, [g1, g2]])).max())
        np.testing.assert_allclose(
            updates[0], updates[1], rtol=0, atol=4 * 6 * EPS * g_max
        )


@functools.cache
def _scaled_runner(count_dtype):
    params = jnp.zeros(W)
    tx = mm.MaskedMultiSteps(
        optax.chain(optax.adam(0.1), records_value()),
        3,
        window_stats=True,
        count_dtype=count_dtype,
    )
    return _window_runner(tx, params, in_axes=(None, 0, None))


@pytest.mark.parametrize("count_dtype", [jnp.float32, jnp.int32])
@settings(max_examples=25, deadline=None)
@given(
    counts=st.lists(st.integers(0, 1000) | st.just(0), min_size=9, max_size=9),
    c=st.integers(2, 2**24 // 3000),
    seed=st.integers(0, 2**16),
)
def test_scaling_every_count_by_an_integer_leaves_the_updates_bit_identical(
    count_dtype, counts, c, seed
):
    rng = np.random.default_rng(seed)
    counts = np.asarray(counts)
    grads = _nan_where_empty(rng.normal(size=(9, W)).astype(np.float32), counts)
    values = rng.normal(size=9).astype(np.float32)
    n = np.stack([counts, c * counts]).astype(np.dtype(count_dtype))
    updates, state = _scaled_runner(count_dtype)(grads, n, values)
    np.testing.assert_array_equal(updates[0], updates[1])
    for leaf in jax.tree.leaves(state.inner_opt_state):  # adam's moments, the loss
        np.testing.assert_array_equal(leaf[0], leaf[1])
    a = jax.tree.map(lambda x: x[0], mm.window_stats(state))
    b = jax.tree.map(lambda x: x[1], mm.window_stats(state))
    np.testing.assert_array_equal(a.loss, b.loss)
    np.testing.assert_array_equal(a.grad_sq_norm, b.grad_sq_norm)
    assert int(b.tokens) == c * int(a.tokens)
    assert int(b.tokens_seen) == c * int(a.tokens_seen) == c * int(counts.sum())


@functools.cache
def _norm_test_runner():
    # The norm test's rule is scale-free in the counts: tr Σ̂ / N <= θ²‖ḡ‖².
    params = jnp.zeros(W)
    tx = mm.MaskedMultiSteps(
        optax.adam(0.1),
        norm_test=mm.norm_test(0.6, min_microbatches=2, max_microbatches=8),
        window_stats=True,
    )

    def run(grads, counts):
        def body(state, x):
            updates, state = tx.update(x[0], state, params, count=x[1])
            return state, (updates, state.updated, mm.window_stats(state))

        return jax.lax.scan(body, tx.init(params), (grads, counts))

    return _each_row(run, in_axes=(None, 0))


@settings(max_examples=25, deadline=None)
@given(
    counts=st.lists(st.integers(0, 60) | st.just(0), min_size=24, max_size=24),
    log2_c=st.integers(-20, 20),
    noise=st.floats(0.1, 3.0),
    seed=st.integers(0, 2**16),
)
def test_scaling_counts_by_a_power_of_two_scales_the_noise_figures_exactly(
    counts, log2_c, noise, seed
):
    rng = np.random.default_rng(seed)
    c = np.float32(2.0**log2_c)
    counts = np.asarray(counts, np.float32)
    grads = (noise * rng.normal(size=(24, W)) + rng.normal(size=W)).astype(np.float32)
    grads = _nan_where_empty(grads, counts)
    _, (updates, updated, stats) = _norm_test_runner()(
        grads, np.stack([counts, c * counts])
    )
    # The same windows, the same updates.
    np.testing.assert_array_equal(updated[0], updated[1])
    np.testing.assert_array_equal(updates[0], updates[1])
    a = jax.tree.map(lambda x: np.asarray(x[0]), stats)
    b = jax.tree.map(lambda x: np.asarray(x[1]), stats)
    for name in ("grad_sq_norm", "true_grad_sq_norm", "microbatches", "windows"):
        np.testing.assert_array_equal(getattr(b, name), getattr(a, name), name)
    for name in ("tokens", "grad_var_trace", "noise_scale", "smoothed_noise_scale"):
        np.testing.assert_array_equal(getattr(b, name), c * getattr(a, name), name)
    np.testing.assert_array_equal(b.tokens_seen.hi, c * a.tokens_seen.hi)
    np.testing.assert_array_equal(b.tokens_seen.lo, c * a.tokens_seen.lo)


# Statistics against float64 references.

SK, SW = 8, 5  # microbatches, width


@functools.cache
def _window():
    params = jnp.zeros(SW)
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), SK, window_stats=True)

    def run(grads, counts):
        def body(state, x):
            _, state = tx.update(x[0], state, params, count=x[1])
            return state, None

        state, _ = jax.lax.scan(body, tx.init(params), (grads, counts))
        return mm.window_stats(state)

    return jax.jit(run)


@settings(max_examples=60, deadline=None)
@given(
    log_counts=st.lists(
        st.none() | st.floats(0, 6), min_size=SK, max_size=SK
    ),  # None: an empty microbatch; else 10**x tokens, rounded
    mean_scale=st.floats(-3, 3),
    noise_scale=st.floats(-3, 3),
    seed=st.integers(0, 2**16),
)
def test_statistics_match_a_float64_two_pass_sum(
    log_counts, mean_scale, noise_scale, seed
):
    rng = np.random.default_rng(seed)
    counts = np.asarray(
        [0 if x is None else round(10**x) for x in log_counts], np.float32
    )
    grads = (
        10**mean_scale * rng.normal(size=SW)
        + 10**noise_scale
        * rng.normal(size=(SK, SW))
        / np.sqrt(np.maximum(counts, 1))[:, None]
    )
    grads = grads.astype(np.float32)
    grads[counts == 0] = np.nan
    stats = _window()(grads, counts)

    live = counts > 0
    n, g = counts[live].astype(np.float64), grads[live].astype(np.float64)
    k, total = int(live.sum()), n.sum()
    assert int(stats.microbatches) == k and float(stats.tokens) == total
    if k == 0:
        assert np.isnan(stats.grad_sq_norm) and np.isnan(stats.grad_var_trace)
        return
    sq_max = float((g**2).sum(1).max())
    mean = (n[:, None] * g).sum(0) / total
    np.testing.assert_allclose(
        stats.grad_sq_norm, mean @ mean, rtol=0, atol=8 * SK * EPS * sq_max
    )
    if k == 1:
        assert np.isnan(stats.grad_var_trace) and np.isnan(stats.noise_scale)
        return
    if k == 2:
        (n1, n2), (g1, g2) = n, g
        s_ref = n1 * n2 / (n1 + n2) * ((g1 - g2) ** 2).sum()
    else:
        s_ref = (n * ((g - mean) ** 2).sum(1)).sum()
    s = float(stats.grad_var_trace) * (k - 1)
    assert abs(s - s_ref) <= 8 * EPS * total * sq_max, (s, s_ref)
    # The estimates derived from S and ‖ḡ‖², as defined.
    var, true_sq = float(stats.grad_var_trace), float(stats.true_grad_sq_norm)
    np.testing.assert_allclose(
        true_sq, float(stats.grad_sq_norm) - var / total, rtol=1e-6, atol=1e-6 * sq_max
    )
    if true_sq > 0:
        np.testing.assert_allclose(stats.noise_scale, var / true_sq, rtol=1e-6)
    else:
        assert np.isnan(stats.noise_scale)


# Statistics never change an update.

NDEV = 8
PARAMS = {"w": jnp.zeros((3, 2)), "b": jnp.zeros(2)}


def _data(rng, length, devices=None):
    lead = (length,) if devices is None else (length, devices)
    counts = rng.integers(0, 40 if devices is None else 12, size=lead)
    counts[rng.random(lead) < 0.2] = 0
    counts = counts.astype(np.float32)
    grads = {
        k: (rng.normal(size=(*lead, *p.shape)) + 0.2).astype(np.float32)
        for k, p in PARAMS.items()
    }
    for g in grads.values():
        g[counts == 0] = np.nan
    return grads, counts, rng.normal(size=length).astype(np.float32)


@functools.cache
def _mesh():
    return jax.make_mesh((NDEV,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


def _without_statistics(state):
    """The state less the statistics' fields (with a deferred reduction that
    agrees at the window's end, also every device's shares of them)."""
    shares = state.reduction_state
    if hasattr(shares, "sq_norms"):
        shares = shares._replace(sq_norms=(), microbatches=())
    return state._replace(stats=(), reduction_state=shares)


RULES = {
    "budget_ramp": dict(
        tokens_per_window=lambda seen: 50 + seen / 8, every_k_schedule=6
    ),
    "skip": dict(every_k_schedule=3, should_skip_update_fn=optax.skip_not_finite),
    "deferred": dict(every_k_schedule=3, deferred=True),
    "deferred_budget": dict(tokens_per_window=80, deferred=True),
}


@pytest.mark.parametrize("name", sorted(RULES))
def test_window_statistics_never_change_the_updates_under_any_window_rule(name):
    rules = dict(RULES[name])
    deferred = rules.pop("deferred", False)
    params, data, devices = PARAMS, None, None
    if deferred:
        rules["reduction"] = mm.deferred(_mesh(), "data")
        params = jax.device_put(PARAMS, NamedSharding(_mesh(), P()))
        data, devices = NamedSharding(_mesh(), P("data")), NDEV
    grads, counts, values = _data(np.random.default_rng(2), 12, devices)
    if "skip" in rules:
        grads["b"][3, 0] = np.inf  # a microbatch the skip function rejects
    runs = []
    for stats in (False, True):
        tx = mm.MaskedMultiSteps(
            optax.adamw(0.1, weight_decay=0.1), window_stats=stats, **rules
        )
        step = jax.jit(
            lambda p, s, g, n, v, tx=tx: tx.apply_gradients(g, s, p, count=n, value=v)
        )
        p, s, trace = params, tx.init(params), []
        for i in range(len(counts)):
            g, n = jax.tree.map(operator.itemgetter(i), grads), counts[i]
            if deferred:
                g, n = jax.device_put(g, data), jax.device_put(n, data)
            p, s = step(p, s, g, n, values[i])
            trace.append((p, _without_statistics(s)))
        runs.append(trace)
    assert int(runs[0][-1][1].gradient_step) >= 2
    assert_bit_identical(runs[0], runs[1])
