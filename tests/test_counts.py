"""The count contract and the paths that once gave a silent wrong result.

What ``count=`` accepts (``masked_multistep._checks``), how the wrapper composes
with skip functions, reverse-mode differentiation, complex and float64
gradients, ``value=``, window schedules and low-precision params.
"""

import os
import subprocess
import sys
import textwrap
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import assert_bit_identical

import masked_multistep as mm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARAMS = {"w": jnp.arange(6.0).reshape(3, 2), "b": jnp.ones(2)}


def _grads(scale):
    return jax.tree.map(lambda p: jnp.full(p.shape, scale, p.dtype), PARAMS)


def _run(tx, *, jit):
    return jax.jit(tx.update) if jit else tx.update


# Counts: float counts by default, every integer dtype by value.


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_float_counts_work_with_the_default_constructor(jit):
    # flax's lm1b/wmt examples build float32 loss weights: count=weights.sum().
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 3)
    update = _run(tx, jit=jit)
    state = tx.init(PARAMS)
    assert state.acc_count.dtype == jnp.float32
    weights = [
        jnp.array([1.0, 1.0, 0.0, 0.0]),  # two real tokens
        jnp.array([0.5, 0.25, 0.0, 0.0]),  # fractional weights
        jnp.array([1.0, 1.0, 1.0, 0.25]),
    ]
    for g, w in zip([1.0, 5.0, -2.0], weights, strict=True):
        count = w.sum()
        assert count.dtype == jnp.float32
        updates, state = update(_grads(g), state, PARAMS, count=count)
    expected = -(2.0 * 1.0 + 0.75 * 5.0 + 3.25 * -2.0) / 6.0
    assert bool(tx.has_updated(state))
    for u in jax.tree.leaves(updates):
        np.testing.assert_allclose(u, expected, rtol=1e-6, atol=1e-6)
    # Integer counts work with the same constructor.
    state = tx.init(PARAMS)
    for g, n in [(1.0, 1), (5.0, 3), (-2.0, 4)]:
        updates, state = update(_grads(g), state, PARAMS, count=jnp.int32(n))
    for u in jax.tree.leaves(updates):
        np.testing.assert_allclose(u, -(1.0 + 15.0 - 8.0) / 8.0, rtol=1e-6)


HONOURED = [
    np.int64(2**32 + 5),  # what np.sum(mask) returns on the host
    np.uint64(2**63 + 11),
    np.uint64(7),
    np.int32(2**31 - 1),
    jnp.int8(100),
    jnp.int16(30000),
    jnp.int32(2**31 - 1),
    jnp.uint8(255),
    jnp.uint16(65535),
    jnp.uint32(2**32 - 1),
    2**70,
]


@pytest.mark.parametrize("count", HONOURED, ids=repr)
def test_every_integer_count_is_converted_by_value(count):
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 2)
    state = tx.init(PARAMS)
    _, state = tx.update(_grads(1.0), state, PARAMS, count=count)
    assert state.acc_count.dtype == jnp.float32
    # Exact up to float32's rounding of the true value, never wrapped.
    assert state.acc_count == np.float32(int(count))
    assert int(state.num_invalid_counts) == 0 and int(state.mini_step) == 1


JAX_INTEGERS = [
    jnp.int8(100),
    jnp.int16(30000),
    jnp.int32(2**31 - 1),
    jnp.uint8(255),
    jnp.uint16(65535),
    jnp.uint32(2**32 - 1),
]


@pytest.mark.parametrize("count", JAX_INTEGERS, ids=repr)
def test_jax_integer_counts_are_converted_by_value_under_jit(count):
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 2)
    _, state = jax.jit(tx.update)(_grads(1.0), tx.init(PARAMS), PARAMS, count=count)
    assert state.acc_count == np.float32(int(count))
    assert int(state.num_invalid_counts) == 0 and int(state.mini_step) == 1


INT32_CASES = [
    (jnp.uint32(2**31 - 1), True, True),
    (jnp.uint32(2**31), False, True),
    (jnp.uint32(2**32 - 1), False, True),
    (jnp.uint16(65535), True, True),
    (jnp.int8(127), True, True),
    # Host scalars: eager only (under jit, jax itself narrows a numpy int64 at
    # the jit boundary, before the library sees it).
    (np.uint64(2**31 - 1), True, False),
    (np.uint64(2**64 - 1), False, False),
    (np.int64(2**32 + 5), False, False),
]


@pytest.mark.parametrize(
    "count,fits,jit",
    [(c, f, False) for c, f, _ in INT32_CASES]
    + [(c, f, True) for c, f, traced in INT32_CASES if traced],
    ids=repr,
)
def test_int32_count_dtype_honours_exactly_or_refuses(count, fits, jit):
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 2, count_dtype=jnp.int32)
    state = tx.init(PARAMS)
    if fits:
        _, state = _run(tx, jit=jit)(_grads(1.0), state, PARAMS, count=count)
        assert state.acc_count.dtype == jnp.int32
        assert int(state.acc_count) == int(count)
    elif not jit:
        with pytest.raises(ValueError, match=rf"at most 2147483647.*got {int(count)}"):
            tx.update(_grads(1.0), state, PARAMS, count=count)
    else:
        _, after = jax.jit(tx.update)(_grads(1.0), state, PARAMS, count=count)
        assert int(after.num_invalid_counts) == 1
        assert int(after.acc_count) == 0 and int(after.mini_step) == 0


@pytest.mark.parametrize(
    "count",
    [
        jnp.int8(-3),
        jnp.int16(-1),
        jnp.int32(-(2**31)),
        jnp.float32(-0.5),
        jnp.float32(jnp.nan),
        jnp.float32(-jnp.inf),
        np.float64(np.inf),
        np.float64(np.nan),
    ],
    ids=repr,
)
def test_invalid_counts_raise_eagerly_and_are_counted_skips_under_jit(count):
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 2)
    state = tx.init(PARAMS)
    _, state = tx.update(_grads(1.0), state, PARAMS, count=jnp.float32(2))
    with pytest.raises(ValueError, match="`count` must be"):
        tx.update(_grads(100.0), state, PARAMS, count=count)
    updates, after = jax.jit(tx.update)(_grads(100.0), state, PARAMS, count=count)
    assert int(after.num_invalid_counts) == 1
    assert_bit_identical(
        (after.acc_grads, after.acc_count, after.mini_step, after.gradient_step),
        (state.acc_grads, state.acc_count, state.mini_step, state.gradient_step),
    )
    assert not bool(tx.has_updated(after))
    for u in jax.tree.leaves(updates):
        np.testing.assert_array_equal(u, 0)
    # The next valid microbatch closes the window with the first one only.
    updates, after = jax.jit(tx.update)(_grads(4.0), after, PARAMS, count=jnp.int8(2))
    for u in jax.tree.leaves(updates):
        np.testing.assert_allclose(u, -2.5)


def test_an_8_bit_float_count_is_refused_with_its_own_example():
    # 17 ones sum to 16 in float8_e4m3fn (the message gave bfloat16's figures).
    assert float(jnp.ones(17, jnp.float8_e4m3fn).sum()) == 16
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 2)
    with pytest.raises(
        TypeError,
        match=r"`count` has dtype float8_e4m3fn, which holds whole numbers exactly "
        r"only up to 16: .* \(in float8_e4m3fn, 17 tokens sum to 16\)",
    ):
        tx.update(
            _grads(1.0), tx.init(PARAMS), PARAMS, count=jnp.array(3, jnp.float8_e4m3fn)
        )


def test_a_timedelta_count_is_refused_by_name():
    # numpy's timedelta64 is a signedinteger subtype: it reached the value
    # checks and failed in Python's `<` on a datetime.timedelta.
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 2)
    state = tx.init(PARAMS)
    for count in (np.timedelta64(3, "s"), np.array(3, "m8[s]")):
        with pytest.raises(
            TypeError,
            match=r"`count` must be an integer or floating scalar, got dtype "
            r"timedelta64\[s\]",
        ):
            tx.update(_grads(1.0), state, PARAMS, count=count)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_counts_in_floats_narrower_than_float32_are_refused(dtype):
    # A mask summed in bfloat16 is already rounded when it arrives (3001 tokens
    # sum to 3008), so its microbatch would be weighed wrong without a sign.
    mask = jnp.ones(3001, dtype)
    assert float(mask.sum()) != 3001
    exact = {jnp.bfloat16: 256, jnp.float16: 2048}[dtype]
    message = (
        rf"has dtype {jnp.dtype(dtype)}, which holds whole numbers exactly "
        rf"only up to {exact}"
    )
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 2)
    state = tx.init(PARAMS)
    for update in (tx.update, jax.jit(tx.update)):
        with pytest.raises(TypeError, match="`count` " + message):
            update(_grads(1.0), state, PARAMS, count=mask.sum())
    grad_fn = mm.microbatched_value_and_grad(
        lambda w, mb: (w * jnp.mean(mb), jnp.asarray(mb.size, dtype)), 2
    )
    with pytest.raises(TypeError, match=message):
        grad_fn(jnp.array(1.0), jnp.arange(4.0))
    with pytest.raises(TypeError, match=message):
        jax.vmap(lambda g, n: mm.weighted_mean_across(g, n, "s"), axis_name="s")(
            jnp.ones(2), jnp.ones(2, dtype)
        )
    # Token budgets too (3001 is 3000 in float16, 3008 in bfloat16).
    budget = jnp.asarray(3001, dtype)
    with pytest.raises(TypeError, match="`tokens_per_window` " + message):
        mm.MaskedMultiSteps(optax.sgd(1.0), tokens_per_window=budget)
    with pytest.raises(TypeError, match="`max_tokens` " + message):
        mm.norm_test(0.5, max_tokens=budget)
    by_seen = mm.MaskedMultiSteps(optax.sgd(1.0), tokens_per_window=lambda _: budget)
    with pytest.raises(TypeError, match=r"`tokens_per_window\(tokens_seen\)` "):
        by_seen.update(_grads(1.0), by_seen.init(PARAMS), PARAMS, count=1)
    # What to pass instead: the mask summed in float32, or masked_mean's count.
    _, state = tx.update(_grads(1.0), state, PARAMS, count=mask.sum(dtype=jnp.float32))
    assert float(state.acc_count) == 3001
    assert float(mm.masked_mean(jnp.ones(3001, dtype), mask)[1]) == 3001


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_count_dtypes_that_round_counts_are_refused_in_the_constructor(dtype):
    assert float(jnp.asarray(257, jnp.bfloat16)) == 256  # why bfloat16 cannot serve
    with pytest.raises(ValueError, match=rf"`count_dtype`.*got {jnp.dtype(dtype)}"):
        mm.MaskedMultiSteps(optax.sgd(1.0), 2, count_dtype=dtype)
    for ok in (jnp.float32, jnp.int32, "float32"):
        mm.MaskedMultiSteps(optax.sgd(1.0), 2, count_dtype=ok)


# Under x64 (its own process: x64 is a process-wide switch).

_X64_PRELUDE = """
import jax
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp
import numpy as np
import optax
import masked_multistep as mm

def fresh(count_dtype=jnp.float32, k=2, params=jnp.zeros(2)):
    tx = mm.MaskedMultiSteps(optax.sgd(-1.0), k, count_dtype=count_dtype)
    return tx, tx.init(params)
"""

_X64_COUNTS = """
g = jnp.ones(2)
for cd in (jnp.float32, jnp.float64, jnp.int32, jnp.int64):
    tx, s0 = fresh(cd)
    update = jax.jit(tx.update)
    for count in (jnp.uint64(7), np.uint64(7), jnp.uint8(7), jnp.int64(7)):
        _, s = update(g, s0, count=count)
        assert s.acc_count.dtype == cd and s.acc_count == 7, (cd, count, s.acc_count)
        assert int(s.num_invalid_counts) == 0

big = 2**31 + 1
for cd in (jnp.float64, jnp.int64):
    tx, s = fresh(cd)
    _, s = jax.jit(tx.update)(g, s, count=jnp.int64(big))
    assert int(s.acc_count) == big and int(s.mini_step) == 1, (cd, s.acc_count)
    _, s = tx.update(g, fresh(cd)[1], count=np.int64(big))
    assert int(s.acc_count) == big, (cd, s.acc_count)
# The default float32 honours it to float32 precision...
tx, s = fresh()
_, s = jax.jit(tx.update)(g, s, count=jnp.int64(big))
assert s.acc_count == np.float32(big) and int(s.num_invalid_counts) == 0
# ...int32 cannot hold it: a counted skip under jit, an error eagerly.
tx, s = fresh(jnp.int32)
_, s = jax.jit(tx.update)(g, s, count=jnp.int64(big))
assert int(s.num_invalid_counts) == 1 and int(s.acc_count) == 0
assert int(s.mini_step) == 0
try:
    tx.update(g, fresh(jnp.int32)[1], count=jnp.int64(big))
except ValueError as err:
    assert "at most 2147483647" in str(err), err
else:
    raise AssertionError("int64 count >= 2**31 accepted by an int32 count_dtype")
# uint64 beyond int64: skipped and counted, never wrapped to a negative.
tx, s = fresh(jnp.int64)
_, s = jax.jit(tx.update)(g, s, count=jnp.uint64(2**64 - 1))
assert int(s.num_invalid_counts) == 1 and int(s.acc_count) == 0
# A window total that would overflow int64 is a counted skip too, and the full
# window closes on it, with the tokens it holds; the next one starts afresh.
tx, s = fresh(jnp.int64, k=3)
update = jax.jit(tx.update)
_, s = update(g, s, count=jnp.int64(2**62))
_, s = update(g, s, count=jnp.int64(2**62))
assert int(s.num_invalid_counts) == 1 and int(s.gradient_step) == 1
assert int(s.acc_count) == 0 and int(s.mini_step) == 0
_, s = update(g, s, count=jnp.int64(2**62))
assert int(s.acc_count) == 2**62 and int(s.mini_step) == 1
"""

_X64_PRECISION = """
rng = np.random.default_rng(0)
n = 1000
grads = [1e3 + 1e3 * rng.standard_normal(n) for _ in range(8)]
counts = [int(c) for c in rng.integers(1, 4096, 8)]
reference = sum(c * g for c, g in zip(counts, grads)) / sum(counts)
for cd in (jnp.float32, jnp.float64, jnp.int32, jnp.int64):
    tx, s = fresh(cd, k=8, params=jnp.zeros(n))
    assert s.acc_grads.dtype == jnp.float64
    update = jax.jit(tx.update)
    for c, g in zip(counts, grads):
        u, s = update(jnp.asarray(g), s, count=jnp.asarray(c, cd))
    assert u.dtype == jnp.float64
    err = float(np.max(np.abs(np.asarray(u) - reference)))
    # float32 anywhere on the way gives ~3e-5 at this magnitude.
    assert err < 1e-9, (cd, err)
# Across devices (a vmapped axis here) the weights n_d / N are float64 too.
mean, _ = jax.vmap(
    lambda g, c: mm.weighted_mean_across(g, c, "d"), axis_name="d"
)(jnp.asarray(np.stack(grads)), jnp.asarray(counts))
assert mean.dtype == jnp.float64
err = float(np.max(np.abs(np.asarray(mean[0]) - reference)))
assert err < 1e-9, err
# An explicit float32 accumulator stays float32.
tx = mm.MaskedMultiSteps(optax.sgd(1.0), 2, accumulator_dtype=jnp.float32)
assert tx.init(jnp.zeros(2)).acc_grads.dtype == jnp.float32
"""

_X64_SCHEDULE = """
tx = mm.MaskedMultiSteps(optax.sgd(1.0), lambda step: jnp.int64(2**40))
s = tx.init(jnp.zeros(2))
s = s._replace(mini_step=jnp.int32(2**31 - 2))
_, s = jax.jit(tx.update)(jnp.ones(2), s, count=jnp.int64(1))
assert bool(s.updated) and int(s.mini_step) == 0, s
# A float32 budget against float64 totals: compared, not clipped through an
# overflowing cast (it warned "overflow encountered in cast").
import warnings
with warnings.catch_warnings():
    warnings.simplefilter("error")
    tx = mm.MaskedMultiSteps(
        optax.sgd(1.0),
        tokens_per_window=lambda seen: 3.0 + seen / 10,  # float32, as seen is
        count_dtype=jnp.float64,
    )
    _, s = jax.jit(tx.update)(jnp.ones(2), tx.init(jnp.zeros(2)), count=4.0)
assert int(s.gradient_step) == 1, s
"""


_X64_MIXED_STRICT = """
# float32 and float64 leaves in one tree, under strict promotion: each leaf's
# sums (finiteness test, squared norms, West's spread) were added implicitly, a
# TypePromotionError from inside the library.
params = {"a": jnp.zeros(2, jnp.float32), "b": jnp.zeros(2, jnp.float64)}
with jax.numpy_dtype_promotion("strict"):
    for kwargs in ({}, {"window_stats": True}, {"per_leaf_stats": True}):
        tx = mm.MaskedMultiSteps(optax.sgd(1.0), 2, **kwargs)
        for step in (tx.apply_gradients, jax.jit(tx.apply_gradients)):
            state, p = tx.init(params), params
            for g, n in [(1.0, 1), (3.0, 3)]:
                grads = jax.tree.map(lambda x, g=g: jnp.full_like(x, g), params)
                p, state = step(grads, state, p, count=jnp.int32(n))
            assert p["a"].dtype == jnp.float32 and p["b"].dtype == jnp.float64
            np.testing.assert_allclose(p["a"], -2.5)
            np.testing.assert_allclose(p["b"], -2.5)
            if kwargs:
                assert float(mm.window_stats(state).grad_var_trace) == 4 * 3.0
    mean, _, spread = mm.running_mean_update(
        params, 1, jax.tree.map(jnp.ones_like, params), 1, with_sq_deviation=True
    )
    assert float(spread) == 2.0, spread
"""


def _run_x64(body):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    env.pop("JAX_ENABLE_X64", None)
    script = textwrap.dedent(_X64_PRELUDE) + textwrap.dedent(body) + "\nprint('ok')\n"
    proc = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr


def test_x64_counts_are_honoured_exactly_or_skipped_and_counted():
    _run_x64(_X64_COUNTS)


def test_x64_float64_gradients_accumulate_in_float64():
    _run_x64(_X64_PRECISION)


def test_x64_schedule_beyond_int32_is_clipped_not_stalled():
    _run_x64(_X64_SCHEDULE)


def test_x64_float32_and_float64_leaves_under_strict_promotion():
    _run_x64(_X64_MIXED_STRICT)


# Skip functions and empty microbatches.


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_empty_nan_microbatch_counts_toward_its_window_whatever_the_skip_fn(jit):
    # An all-masked microbatch: the user's loss is 0/0 = NaN, its count 0.
    tx = mm.MaskedMultiSteps(
        optax.sgd(1.0), 3, should_skip_update_fn=optax.skip_not_finite
    )
    update = _run(tx, jit=jit)
    state = tx.init(PARAMS)
    _, state = update(_grads(1.0), state, PARAMS, count=jnp.float32(2))
    _, after = update(_grads(jnp.nan), state, PARAMS, count=jnp.float32(0))
    assert int(after.mini_step) == int(state.mini_step) + 1
    assert_bit_identical(
        (after.acc_grads, after.acc_count, after.skip_state, after.num_invalid_counts),
        (state.acc_grads, state.acc_count, state.skip_state, state.num_invalid_counts),
    )
    # The window closes on schedule, on the third microbatch, with the two real ones.
    updates, after = update(_grads(3.0), after, PARAMS, count=jnp.float32(2))
    assert bool(tx.has_updated(after)) and int(after.gradient_step) == 1
    for u in jax.tree.leaves(updates):
        np.testing.assert_allclose(u, -2.0)


def test_skip_fn_rejection_is_not_an_invalid_count():
    tx = mm.MaskedMultiSteps(
        optax.sgd(1.0), 2, should_skip_update_fn=optax.skip_not_finite
    )
    update = jax.jit(tx.update)
    state = tx.init(PARAMS)
    for g in (jnp.inf, jnp.nan):
        _, state = update(_grads(g), state, PARAMS, count=jnp.float32(5))
        assert bool(state.skip_state["should_skip"])
        assert int(state.num_invalid_counts) == 0
        assert int(state.mini_step) == 0 and int(state.acc_count) == 0
    # A bad count is still counted as one while the skip function rejects.
    _, state = update(_grads(jnp.nan), state, PARAMS, count=jnp.float32(-1))
    assert int(state.num_invalid_counts) == 1


# Reverse-mode derivatives through an empty microbatch.


@pytest.mark.parametrize("fused", [False, True], ids=["update", "apply_gradients"])
def test_grad_wrt_microbatch_gradients_ignores_an_empty_microbatch(fused):
    weights = jax.tree.map(
        lambda p: jnp.linspace(-1.0, 2.0, p.size).reshape(p.shape), PARAMS
    )

    def objective(microbatches, k):
        tx = mm.MaskedMultiSteps(optax.sgd(1.0), k)
        state, params = tx.init(PARAMS), PARAMS
        for g, n in microbatches:
            if fused:
                params, state = tx.apply_gradients(g, state, params, count=n)
            else:
                updates, state = tx.update(g, state, params, count=n)
                params = optax.apply_updates(params, updates)
        return sum(
            jnp.vdot(w, p)
            for w, p in zip(jax.tree.leaves(weights), jax.tree.leaves(params))
        )

    g1, g2, g3 = _grads(1.0), _grads(jnp.nan), _grads(-3.0)

    def with_empty(g1, g2, g3):
        return objective(
            [(g1, jnp.float32(2)), (g2, jnp.float32(0)), (g3, jnp.float32(3))], 3
        )

    def reference(g1, g3):
        return objective([(g1, jnp.float32(2)), (g3, jnp.float32(3))], 2)

    value, (d1, d2, d3) = jax.jit(jax.value_and_grad(with_empty, argnums=(0, 1, 2)))(
        g1, g2, g3
    )
    ref_value, (r1, r3) = jax.jit(jax.value_and_grad(reference, argnums=(0, 1)))(g1, g3)
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6)
    for d, r, share in [(d1, r1, 0.4), (d3, r3, 0.6)]:
        jax.tree.map(close, d, r)
        jax.tree.map(close, d, jax.tree.map(lambda w, s=share: -s * w, weights))
    for leaf in jax.tree.leaves(d2):
        np.testing.assert_array_equal(leaf, 0.0)


def test_meta_gradient_of_the_learning_rate_through_empty_microbatches():
    # Meta-learning a learning rate: the second window's gradients depend on the
    # learning rate through the params the first window produced.
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((6, 4, 3)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((6, 4)), jnp.float32)
    masks = jnp.asarray(
        [
            [1, 1, 0, 0],
            [0, 0, 0, 0],
            [1, 1, 1, 0],
            [1, 0, 0, 0],
            [0, 0, 0, 0],
            [1, 1, 1, 1],
        ],
        bool,
    )

    def microbatch_loss(w, i):
        return mm.masked_mean((x[i] @ w - y[i]) ** 2, masks[i])

    def train(lr, order, k):
        tx = mm.MaskedMultiSteps(
            optax.inject_hyperparams(optax.sgd)(learning_rate=lr), k
        )
        w = jnp.zeros(3)
        state = tx.init(w)
        for i in order:
            (_, n), g = jax.value_and_grad(microbatch_loss, has_aux=True)(w, i)
            w, state = tx.apply_gradients(g, state, w, count=n)
        return jnp.sum((x[5] @ w - y[5]) ** 2), state.gradient_step

    def meta_grad(order, k):
        grad = jax.jit(jax.grad(lambda lr: train(lr, order, k), has_aux=True))
        return grad(jnp.float32(0.1))

    meta, steps = meta_grad(range(6), 3)
    reference, ref_steps = meta_grad([0, 2, 3, 5], 2)
    assert int(steps) == int(ref_steps) == 2
    assert np.isfinite(meta)
    np.testing.assert_allclose(meta, reference, rtol=1e-5)
    assert meta != 0


# Complex and float64 gradients.


@pytest.mark.parametrize("inner", ["sgd", "adam"])
def test_complex_params_end_to_end(inner):
    rng = np.random.default_rng(1)
    z0 = jnp.asarray(
        rng.standard_normal(4) + 1j * rng.standard_normal(4), jnp.complex64
    )
    targets = jnp.asarray(
        rng.standard_normal((3, 5, 4)) + 1j * rng.standard_normal((3, 5, 4)),
        jnp.complex64,
    )
    masks = jnp.asarray(rng.random((3, 5)) < 0.6).at[:, 0].set(True)

    def loss(z, t, m):
        per_token = jnp.sum(jnp.abs(z[None, :] - t) ** 2, axis=-1)
        return mm.masked_mean(per_token, m)

    make = {"sgd": lambda: optax.sgd(0.1), "adam": lambda: optax.adam(0.1)}[inner]
    tx = mm.MaskedMultiSteps(make(), 3)
    state = tx.init(z0)
    assert state.acc_grads.dtype == jnp.complex64
    grad = jax.jit(jax.grad(loss, has_aux=True))
    update = jax.jit(tx.update)
    for t, m in zip(targets, masks, strict=True):
        g, n = grad(z0, t, m)
        updates, state = update(g, state, z0, count=n)
    g_full, _ = grad(z0, targets.reshape(15, 4), masks.reshape(15))
    expected, _ = jax.jit(make().update)(g_full, make().init(z0), z0)
    assert updates.dtype == jnp.complex64
    assert np.any(np.imag(np.asarray(updates)) != 0)
    np.testing.assert_allclose(updates, expected, rtol=1e-5, atol=1e-6)


# `value=`.


class _ValueRecorder(optax.GradientTransformationExtraArgs):
    """Identity on the updates; keeps the `value` it was last given (required)."""

    def __new__(cls):
        def init(params):
            del params
            return {"value": jnp.full([], -1.0), "calls": jnp.zeros([], jnp.int32)}

        def update(updates, state, params=None, *, value):
            del params
            return updates, {"value": value, "calls": state["calls"] + 1}

        return super().__new__(cls, init, update)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize(
    "value,error,match",
    [
        (jnp.ones(2), ValueError, r"`value` must be a scalar .* got shape \(2,\)"),
        (np.ones((1,)), ValueError, r"`value` must be a scalar .* got shape \(1,\)"),
        (jnp.array(1 + 1j), TypeError, "`value` must be a real number"),
    ],
    ids=["vector", "numpy-1", "complex"],
)
def test_value_must_be_a_real_scalar(value, error, match, jit):
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 2)
    with pytest.raises(error, match=match):
        _run(tx, jit=jit)(_grads(1.0), tx.init(PARAMS), PARAMS, count=1.0, value=value)


@pytest.mark.filterwarnings("ignore:The inner optimizer needs `value=`")
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_microbatches_without_value_do_not_dilute_the_window_loss(jit):
    tx = mm.MaskedMultiSteps(_ValueRecorder(), 4)
    update = _run(tx, jit=jit)
    state = tx.init(PARAMS)
    calls = [(2.0, 1.0), (None, 2.0), (4.0, 3.0), (None, 5.0)]
    for i, (value, n) in enumerate(calls):
        kwargs = {} if value is None else {"value": jnp.float32(value)}
        _, state = update(_grads(1.0), state, PARAMS, count=jnp.float32(n), **kwargs)
        if i == 1:
            assert float(state.value_count) == 1.0 and float(state.acc_count) == 3.0
            assert float(state.acc_value) == 2.0
    assert int(state.inner_opt_state["calls"]) == 1
    # Token-weighted over the microbatches that passed a value: (1·2 + 3·4) / 4.
    np.testing.assert_allclose(state.inner_opt_state["value"], 3.5, rtol=1e-6)


@pytest.mark.filterwarnings("ignore:The inner optimizer needs `value=`")
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_inner_that_needs_value_gets_the_window_value_when_the_last_call_has_none(jit):
    tx = mm.MaskedMultiSteps(_ValueRecorder(), 3)
    update = _run(tx, jit=jit)
    state = tx.init(PARAMS)
    _, state = update(_grads(1.0), state, PARAMS, count=1.0, value=jnp.float32(3.0))
    _, state = update(_grads(1.0), state, PARAMS, count=1.0, value=jnp.float32(5.0))
    _, state = update(_grads(1.0), state, PARAMS, count=2.0)
    assert int(state.inner_opt_state["calls"]) == 1
    np.testing.assert_allclose(state.inner_opt_state["value"], 4.0, rtol=1e-6)
    # A window in which no microbatch passed a value (a forgotten `value=`) is
    # held like a non-finite mean, and counted: handed over, its NaN made
    # polyak_sgd's params NaN and every window a reduce_on_plateau plateau.
    for _ in range(3):
        _, state = update(_grads(1.0), state, PARAMS, count=1.0)
    assert int(state.inner_opt_state["calls"]) == 1
    assert (int(state.gradient_step), int(state.num_nonfinite_windows)) == (1, 1)
    assert not bool(tx.has_updated(state))
    # So is a window whose value is not finite; the next window runs as usual.
    for v in (jnp.nan, 2.0, 2.0, 2.0, 2.0, 2.0):
        _, state = update(_grads(1.0), state, PARAMS, count=1.0, value=jnp.float32(v))
    assert int(state.num_nonfinite_windows) == 2
    assert int(state.inner_opt_state["calls"]) == 2
    np.testing.assert_allclose(state.inner_opt_state["value"], 2.0)


@pytest.mark.filterwarnings("ignore:The inner optimizer needs `value=`")
def test_reduce_on_plateau_gets_the_window_loss_when_the_last_call_has_none():
    inner = optax.chain(
        optax.sgd(1.0), optax.contrib.reduce_on_plateau(patience=0, factor=0.5)
    )
    tx = mm.MaskedMultiSteps(inner, 2)
    state = tx.init(PARAMS)
    _, state = tx.update(
        _grads(1.0), state, PARAMS, count=jnp.int32(1), value=jnp.float32(3.0)
    )
    _, state = tx.update(_grads(1.0), state, PARAMS, count=jnp.int32(3))
    assert int(state.gradient_step) == 1
    np.testing.assert_allclose(state.inner_opt_state[1].best_value, 3.0)


def _checks_its_value(max_lr=1.0):
    """A Polyak step that checks ``value`` itself, as optax.contrib.momo
    does: ``value=None`` by default, ``ValueError`` without one."""

    def update(updates, state, params=None, value=None, **extra):
        del params, extra
        if value is None:
            raise ValueError("You need to pass the latest loss value.")
        sq = optax.tree.norm(updates, squared=True)
        step = jnp.minimum(value / (sq + 1e-12), max_lr)
        return jax.tree.map(lambda g: -step * g, updates), state

    return optax.GradientTransformationExtraArgs(
        lambda params: optax.EmptyState(), update
    )


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_an_inner_that_raises_value_error_without_value_gets_the_windows(jit):
    # Its ValueError in the wrapper's trace without the value (to learn
    # whether it needs one) escaped: "You need to pass the latest loss value",
    # from a call that passed one.
    inner = _checks_its_value()
    tx = mm.MaskedMultiSteps(inner, 2)
    update = _run(tx, jit=jit)
    state = tx.init(PARAMS)
    for scale, n, value in [(1.0, 1, 2.0), (3.0, 3, 6.0)]:
        updates, state = update(
            _grads(scale), state, PARAMS, count=jnp.int32(n), value=jnp.float32(value)
        )
    want, _ = inner.update(_grads(2.5), optax.EmptyState(), PARAMS, value=5.0)
    for got, expected in zip(jax.tree.leaves(updates), jax.tree.leaves(want)):
        np.testing.assert_allclose(got, expected, rtol=1e-6)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize(
    "inner",
    [
        optax.chain(optax.sgd(1.0), optax.contrib.reduce_on_plateau()),
        optax.polyak_sgd(),
        _checks_its_value(),
    ],
    ids=["reduce_on_plateau", "polyak_sgd", "value_error"],
)
def test_inner_that_needs_value_warns_when_a_call_passes_none(inner, jit):
    # Without the wrapper such an optimizer refuses a call without `value=`
    # (TypeError); with it, a window in which no call passed one is held, so a
    # loop that never passes `value=` would never update the params.
    tx = mm.MaskedMultiSteps(inner, 2)
    update = _run(tx, jit=jit)
    state = tx.init(PARAMS)
    with pytest.warns(UserWarning, match=r"^The inner optimizer needs `value=`"):
        _, state = update(_grads(1.0), state, PARAMS, count=jnp.int32(1))
    # With a value, nothing to say.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        update(_grads(1.0), state, PARAMS, count=jnp.int32(1), value=jnp.float32(1))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_inner_that_refuses_value_runs_without_it_and_the_window_loss_is_kept(jit):
    # optax.contrib.sam declares extra arguments but its update takes none:
    # `value=` (for the window's loss) was a TypeError from inside sam.
    def sam():
        return optax.contrib.sam(optax.sgd(0.1), optax.sgd(0.05), sync_period=2)

    with_value = mm.MaskedMultiSteps(sam(), 2, window_stats=True)
    without = mm.MaskedMultiSteps(sam(), 2, window_stats=True)
    update_v, update = _run(with_value, jit=jit), _run(without, jit=jit)
    state_v, state = with_value.init(PARAMS), without.init(PARAMS)
    calls = [(1.0, 1, 2.0), (3.0, 3, 6.0), (2.0, 2, 1.0), (5.0, 0, jnp.nan)] * 2
    losses = []
    for scale, n, value in calls:
        grads, count = _grads(scale), jnp.int32(n)
        u_v, state_v = update_v(
            grads, state_v, PARAMS, count=count, value=jnp.float32(value)
        )
        u, state = update(grads, state, PARAMS, count=count)
        assert_bit_identical(u_v, u)
        if bool(mm.has_updated(state_v)):
            losses.append(float(mm.window_stats(state_v).loss))
    assert_bit_identical(state_v.inner_opt_state, state.inner_opt_state)
    # The windows' token-weighted losses: (1·2 + 3·6) / 4, then 2 tokens of 1
    # and an empty microbatch.
    np.testing.assert_allclose(losses, [5.0, 1.0, 5.0, 1.0], rtol=1e-6)
    assert np.isnan(float(mm.window_stats(state).loss))


# Window schedules.


def _flags(tx, n, *, jit=True, state=None):
    update = _run(tx, jit=jit)
    state = tx.init(PARAMS) if state is None else state
    flags = []
    for _ in range(n):
        _, state = update(_grads(1.0), state, PARAMS, count=jnp.int32(1))
        flags.append(bool(tx.has_updated(state)))
    return flags, state


def test_traced_nan_schedule_closes_every_microbatch():
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), lambda s: s * jnp.nan)
    flags, _ = _flags(tx, 3)
    assert flags == [True, True, True]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize(
    "k", [0, -7, np.int64(0), 0.2, 0.5, -7.0, float("nan"), np.float32("nan")], ids=repr
)
def test_host_schedule_value_below_one_is_a_clear_error(k, jit):
    # A Python or numpy value is known when it is returned, under jit too: a
    # window of no microbatches is a mistake, as a constant every_k_schedule=0
    # is (it was silently clipped to 1, a window per microbatch).
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), lambda s: k)
    with pytest.raises(
        ValueError,
        match=r"^`every_k_schedule\(step\)` returned .*: a window must hold at "
        r"least 1 microbatch",
    ):
        _flags(tx, 1, jit=jit)


def test_host_cap_value_below_one_is_a_clear_error():
    tx = mm.MaskedMultiSteps(
        optax.sgd(1.0),
        tokens_per_window=mm.token_budget(4, max_microbatches=lambda s: 0),
    )
    with pytest.raises(ValueError, match=r"^`max_microbatches\(step\)` returned 0"):
        _flags(tx, 1)


@pytest.mark.parametrize(
    "k,expected",
    [(2.6, 3), (2.4, 2), (jnp.float32(0.2), 1), (jnp.float32(-7.0), 1), (2.5, 2)],
    ids=repr,
)
def test_fractional_schedule_is_rounded_to_the_nearest_integer_ties_to_even(
    k, expected
):
    flags, _ = _flags(mm.MaskedMultiSteps(optax.sgd(1.0), lambda s: k), 6)
    assert flags == [(i + 1) % expected == 0 for i in range(6)]


@pytest.mark.parametrize(
    "k",
    [1e30, jnp.inf, 2.0**31, 2.0**31 - 1, jnp.uint32(2**32 - 1), jnp.int32(2**31 - 1)],
    ids=repr,
)
def test_huge_schedule_is_clipped_and_still_closes(k):
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), lambda s: k)
    flags, state = _flags(tx, 3)
    assert flags == [False, False, False] and int(state.mini_step) == 3
    # k is clipped to 2**31 - 1: the window closes there, mini_step never wraps.
    flags, state = _flags(tx, 2, state=state._replace(mini_step=jnp.int32(2**31 - 3)))
    assert flags == [False, True] and int(state.mini_step) == 0


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_non_scalar_schedule_is_a_clear_error(jit):
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), lambda s: jnp.array([2, 3]))
    with pytest.raises(ValueError, match=r"must return a scalar, got shape \(2,\)"):
        _flags(tx, 1, jit=jit)


def test_schedule_of_the_wrong_kind_is_a_clear_error():
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), lambda s: jnp.array(True))
    with pytest.raises(
        TypeError, match="must return an integer or float, got dtype bool"
    ):
        _flags(tx, 1)


# Low-precision params: the inner state keeps its dtypes.


@pytest.mark.parametrize(
    "make",
    [lambda: optax.adam(0.1), lambda: optax.sgd(0.1, momentum=0.9)],
    ids=["adam", "momentum"],
)
def test_bf16_params_with_f32_grads_keep_the_inner_state_dtypes(make):
    params = {
        "w": jnp.linspace(-1, 1, 6, dtype=jnp.bfloat16),
        "b": jnp.ones(2, jnp.bfloat16),
    }
    rng = np.random.default_rng(2)
    tx = mm.MaskedMultiSteps(make(), 2)
    reference = optax.MultiSteps(make(), 2)
    state, ref_state = tx.init(params), reference.init(params)
    dtypes = [x.dtype for x in jax.tree.leaves(state.inner_opt_state)]
    assert jnp.bfloat16 in dtypes
    # A bare inner update would turn its bfloat16 state into float32.
    g = jax.tree.map(lambda p: jnp.ones(p.shape, jnp.float32), params)
    _, bare = make().update(g, make().init(params), params)
    assert [x.dtype for x in jax.tree.leaves(bare)] != dtypes
    update = jax.jit(tx.update)
    for _ in range(6):
        grads = jax.tree.map(
            lambda p: jnp.asarray(rng.standard_normal(p.shape), jnp.float32), params
        )
        updates, state = update(grads, state, params, count=jnp.int32(4))
        ref_updates, ref_state = reference.update(grads, ref_state, params)
        assert [x.dtype for x in jax.tree.leaves(state.inner_opt_state)] == dtypes
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(
                np.asarray(a, np.float32),
                np.asarray(b, np.float32),
                rtol=1e-2,
                atol=1e-3,
            ),
            updates,
            ref_updates,
        )
        params = optax.apply_updates(params, updates)
    assert int(state.gradient_step) == 3
    ref_dtypes = [x.dtype for x in jax.tree.leaves(ref_state.inner_opt_state)]
    assert dtypes == ref_dtypes


def test_the_state_counters_saturate_at_the_int32_maximum():
    # `num_invalid_counts` is added to with a clip at 2**31 - 1: without the
    # clip one more invalid count wrapped it to -2**31.
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 1)
    top = jnp.int32(2**31 - 1)
    s = tx.init(jnp.zeros(2))._replace(
        num_invalid_counts=top, num_nonfinite_windows=top
    )
    step = jax.jit(tx.update)
    _, s = step(jnp.ones(2), s, count=jnp.int32(-1))  # invalid (traced)
    _, s = step(jnp.full(2, jnp.nan), s, count=jnp.int32(3))  # a non-finite window
    assert int(s.num_invalid_counts) == 2**31 - 1
    assert int(s.num_nonfinite_windows) == 2**31 - 1
    # Deferred: every device's invalid counts are added when the window closes.
    n = len(jax.devices())
    mesh = jax.make_mesh((n,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 1, reduction=mm.deferred(mesh, "data"))
    s = tx.init(jnp.zeros(2))._replace(num_invalid_counts=top)
    counts = jnp.full(n, -1, jnp.int32)  # n invalid counts in one window
    _, s = jax.jit(tx.update)(jnp.ones((n, 2)), s, count=counts)
    assert int(s.num_invalid_counts) == 2**31 - 1


# An inner optimizer whose value= is optional still gets the window's loss.
def _records_optional_value():
    def init(params):
        del params
        return jnp.float32(-1.0)

    def update(updates, state, params=None, *, value=None, **extra):
        del state, params, extra
        seen = jnp.float32(-2.0) if value is None else jnp.asarray(value, jnp.float32)
        return updates, seen

    return optax.GradientTransformationExtraArgs(init, update)


def test_inner_with_optional_value_gets_the_window_mean_value():
    tx = mm.MaskedMultiSteps(_records_optional_value(), 2)
    p = jnp.zeros(2)
    state = tx.init(p)
    step = jax.jit(tx.update)
    _, state = step(jnp.ones(2), state, p, count=jnp.float32(1), value=jnp.float32(2.0))
    _, state = step(jnp.ones(2), state, p, count=jnp.float32(3), value=jnp.float32(6.0))
    assert bool(mm.has_updated(state))
    # (1 * 2 + 3 * 6) / 4 = 5
    assert float(state.inner_opt_state) == 5.0


# The window's loss reaches the inner optimizer in the losses' dtype.
def _scales_by_value():
    def init(params):
        del params
        return optax.EmptyState()

    def update(updates, state, params=None, *, value, **extra):
        del params, extra
        assert value.dtype == jnp.bfloat16, value.dtype
        return jax.tree.map(lambda u: u * value, updates), state

    return optax.GradientTransformationExtraArgs(init, update)


def test_inner_sees_the_window_loss_in_the_microbatch_loss_dtype():
    tx = mm.MaskedMultiSteps(_scales_by_value(), 2)
    p = jnp.zeros(2, jnp.bfloat16)
    state = tx.init(p)
    step = jax.jit(tx.update)
    for n, v in [(1, 2.0), (3, 6.0)]:
        updates, state = step(
            jnp.ones(2, jnp.bfloat16),
            state,
            p,
            count=jnp.float32(n),
            value=jnp.bfloat16(v),
        )
    assert bool(mm.has_updated(state))
    assert updates.dtype == jnp.bfloat16
    assert jnp.allclose(updates.astype(jnp.float32), 5.0)


def test_a_value_refused_deeper_inside_the_inner_optimizer_is_an_error():
    # Only an update whose own signature refuses `value=` runs without it: a
    # TypeError from deeper inside (a transformation that forwards it, a chain
    # holding sam) is not swallowed, which would drop a loss the inner
    # optimizer reads.
    inner_adam = optax.scale_by_adam()

    def update(updates, state, params=None, *, value=None, **extra):
        del value  # read, then forwarded by mistake with the rest
        return inner_adam.update(updates, state, params, value=1.0, **extra)

    gated = optax.GradientTransformationExtraArgs(inner_adam.init, update)

    def sam():
        return optax.contrib.sam(optax.sgd(0.1), optax.sgd(0.05), sync_period=2)

    for inner in [gated, optax.chain(sam())]:
        tx = mm.MaskedMultiSteps(inner, 1)
        state = tx.init(PARAMS)
        # The way out first, then what the optimizer said.
        with pytest.raises(
            TypeError,
            match=r"^a transformation inside the inner optimizer refuses the "
            r"`value=`.*optax.GradientTransformation\(t.init, t.update\).*; it "
            r"said: .*unexpected keyword argument 'value'",
        ):
            tx.update(_grads(1.0), state, PARAMS, count=1, value=jnp.float32(1.0))
    # The note's way out: wrapped so, optax.chain calls sam without it.
    wrapped = sam()
    tx = mm.MaskedMultiSteps(
        optax.chain(optax.GradientTransformation(wrapped.init, wrapped.update)), 1
    )
    state = tx.init(PARAMS)
    _, state = tx.update(_grads(1.0), state, PARAMS, count=2, value=jnp.float32(3.0))
    assert int(state.gradient_step) == 1


def test_value_reaches_an_update_whose_decorator_adds_the_keyword():
    # The signature read is the decorator's own (functools.wraps would show
    # the wrapped function's, which refuses `value=`): it was withheld.
    import functools

    seen = []
    base = optax.sgd(1.0)

    def plain_update(updates, state, params=None):
        return base.update(updates, state, params)

    @functools.wraps(plain_update)
    def update(updates, state, params=None, value=None):
        seen.append(value)
        return plain_update(updates, state, params)

    inner = optax.GradientTransformationExtraArgs(base.init, update)
    tx = mm.MaskedMultiSteps(inner, 1)
    state = tx.init(PARAMS)
    tx.update(_grads(1.0), state, PARAMS, count=2, value=jnp.float32(7.0))
    assert seen[-1] is not None and float(seen[-1]) == 7.0  # the eager run's
