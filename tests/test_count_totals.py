"""Counts in `microbatched_value_and_grad` and `weighted_mean_across`.

Counts are float32 weights, converted by value: totals never wrap, wide integer
counts keep their value, and a count that is negative, NaN or infinite carries
no tokens (traced) or is refused (concrete).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import masked_multistep as mm
from masked_multistep._token_total import add_tokens


def _across(grads, counts):
    """`weighted_mean_across` over a vmapped axis of shards."""
    return jax.jit(
        jax.vmap(lambda g, n: mm.weighted_mean_across(g, n, "s"), axis_name="s")
    )(grads, counts)


def _counted_loss(w, mb):
    """Mean of ``w * v`` over the rows, weighted by the per-row counts ``n``."""
    n = mb["n"]
    count = jnp.sum(n)
    weights = n.astype(jnp.float32)
    loss = jnp.sum(weights * w * mb["v"]) / jnp.sum(weights)
    return loss, count


def test_weighted_mean_across_int32_total_beyond_2_31_does_not_wrap():
    """Three shards of 2**30 tokens: an int32 total wraps to -2**30 (mean -6)."""
    counts = jnp.full(3, 2**30, jnp.int32)
    mean, total = _across(jnp.array([1.0, 2.0, 3.0]), counts)
    np.testing.assert_allclose(np.asarray(mean), 2.0, rtol=1e-6)
    assert total.dtype == jnp.float32
    assert np.all(np.asarray(total, np.float64) == 3 * 2**30)


def test_microbatched_int32_total_beyond_2_31_does_not_wrap():
    """Four microbatches of 2**30 tokens each: the total is 2**32, exactly."""
    k = 4
    v = jnp.arange(8.0)
    batch = {"v": v, "n": jnp.full(8, 2**29, jnp.int32)}
    (loss, count), grad = jax.jit(mm.microbatched_value_and_grad(_counted_loss, k))(
        jnp.array(2.0), batch
    )
    assert count.dtype == jnp.float32 and float(count) == 2.0**32
    np.testing.assert_allclose(float(loss), 2.0 * float(v.mean()), rtol=1e-6)
    np.testing.assert_allclose(float(grad), float(v.mean()), rtol=1e-6)


def test_host_int64_count_keeps_its_value():
    """`np.sum(mask)` on the host is int64; jnp.asarray would wrap 2**32 + 5 to 5."""
    big = np.int64(2**32 + 5)
    mean, total = _across(jnp.array([1.0, 3.0]), big * np.ones(2, np.int64))
    np.testing.assert_allclose(np.asarray(mean), 2.0)
    # A constant count (not mapped) is converted on the host.
    mean, total = jax.vmap(
        lambda g: mm.weighted_mean_across(g, big, "s"), axis_name="s"
    )(jnp.array([1.0, 3.0]))
    np.testing.assert_allclose(np.asarray(mean), 2.0)
    np.testing.assert_allclose(np.asarray(total, np.float64), 2 * (2**32 + 5))

    grad_fn = mm.microbatched_value_and_grad(lambda w, mb: (w * jnp.mean(mb), big), 2)
    (loss, count), _ = jax.jit(grad_fn)(jnp.array(1.0), jnp.arange(4.0))
    np.testing.assert_allclose(float(count), 2 * (2**32 + 5), rtol=1e-7)
    np.testing.assert_allclose(float(loss), 1.5)


@pytest.mark.parametrize(
    ("dtype", "value"),
    [
        (jnp.uint64, 7),
        (jnp.uint64, 2**33 + 1),
        (jnp.int64, 2**40),
        (jnp.uint8, 60),
        (jnp.int16, 3),
        (jnp.float64, 2.5),
    ],
)
def test_every_count_dtype_is_converted_by_value(dtype, value):
    with jax.enable_x64(True):
        counts = jnp.array([value, 3 * value], dtype)
        mean, total = _across(jnp.array([1.0, 5.0], jnp.float32), counts)
        np.testing.assert_allclose(np.asarray(mean), 4.0, rtol=1e-6)
        assert total.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(total, np.float64), 4 * value, rtol=1e-7)

        batch = {"v": jnp.array([1.0, 5.0]), "n": counts}
        (loss, count), grad = jax.jit(mm.microbatched_value_and_grad(_counted_loss, 2))(
            jnp.array(1.0, jnp.float32), batch
        )
        assert count.dtype == jnp.float32
        np.testing.assert_allclose(float(count), 4 * value, rtol=1e-7)
        np.testing.assert_allclose(float(loss), 4.0, rtol=1e-6)


# Microbatch 0 holds the only valid count; the others hold inf, NaN and -1
# tokens, and their losses NaN or garbage: none of it may reach the result.
_BAD_COUNTS = [5.0, np.inf, np.nan, -1.0]


def test_weighted_mean_across_ignores_non_finite_and_negative_counts():
    grads = jnp.array([2.0, 100.0, jnp.nan, -7.0])
    mean, total = _across(grads, jnp.asarray(_BAD_COUNTS, jnp.float32))
    np.testing.assert_array_equal(np.asarray(mean), 2.0)
    np.testing.assert_array_equal(np.asarray(total), 5.0)
    mean, total = _across(grads, jnp.array([5, 0, 0, -1], jnp.int32))
    np.testing.assert_array_equal(np.asarray(mean), 2.0)
    np.testing.assert_array_equal(np.asarray(total), 5.0)


@pytest.mark.parametrize("count_dtype", [jnp.float32, jnp.int32])
def test_microbatched_ignores_non_finite_and_negative_counts(count_dtype):
    k = 4
    counts = np.asarray(_BAD_COUNTS)
    if count_dtype == jnp.int32:
        counts = np.array([5, 0, 0, -1])  # integers hold no inf or NaN
    values = jnp.array([2.0, jnp.inf, jnp.nan, -7.0])

    def loss_fn(w, mb):
        return w * mb["v"][0], mb["n"][0].astype(count_dtype)

    batch = {"v": values, "n": jnp.asarray(counts, jnp.float32)}  # row j = mb j
    (loss, count), grad = jax.jit(mm.microbatched_value_and_grad(loss_fn, k))(
        jnp.array(3.0), batch
    )
    assert (float(loss), float(count), float(grad)) == (6.0, 5.0, 2.0)


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (-1, r"must be non-negative, got -1"),
        (float("nan"), r"must be a finite non-negative number, got nan"),
        (float("inf"), r"must be a finite non-negative number, got inf"),
        (1e39, r"is too large for float32, the weights' dtype"),
    ],
)
def test_concrete_bad_counts_are_refused(bad, match):
    with pytest.raises(
        ValueError, match=r"`count` \(this shard's token count\) " + match
    ):
        jax.vmap(lambda g: mm.weighted_mean_across(g, bad, "s"), axis_name="s")(
            jnp.ones(2)
        )
    grad_fn = mm.microbatched_value_and_grad(lambda w, mb: (w * jnp.sum(mb), bad), 2)
    with pytest.raises(ValueError, match=r"count returned by `loss_fn` " + match):
        grad_fn(jnp.array(1.0), jnp.ones(4))


@pytest.mark.parametrize(
    ("count", "error", "match"),
    [
        (True, TypeError, r"must be a number of tokens, got a bool \(True\)"),
        (None, TypeError, r"must be a number of tokens, got None"),
        (
            jnp.array(1 + 2j),
            TypeError,
            r"must be an integer or floating scalar, got dtype complex64",
        ),
        ("3", TypeError, r"must be a real scalar, got '3' of type str"),
        (
            jnp.ones(2),
            ValueError,
            r"must be a scalar \(a token count\), got shape \(2,\)",
        ),
    ],
)
def test_bad_count_kinds_are_clear_errors(count, error, match):
    with pytest.raises(error, match=r"`count` \(this shard's token count\) " + match):
        jax.vmap(lambda g: mm.weighted_mean_across(g, count, "s"), axis_name="s")(
            jnp.ones(2)
        )
    grad_fn = mm.microbatched_value_and_grad(lambda w, mb: (w * jnp.sum(mb), count), 2)
    with pytest.raises(error, match=r"count returned by `loss_fn` " + match):
        grad_fn(jnp.array(1.0), jnp.ones(4))


@pytest.mark.parametrize("scale", [1e-40, 1e39], ids=["subnormal", "huge"])
def test_float64_weights_beside_float32_gradients_keep_their_range(scale):
    """Under x64 with ``count_dtype=float64``, weights beyond float32's normal
    range (1e-40, 1e39) beside float32 gradients: the running mean's ratio N/n
    and the devices' weights nᵈ/N were formed in float32, where they are 0/0
    or inf/inf: the window was dropped as non-finite, or (deferred) its mean
    handed on as zeros."""
    with jax.enable_x64(True):
        params = {"w": jnp.zeros(2, jnp.float32)}
        grads = [jnp.full(2, g, jnp.float32) for g in (1.0, 3.0)]
        plain = mm.MaskedMultiSteps(optax.sgd(-1.0), 2, count_dtype=jnp.float64)
        state = plain.init(params)
        for g, n in zip(grads, (scale, 3 * scale), strict=True):
            updates, state = plain.update({"w": g}, state, params, count=jnp.float64(n))
        np.testing.assert_allclose(updates["w"], 2.5, rtol=1e-6)
        assert int(state.num_nonfinite_windows) == 0

        mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
        deferred = mm.MaskedMultiSteps(
            optax.sgd(-1.0),
            1,
            count_dtype=jnp.float64,
            reduction=mm.deferred(mesh, "data"),
        )
        state = deferred.init(params)
        with jax.set_mesh(mesh):
            updates, state = jax.jit(deferred.update)(
                {"w": jnp.stack(grads)},
                state,
                params,
                count=jnp.array([scale, 3 * scale], jnp.float64),
            )
        np.testing.assert_allclose(updates["w"], 2.5, rtol=1e-6)
        assert bool(state.updated) and int(state.num_nonfinite_windows) == 0


def test_float64_windows_beyond_float32s_range_make_the_tokens_seen_inf_not_nan():
    # The total's float32 pieces were inf and -inf (x - float32(x)): the tokens
    # seen NaN for good, and a budget of them 0, every window closing at once.
    with jax.enable_x64(True):
        tx = mm.MaskedMultiSteps(
            optax.sgd(1.0),
            tokens_per_window=lambda seen: jnp.interp(
                seen, jnp.array([0.0, 1e6]), jnp.array([1024.0, 8192.0])
            ),
            count_dtype=jnp.float64,
            window_stats=True,
        )
        params = {"w": jnp.zeros(2, jnp.float32)}
        state = tx.init(params)
        step = jax.jit(tx.update)
        _, state = step({"w": jnp.ones(2)}, state, params, count=jnp.float64(1e39))
        assert np.isposinf(float(mm.window_stats(state).tokens_seen))
        closed = []
        for _ in range(3):
            _, state = step({"w": jnp.ones(2)}, state, params, count=jnp.float64(10))
            closed.append(bool(state.updated))
        assert closed == [False, False, False]  # the budget of inf tokens seen: 8192
        for x in (1e39, 1e300, np.inf, 3.5e38):
            zero = jnp.zeros([], jnp.float32)
            total = add_tokens(mm.TokenTotal(zero, zero), jnp.float64(x))
            assert np.isposinf(float(total.hi)) and float(total.lo) == 0
