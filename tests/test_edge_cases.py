"""Edge cases of MaskedMultiSteps: skipped and odd microbatches, low-precision
accumulators, window sizes, and data that ends mid-window."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import assert_bit_identical

import masked_multistep as mm

PARAMS = {"w": jnp.arange(6.0).reshape(3, 2), "b": jnp.ones(2)}


def _grads(scale):
    return jax.tree.map(lambda p: jnp.full(p.shape, scale, p.dtype), PARAMS)


@pytest.mark.parametrize(
    "skip_fn",
    [
        optax.skip_not_finite,
        functools.partial(optax.skip_large_updates, max_squared_norm=1e4),
    ],
    ids=["skip_not_finite", "skip_large_updates"],
)
def test_skipped_microbatch_is_as_if_it_never_happened(skip_fn):
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 2, should_skip_update_fn=skip_fn)
    update = jax.jit(tx.update)
    state = tx.init(PARAMS)
    _, state = update(_grads(1.0), state, PARAMS, count=jnp.int32(1))
    bad = _grads(jnp.inf if skip_fn is optax.skip_not_finite else 1e6)
    updates, skipped = update(bad, state, PARAMS, count=jnp.int32(5))
    assert_bit_identical(skipped.acc_grads, state.acc_grads)
    assert_bit_identical(
        (skipped.acc_count, skipped.mini_step, skipped.gradient_step),
        (state.acc_count, state.mini_step, state.gradient_step),
    )
    assert not bool(tx.has_updated(skipped))
    assert bool(skipped.skip_state["should_skip"])
    for u in jax.tree.leaves(updates):
        np.testing.assert_array_equal(u, 0)
    updates, state = update(_grads(4.0), skipped, PARAMS, count=jnp.int32(3))
    assert bool(tx.has_updated(state))
    for u in jax.tree.leaves(updates):
        np.testing.assert_allclose(u, -3.25)


def test_a_skip_state_keeps_its_dtypes_for_gradients_of_another_dtype():
    # skip_large_updates' norm comes in the gradients' dtype, its initial state
    # in the params': float32 gradients for bfloat16 params were refused as "a
    # state built by a MaskedMultiSteps with another skip function".
    skip = functools.partial(optax.skip_large_updates, max_squared_norm=100.0)
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 2, should_skip_update_fn=skip)
    params = jnp.ones(3, jnp.bfloat16)
    state = tx.init(params)
    update = jax.jit(tx.update)
    _, new = update(jnp.ones(3, jnp.float32), state, params, count=jnp.int32(2))
    chex.assert_trees_all_equal_shapes_and_dtypes(new.skip_state, state.skip_state)
    assert float(new.skip_state["norm_squared"]) == 3.0 and int(new.mini_step) == 1
    updates, new = update(jnp.full(3, 9.0), new, params, count=jnp.int32(2))
    assert bool(new.skip_state["should_skip"]) and int(new.mini_step) == 1


def test_has_updated_is_true_exactly_after_an_applied_update():
    tx = mm.MaskedMultiSteps(
        optax.sgd(1.0), 2, should_skip_update_fn=optax.skip_not_finite
    )
    update = jax.jit(tx.update)
    state = tx.init(PARAMS)
    assert not bool(tx.has_updated(state))
    flags = []
    for g, n in [(1.0, 1), (1.0, 1), (jnp.nan, 1), (1.0, 0), (1.0, 0), (1.0, 2)]:
        _, state = update(_grads(g), state, PARAMS, count=jnp.int32(n))
        flags.append(bool(tx.has_updated(state)))
    # Applied at call 2; the NaN call is skipped; calls 4-5 close an empty window.
    assert flags == [False, True, False, False, False, False]


def test_fp16_accumulator_does_not_overflow_on_large_gradients():
    big = 60000.0  # close to float16's max of 65504
    k = 8
    params = jnp.zeros(4, jnp.float16)
    tx = mm.MaskedMultiSteps(optax.sgd(-1.0), k, accumulator_dtype=jnp.float16)
    state = tx.init(params)
    assert state.acc_grads.dtype == jnp.float16
    update = jax.jit(tx.update)
    grads = jnp.array([big, -big, big / 2, 1.0], jnp.float16)
    for i in range(k):
        updates, state = update(grads, state, params, count=jnp.int32(1000 + i))
    assert np.all(np.isfinite(np.asarray(updates, np.float32)))
    np.testing.assert_allclose(np.asarray(updates, np.float32), grads, rtol=1e-3)
    # A sum-then-divide accumulator in the same dtype overflows.
    summed = optax.MultiSteps(
        optax.sgd(-1.0), k, use_grad_mean=False, accumulator_dtype=jnp.float16
    )
    s = summed.init(params)
    for _ in range(k):
        u, s = summed.update(grads, s, params)
    assert not np.all(np.isfinite(np.asarray(u, np.float32)))


@pytest.mark.parametrize(
    "accumulator_dtype, expected",
    [(None, 1.5), (jnp.bfloat16, 1.0)],
    ids=["default", "bfloat16"],
)
def test_a_low_precision_mean_stops_moving_when_gradients_drift(
    accumulator_dtype, expected
):
    # As the README says of accumulator_dtype: 1024 equal counts, gradients of
    # 1 then 2. A bfloat16 mean stays at 1 once (g - m) / j is below half its
    # rounding unit; the default (float32) accumulator gets 1.5.
    k = 1024
    tx = mm.MaskedMultiSteps(optax.sgd(-1.0), k, accumulator_dtype=accumulator_dtype)
    params = jnp.zeros(4, jnp.bfloat16)
    grads = jnp.repeat(jnp.array([1.0, 2.0], jnp.bfloat16), k // 2)[:, None]

    def body(state, g):
        updates, state = tx.update(
            jnp.broadcast_to(g, (4,)), state, params, count=jnp.int32(1)
        )
        return state, updates

    _, updates = jax.lax.scan(body, tx.init(params), grads)
    np.testing.assert_allclose(np.asarray(updates[-1], np.float32), expected, rtol=1e-6)


def test_float_weights_with_float_count_dtype():
    tx = mm.MaskedMultiSteps(optax.sgd(-1.0), 3, count_dtype=jnp.float32)
    state = tx.init(jnp.zeros(()))
    assert state.acc_count.dtype == jnp.float32
    for g, w in [(1.0, 0.5), (2.0, 0.25), (10.0, 0.25)]:
        updates, state = tx.update(jnp.float32(g), state, count=jnp.float32(w))
    np.testing.assert_allclose(updates, 0.5 * 1 + 0.25 * 2 + 0.25 * 10, rtol=1e-6)


@pytest.mark.parametrize(
    "k", [3, np.int64(3), np.int32(3), jnp.array(3), jnp.int32(3)], ids=repr
)
def test_every_k_schedule_accepts_integer_kinds(k):
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), k)
    state = tx.init(PARAMS)
    flags = []
    for _ in range(6):
        _, state = tx.update(_grads(1.0), state, PARAMS, count=jnp.int32(1))
        flags.append(bool(tx.has_updated(state)))
    # k = 3 exactly: a conversion that collapsed k to 1 or 2 would close earlier.
    assert flags == [False, False, True, False, False, True]


def test_callable_schedule_varies_window_size():
    # k = 1 for the first two updates, then 3.
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), lambda step: jnp.where(step < 2, 1, 3))
    update = jax.jit(tx.update)
    state = tx.init(PARAMS)
    flags = []
    for _ in range(8):
        _, state = update(_grads(1.0), state, PARAMS, count=jnp.int32(1))
        flags.append(bool(tx.has_updated(state)))
    assert flags == [True, True, False, False, True, False, False, True]


def test_a_window_the_data_leaves_unfinished_closes_on_count_0_microbatches():
    # The README's recipe for the end of the data: zero gradients with count=0
    # until mini_step is 0, in mm.TrainState and an nnx.Optimizer under jit.
    pytest.importorskip("flax")
    from flax import nnx

    k, lr = 4, 0.5
    pending = [(jnp.array([1.0, 2.0]), 2), (jnp.array([4.0, -1.0]), 6)]
    mean = (2 * pending[0][0] + 6 * pending[1][0]) / 8
    expected = optax.apply_updates(jnp.ones(2), -lr * mean)

    state = mm.TrainState.create(
        apply_fn=None, params=jnp.ones(2), tx=mm.MaskedMultiSteps(optax.sgd(lr), k)
    )
    step = jax.jit(lambda s, g, n: s.apply_gradients(grads=g, count=n))
    for g, n in pending:
        state = step(state, g, n)
    flushes = 0
    while int(state.mini_step) != 0:
        state = step(state, jnp.zeros(2), 0)
        flushes += 1
    assert flushes == 2 and int(state.gradient_step) == 1
    np.testing.assert_allclose(state.params, expected, rtol=1e-6)

    class Model(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones(2))

    model = Model()
    tx = mm.MaskedMultiSteps(optax.sgd(lr), k)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def update(model, optimizer, g, n):
        grads = jax.tree.map(lambda _: g, nnx.state(model, nnx.Param))
        optimizer.update(model, grads, count=n)

    for g, n in pending:
        update(model, optimizer, g, n)
    while int(mm.find_state(optimizer.opt_state).mini_step) != 0:
        update(model, optimizer, jnp.zeros(2), 0)
    assert int(mm.find_state(optimizer.opt_state).gradient_step) == 1
    np.testing.assert_allclose(model.w[...], expected, rtol=1e-6)
