"""The central property: a window of masked microbatches equals one full-batch step.

For random pytrees, window sizes, microbatch splits and masks (empty microbatches
included, with NaN mean gradients as an all-masked loss produces), the update
`MaskedMultiSteps` emits equals the inner optimizer applied to the full batch's
token-mean gradient, computed in float64 by numpy.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import masked_multistep as mm

INNER = {
    "sgd_momentum": lambda: optax.sgd(0.1, momentum=0.9),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=1e-2),
    # Clipping inside the inner optimizer must see the full-batch gradient: the
    # threshold is small enough that it always binds.
    "clip_adamw": lambda: optax.chain(
        optax.clip_by_global_norm(0.5), optax.adamw(1e-2, weight_decay=1e-2)
    ),
}


# Pytree shapes: a few fixed layouts keep the number of compilations small.
TREES = [((3, 2), (2,), ()), ((2, 2, 2), (1,))]


@functools.cache
def _jitted(inner_name: str, k: int):
    tx = mm.MaskedMultiSteps(INNER[inner_name](), k)
    return tx, jax.jit(tx.update), jax.jit(tx.inner_opt.update)


_apply_updates = jax.jit(optax.apply_updates)


@st.composite
def problems(draw):
    shapes = draw(st.sampled_from(TREES))
    k = draw(st.integers(1, 4))
    windows = draw(st.integers(1, 3))
    counts = draw(
        st.lists(
            st.integers(0, 6) | st.just(0), min_size=k * windows, max_size=k * windows
        )
    )
    inner = draw(st.sampled_from(sorted(INNER)))
    seed = draw(st.integers(0, 2**31 - 1))
    return shapes, k, windows, counts, inner, seed


@settings(max_examples=100, deadline=None)
@given(problems())
def test_window_equals_full_batch_step(problem):
    shapes, k, windows, counts, inner_name, seed = problem
    rng = np.random.default_rng(seed)
    params = {
        f"p{i}": rng.normal(size=s).astype(np.float32) for i, s in enumerate(shapes)
    }
    tx, update, inner_update = _jitted(inner_name, k)

    state = tx.init(params)
    ref_params = jax.tree.map(np.float64, params)
    ref_state = tx.inner_opt.init(params)
    mm_params = params

    for w in range(windows):
        window_counts = counts[w * k : (w + 1) * k]
        # Per-token gradients for every token of the window (float64).
        tokens = [
            {name: rng.normal(size=(n, *p.shape)) * 3.0 for name, p in params.items()}
            for n in window_counts
        ]
        for n, tok in zip(window_counts, tokens, strict=True):
            # The microbatch's mean gradient: NaN (0/0) when it holds no token.
            grads = {
                name: (g.mean(0) if n else np.full(g.shape[1:], np.nan)).astype(
                    np.float32
                )
                for name, g in tok.items()
            }
            updates, state = update(grads, state, mm_params, count=jnp.int32(n))
            mm_params = _apply_updates(mm_params, updates)

        total = sum(window_counts)
        if total == 0:
            # Nothing to learn from: no update, inner state untouched.
            assert not tx.has_updated(state)
            assert all(np.all(np.asarray(u) == 0) for u in jax.tree.leaves(updates))
            continue
        assert tx.has_updated(state)
        full_grad = {
            name: np.concatenate([t[name] for t in tokens]).mean(0) for name in params
        }
        ref_updates, ref_state = inner_update(
            jax.tree.map(np.float32, full_grad),
            ref_state,
            jax.tree.map(np.float32, ref_params),
        )
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6),
            updates,
            ref_updates,
        )
        ref_params = jax.tree.map(
            lambda p, u: p + np.float64(u), ref_params, ref_updates
        )

    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-5),
        mm_params,
        ref_params,
    )
    assert int(state.gradient_step) == sum(
        sum(counts[w * k : (w + 1) * k]) > 0 for w in range(windows)
    )


@settings(max_examples=100, deadline=None)
@given(
    counts=st.lists(st.integers(0, 1000), min_size=1, max_size=12),
    seed=st.integers(0, 2**31 - 1),
)
def test_running_mean_matches_float64_weighted_mean(counts, seed):
    rng = np.random.default_rng(seed)
    values = rng.normal(size=(len(counts), 5)) * 10.0
    mean, total = jnp.zeros(5), jnp.int32(0)
    for v, n in zip(values, counts, strict=True):
        g = v if n else np.full(5, np.nan)
        mean, total = mm.running_mean_update(mean, total, jnp.float32(g), jnp.int32(n))
    assert int(total) == sum(counts)
    if sum(counts) == 0:
        np.testing.assert_array_equal(mean, np.zeros(5))
    else:
        expected = (np.asarray(counts)[:, None] * values).sum(0) / sum(counts)
        np.testing.assert_allclose(mean, expected, rtol=1e-5, atol=1e-5)


def test_running_mean_takes_python_numbers_and_refuses_a_truncating_total():
    # Python numbers are scalars like any other.
    mean, total = mm.running_mean_update(0.0, 0, jnp.float32(4.0), 2)
    mean, total = mm.running_mean_update(mean, total, jnp.float32(1.0), 1)
    assert (float(mean), int(total)) == (3.0, 3)
    # Fractional weights need a float total: in an integer one, 0.5 + 0.5 would
    # be truncated to 0 and every value would overwrite the mean.
    with pytest.raises(TypeError, match="`count` has dtype float32 but `total`"):
        mm.running_mean_update(jnp.zeros(()), jnp.array(0), jnp.ones(()), 0.5)
    mean, total = jnp.zeros(()), jnp.float32(0)
    for v in (1.0, 5.0):
        mean, total = mm.running_mean_update(mean, total, jnp.float32(v), 0.5)
    assert (float(mean), float(total)) == (3.0, 1.0)
    # Host integers by value (jnp.asarray would wrap a numpy int64 into int32:
    # 2**32 + 1 into 1).
    big = np.int64(2**32 + 1)
    mean, total = mm.running_mean_update(jnp.float32(1.0), jnp.float32(1), 5.0, big)
    assert float(total) == float(np.float32(2**32 + 2)) and float(mean) == 5.0
    with pytest.raises(ValueError, match=r"`count` \(4294967297\) does not fit"):
        mm.running_mean_update(jnp.zeros(()), jnp.int32(0), jnp.ones(()), big)


@pytest.mark.parametrize("jit", [False, True])
def test_running_mean_ignores_weights_that_would_corrupt_it(jit):
    update = jax.jit(mm.running_mean_update) if jit else mm.running_mean_update
    mean, g = jnp.float32(1.0), jnp.float32(3.0)
    cases = [
        # An integer total that would wrap: 2³¹ − 1 + 2³¹ − 1 was −2, mean −2e9.
        (jnp.int32(2**31 - 1), jnp.int32(2**31 - 1)),
        (jnp.int8(100), jnp.int8(100)),  # 100 + 100 wrapped to −56
        (jnp.float32(2.0), jnp.float32(jnp.inf)),  # N / n = inf / inf: NaN mean
        (jnp.float32(3e38), jnp.float32(3e38)),  # a total past float32's range
        (jnp.float32(2.0), jnp.float32(-1.0)),
        (jnp.float32(2.0), jnp.float32(jnp.nan)),
        # A count of another dtype: compared as int32, 3e9 was negative and
        # wrapped the total to -1294967286.
        (jnp.int32(10), jnp.uint32(3_000_000_000)),
        (jnp.int16(10), jnp.uint16(60000)),
        (jnp.uint8(250), jnp.int32(6)),
        # (A float16 total is refused: see the test below.)
    ]
    for total, count in cases:
        new_mean, new_total = update(mean, total, g, count)
        assert float(new_mean) == 1.0, (total, count)
        assert new_total.dtype == total.dtype and new_total == total, (total, count)
    # The largest weight that fits is taken, in any dtype (a uint32 total's
    # range check crashed: its maximum was parsed as an int32).
    new_mean, new_total = update(mean, jnp.int32(1), g, jnp.int32(2**31 - 2))
    assert int(new_total) == 2**31 - 1 and float(new_mean) == 3.0
    new_mean, new_total = update(mean, jnp.uint8(250), g, jnp.int32(5))
    assert new_total.dtype == jnp.uint8 and int(new_total) == 255
    new_mean, new_total = update(mean, jnp.uint32(1), g, jnp.uint32(3))
    assert int(new_total) == 4 and float(new_mean) == 2.5


def test_running_mean_refuses_what_is_outside_its_contract():
    # Each was taken: a vector count or total changed the mean's shape, an
    # integer mean truncated ([1 2] for [1.5 2.5]), complex and bool counts
    # weighed as numbers; a mismatched tree failed inside jax's tree_map.
    update = mm.running_mean_update
    for args, error, match in [
        ((0.0, 0.0, 1.0, jnp.array([1.0, 3.0])), ValueError, "`count` must be a sc"),
        ((0.0, jnp.zeros(3), 1.0, 2.0), ValueError, "`total` must be a scalar"),
        ((jnp.zeros(2, jnp.int32), 0.0, jnp.ones(2), 1.0), TypeError, "`mean` at"),
        ((jnp.zeros(2), 0.0, jnp.ones(2), 1 + 0j), TypeError, "got dtype complex"),
        ((jnp.zeros(2), 0.0, jnp.ones(2), jnp.array(True)), TypeError, "dtype bool"),
        ((jnp.zeros(2), jnp.int32(0), jnp.ones(2), True), TypeError, "got a bool"),
        ((jnp.zeros(2), 0.0, jnp.ones(2), None), TypeError, "`count` must be a real"),
        (({"a": 0.0}, 0.0, {"b": 1.0}, 1.0), ValueError, "`value` must have the tree"),
        # A numpy int64 total was wrapped to int32 (2**40 to 0: the mean then
        # overwritten by the value), a Python int past int32 called no number.
        ((0.0, np.int64(2**40), 1.0, 1), ValueError, r"`total` \(1099511627776\)"),
        ((0.0, 2**31, 1.0, 1), ValueError, "`total` .* does not fit int32"),
        # A bfloat16 count arrived rounded (3001 as 3008), and a bfloat16 total
        # stopped at 256; a complex value lost its imaginary part in a real mean.
        (
            (0.0, 0.0, 1.0, jnp.ones(3001, jnp.bfloat16).sum()),
            TypeError,
            "`count` has dtype bfloat16, which holds whole numbers exactly",
        ),
        (
            (0.0, jnp.zeros((), jnp.float16), 1.0, 1.0),
            TypeError,
            "`total` has dtype float16, which holds whole numbers exactly only up",
        ),
        ((jnp.zeros(2), 0.0, jnp.ones(2) + 5j, 1.0), TypeError, "imaginary part"),
    ]:
        with pytest.raises(error, match=match):
            update(*args)


def test_running_mean_ignores_a_host_count_beyond_its_range():
    # It was an OverflowError, where a weight past the total's range is
    # documented to leave the mean and total as they were.
    mean, total = mm.running_mean_update(
        jnp.ones(2), jnp.float32(1), jnp.full(2, 5.0), 10**400
    )
    assert float(total) == 1.0 and float(mean[0]) == 1.0
    assert np.isnan(mm.noise_scale_estimates(4.0, 2, 10**400, 4.0)).all()
    # Host floats beyond float32 likewise, eagerly and inside a jitted function
    # (numpy warned of an overflow in the cast, an error under this suite's
    # warnings); a total beyond is refused. A host float total in range is
    # taken under jit.
    for count in (1e39, np.float64(1e39), np.array(1e39), 2**130):
        for jit in (False, True):
            update = functools.partial(mm.running_mean_update, count=count)
            update = jax.jit(update) if jit else update
            mean, total = update(jnp.ones(2), jnp.float32(1), jnp.full(2, 5.0))
            assert float(total) == 1.0 and float(mean[0]) == 1.0, (count, jit)
    for total in (1e39, np.float64(1e39)):
        with pytest.raises(ValueError, match=r"`total` must be a finite number its"):
            mm.running_mean_update(jnp.ones(2), total, jnp.full(2, 5.0), 1.0)
    mean, total = jax.jit(lambda m, v: mm.running_mean_update(m, 2.0, v, 1.0))(
        jnp.zeros(2), jnp.full(2, 3.0)
    )
    assert float(total) == 3.0 and float(mean[0]) == 1.0


def test_running_mean_derivatives_are_finite_after_a_stale_nan_or_an_inf_count():
    # The first value overwrites the mean whatever it held; its derivative with
    # respect to the count was NaN when that was NaN or inf (after a
    # non-finite window), and so was an ignored infinite count's.
    def first(count, stale):
        mean, _ = mm.running_mean_update(stale, jnp.float32(0), jnp.ones(2), count)
        return mean.sum()

    for stale in (jnp.zeros(2), jnp.array([jnp.nan, 0.0]), jnp.array([jnp.inf, 0])):
        assert float(jax.grad(first)(jnp.float32(3.0), stale)) == 0.0

    def later(count):
        mean, _ = mm.running_mean_update(
            jnp.ones(2), jnp.float32(2), jnp.full(2, 5.0), count
        )
        return mean.sum()

    assert float(later(jnp.float32(jnp.inf))) == 2.0
    assert float(jax.grad(later)(jnp.float32(jnp.inf))) == 0.0
    assert float(jax.grad(later)(jnp.float32(2.0))) == 2 * (5 - 1) * 2 / 4**2


def test_running_mean_spread_keeps_float64_with_an_integer_total():
    # With an int64 total the spread's weight N_old·n/N was float32 (5.8e-8
    # relative error in S); the mean already kept float64.
    with jax.enable_x64(True):
        gs, ns = [0.1, 0.7, -0.3], [3, 2**33 + 1, 7]
        for total in (jnp.int64(0), jnp.float64(0)):
            m, n, spread = jnp.float64(0), total, 0.0
            for g, c in zip(gs, ns):
                m, n, ds = mm.running_mean_update(
                    m, n, jnp.float64(g), c, with_sq_deviation=True
                )
                spread += float(ds)
            mean = np.dot(ns, gs) / sum(ns)
            want = sum(c * (g - mean) ** 2 for g, c in zip(gs, ns))
            np.testing.assert_allclose(spread, want, rtol=1e-12)


def test_running_mean_refuses_a_value_of_another_shape():
    # It broadcast: a scalar mean became a vector.
    with pytest.raises(ValueError, match=r"`value` at <root> has shape \(3,\), "):
        mm.running_mean_update(jnp.float32(1.0), jnp.float32(2.0), jnp.ones(3), 2.0)
    with pytest.raises(ValueError, match=r"`value` at \['a'\] has shape \(2, 2\)"):
        mm.running_mean_update(
            {"a": jnp.ones(2)}, jnp.float32(2.0), {"a": jnp.ones((2, 2))}, 2.0
        )
