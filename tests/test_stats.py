"""Window statistics: the estimators of tr Σ, |G|² and B_simple, and their state."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import masked_multistep as mm
from masked_multistep import _sq_norms, _stats, _stats_state, _token_total
from tests._helpers import assert_bit_identical

DECAY = 0.9


def _window(stats, grads, counts, decay=DECAY):
    """Folds one window (arrays of shape (K, d) and (K,)) into ``stats`` with
    the library's own arithmetic: the running mean for ḡ, the statistics'
    accumulation, then the window's close."""

    def body(carry, xs):
        mean, total, stats = carry
        g, n = xs
        mean, total = mm.running_mean_update(mean, total, g, n)
        stats = _stats.accumulate_window_stats(stats, g, n)
        return (mean, total, stats), None

    d = grads.shape[-1]
    init = (jnp.zeros(d, jnp.float32), jnp.zeros([], counts.dtype), stats)
    (mean, total, stats), _ = jax.lax.scan(body, init, (grads, counts))
    return _stats.close_window_stats(
        stats,
        tokens=total,
        grad_sq_norm=_sq_norms.tree_sq_norm(mean),
        loss=jnp.float32(0),
        loss_tokens=jnp.zeros([], counts.dtype),
        decay=decay,
    )


def _one_window(grads, counts):
    state = _window(_stats_state.init_window_stats(counts.dtype), grads, counts)
    return _stats.read_window_stats(state)


def _microbatch_means(rng, g_true, sigma_diag, counts):
    """Per-token Gaussian gradients N(G, diag σ²), averaged per microbatch; a
    microbatch without tokens gets NaN (the 0/0 of an all-masked mean)."""
    out = []
    for n in counts:
        if n == 0:
            out.append(np.full_like(g_true, np.nan))
        else:
            tokens = g_true + rng.normal(size=(n, g_true.size)) * np.sqrt(sigma_diag)
            out.append(tokens.mean(axis=0))
    return np.asarray(out, np.float32)


def _data_mesh(ndev):
    """A mesh of the first ``ndev`` devices along the axis "data"."""
    return jax.make_mesh((ndev,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


def test_estimators_are_unbiased_with_unequal_counts_and_empty_microbatches():
    rng = np.random.default_rng(0)
    d, windows = 8, 3000
    g_true = rng.normal(size=d) * 0.3
    sigma_diag = rng.uniform(0.5, 2.0, size=d)
    counts = np.array([0, 3, 17, 1, 40, 0, 9, 2], np.int32)
    grads = np.stack(
        [_microbatch_means(rng, g_true, sigma_diag, counts) for _ in range(windows)]
    )
    last = jax.jit(jax.vmap(_one_window, in_axes=(0, None)))(
        jnp.asarray(grads), jnp.asarray(counts)
    )
    assert np.all(np.asarray(last.microbatches) == 6)
    assert np.all(np.asarray(last.tokens) == counts.sum())
    for estimate, truth in [
        (last.grad_var_trace, sigma_diag.sum()),
        (last.true_grad_sq_norm, np.sum(g_true**2)),
    ]:
        x = np.asarray(estimate, np.float64)
        assert np.all(np.isfinite(x))
        se = x.std(ddof=1) / np.sqrt(windows)
        assert abs(x.mean() - truth) < 3 * se, (x.mean(), truth, se)


def test_equal_counts_give_mccandlish_two_batch_estimators():
    rng = np.random.default_rng(1)
    k, n, d = 4, 16, 32
    grads = rng.normal(loc=0.5, size=(k, d)).astype(np.float32)
    last = jax.jit(_one_window)(jnp.asarray(grads), jnp.full(k, n, jnp.int32))

    g = grads.astype(np.float64)
    b_small, b_big = n, k * n
    g_small_sq = np.mean(np.sum(g**2, axis=1))  # |G_small|², averaged
    g_big_sq = np.sum(g.mean(axis=0) ** 2)  # |G_big|²
    true_sq = (b_big * g_big_sq - b_small * g_small_sq) / (b_big - b_small)
    trace = (g_small_sq - g_big_sq) / (1 / b_small - 1 / b_big)
    np.testing.assert_allclose(last.grad_var_trace, trace, rtol=1e-5)
    np.testing.assert_allclose(last.true_grad_sq_norm, true_sq, rtol=1e-5)
    np.testing.assert_allclose(last.noise_scale, trace / true_sq, rtol=2e-5)
    np.testing.assert_allclose(last.grad_sq_norm, g_big_sq, rtol=1e-6)


@pytest.mark.parametrize("tokens_per_noise_scale", [1, 10, 100, 1000])
def test_spread_matches_float64_two_pass(tokens_per_noise_scale):
    """S = Σ nᵢ‖gᵢ − ḡ‖² from the float32 state against a float64 two-pass sum,
    at N / B_simple = 1 to 1000 (S is formed by a subtraction whose
    cancellation grows with N / B_simple: about 1e-4 at 10⁴, see _stats)."""
    rng = np.random.default_rng(2)
    k, d = 8, 100_000
    counts = rng.integers(1, 500, size=k).astype(np.int32)
    # Unit per-token noise: tr Σ = d, |G|² ≈ d·scale², so B_simple ≈ 1 / scale².
    scale = np.sqrt(tokens_per_noise_scale / counts.sum())
    g_true = scale * rng.normal(size=d)
    noise = rng.normal(size=(k, d)) / np.sqrt(counts[:, None])
    grads = (g_true + noise).astype(np.float32)
    last = jax.jit(_one_window)(jnp.asarray(grads), jnp.asarray(counts))

    g = grads.astype(np.float64)
    w = counts.astype(np.float64)
    mean = (w[:, None] * g).sum(axis=0) / w.sum()
    s_ref = np.sum(w * np.sum((g - mean) ** 2, axis=1))
    s = float(last.grad_var_trace) * (k - 1)
    assert abs(s - s_ref) <= 1e-5 * s_ref, (s, s_ref)

    # West's update of the running mean carries the same S.
    def body(carry, xs):
        m, total, s = carry
        m, total, ds = mm.running_mean_update(m, total, *xs, with_sq_deviation=True)
        return (m, total, s + ds), None

    init = (jnp.zeros(d), jnp.zeros([], jnp.int32), jnp.zeros([]))
    (_, _, s_west), _ = jax.jit(lambda xs: jax.lax.scan(body, init, xs))(
        (jnp.asarray(grads), jnp.asarray(counts))
    )
    assert abs(float(s_west) - s_ref) <= 1e-5 * s_ref, (float(s_west), s_ref)


def test_no_tokens_one_microbatch_and_empty_nan_microbatches():
    d = 3
    nan = np.full((1, d), np.nan, np.float32)
    # K = 0: every estimate NaN, the window still counts.
    last = _one_window(jnp.asarray(np.concatenate([nan, nan])), jnp.zeros(2, jnp.int32))
    assert int(last.microbatches) == 0 and int(last.tokens) == 0
    assert int(last.windows) == 1 and float(last.tokens_seen) == 0.0
    for x in (last.grad_sq_norm, last.grad_var_trace, last.noise_scale):
        assert np.isnan(x)
    # K = 1 (with empty NaN microbatches around it): the norm is known, the
    # variance is not.
    g = np.array([[1.0, 2.0, 2.0]], np.float32)
    last = _one_window(
        jnp.asarray(np.concatenate([nan, g, nan])), jnp.array([0, 5, 0], jnp.int32)
    )
    assert int(last.microbatches) == 1 and int(last.tokens) == 5
    assert float(last.grad_sq_norm) == 9.0
    for x in (
        last.grad_var_trace,
        last.true_grad_sq_norm,
        last.noise_scale,
        last.smoothed_noise_scale,
    ):
        assert np.isnan(x)


def test_empty_microbatch_leaves_state_bit_identical():
    stats = _stats_state.init_window_stats(jnp.float32)
    stats = _stats.accumulate_window_stats(stats, jnp.arange(3.0), jnp.float32(2.5))
    after = _stats.accumulate_window_stats(
        stats, jnp.array([jnp.nan, jnp.inf, 1.0]), jnp.float32(0)
    )
    for a, b in zip(jax.tree.leaves(stats), jax.tree.leaves(after), strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True)


def test_non_finite_gradient_spoils_only_its_window():
    stats = _stats_state.init_window_stats(jnp.int32)
    bad = jnp.array([[1.0, 1.0], [jnp.inf, 0.0], [0.0, 1.0]])
    stats = _window(stats, bad, jnp.array([1, 2, 3], jnp.int32))
    last = _stats.read_window_stats(stats)
    assert np.isnan(last.grad_var_trace) and np.isnan(last.noise_scale)
    assert float(stats.ema_weight) == 0.0  # not averaged in
    good = jnp.array([[1.0, 1.0], [2.0, 0.0], [0.0, 1.0]])
    stats = _window(stats, good, jnp.array([1, 2, 3], jnp.int32))
    last = _stats.read_window_stats(stats)
    assert np.isfinite(last.grad_var_trace)
    assert int(last.windows) == 2 and float(last.tokens_seen) == 12.0


def test_smoothing_is_a_ratio_of_debiased_moving_averages():
    rng = np.random.default_rng(3)
    stats = _stats_state.init_window_stats(jnp.int32)
    counts = jnp.array([4, 7, 2, 9], jnp.int32)
    window = jax.jit(_window)
    var, true_sq, smoothed = [], [], []
    for _ in range(6):
        grads = jnp.asarray(rng.normal(loc=0.3, size=(4, 16)), jnp.float32)
        stats = window(stats, grads, counts)
        last = _stats.read_window_stats(stats)
        var.append(float(last.grad_var_trace))
        true_sq.append(float(last.true_grad_sq_norm))
        smoothed.append(float(last.smoothed_noise_scale))
    num = den = weight = 0.0
    for t, (v, g) in enumerate(zip(var, true_sq, strict=True)):
        num = DECAY * num + (1 - DECAY) * v
        den = DECAY * den + (1 - DECAY) * g
        weight = DECAY * weight + (1 - DECAY)
        expect = (num / weight) / (den / weight) if den > 0 else np.nan
        np.testing.assert_allclose(smoothed[t], expect, rtol=1e-5)
    assert np.isclose(float(stats.ema_weight), weight, rtol=1e-6)


@pytest.mark.parametrize(
    ("dtype", "count", "steps"),
    [(jnp.float32, 2**24 - 1, 300_000), (jnp.int32, 2**31 - 1, 3_000)],
    ids=["float32-counts", "int32-counts"],
)
def test_tokens_seen_is_exact_far_beyond_int32(dtype, count, steps):
    def body(total, _):
        return _token_total.add_tokens(total, jnp.asarray(count, dtype)), None

    zero = _token_total.TokenTotal(
        jnp.zeros([], jnp.float32), jnp.zeros([], jnp.float32)
    )
    total, _ = jax.jit(lambda t: jax.lax.scan(body, t, None, length=steps))(zero)
    assert count * steps > 2**40
    assert float(total) == count * steps
    assert total.value() == count * steps


def test_tokens_seen_past_float32s_range_is_inf_not_nan():
    # inf - inf in the compensated sum's remainder made it NaN, which a budget
    # callable of the tokens seen would get.
    seen = []
    tx = mm.MaskedMultiSteps(
        optax.sgd(1.0),
        1,
        window_stats=True,
        tokens_per_window=lambda t: (seen.append(t), 1e38)[1],
    )
    params = {"w": jnp.zeros(2)}
    state = tx.init(params)
    for _ in range(3):
        _, state = tx.update({"w": jnp.ones(2)}, state, params, count=3e38)
    assert float(mm.window_stats(state).tokens_seen) == np.inf
    assert float(seen[-1]) == np.inf


def test_reverse_mode_derivatives_are_finite_through_empty_microbatches():
    def spread(g):
        m, total, s = jnp.zeros(2), jnp.float32(0), jnp.float32(0)
        stats = _stats_state.init_window_stats(jnp.float32)
        for gi, n in [(g, 2.0), (jnp.full(2, jnp.nan), 0.0), (2 * g + 1, 3.0)]:
            m, total, ds = mm.running_mean_update(
                m, total, gi, jnp.float32(n), with_sq_deviation=True
            )
            s = s + ds
            stats = _stats.accumulate_window_stats(stats, gi, jnp.float32(n))
        return s + stats.weighted_sq_norms

    grad = jax.grad(spread)(jnp.array([0.5, -1.0]))
    assert np.all(np.isfinite(grad)), grad


_STAT_FIELDS = ("grad_sq_norm", "grad_var_trace", "true_grad_sq_norm", "noise_scale")


def _reverse_equals_forward(fn, *cases):
    """jax.grad of each statistic equals its forward-mode derivative (jvp,
    which never multiplies by a discarded gradient) and is finite, for
    ``fn(theta, *case)`` with each case (one compiled program for them all)."""

    def derivatives(theta, *case):
        # Every statistic's forward derivative in one jvp, and its reverse
        # one in a jacrev (a vjp per statistic, each with a cotangent of 0 for
        # the others, as jax.grad of it alone), in one program (one compile).
        def fields(t):
            stats = mm.window_stats(fn(t, *case))
            return {name: getattr(stats, name) for name in _STAT_FIELDS}

        return jax.jvp(fields, (theta,), (1.0,)), jax.jacrev(fields)(theta)

    derivatives = jax.jit(derivatives)
    for case in cases or [()]:
        (values, tangents), grads = derivatives(1.0, *case)
        for name in _STAT_FIELDS:
            value, tangent, grad = values[name], tangents[name], grads[name]
            assert np.isfinite(value) and np.isfinite(tangent), (name, case, value)
            # (B_simple does not change when every gradient is scaled: its
            # derivative is 0, computed as a difference of terms of about its
            # value, a few float32 units of which either mode may keep.)
            np.testing.assert_allclose(
                grad,
                tangent,
                rtol=1e-4,
                atol=1e-5 * max(1.0, abs(float(value))),
                err_msg=f"{name} {case}",
            )


def test_reverse_mode_derivatives_skip_an_earlier_non_finite_window():
    """A window with a non-finite gradient (inf, then NaN) is recorded, then
    reset: the next window's statistics do not depend on it, and neither do
    their derivatives (its zero cotangent times the non-finite gradient was
    NaN)."""
    tx = mm.MaskedMultiSteps(optax.sgd(0.1), 2, window_stats=True)
    params = {"w": jnp.ones(3)}
    rows = jnp.array([[1.0, 2, 3], [1, 0, 3], [2, 2, 1], [1, 5, 3]])

    def run(theta, bad):
        offset = jnp.zeros(3).at[1].set(bad)  # not a function of theta
        state = tx.init(params)
        for i in range(4):
            g = theta * rows[i] + (offset if i == 1 else 0)
            _, state = tx.update({"w": g}, state, params, count=jnp.float32(i + 1))
        return state

    _reverse_equals_forward(run, (jnp.float32(np.inf),), (jnp.float32(np.nan),))


def test_reverse_mode_derivatives_skip_an_empty_device_with_nan_gradients():
    """reduction=mm.deferred: a device without tokens holds NaN; the window's
    statistics and their derivatives leave it out."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    ndev = len(jax.devices())
    mesh = _data_mesh(ndev)
    tx = mm.MaskedMultiSteps(
        optax.sgd(0.1), 2, window_stats=True, reduction=mm.deferred(mesh, "data")
    )
    params = jax.device_put({"w": jnp.ones(3)}, NamedSharding(mesh, P()))
    base = jnp.arange(3.0 * ndev).reshape(ndev, 3) / 7 + 0.5
    counts = [jnp.arange(ndev, dtype=jnp.float32) % 3 for _ in range(2)]

    def run(theta):
        state = tx.init(params)
        for i, n in enumerate(counts):
            # The empty devices' gradients: NaN, whose derivative is not 0.
            g = theta * base * (i + 1) + jnp.where((n == 0)[:, None], jnp.nan, 0)
            _, state = tx.update({"w": g}, state, params, count=n)
        return state

    _reverse_equals_forward(run)


def test_deferred_statistics_with_no_parameters():
    """An empty tree (``tx.init({})``) accumulates the devices' counts alone."""
    ndev = len(jax.devices())
    mesh = _data_mesh(ndev)
    tx = mm.MaskedMultiSteps(
        optax.sgd(0.1), 2, window_stats=True, reduction=mm.deferred(mesh, "data")
    )
    state = tx.init({})
    counts = jnp.arange(ndev, dtype=jnp.int32) % 3
    for _ in range(2):
        _, state = tx.update({}, state, {}, count=counts)
    stats = mm.window_stats(state)
    assert float(stats.tokens) == 2 * int(counts.sum())
    assert int(stats.microbatches) == 2 * int((counts > 0).sum())
    assert float(stats.grad_sq_norm) == 0.0


# ------------------------------------------------------------------ the wrapper

D = 5
WINDOW = 3
# (count, gradient is NaN): unequal counts, empty NaN microbatches, a window
# with one counted microbatch and a window with none.
PLAN = [
    (4, False), (0, True), (9, False),
    (2, False), (7, False), (1, False),
    (0, True), (6, False), (0, False),
    (0, True), (0, True), (0, False),
    (3, False), (5, False),
]  # fmt: skip


def _plan_data(seed=0, plan=PLAN):
    rng = np.random.default_rng(seed)
    grads, counts, values = [], [], []
    for n, bad in plan:
        g = rng.normal(loc=0.4, size=D).astype(np.float32)
        grads.append(np.full(D, np.nan, np.float32) if bad else g)
        counts.append(n)
        values.append(np.float32(rng.uniform(1, 3)))
    return np.asarray(grads), np.asarray(counts, np.int32), np.asarray(values)


def _run(tx, grads, counts, values, apply_params=False, params=None):
    """Feeds the plan through ``tx`` under jit; returns outputs and states."""
    params = jnp.zeros(D) if params is None else params
    state = tx.init(params)

    @jax.jit
    def step(params, state, g, n, v):
        if apply_params:
            return tx.apply_gradients(g, state, params, count=n, value=v)
        updates, state = tx.update(g, state, params, count=n, value=v)
        return optax.apply_updates(params, updates), state

    outs, states = [], []
    for g, n, v in zip(grads, counts, values, strict=True):
        params, state = step(params, state, g, n, v)
        outs.append(params)
        states.append(state)
    return outs, states


def _without_stats(state):
    return state._replace(stats=())


def _assert_same_run(plain, stats, data, apply_params):
    """Runs both wrappers on ``data``: every output and every state field but
    ``stats`` equal bit for bit (dtypes too). Returns both runs' states."""
    outs_a, states_a = _run(plain, *data, apply_params=apply_params)
    outs_b, states_b = _run(stats, *data, apply_params=apply_params)
    for a, b, sa, sb in zip(outs_a, outs_b, states_a, states_b, strict=True):
        assert np.array_equal(a, b)
        for x, y in zip(
            jax.tree.leaves(sa), jax.tree.leaves(_without_stats(sb)), strict=True
        ):
            assert x.dtype == y.dtype and np.array_equal(x, y, equal_nan=True)
    return states_a, states_b


@pytest.mark.parametrize("apply_params", [False, True], ids=["update", "apply"])
def test_statistics_never_change_the_updates(apply_params):
    data = _plan_data()
    inner = optax.adam(0.1)
    plain = mm.MaskedMultiSteps(inner, WINDOW)
    stats = mm.MaskedMultiSteps(inner, WINDOW, window_stats=True)
    states_a, states_b = _assert_same_run(plain, stats, data, apply_params)
    assert states_a[-1].stats == ()


def test_wrapper_reports_each_completed_window_until_the_next():
    grads, counts, values = _plan_data()
    tx = mm.MaskedMultiSteps(optax.sgd(0.1), WINDOW, window_stats=True)
    _, states = _run(tx, grads, counts, values)
    seen = 0
    previous = _stats.read_window_stats(_stats_state.init_window_stats(jnp.int32))
    for i, state in enumerate(states):
        last = mm.window_stats(state)
        if (i + 1) % WINDOW:
            # Mid-window: still the previous window's figures.
            for a, b in zip(jax.tree.leaves(last), jax.tree.leaves(previous)):
                assert np.array_equal(a, b, equal_nan=True)
            continue
        sl = slice(i + 1 - WINDOW, i + 1)
        g, n, v = grads[sl], counts[sl], values[sl]
        ref = _one_window(jnp.asarray(g), jnp.asarray(n))
        seen += int(n.sum())
        assert int(last.tokens) == n.sum()
        assert int(last.microbatches) == np.count_nonzero(n)
        assert int(last.windows) == (i + 1) // WINDOW
        assert float(last.tokens_seen) == seen
        if n.sum():
            np.testing.assert_allclose(last.loss, np.sum(n * v) / n.sum(), rtol=1e-6)
        for name in ("grad_sq_norm", "grad_var_trace", "true_grad_sq_norm"):
            np.testing.assert_allclose(
                getattr(last, name), getattr(ref, name), rtol=1e-5
            )
        previous = last
    # Windows: K = 2, 3, 1 (NaN variance), 0 (no tokens) in turn.
    assert [int(mm.window_stats(s).microbatches) for s in states[2::3]] == [2, 3, 1, 0]


def test_skipped_and_non_finite_microbatches():
    grads, counts, values = _plan_data(plan=[(3, False)] * 6)
    grads[1] = np.inf
    # With optax.skip_not_finite the bad microbatch never happened.
    tx = mm.MaskedMultiSteps(
        optax.sgd(0.1),
        WINDOW,
        should_skip_update_fn=optax.skip_not_finite,
        window_stats=True,
    )
    _, states = _run(tx, grads, counts, values)
    first = mm.window_stats(states[3])  # the window of microbatches 0, 2, 3
    ref = _one_window(jnp.asarray(grads[[0, 2, 3]]), jnp.asarray(counts[[0, 2, 3]]))
    assert int(first.microbatches) == 3
    np.testing.assert_allclose(first.grad_var_trace, ref.grad_var_trace, rtol=1e-5)
    # Without it, the non-finite gradient spoils its window's statistics only.
    tx = mm.MaskedMultiSteps(optax.sgd(0.1), WINDOW, window_stats=True)
    _, states = _run(tx, grads, counts, values)
    assert np.isnan(mm.window_stats(states[2]).noise_scale)
    assert np.isfinite(mm.window_stats(states[5]).grad_var_trace)
    assert float(mm.window_stats(states[5]).tokens_seen) == 18.0


def test_statistics_under_scan_and_vmap():
    grads, counts, values = _plan_data()
    tx = mm.MaskedMultiSteps(optax.sgd(0.1), WINDOW, window_stats=True)
    params = jnp.zeros(D)

    def run(g, n, v):
        def body(state, xs):
            _, state = tx.update(xs[0], state, params, count=xs[1], value=xs[2])
            return state, None

        return jax.lax.scan(body, tx.init(params), (g, n, v))[0]

    _, states = _run(tx, grads, counts, values)
    scanned = jax.jit(run)(grads, counts, values)
    for a, b in zip(
        jax.tree.leaves(states[-1].stats), jax.tree.leaves(scanned.stats), strict=True
    ):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    # Two independent runs side by side; the second sees the plan reversed.
    batched = jax.jit(jax.vmap(run))(
        np.stack([grads, grads[::-1]]),
        np.stack([counts, counts[::-1]]),
        np.stack([values, values[::-1]]),
    )
    reverse = jax.jit(run)(grads[::-1], counts[::-1], values[::-1])
    for a, b, c in zip(
        jax.tree.leaves(batched.stats),
        jax.tree.leaves(scanned.stats),
        jax.tree.leaves(reverse.stats),
        strict=True,
    ):
        np.testing.assert_allclose(a[0], b, rtol=1e-6)
        np.testing.assert_allclose(a[1], c, rtol=1e-6)


def test_window_stats_and_has_updated_find_nested_states():
    params = {"a": jnp.zeros(2), "b": jnp.zeros(3)}
    grads = {"a": jnp.array([1.0, 2.0]), "b": jnp.array([0.5, 0.0, -1.0])}
    mmtx = mm.MaskedMultiSteps(optax.sgd(0.1), 1, window_stats=True)
    nested = {
        "chain": optax.chain(
            optax.clip_by_global_norm(10.0), mmtx.gradient_transformation()
        ),
        "inject": optax.inject_hyperparams(
            lambda learning_rate: mm.MaskedMultiSteps(
                optax.sgd(learning_rate), 1, window_stats=True
            ).gradient_transformation()
        )(learning_rate=0.1),
        "multi_transform": optax.multi_transform(
            {"mm": mmtx.gradient_transformation(), "sgd": optax.sgd(0.1)},
            {"a": "mm", "b": "sgd"},
        ),
    }
    for name, tx in nested.items():
        state = tx.init(params)
        assert not bool(mm.has_updated(state)), name
        _, state = tx.update(grads, state, params, count=jnp.array(2))
        assert bool(mm.has_updated(state)), name
        stats = mm.window_stats(state)
        assert int(stats.tokens) == 2 and int(stats.windows) == 1, name

    with pytest.raises(
        ValueError,
        match=r"exactly one MaskedMultiStepsState, found 2 in a tuple \(at "
        r"`state\[0\]`, `state\[1\]`\): pass the one you mean\. \(Two wrappers "
        r"one after the other in an optax\.chain would be a mistake",
    ):
        mm.window_stats((mmtx.init(params), mmtx.init(params)))
    # A state with an `opt_state` field that is no TrainState (optax.contrib.sam's,
    # beside its `adv_state`) is searched whole: its `opt_state` alone was, a
    # wrapper in `adv_state` was not found and one on both sides not refused.
    sam = optax.contrib.sam(optax.sgd(0.1), mmtx.gradient_transformation())
    assert int(mm.find_state(sam.init(params)).mini_step) == 0
    sam = optax.contrib.sam(
        mmtx.gradient_transformation(), mmtx.gradient_transformation()
    )
    with pytest.raises(
        ValueError, match=r"found 2 in a SAMState \(at `state\.opt_state`"
    ):
        mm.find_state(sam.init(params))

    # A trainer object of the user's, no pytree, is read by its `opt_state`.
    class Trainer:
        def __init__(self, opt_state):
            self.opt_state, self.model = opt_state, None

    assert not bool(mm.has_updated(Trainer(mmtx.init(params))))
    with pytest.raises(
        ValueError, match=r"exactly one MaskedMultiStepsState, found 0 in a tuple$"
    ):
        mm.has_updated(optax.adam(0.1).init(params))
    # A state restored without a template holds its fields as a dict.
    from flax import serialization

    as_dict = serialization.to_state_dict(mmtx.init(params))
    with pytest.raises(ValueError, match=r"found 0 in a dict: .*tx.init\(params\)"):
        mm.has_updated({"opt_state": as_dict})
    with pytest.raises(ValueError, match="window_stats=True"):
        mm.window_stats(mm.MaskedMultiSteps(optax.sgd(0.1), 1).init(params))


def test_window_stats_in_flax_train_states():
    pytest.importorskip("flax")
    from flax import nnx

    tx = mm.MaskedMultiSteps(optax.adam(0.1), 2, window_stats=True)
    state = mm.TrainState.create(apply_fn=None, params=jnp.zeros(3), tx=tx)
    for g, n in [(1.0, 2), (3.0, 2)]:
        state = state.apply_gradients(grads=jnp.full(3, g), count=jnp.array(n))
    assert bool(mm.has_updated(state))
    np.testing.assert_allclose(mm.window_stats(state).grad_var_trace, 12.0)

    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    grads = jax.tree.map(jnp.ones_like, nnx.state(model, nnx.Param))
    for n in (2, 5):
        optimizer.update(model, grads, count=jnp.array(n))
    stats = mm.window_stats(optimizer.opt_state)
    assert isinstance(stats.tokens, jax.Array) and int(stats.tokens) == 7
    assert float(stats.grad_var_trace) == 0.0  # equal gradients: no spread
    assert bool(mm.has_updated(optimizer.opt_state))


def test_reading_a_boxed_state_unwraps_only_the_fields_read():
    # has_updated and window_stats unwrapped the whole state, every parameter
    # leaf's accumulator and inner state (16.7 ms per call for 1000 leaves).
    from flax import nnx

    class _Box(nnx.OptArray):
        """An NNX optimizer's variable, as `nnx.Optimizer` wraps each leaf of
        its optax state in one, counting the reads."""

        reads = 0

        def get_value(self, *args, **kwargs):
            _Box.reads += 1
            return super().get_value(*args, **kwargs)

    params = {f"w{i}": jnp.zeros(2) for i in range(40)}
    tx = mm.MaskedMultiSteps(optax.adam(0.1), 1, per_leaf_stats=True)
    state = tx.init(params)
    _, state = tx.update(jax.tree.map(jnp.ones_like, params), state, params, count=3)
    boxed = jax.tree.map(_Box, state)
    _Box.reads = 0
    assert bool(mm.has_updated(boxed)) and _Box.reads == 1
    _Box.reads = 0
    stats = mm.window_stats(boxed)
    assert _Box.reads == len(jax.tree.leaves(state.stats))
    jax.tree.map(np.testing.assert_array_equal, stats, mm.window_stats(state))
    # Each leaf's figures read the accumulator's layout too, not adam's moments.
    for kwargs in ({"per_leaf": True}, {"groups": lambda p: jax.tree.map(str, p)}):
        _Box.reads = 0
        read = mm.window_stats(boxed, **kwargs)
        assert _Box.reads <= len(jax.tree.leaves(state.stats)) + 40 + 1
        jax.tree.map(
            np.testing.assert_array_equal, read, mm.window_stats(state, **kwargs)
        )


def test_checkpoint_mid_window_restores_the_statistics(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    grads, counts, values = _plan_data()
    tx = mm.MaskedMultiSteps(optax.adam(0.1), WINDOW, window_stats=True)
    _, states = _run(tx, grads, counts, values)
    saved = states[4]  # mid-window, after one completed window
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "ckpt", saved)
        checkpointer.wait_until_finished()
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, tx.init(jnp.zeros(D)))
        restored = checkpointer.restore(tmp_path / "ckpt", abstract)
    assert isinstance(restored.stats, _stats_state.WindowStatsState)
    params = jnp.zeros(D)
    state = restored
    # Under jit, as the run it restores (an eager step runs its operations one by
    # one: the same values to rounding, not bit for bit).
    step = jax.jit(lambda g, s, n, v: tx.update(g, s, params, count=n, value=v))
    for g, n, v in zip(grads[5:], counts[5:], values[5:], strict=True):
        _, state = step(g, state, n, v)
    for a, b in zip(
        jax.tree.leaves(state.stats), jax.tree.leaves(states[-1].stats), strict=True
    ):
        assert np.array_equal(a, b, equal_nan=True)


def test_constructor_checks_the_statistics_arguments():
    with pytest.raises(
        TypeError, match="`window_stats` must be a bool, got 1 of type int"
    ):
        mm.MaskedMultiSteps(optax.sgd(0.1), 2, window_stats=1)
    with pytest.raises(ValueError, match=r"`stats_decay` must be in \[0, 1\), got 1"):
        mm.MaskedMultiSteps(optax.sgd(0.1), 2, window_stats=True, stats_decay=1)
    for bad in (True, jnp.array(0.5 + 0j), "0.5", None):
        with pytest.raises(TypeError, match="`stats_decay` must be a real number"):
            mm.MaskedMultiSteps(optax.sgd(0.1), 2, window_stats=True, stats_decay=bad)
    with pytest.raises(ValueError, match=r"`stats_decay` must be a scalar.*\(1,\)"):
        mm.MaskedMultiSteps(
            optax.sgd(0.1), 2, window_stats=True, stats_decay=jnp.array([0.5])
        )
    with pytest.raises(TypeError, match="`stats_decay` must be a concrete number"):
        jax.jit(
            lambda d: mm.MaskedMultiSteps(
                optax.sgd(0.1), 2, window_stats=True, stats_decay=d
            )
        )(0.5)
    # Below 1, but 1.0 in float32 (the moving averages would never move).
    with pytest.raises(ValueError, match="rounds to 1.0"):
        mm.MaskedMultiSteps(
            optax.sgd(0.1), 2, window_stats=True, stats_decay=0.99999999
        )
    tx = mm.MaskedMultiSteps(
        optax.sgd(0.1), 2, window_stats=True, stats_decay=1 - 2**-24
    )
    p = jnp.zeros(1)
    state = tx.init(p)
    for g in [1.0, 3.0, 1.0, 3.0]:  # two windows with tr Σ̂ = 2, |G|²̂ = 3.5
        _, state = tx.update(jnp.array([g]), state, p, count=jnp.float32(2))
    assert np.isfinite(float(mm.window_stats(state).smoothed_noise_scale))
    # A 0-d numpy or jax real is a real number.
    for decay in (np.float64(0.5), jnp.float32(0.5), jnp.array(0.5)):
        tx = mm.MaskedMultiSteps(
            optax.sgd(0.1), 2, window_stats=True, stats_decay=decay
        )
        assert tx._recorder.decay == 0.5
    # A decay with the statistics off would be silently unused.
    with pytest.raises(ValueError, match=r"`stats_decay` \(0.99\).*window_stats=True"):
        mm.MaskedMultiSteps(optax.sgd(0.1), 2, stats_decay=0.99)
    mm.MaskedMultiSteps(optax.sgd(0.1), 2, norm_test=0.5, stats_decay=0.99)


# --------------------------------------------- the Core semantics, with statistics

# A plan with a non-finite gradient in a counted microbatch (its window is not
# handed to the inner optimizer), empty NaN microbatches, and a window with one.
PLAN_NONFINITE = [
    (4, False), (3, False), (5, False),
    (2, False), (0, True), (6, False),
    (3, False), (2, False), (4, False),
]  # fmt: skip


def _nonfinite_plan_data():
    grads, counts, values = _plan_data(seed=4, plan=PLAN_NONFINITE)
    grads[3, 1] = np.inf  # window 1: a counted microbatch with an inf element
    return grads, counts, values


@pytest.mark.parametrize("apply_params", [False, True], ids=["update", "apply"])
@pytest.mark.parametrize(
    "skip", [None, optax.skip_not_finite], ids=["no-skip", "skip-not-finite"]
)
def test_statistics_never_change_the_updates_with_non_finite_windows(
    apply_params, skip
):
    data = _nonfinite_plan_data()
    inner = optax.adam(0.1)
    plain = mm.MaskedMultiSteps(inner, WINDOW, should_skip_update_fn=skip)
    stats = mm.MaskedMultiSteps(
        inner, WINDOW, should_skip_update_fn=skip, window_stats=True
    )
    _, states_b = _assert_same_run(plain, stats, data, apply_params)
    expected_nonfinite = 0 if skip else 1
    assert int(states_b[-1].num_nonfinite_windows) == expected_nonfinite


def test_a_non_finite_window_is_recorded_without_estimates():
    """The window whose mean is not finite (not handed to the inner optimizer)
    still completes: its tokens, microbatches, loss and tokens_seen count; its
    ‖ḡ‖² is the non-finite value; its estimates are NaN and the smoothing skips
    it."""
    grads, counts, values = _nonfinite_plan_data()
    tx = mm.MaskedMultiSteps(optax.sgd(0.1), WINDOW, window_stats=True)
    _, states = _run(tx, grads, counts, values)
    before, bad, after = (mm.window_stats(states[i]) for i in (2, 5, 8))
    assert not bool(states[5].updated) and int(states[5].num_nonfinite_windows) == 1
    assert int(bad.tokens) == 8 and int(bad.microbatches) == 2
    assert int(bad.windows) == 2 and float(bad.tokens_seen) == 12 + 8
    np.testing.assert_allclose(bad.loss, (2 * values[3] + 6 * values[5]) / 8, rtol=1e-6)
    assert not np.isfinite(bad.grad_sq_norm)
    for x in (bad.grad_var_trace, bad.true_grad_sq_norm, bad.noise_scale):
        assert np.isnan(x)
    # The moving averages skipped it: the smoothed figure is still the first
    # window's, and the third window folds in as the second averaged one.
    assert float(bad.smoothed_noise_scale) == float(before.smoothed_noise_scale)
    assert np.isclose(float(states[5].stats.ema_weight), 1 - DECAY)
    assert np.isclose(float(states[8].stats.ema_weight), 1 - DECAY**2)
    assert np.isfinite(after.grad_var_trace) and bool(states[8].updated)


def test_loss_is_the_token_weighted_mean_over_microbatches_that_passed_a_value():
    tx = mm.MaskedMultiSteps(optax.sgd(0.1), 4, window_stats=True)
    params = jnp.zeros(2)
    state = tx.init(params)
    # (count, value or None): the value-less microbatches weigh nothing in the
    # loss, a count-0 microbatch neither (its NaN value included).
    plan = [(2, 1.0), (3, None), (0, float("nan")), (6, 4.0)]
    for n, v in plan:
        extra = {} if v is None else {"value": jnp.float32(v)}
        _, state = tx.update(jnp.ones(2), state, params, count=jnp.array(n), **extra)
    stats = mm.window_stats(state)
    assert int(stats.tokens) == 11 and int(stats.microbatches) == 3
    np.testing.assert_allclose(stats.loss, (2 * 1.0 + 6 * 4.0) / 8, rtol=1e-6)
    # No microbatch passed a value: the loss is NaN.
    for _ in range(4):
        _, state = tx.update(jnp.ones(2), state, params, count=jnp.array(1))
    assert np.isnan(mm.window_stats(state).loss)


@pytest.mark.parametrize(
    ("values", "loss"),
    [((1.0, np.inf), np.inf), ((np.inf, 1.0), np.nan), ((np.inf, np.inf), np.nan)],
)
def test_an_infinite_loss_is_inf_as_the_windows_last_and_nan_before_another(
    values, loss
):
    # As the README says: `m + (v − m)·n/N` forms inf − inf once the running
    # mean is infinite. The gradients' update is not touched by it.
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 2, window_stats=True)
    params = jnp.zeros(2)
    state = tx.init(params)
    for g, n, v in zip((1.0, 4.0), (2, 3), values):
        updates, state = tx.update(
            jnp.full(2, g), state, params, count=n, value=jnp.float32(v)
        )
    np.testing.assert_array_equal(mm.window_stats(state).loss, np.float32(loss))
    np.testing.assert_allclose(updates, -np.full(2, (2 * 1.0 + 3 * 4.0) / 5), rtol=1e-6)


def test_count_zero_microbatches_count_toward_the_window_whatever_the_skip_says():
    """optax.skip_not_finite would skip the NaN gradient of an empty microbatch;
    the window counts it anyway, and the statistics see no tokens from it."""
    tx = mm.MaskedMultiSteps(
        optax.sgd(0.1),
        3,
        should_skip_update_fn=optax.skip_not_finite,
        window_stats=True,
    )
    params = jnp.zeros(2)
    state = tx.init(params)
    for g, n in [([1.0, 0.0], 2), ([np.nan, np.nan], 0), ([0.0, 3.0], 1)]:
        _, state = tx.update(jnp.array(g), state, params, count=jnp.array(n))
    assert bool(state.updated)
    stats = mm.window_stats(state)
    ref = _one_window(jnp.array([[1.0, 0.0], [0.0, 3.0]]), jnp.array([2, 1], jnp.int32))
    assert int(stats.microbatches) == 2 and int(stats.tokens) == 3
    np.testing.assert_allclose(stats.grad_var_trace, ref.grad_var_trace, rtol=1e-6)


@pytest.mark.parametrize("count_dtype", [jnp.float32, jnp.int32])
def test_statistics_follow_the_count_dtype(count_dtype):
    tx = mm.MaskedMultiSteps(
        optax.sgd(0.1), 2, count_dtype=count_dtype, window_stats=True
    )
    params = jnp.zeros(3)
    state = tx.init(params)
    for g, n in [(1.0, 2), (3.0, 2)]:
        _, state = tx.update(jnp.full(3, g), state, params, count=n)
    stats = mm.window_stats(state)
    assert stats.tokens.dtype == jnp.dtype(count_dtype) and int(stats.tokens) == 4
    np.testing.assert_allclose(stats.grad_var_trace, 12.0)  # 2·3 + 2·3 over 1


def test_microbatched_value_and_grad_returns_the_same_statistics():
    """One call of `microbatched_value_and_grad(..., with_stats=True)` is one
    window: its statistics equal the wrapper's over the same microbatches."""
    rng = np.random.default_rng(5)
    k, rows, width = 4, 16, 6
    # Unequal counts (microbatch j is rows j, j + 4, ...); microbatch 1 empty.
    mask = rng.uniform(size=(rows,)) < 0.7
    mask[[0, 2, 3]] = True
    mask[1::k] = False
    batch = {
        "x": jnp.asarray(rng.normal(size=(rows, width)), jnp.float32),
        "y": jnp.asarray(rng.normal(size=(rows,)), jnp.float32),
        "mask": jnp.asarray(mask),
    }

    def loss_fn(w, mb):
        return mm.masked_mean((mb["x"] @ w - mb["y"]) ** 2, mb["mask"])

    w = jnp.asarray(rng.normal(size=width), jnp.float32)
    grad_fn = jax.jit(mm.microbatched_value_and_grad(loss_fn, k, with_stats=True))
    (loss, count), grads, stats = grad_fn(w, batch)
    assert isinstance(stats, mm.WindowStats)

    tx = mm.MaskedMultiSteps(optax.sgd(0.1), k, window_stats=True)
    state = tx.init(w)
    for j in range(k):
        mb = jax.tree.map(lambda x, j=j: x[j::k], batch)
        (lj, nj), gj = jax.value_and_grad(loss_fn, has_aux=True)(w, mb)
        _, state = tx.update(gj, state, w, count=nj, value=lj)
    ref = mm.window_stats(state)
    assert int(stats.microbatches) == int(ref.microbatches) == k - 1  # one empty
    assert int(stats.tokens) == int(ref.tokens) == int(count)
    assert int(stats.windows) == 1 and float(stats.tokens_seen) == int(count)
    np.testing.assert_allclose(stats.loss, loss, rtol=1e-6)
    for name in (
        "loss",
        "grad_sq_norm",
        "grad_var_trace",
        "true_grad_sq_norm",
        "noise_scale",
    ):
        np.testing.assert_allclose(
            getattr(stats, name), getattr(ref, name), rtol=2e-5, err_msg=name
        )
    np.testing.assert_allclose(stats.smoothed_noise_scale, stats.noise_scale)
    # Without with_stats the output is unchanged.
    plain = jax.jit(mm.microbatched_value_and_grad(loss_fn, k))(w, batch)
    assert len(plain) == 2
    np.testing.assert_array_equal(plain[1], grads)
    with pytest.raises(TypeError, match="`with_stats` must be a bool, got 1"):
        mm.microbatched_value_and_grad(loss_fn, k, with_stats=1)


def test_switching_from_optax_multisteps_mid_window_keeps_the_statistics_unbiased():
    """The converted window holds the optax.MultiSteps mean as one microbatch
    of `acc_count` tokens."""
    params = jnp.zeros(2)
    old = optax.MultiSteps(optax.sgd(0.1), every_k_schedule=3)
    old_state = old.init(params)
    g = np.array([[1.0, 2.0], [3.0, 0.0], [-1.0, 5.0]], np.float32)
    for gi in g[:2]:
        _, old_state = old.update(jnp.asarray(gi), old_state, params)
    tx = mm.MaskedMultiSteps(optax.sgd(0.1), 3, window_stats=True)
    state = mm.from_optax_multisteps(old_state, tx, params, acc_count=2 * 4)
    _, state = tx.update(jnp.asarray(g[2]), state, params, count=jnp.array(5))
    stats = mm.window_stats(state)
    ref = _one_window(
        jnp.asarray(np.stack([g[:2].mean(axis=0), g[2]])),
        jnp.array([8, 5], jnp.int32),
    )
    assert int(stats.microbatches) == 2 and int(stats.tokens) == 13
    for name in ("grad_sq_norm", "grad_var_trace", "true_grad_sq_norm"):
        np.testing.assert_allclose(getattr(stats, name), getattr(ref, name), rtol=1e-6)


def test_repr_and_copies_keep_the_statistics_options():
    import copy

    tx = mm.MaskedMultiSteps(optax.sgd(0.1), 2, window_stats=True, stats_decay=0.5)
    assert "window_stats=True, stats_decay=0.5" in repr(tx)
    assert "window_stats" not in repr(mm.MaskedMultiSteps(optax.sgd(0.1), 2))
    # Pickling rebuilds it from the constructor's arguments (`__reduce__`).
    rebuild, args = tx.__reduce__()
    again = rebuild(*args)
    assert again is not tx and repr(again) == repr(tx)
    # A copy is the (immutable) wrapper itself.
    assert copy.deepcopy(tx) is tx and copy.copy(tx) is tx
    assert isinstance(again.init(jnp.zeros(2)).stats, _stats_state.WindowStatsState)


def test_a_0_1_checkpoint_mid_window_keeps_the_statistics_unbiased():
    """0.1 kept no statistics: the pending window's mean counts as one
    microbatch of its tokens. 0.1 counted a window's tokens whether or not
    `value=` was passed: the pending window holds no value weight, and the
    window's loss is the mean of the values passed after."""
    tx = mm.MaskedMultiSteps(optax.sgd(0.1), 2, window_stats=True)
    params = jnp.zeros(2)
    template = tx.init(params)
    old = {
        **mm.state_0_1_target(template),
        "mini_step": jnp.int32(1),
        "acc_count": jnp.int32(6),
        "acc_grads": jnp.array([1.0, -2.0]),
    }
    state = mm.from_state_0_1(old, template)
    assert float(state.value_count) == 0.0
    _, state = tx.update(
        jnp.array([3.0, 0.0]), state, params, count=jnp.int32(2), value=jnp.float32(3)
    )
    stats = mm.window_stats(state)
    ref = _one_window(jnp.array([[1.0, -2.0], [3.0, 0.0]]), jnp.array([6, 2]))
    assert int(stats.microbatches) == 2 and int(stats.tokens) == 8
    assert float(stats.loss) == 3.0
    for name in ("grad_sq_norm", "grad_var_trace", "true_grad_sq_norm"):
        np.testing.assert_allclose(getattr(stats, name), getattr(ref, name), rtol=1e-6)


def test_deferred_reduction_counts_each_devices_share_as_a_small_batch():
    """With reduction=mm.deferred, every device's share of a microbatch is a
    small batch of its own: the statistics equal those of a single-device
    window fed the same per-device gradients one by one, and the updates stay
    bit-identical with statistics on."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    ndev, rows, width = len(jax.devices()), 2, 4
    mesh = _data_mesh(ndev)
    data = NamedSharding(mesh, P("data"))
    rng = np.random.default_rng(6)

    def loss_fn(w, mb):
        x = jnp.where(mb["mask"][..., None], mb["x"], 0)  # padding holds NaN
        return mm.masked_mean((x @ w - mb["y"]) ** 2, mb["mask"])

    def batch(empty_device):
        mask = rng.uniform(size=(ndev * rows, 3)) < 0.8
        mask[empty_device * rows : (empty_device + 1) * rows] = False
        x = rng.normal(size=(ndev * rows, 3, width))
        return {
            "x": jnp.asarray(np.where(mask[..., None], x, np.nan), jnp.float32),
            "y": jnp.asarray(rng.normal(size=(ndev * rows, 3)), jnp.float32),
            "mask": jnp.asarray(mask),
        }

    grad_fn = jax.jit(mm.per_device_value_and_grad(loss_fn, mesh, "data"))
    params = jax.device_put(jnp.asarray(rng.normal(size=width), jnp.float32))
    pieces = [grad_fn(params, jax.device_put(batch(d), data)) for d in (1, 4)]

    def run(tx):
        state = tx.init(params)
        step = jax.jit(lambda s, g, n, v: tx.update(g, s, params, count=n, value=v))
        outs = []
        for (loss, count), grads in pieces:
            updates, state = step(state, grads, count, loss)
            outs.append(updates)
        return outs, state, step

    reduction = mm.deferred(mesh, "data")
    plain_tx = mm.MaskedMultiSteps(optax.adam(0.1), 2, reduction=reduction)
    stats_tx = mm.MaskedMultiSteps(
        optax.adam(0.1), 2, reduction=reduction, window_stats=True
    )
    plain_out, plain, plain_step = run(plain_tx)
    stats_out, with_stats, stats_step = run(stats_tx)
    for a, b in zip(plain_out, stats_out, strict=True):
        assert np.array_equal(a, b)
    assert bool(with_stats.updated)

    # Still one gradient-sized reduction per window, and no collective between
    # window ends, with or without statistics: every device keeps its own
    # Σᵢ nᵈᵢ‖gᵈᵢ‖² and K until the window closes, and their sums (8 bytes) and
    # the window's loss (4 bytes, recorded with statistics) join the window's
    # closing all-reduces.
    from _helpers import collectives

    def compiled(tx, step):
        # The program `run` compiled (the same jitted function: no new compile).
        (loss, count), grads = pieces[0]
        lowered = step.lower(tx.init(params), grads, count, loss)
        return sorted(
            (c.kind, c.where, c.bytes) for c in collectives(lowered.compile().as_text())
        )

    base = compiled(plain_tx, plain_step)
    more = compiled(stats_tx, stats_step)
    assert {where for _, where, _ in base} == {"branch"}, base
    assert {where for _, where, _ in more} == {"branch"}, more
    assert max(size for *_, size in base) >= 4 * width, base
    assert len(more) == len(base), (base, more)
    assert sum(c[2] for c in more) == sum(c[2] for c in base) + 12, (base, more)

    # The same pieces, one by one, through a single-device window.
    ref_tx = mm.MaskedMultiSteps(optax.sgd(0.1), 2 * ndev, window_stats=True)
    ref = ref_tx.init(jnp.zeros(width))
    ref_step = jax.jit(lambda g, s, n: ref_tx.update(g, s, jnp.zeros(width), count=n))
    for (_, count), grads in pieces:
        grads, count = np.asarray(grads), np.asarray(count)  # on one device
        for d in range(ndev):
            _, ref = ref_step(grads[d], ref, count[d])
    got, want = mm.window_stats(with_stats), mm.window_stats(ref)
    assert int(got.microbatches) == int(want.microbatches) == 2 * (ndev - 1)
    assert float(got.tokens) == float(want.tokens)
    for name in ("grad_sq_norm", "grad_var_trace", "true_grad_sq_norm"):
        np.testing.assert_allclose(
            getattr(got, name), getattr(want, name), rtol=1e-5, err_msg=name
        )


def test_noise_scale_estimates_are_nan_outside_their_domain():
    # S is a sum of squares and K a count of microbatches.
    for s, k in [
        (-1.0, 2),
        (jnp.nan, 2),
        (4.0, 2.5),
        (4.0, 1),
        (4.0, 0),
        (4.0, jnp.inf),
        (jnp.inf, 2),  # were inf and -inf
    ]:
        estimates = mm.noise_scale_estimates(s, k, 4, 4.0)
        assert all(np.isnan(float(x)) for x in estimates), (s, k)
    # N = inf gave finite estimates (4, 4, 1).
    assert np.isnan(mm.noise_scale_estimates(4.0, 2, np.inf, 4.0)).all()
    # An infinite ‖ḡ‖² (an overflow) gave B_simple = 0, a negative one a
    # negative |G|²; the wrapper's own estimates are NaN there.
    for g2 in (np.inf, -1.0, np.nan):
        assert np.isnan(mm.noise_scale_estimates(4.0, 2, 4, g2)).all(), g2
    # Complex arguments gave complex "estimates" (or lost their imaginary part);
    # other non-numbers failed in jax without naming the argument.
    for args, name in [
        ((4.0 + 1j, 2, 4, 4.0), "sq_deviation"),
        ((4.0, 2, 4, 4.0 + 1j), "grad_sq_norm"),
        ((4.0, None, 4, 4.0), "microbatches"),
        ((4.0, 2, "4", 4.0), "tokens"),
        ((4.0, 2, True, 4.0), "tokens"),
    ]:
        with pytest.raises(TypeError, match=f"`{name}` must be a real number"):
            mm.noise_scale_estimates(*args)
    # A WindowStats (a NamedTuple) became a vector of its fields: ten estimates.
    stats = mm.window_stats(
        mm.MaskedMultiSteps(optax.sgd(0.1), 2, window_stats=True).init(jnp.zeros(2))
    )
    with pytest.raises(TypeError, match=r"got a WindowStats: its fields are the"):
        mm.noise_scale_estimates(stats, 2, 4, 4.0)  # pyright: ignore[reportArgumentType]
    var, true_sq, b = mm.noise_scale_estimates(0.0, 2, 4, 4.0)  # agreeing microbatches
    assert (float(var), float(true_sq), float(b)) == (0.0, 4.0, 0.0)
    # Host integers by value: numpy int64 sums (mask.sum()) are not wrapped.
    n, k = np.int64(2**33), np.int64(2**32 + 2)
    got = mm.noise_scale_estimates(6000.0, 4, n, 2.0)
    want = mm.noise_scale_estimates(6000.0, 4, float(n), 2.0)
    np.testing.assert_array_equal(got, want)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(
        mm.noise_scale_estimates(6000.0, k, 100, 2.0)[0], 6000.0 / (2**32 + 1)
    )


@pytest.mark.parametrize("g", [0.1, 0.3, 0.7, 1.1])
def test_microbatches_that_agree_have_zero_variance_not_nan(g):
    # S = Σ nᵢ‖gᵢ‖² − N‖ḡ‖² is 0 up to rounding, which can make it slightly
    # negative: clamped at 0, the estimates are 0 or of the rounding's size
    # (XLA may fuse N‖ḡ‖²'s product into the subtraction, which then leaves
    # the weighted sum's own rounding), never NaN or negative.
    tx = mm.MaskedMultiSteps(optax.sgd(0.1), 3, window_stats=True)
    params = {"w": jnp.zeros(5)}
    state = tx.init(params)
    for _ in range(3):
        _, state = tx.update({"w": jnp.full(5, g)}, state, params, count=7)
    stats = mm.window_stats(state)
    # Σ nᵢ‖gᵢ‖² = 21·5g², each of its 3 roundings at most half an ulp.
    rounding = 3 * 21 * 5 * g**2 * 2.0**-24
    assert 0.0 <= float(stats.grad_var_trace) <= rounding / 2
    assert 0.0 <= float(stats.noise_scale) <= rounding / (2 * 5 * g**2)
    np.testing.assert_allclose(
        stats.true_grad_sq_norm, 5 * np.float32(g) ** 2, rtol=1e-6
    )


def test_tokens_seen_formats_as_a_number():
    stats_total = mm.TokenTotal(jnp.float32(2.0**24), jnp.float32(1.0))
    assert (int(stats_total), f"{stats_total:,.0f}") == (16777217, "16,777,217")
    # No spec: the number as a float formats, batched too; traced, the tuple.
    assert f"{stats_total}" == "16777217.0"
    batched = jax.tree.map(lambda x: jnp.stack([x, x]), stats_total)
    assert f"{batched}" == "[16777217. 16777217.]"
    jax.jit(lambda t: f"{t}" and t.hi)(stats_total)


def test_tokens_seen_does_arithmetic_and_comparisons_on_the_number():
    # As a tuple, `total * 2` was the 4-tuple (hi, lo, hi, lo), silently, and
    # `total / 1e6`, `total > 100` and `round(total)` were TypeErrors.
    total = mm.TokenTotal(jnp.float32(2.0**24), jnp.float32(1.0))
    exact = 2.0**24 + 1
    assert total * 2 == 2 * total == 2 * exact
    assert total / 1e6 == exact / 1e6 and 1e6 / total == 1e6 / exact
    assert total + 1 == 1 + total == exact + 1 and total - 1 == exact - 1
    assert total + total == 2 * exact and total // 2 == exact // 2
    assert total > exact - 1 and total >= exact and total <= exact
    assert not total < exact
    assert total == exact and total != exact + 1
    assert round(total) == 16777217 and total.item() == exact and -total == -exact
    # (The reflected remainder, divmod and powers were TypeErrors.)
    assert total % 7 == exact % 7 and 7 % total == 7 % exact
    assert divmod(total, 7) == divmod(exact, 7)
    assert divmod(2**25, total) == divmod(2**25, exact)
    small = mm.TokenTotal(jnp.float32(3.0), jnp.float32(0.0))
    assert total**2 == exact**2 and 2**small == 8.0
    assert isinstance(total * 2, np.float64)  # exact, not a float32 rounding
    # Traced: hi + lo, float32.
    doubled, above = jax.jit(lambda t: (t * 2, t > 5))(total)
    assert doubled.dtype == jnp.float32 and bool(above)


def test_tokens_seen_is_true_where_the_number_is():
    # As a tuple of two it was always true: `if seen:` took no tokens for some.
    zero = mm.TokenTotal(jnp.float32(0.0), jnp.float32(0.0))
    assert not zero and bool(zero) is False
    assert mm.TokenTotal(jnp.float32(0.0), jnp.float32(1.0))
    tx = mm.MaskedMultiSteps(optax.sgd(0.1), 2, window_stats=True)
    assert not mm.window_stats(tx.init(jnp.zeros(2))).tokens_seen
    with pytest.raises(jax.errors.TracerBoolConversionError):
        jax.jit(lambda t: jnp.float32(1.0 if t else 0.0))(zero)


def test_batched_tokens_seen_indexes_as_its_numbers():
    # As a tuple, `seen[1]` was the `lo` of every run, silently.
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 1, window_stats=True)
    params = {"w": jnp.zeros(2)}

    def run(count):
        _, state = tx.update({"w": jnp.ones(2)}, tx.init(params), params, count=count)
        return mm.window_stats(state).tokens_seen

    seen = jax.jit(jax.vmap(run))(jnp.array([2.0**24, 2.0, 3.0]))
    assert isinstance(seen[1], mm.TokenTotal) and float(seen[1]) == 2.0
    assert [float(seen[i]) for i in range(3)] == [2.0**24, 2.0, 3.0]
    # Formatted as its numbers are (numpy's `format` refused the spec).
    assert f"{seen:,.0f}" == "[16,777,216, 2, 3]"
    np.testing.assert_array_equal(np.asarray(seen[1:]), [2.0, 3.0])
    hi, lo = seen  # the pair, by unpacking (or by name)
    np.testing.assert_array_equal(hi, seen.hi)
    assert seen._replace(lo=seen.hi).lo is seen.hi  # NamedTuple methods intact
    assert jax.tree.structure(seen) == jax.tree.structure(mm.TokenTotal(0.0, 0.0))
    with pytest.raises(IndexError, match="has no entries to index"):
        seen[1][0]  # one total


def test_tokens_seen_is_one_number_to_numpy_and_jax():
    # As a tuple, the pair would read as [hi, lo] (a metric logger's silent
    # 2-vector); numpy gets the exact float64 total, jax hi + lo in float32.
    total = mm.TokenTotal(jnp.float32(2.0**24), jnp.float32(1.0))
    assert np.asarray(total).shape == () and np.asarray(total) == 2.0**24 + 1
    assert np.asarray(total).dtype == np.float64
    assert np.asarray(total, np.int64) == 2**24 + 1
    assert jnp.asarray(total).shape == () and jnp.asarray(total) == 2.0**24
    # A schedule in tokens takes it, also under jit, and batched totals stay
    # one number per run.
    lr = optax.linear_schedule(0.0, 1.0, 2**25)
    assert float(jax.jit(lambda t: lr(jnp.asarray(t)))(total)) == 0.5
    ramp = jnp.interp(total, jnp.array([0.0, 2.0**25]), jnp.array([0.0, 2.0]))
    assert float(ramp) == 1.0
    batched = jax.tree.map(lambda x: jnp.stack([x, 2 * x]), total)
    np.testing.assert_array_equal(np.asarray(batched), [2.0**24 + 1, 2.0**25 + 2])
    assert jnp.asarray(batched).shape == (2,)
    # What window_stats returns, through the wrapper.
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 1, window_stats=True)
    params = jnp.zeros(2)
    _, state = tx.update(jnp.ones(2), tx.init(params), params, count=jnp.int32(5))
    assert np.asarray(mm.window_stats(state).tokens_seen) == 5.0


def test_noise_scale_is_nan_where_the_true_gradient_estimate_is_exactly_zero():
    # B_simple is NaN, not inf, where |G|²̂ is exactly 0.
    # tr Σ̂ = 4 / 1 = 4, |G|²̂ = 1 − 4 / 4 = 0 exactly: B_simple is undefined.
    var, true_sq, b = mm.noise_scale_estimates(4.0, 2, 4, 1.0)
    assert (float(var), float(true_sq)) == (4.0, 0.0)
    assert np.isnan(float(b))
    # The same through the wrapper: gradients 0 and 2 with one token each give
    # ḡ = 1, S = 2, tr Σ̂ = 2, |G|²̂ = 1 − 2 / 2 = 0 exactly.
    tx = mm.MaskedMultiSteps(optax.sgd(0.1), 2, window_stats=True)
    params = {"w": jnp.zeros([])}
    state = tx.init(params)
    for g in (0.0, 2.0):
        _, state = tx.update({"w": jnp.float32(g)}, state, params, count=1)
    stats = mm.window_stats(state)
    assert float(stats.true_grad_sq_norm) == 0.0
    assert np.isnan(float(stats.noise_scale))


def test_a_non_finite_window_leaves_the_moving_averages_as_they_were():
    # The moving averages of tr Σ̂ and |G|²̂ skip a window without estimates
    # (decaying them there would reweight the windows before it against the
    # ones after), checked against a float64 model.
    decay = 0.5
    windows = [  # (gradients, counts) of windows of 2 microbatches
        ([1.0, 3.0], [2, 2]),
        ([np.inf, 1.0], [1, 1]),  # non-finite: recorded without estimates
        ([0.5, 4.0], [3, 1]),
    ]
    tx = mm.MaskedMultiSteps(optax.sgd(0.1), 2, window_stats=True, stats_decay=decay)
    params = {"w": jnp.zeros([])}
    state = tx.init(params)
    var_ema = true_ema = 0.0
    for grads, counts in windows:
        for g, n in zip(grads, counts, strict=True):
            _, state = tx.update({"w": jnp.float32(g)}, state, params, count=n)
        stats = mm.window_stats(state)
        g = np.asarray(grads, np.float64)
        n = np.asarray(counts, np.float64)
        if np.all(np.isfinite(g)):
            mean = np.sum(n * g) / n.sum()
            var = np.sum(n * (g - mean) ** 2) / (len(g) - 1)
            true_sq = mean**2 - var / n.sum()
            var_ema = decay * var_ema + (1 - decay) * var
            true_ema = decay * true_ema + (1 - decay) * true_sq
        else:
            assert np.isnan(float(stats.grad_var_trace))
        np.testing.assert_allclose(
            float(stats.smoothed_noise_scale), var_ema / true_ema, rtol=1e-5
        )


def test_the_window_counter_saturates_at_the_int32_maximum():
    # The window counter saturates (does not wrap to -2**31), as
    # num_invalid_counts and num_nonfinite_windows do.
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 1, window_stats=True)
    top = jnp.int32(2**31 - 1)
    state = tx.init(jnp.zeros(2))
    stats = state.stats
    state = state._replace(stats=stats.replaced(last=stats.last._replace(windows=top)))
    _, state = tx.update(jnp.ones(2), state, count=3)
    assert int(mm.window_stats(state).windows) == 2**31 - 1
    assert int(mm.window_stats(state).tokens) == 3


def test_tokens_seen_is_exact_for_float64_counts_under_x64():
    # A float64 count is added whole (its float32 rounding and the rest):
    # 2**24 + 1 tokens are not read as 2**24.
    with jax.enable_x64(True):
        tx = mm.MaskedMultiSteps(
            optax.sgd(1.0), 1, window_stats=True, count_dtype=jnp.float64
        )
        state = tx.init(jnp.zeros(2))
        update = jax.jit(tx.update)
        for _ in range(3):
            _, state = update(jnp.ones(2), state, count=jnp.float64(2**24 + 1))
        seen = mm.window_stats(state).tokens_seen
        assert int(seen) == 3 * (2**24 + 1), seen


def _closed_form_sq_norm_and_var(rows, counts):
    """‖ḡ‖² and tr Σ̂ of one window of gradients rᵢ with counts nᵢ, in float64
    (for gradients θ·rᵢ they are θ² times these, their derivatives in θ 2θ
    times)."""
    mean = (counts[:, None] * rows).sum(0) / counts.sum()
    spread = np.sum(counts * np.sum((rows - mean) ** 2, axis=1))
    return float(mean @ mean), float(spread / (len(counts) - 1))


def _scaled_window_stats(tx, rows, counts, theta, dtype=jnp.float32):
    """``mm.window_stats`` after one window of gradients θ·rᵢ (computed in
    float32, then cast to ``dtype``) with counts nᵢ."""
    params = {"w": jnp.zeros(rows.shape[1], dtype)}
    state = tx.init(params)
    for r, n in zip(rows, counts, strict=True):
        g = {"w": (theta * jnp.asarray(r, jnp.float32)).astype(dtype)}
        _, state = tx.update(g, state, params, count=jnp.float32(n))
    return mm.window_stats(state)


def test_derivatives_of_the_statistics_match_their_closed_form():
    # Against the closed form (the other derivative tests compare reverse
    # with forward mode, both from the same custom rule).
    rows = np.array([[1.0, 2.0, -1.0], [0.5, 0.0, 3.0]])
    counts = np.array([2.0, 3.0])
    a, b = _closed_form_sq_norm_and_var(rows, counts)
    tx = mm.MaskedMultiSteps(optax.sgd(0.1), 2, window_stats=True)

    def both(theta):
        s = _scaled_window_stats(tx, rows, counts, theta)
        return jnp.stack([s.grad_sq_norm, s.grad_var_trace])

    theta = 1.5
    grads = jax.jit(jax.jacrev(both))(theta)  # reverse mode, one compilation
    np.testing.assert_allclose(grads, [2 * theta * a, 2 * theta * b], rtol=1e-5)


def test_a_stats_decay_of_zero_is_accepted_and_smooths_nothing():
    # The documented range [0, 1) includes 0: no smoothing.
    tx = mm.MaskedMultiSteps(optax.sgd(0.1), 2, window_stats=True, stats_decay=0.0)
    params = {"w": jnp.zeros([])}
    state = tx.init(params)
    for g, n in [(1.0, 2), (3.0, 2), (0.5, 1), (4.0, 3)]:
        _, state = tx.update({"w": jnp.float32(g)}, state, params, count=n)
    stats = mm.window_stats(state)
    assert np.isfinite(float(stats.noise_scale))
    np.testing.assert_allclose(stats.smoothed_noise_scale, stats.noise_scale, rtol=1e-6)


def test_microbatched_statistics_of_a_batch_without_tokens_have_no_loss():
    # An all-masked batch has no loss (NaN), not the masked mean's 0.
    def loss_fn(w, mb):
        return mm.masked_mean((mb["x"] * w) ** 2, mb["mask"])

    batch = {"x": jnp.ones((4, 3)), "mask": jnp.zeros((4, 3), bool)}
    grad_fn = mm.microbatched_value_and_grad(loss_fn, 2, with_stats=True)
    (loss, count), _, stats = grad_fn(jnp.float32(1.0), batch)
    assert int(count) == 0 and int(stats.tokens) == 0
    assert np.isnan(float(stats.loss))


def test_deferred_statistics_of_complex_gradients_use_their_modulus():
    # Each device's nᵈ‖gᵈ‖² counts the imaginary parts too.
    ndev = len(jax.devices())
    mesh = _data_mesh(ndev)
    tx = mm.MaskedMultiSteps(
        optax.sgd(0.1), 1, window_stats=True, reduction=mm.deferred(mesh, "data")
    )
    rng = np.random.default_rng(0)
    g = (rng.normal(size=(ndev, 3)) + 1j * rng.normal(size=(ndev, 3))).astype(
        np.complex64
    )
    n = np.arange(1, ndev + 1, dtype=np.float32)
    params = {"w": jnp.zeros(3, jnp.complex64)}
    state = tx.init(params)
    _, state = jax.jit(tx.update)(
        {"w": jnp.asarray(g)}, state, params, count=jnp.asarray(n)
    )
    stats = mm.window_stats(state)
    g64, n64 = g.astype(np.complex128), n.astype(np.float64)
    mean = (n64[:, None] * g64).sum(0) / n64.sum()
    s = np.sum(n64 * np.sum(np.abs(g64 - mean) ** 2, axis=1))
    np.testing.assert_allclose(float(stats.grad_var_trace), s / (ndev - 1), rtol=1e-5)


def test_window_stats_errors_say_where_to_look():
    params = {"a": jnp.zeros(2), "b": jnp.zeros(3)}
    # An optax.MultiSteps state: the error names the conversion.
    old = optax.MultiSteps(optax.sgd(0.1), 2)
    with pytest.raises(ValueError, match=r"found 0 in a MultiStepsState: .*from_optax"):
        mm.window_stats(old.init(params))
    with pytest.raises(ValueError, match=r"convert it with `mm.from_optax_multisteps"):
        mm.has_updated(optax.chain(optax.clip(1.0), old).init(params))
    # Two wrappers inside a train state: the hint points into its opt_state.
    pytest.importorskip("flax")
    from flax.training import train_state

    per_leaf = {
        name: mm.MaskedMultiSteps(
            optax.sgd(0.1), 2, window_stats=True
        ).gradient_transformation()
        for name in params
    }
    tx = optax.multi_transform(per_leaf, {name: name for name in params})
    state = train_state.TrainState.create(apply_fn=None, params=params, tx=tx)
    with pytest.raises(
        ValueError,
        # (One wrapper per branch is right: no word of a chain's mistake.)
        match=r"found 2 in a TrainState \(at `state\.opt_state\.inner_states\['a'\]"
        r"\.inner_state`, `state\.opt_state\.inner_states\['b'\]\.inner_state`\): "
        r"pass the one you mean\.$",
    ):
        mm.window_stats(state)
    stats = mm.window_stats(state.opt_state.inner_states["a"])
    assert int(stats.windows) == 0


# Gradients of a few hundred: every n·‖gᵢ‖² term is far beyond float16's
# range per element product g·dg, and S is a small difference of large sums.
_LOW_PRECISION_ROWS = np.array([[300.0, 200, 310], [290, 250, 330], [280, 260, 300]])
_LOW_PRECISION_COUNTS = np.array([1.0, 2.0, 3.0])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_derivatives_of_the_statistics_of_low_precision_gradients(dtype):
    # The statistics are computed in float32 from bfloat16 or float16
    # gradients, and so are their derivatives: forward and reverse mode agree
    # with the closed form (the values above are exact in both dtypes).
    a, b = _closed_form_sq_norm_and_var(_LOW_PRECISION_ROWS, _LOW_PRECISION_COUNTS)
    tx = mm.MaskedMultiSteps(optax.sgd(0.1), 3, window_stats=True)

    def both(theta):
        s = _scaled_window_stats(
            tx, _LOW_PRECISION_ROWS, _LOW_PRECISION_COUNTS, theta, dtype
        )
        return jnp.stack([s.grad_sq_norm, s.grad_var_trace])

    value, forward = jax.jit(lambda t: jax.jvp(both, (t,), (1.0,)))(1.0)
    reverse = jax.jit(jax.jacrev(both))(1.0)
    np.testing.assert_allclose(value, [a, b], rtol=1e-4)
    np.testing.assert_allclose(forward, [2 * a, 2 * b], rtol=1e-4)
    np.testing.assert_allclose(reverse, [2 * a, 2 * b], rtol=1e-3)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_microbatched_statistics_derivatives_of_low_precision_gradients(dtype):
    # The same through mm.microbatched_value_and_grad(with_stats=True).
    a, b = _closed_form_sq_norm_and_var(_LOW_PRECISION_ROWS, _LOW_PRECISION_COUNTS)
    batch = {
        "x": jnp.asarray(_LOW_PRECISION_ROWS, jnp.float32),
        "n": jnp.asarray(_LOW_PRECISION_COUNTS, jnp.float32),
    }
    params = jnp.zeros(3, dtype)

    def both(theta):
        def loss_fn(w, mb):
            return jnp.sum((theta * mb["x"][0]).astype(dtype) * w), mb["n"][0]

        grad_fn = mm.microbatched_value_and_grad(loss_fn, 3, with_stats=True)
        _, _, s = grad_fn(params, batch)
        return jnp.stack([s.grad_sq_norm, s.grad_var_trace])

    _, forward = jax.jit(lambda t: jax.jvp(both, (t,), (1.0,)))(1.0)
    reverse = jax.jit(jax.jacrev(both))(1.0)
    np.testing.assert_allclose(forward, [2 * a, 2 * b], rtol=1e-4)
    np.testing.assert_allclose(reverse, [2 * a, 2 * b], rtol=1e-3)


def test_derivative_of_the_squared_norm_of_a_float16_accumulator_is_finite():
    # ‖ḡ‖² read from a float16 accumulator (mean of a few hundred): its
    # tangent is formed in float32, not as a float16 product that overflows.
    tx = mm.MaskedMultiSteps(
        optax.sgd(0.1), 3, window_stats=True, accumulator_dtype=jnp.float16
    )

    def sq_norm(theta):
        return _scaled_window_stats(
            tx, _LOW_PRECISION_ROWS, _LOW_PRECISION_COUNTS, theta
        ).grad_sq_norm

    value, tangent = jax.jit(lambda t: jax.jvp(sq_norm, (t,), (1.0,)))(1.0)
    assert np.isfinite(float(tangent)), tangent
    np.testing.assert_allclose(tangent, 2 * value, rtol=1e-6)


def test_an_eager_read_of_a_state_laid_over_a_mesh_is_one_program():
    # Read outside a trace, the statistics of a state replicated over several
    # devices come from one compiled program, not one per operation of the
    # read (each its own multi-device dispatch), and equal the same read on one
    # device, NaN placeholders included (K = 1 leaves the noise scale undefined).
    from _helpers import backend_compiles

    tx = mm.MaskedMultiSteps(optax.sgd(0.1), 2, window_stats=True)
    params = jnp.zeros(3)
    state = tx.init(params)
    for g, n in [(1.0, 2), (3.0, 0)]:
        _, state = tx.update(
            jnp.full(3, g), state, params, count=jnp.array(n), value=jnp.array(g)
        )
    # Three devices: a placement no other test reads statistics on.
    mesh = jax.sharding.Mesh(np.array(jax.devices()[2:5]), ("d",))
    laid = jax.device_put(state, jax.NamedSharding(mesh, jax.P()))
    with backend_compiles() as compiles:
        got = mm.window_stats(laid)
    assert len(compiles) <= 1, compiles
    with backend_compiles() as compiles:
        again = mm.window_stats(laid)
    assert compiles == []
    want = mm.window_stats(state)
    assert np.isnan(float(want.noise_scale))
    for read in (got, again):
        for a, b in zip(jax.tree.leaves(read), jax.tree.leaves(want)):
            np.testing.assert_array_equal(a, b)


def _scalar_reductions(fn, *args):
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    return [
        e
        for e in jaxpr.eqns
        if e.primitive.name == "reduce_sum" and e.outvars[0].aval.shape == ()
    ]


@pytest.fixture
def as_on_one_gpu(monkeypatch):
    """The squared norms as a GPU's one device gets them (8 CPU devices here)."""
    monkeypatch.setattr(_sq_norms, "ONE_REDUCTION", True)
    monkeypatch.setattr(jax, "device_count", lambda *a, **k: 1)


def test_a_trees_squared_norm_is_one_reduction_per_shape_of_rows(as_on_one_gpu):
    # Each leaf's rows are summed, the rows of leaves of one shape added up,
    # then summed: on GPUs one kernel for their second stages, where a sum of
    # per-leaf norms was a kernel per leaf on every microbatch.
    rng = np.random.default_rng(5)
    tree = {
        "matrix": rng.normal(size=(7, 5)),
        "vector": rng.normal(size=7),  # rows of the matrix's shape
        "bf16": rng.normal(size=(7, 9)),
        "complex": rng.normal(size=(7, 2)) + 1j * rng.normal(size=(7, 2)),
        "cube": rng.normal(size=(2, 3, 4)),
        "scalar": np.float32(3.0),
        "empty rows": np.zeros((0, 4)),
        "empty columns": np.zeros((3, 0)),
    }
    dtypes = {"bf16": jnp.bfloat16, "complex": jnp.complex64}
    leaves = {k: jnp.asarray(v, dtypes.get(k, jnp.float32)) for k, v in tree.items()}
    want = sum(
        float(np.sum(np.abs(np.asarray(x, np.complex128)) ** 2))
        for x in leaves.values()
    )
    got = _sq_norms.tree_sq_norm(leaves)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(float(got), want, rtol=1e-6)
    # (7,): matrix, vector, bf16, complex; then (2, 3), (), (0,), (3,).
    assert len(_scalar_reductions(_sq_norms.tree_sq_norm, leaves)) == 5
    assert float(_sq_norms.tree_sq_norm({})) == 0.0


def test_a_trees_squared_norm_leaf_by_leaf_elsewhere():
    # CPUs (and TPUs) reduce leaf by leaf: no kernel per second stage there,
    # and adding the rows up is a pass XLA:CPU would pay for.
    tree = {"a": jnp.ones((4, 3)), "b": jnp.ones((4, 5)), "c": jnp.ones(4)}
    assert len(_scalar_reductions(_sq_norms.tree_sq_norm, tree)) == 3
    assert float(_sq_norms.tree_sq_norm(tree)) == 36.0


def test_a_trees_squared_norm_sums_each_precision_apart_under_x64(as_on_one_gpu):
    # float64 leaves are summed in float64, the others in float32, then added.
    with jax.enable_x64(True):
        tree = {
            "a": jnp.full((5, 4), 0.1, jnp.float64),
            "b": jnp.ones(5, jnp.float32),
            "c": jnp.ones((5, 2), jnp.float32),
        }
        got = _sq_norms.tree_sq_norm(tree)
        assert got.dtype == jnp.float64
        np.testing.assert_allclose(float(got), 15 + 20 * 0.01, rtol=1e-13)
        assert len(_scalar_reductions(_sq_norms.tree_sq_norm, tree)) == 2


@pytest.mark.parametrize("gpu", [True, False], ids=["gpu", "cpu"])
def test_a_microbatch_adds_its_figures_in_the_form_of_its_backend(gpu, monkeypatch):
    # As on GPUs each vector is rewritten whole (an elementwise select): its
    # entry sliced and written back in place (dynamic_update_slice), jax
    # 0.12's XLA:GPU copied both vectors first, two kernels more on every
    # microbatch, six with the norm test (compiled H100 programs). XLA:CPU
    # fuses each leaf's reduction into the write in place, so CPUs keep it.
    # The figures are the same to the bit either way, other entries
    # (non-finite, -0.0) untouched.
    monkeypatch.setattr(_sq_norms, "ONE_REDUCTION", gpu)
    state = _stats_state.init_window_stats(jnp.int32)._replace(
        sums=jnp.array([0.5, -0.0, np.nan, np.inf, -1.5, 2, 3, 4, 5], jnp.float32),
        tallies=jnp.array([7, -1, 2], jnp.int32),
    )
    batch = jax.tree.map(lambda x: jnp.stack([x, x, x]), state)
    cases = (
        (state, 0.25, 1, True),
        (state, 0.25, 1, False),
        (batch, [0.25, 1, 2], [1, 2, 3], [True, False, True]),
    )
    for st, norms, microbatches, where in cases:
        got = jax.jit(lambda st, n, k, w: st.plus(n, k, where=w))(
            st, np.float32(norms), np.int32(microbatches), np.bool_(where)
        )
        for vector, value in (("sums", norms), ("tallies", microbatches)):
            old = np.asarray(getattr(st, vector))
            add = np.asarray(where)[..., None] & (np.arange(old.shape[-1]) == 0)
            want = np.where(add, old + np.asarray(value, old.dtype)[..., None], old)
            assert_bit_identical(getattr(got, vector), want)
    jaxpr = str(jax.make_jaxpr(lambda st: st.plus(np.float32(0.25), 1))(state))
    assert ("dynamic_update_slice" in jaxpr) is not gpu


def _mesh_2x4(axis_type):
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(axis_type,) * 2)


def test_rows_split_over_explicit_axes_add_up_where_they_are(monkeypatch):
    # As on GPUs: leaves split over different explicit axes (FSDP beside
    # tensor parallelism) are summed apart by sharding; adding their rows
    # raised jax's ShardingTypeError.
    monkeypatch.setattr(_sq_norms, "ONE_REDUCTION", True)
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = _mesh_2x4(jax.sharding.AxisType.Explicit)
    rng = np.random.default_rng(0)
    specs = {"w": P("model", None), "v": P("data", None), "u": P("model", None)}
    tree = {
        k: jax.device_put(
            jnp.asarray(rng.normal(size=(8, 6)), jnp.float32), NamedSharding(mesh, s)
        )
        for k, s in specs.items()
    }
    want = sum(float(np.sum(np.square(np.asarray(x)))) for x in tree.values())
    got = jax.jit(_sq_norms.tree_sq_norm)(tree)
    np.testing.assert_allclose(float(got), want, rtol=1e-6)
    with jax.set_mesh(mesh):
        assert len(_scalar_reductions(_sq_norms.tree_sq_norm, tree)) == 2
    tx = mm.MaskedMultiSteps(optax.sgd(0.1), 2, window_stats=True)
    state = tx.init(tree)
    _, state = jax.jit(tx.update)(tree, state, tree, count=jnp.float32(3))
    np.testing.assert_allclose(
        float(state.stats.weighted_sq_norms), 3 * want, rtol=1e-6
    )


def test_rows_split_over_automatic_axes_are_not_added_up(monkeypatch):
    # Over automatic axes the rows' shardings are the partitioner's to choose:
    # adding them up would all-gather rows on every microbatch, so the
    # squared norms stay one per leaf there (one scalar all-reduce).
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = _mesh_2x4(jax.sharding.AxisType.Auto)
    specs = {"w": P("model", None), "v": P("data", None)}
    tree = {
        k: jax.device_put(jnp.ones((8, 6)), NamedSharding(mesh, s))
        for k, s in specs.items()
    }

    monkeypatch.setattr(_sq_norms, "ONE_REDUCTION", True)
    text = jax.jit(lambda t: _sq_norms.tree_sq_norm(t)).lower(tree).compile().as_text()
    assert float(jax.jit(lambda t: _sq_norms.tree_sq_norm(t))(tree)) == 96.0
    assert not _COLLECTIVE_MOVES.findall(text)
    # (Forced to add them up, the partitioner all-gathers the rows.)
    monkeypatch.setattr(_sq_norms, "_one_reduction", lambda leaves: True)
    text = jax.jit(lambda t: _sq_norms.tree_sq_norm(t)).lower(tree).compile().as_text()
    assert _COLLECTIVE_MOVES.findall(text)


# Collectives that move slices between devices (not a scalar's all-reduce).
_COLLECTIVE_MOVES = re.compile(
    r" (all-gather|all-to-all|collective-permute)(-start)?\("
)
_VECTOR_ALL_REDUCE = re.compile(r"= \(?[^=]*f32\[\d+[^=]*all-reduce(-start)?\(")


def test_a_last_axis_split_over_devices_is_reduced_as_a_scalar(monkeypatch):
    # Its rows' sums would be partial sums, all-reduced across the devices
    # as a vector; reduced to a scalar first, one scalar crosses.
    monkeypatch.setattr(_sq_norms, "ONE_REDUCTION", True)
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = _mesh_2x4(jax.sharding.AxisType.Explicit)
    tree = {
        "w": jax.device_put(
            jnp.ones((16, 1024)), NamedSharding(mesh, P(None, "model"))
        ),
        "v": jax.device_put(jnp.ones((16, 8)), NamedSharding(mesh, P("data", None))),
    }
    text = jax.jit(lambda t: _sq_norms.tree_sq_norm(t)).lower(tree).compile().as_text()
    assert float(jax.jit(lambda t: _sq_norms.tree_sq_norm(t))(tree)) == 16 * 1032
    reduces = [line for line in text.splitlines() if "all-reduce(" in line]
    assert reduces and not any(_VECTOR_ALL_REDUCE.search(line) for line in reduces)
    assert not _COLLECTIVE_MOVES.findall(text)


def test_one_device_keeps_rows_on_differently_named_axes_apart(as_on_one_gpu):
    # A data × model mesh of one device each (explicit axes, jax.make_mesh's
    # default): rows typed as split over different axes cannot be added up
    # (jax's ShardingTypeError), even on one device.
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh(
        (1, 1),
        ("data", "model"),
        axis_types=(jax.sharding.AxisType.Explicit,) * 2,
        devices=jax.devices()[:1],
    )
    specs = {"w": P("model", None), "v": P("data", None), "u": P(None, "model")}
    tree = {
        k: jax.device_put(jnp.ones((8, 6)), NamedSharding(mesh, s))
        for k, s in specs.items()
    }
    assert float(jax.jit(lambda t: _sq_norms.tree_sq_norm(t))(tree)) == 144.0
    assert float(_sq_norms.tree_sq_norm(tree)) == 144.0
    tx = mm.MaskedMultiSteps(optax.sgd(0.1), 2, window_stats=True)
    _, state = jax.jit(tx.update)(tree, tx.init(tree), tree, count=jnp.float32(1))
    assert float(state.stats.weighted_sq_norms) == 144.0


def test_the_packed_state_reads_and_writes_each_figure_by_name():
    """The state's fourteen scalars live in three arrays; each figure reads
    back what was written, the others stay as they were (also for a state
    batched by vmap, whose figures are batched alike)."""
    state = _stats_state.init_window_stats(jnp.int32)
    last = state.last._replace(
        tokens=jnp.int32(7),
        microbatches=jnp.int32(3),
        loss=jnp.float32(0.5),
        loss_tokens=jnp.int32(6),
        grad_sq_norm=jnp.float32(2.0),
        sq_deviation=jnp.float32(4.0),
        tokens_seen=mm.TokenTotal(jnp.float32(70.0), jnp.float32(1.0)),
        windows=jnp.int32(10),
    )
    state = state.replaced(ema_weight=jnp.float32(0.25), last=last)
    assert state.last == jax.tree.map(jnp.asarray, last)
    assert float(state.ema_weight) == 0.25 and float(state.weighted_sq_norms) == 0
    assert state.counts.dtype == jnp.int32
    grown = state.plus(jnp.float32(3.0), jnp.int32(1), where=True)
    held = state.plus(jnp.float32(jnp.nan), jnp.int32(1), where=False)
    assert float(grown.weighted_sq_norms) == 3.0 and int(grown.microbatches) == 1
    assert grown.last == state.last and float(grown.ema_weight) == 0.25
    assert_bit_identical(held, state)
    with pytest.raises(TypeError, match=r"no figure named 'tokens'"):
        state.replaced(tokens=1)
    batched = jax.vmap(lambda n: state.plus(n, jnp.int32(1)))(jnp.arange(3.0))
    np.testing.assert_array_equal(batched.weighted_sq_norms, [0.0, 1.0, 2.0])
    np.testing.assert_array_equal(batched.last.windows, [10, 10, 10])


@pytest.mark.parametrize(
    ("element", "count", "sq_norm_finite"),
    [(1e20, 1.0, False), (1e5, 1e30, True)],
    ids=["squared-norm-overflows", "count-times-it-overflows"],
)
def test_float32_overflow_of_the_statistics_is_as_documented(
    element, count, sq_norm_finite
):
    # An element past 1e19: ‖ḡ‖² infinite, the estimates NaN. nᵢ‖gᵢ‖² past
    # float32's range (1e30 tokens of a gradient of norm 1e5): the estimates
    # NaN, ‖ḡ‖² (of the mean) finite. The update is unaffected either way.
    params = {"w": jnp.zeros(2)}
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 2, window_stats=True)
    state = tx.init(params)
    g = {"w": jnp.array([element, 0.0], jnp.float32)}
    for _ in range(2):
        updates, state = tx.update(g, state, params, count=jnp.float32(count))
    np.testing.assert_array_equal(updates["w"], -g["w"])
    stats = mm.window_stats(state)
    assert np.isfinite(float(stats.grad_sq_norm)) == sq_norm_finite
    if sq_norm_finite:
        np.testing.assert_allclose(float(stats.grad_sq_norm), element**2, rtol=1e-6)
    for estimate in (stats.grad_var_trace, stats.true_grad_sq_norm, stats.noise_scale):
        assert np.isnan(float(estimate))
