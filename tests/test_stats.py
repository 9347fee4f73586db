"""Window statistics: the estimators of tr Σ, |G|² and B_simple, and their state."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import masked_multistep as mm
from masked_multistep import _stats

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
        jnp.array(True),
        tokens=total,
        grad_sq_norm=_stats.tree_sq_norm(mean),
        loss=jnp.float32(jnp.nan),
        decay=decay,
    )


def _one_window(grads, counts):
    return _window(_stats.init_window_stats(counts.dtype), grads, counts).last


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


@pytest.mark.parametrize("tokens_per_noise_scale", [1, 10, 100])
def test_spread_matches_float64_two_pass(tokens_per_noise_scale):
    """S = Σ nᵢ‖gᵢ − ḡ‖² from the float32 state against a float64 two-pass sum,
    at N / B_simple = 1, 10 and 100 (S is formed by a subtraction whose
    cancellation grows with N / B_simple)."""
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
    stats = _stats.init_window_stats(jnp.float32)
    stats = _stats.accumulate_window_stats(stats, jnp.arange(3.0), jnp.float32(2.5))
    after = _stats.accumulate_window_stats(
        stats, jnp.array([jnp.nan, jnp.inf, 1.0]), jnp.float32(0)
    )
    for a, b in zip(jax.tree.leaves(stats), jax.tree.leaves(after), strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True)
    # A window that does not end leaves the snapshot alone.
    kept = _stats.close_window_stats(
        after,
        jnp.array(False),
        tokens=jnp.float32(2.5),
        grad_sq_norm=jnp.float32(5.0),
        loss=jnp.float32(1.0),
        decay=DECAY,
    )
    for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(kept), strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True)


def test_non_finite_gradient_spoils_only_its_window():
    stats = _stats.init_window_stats(jnp.int32)
    bad = jnp.array([[1.0, 1.0], [jnp.inf, 0.0], [0.0, 1.0]])
    stats = _window(stats, bad, jnp.array([1, 2, 3], jnp.int32))
    assert np.isnan(stats.last.grad_var_trace) and np.isnan(stats.last.noise_scale)
    assert float(stats.ema_weight) == 0.0  # not averaged in
    good = jnp.array([[1.0, 1.0], [2.0, 0.0], [0.0, 1.0]])
    stats = _window(stats, good, jnp.array([1, 2, 3], jnp.int32))
    assert np.isfinite(stats.last.grad_var_trace)
    assert int(stats.last.windows) == 2 and float(stats.last.tokens_seen) == 12.0


def test_smoothing_is_a_ratio_of_debiased_moving_averages():
    rng = np.random.default_rng(3)
    stats = _stats.init_window_stats(jnp.int32)
    counts = jnp.array([4, 7, 2, 9], jnp.int32)
    window = jax.jit(_window)
    var, true_sq, smoothed = [], [], []
    for _ in range(6):
        grads = jnp.asarray(rng.normal(loc=0.3, size=(4, 16)), jnp.float32)
        stats = window(stats, grads, counts)
        var.append(float(stats.last.grad_var_trace))
        true_sq.append(float(stats.last.true_grad_sq_norm))
        smoothed.append(float(stats.last.smoothed_noise_scale))
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
        return _stats._add_tokens(total, jnp.asarray(count, dtype)), None

    zero = _stats.TokenTotal(jnp.zeros([], jnp.float32), jnp.zeros([], jnp.float32))
    total, _ = jax.jit(lambda t: jax.lax.scan(body, t, None, length=steps))(zero)
    assert count * steps > 2**40
    assert float(total) == count * steps
    assert total.value() == count * steps


def test_reverse_mode_derivatives_are_finite_through_empty_microbatches():
    def spread(g):
        m, total, s = jnp.zeros(2), jnp.float32(0), jnp.float32(0)
        stats = _stats.init_window_stats(jnp.float32)
        for gi, n in [(g, 2.0), (jnp.full(2, jnp.nan), 0.0), (2 * g + 1, 3.0)]:
            m, total, ds = mm.running_mean_update(
                m, total, gi, jnp.float32(n), with_sq_deviation=True
            )
            s = s + ds
            stats = _stats.accumulate_window_stats(stats, gi, jnp.float32(n))
        return s + stats.weighted_sq_norms

    grad = jax.grad(spread)(jnp.array([0.5, -1.0]))
    assert np.all(np.isfinite(grad)), grad
