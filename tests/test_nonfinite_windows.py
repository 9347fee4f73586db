"""Non-finite and empty windows: what the inner optimizer never sees, what is
counted."""

import functools

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


@pytest.fixture
def adam_tx():
    return mm.MaskedMultiSteps(optax.adam(0.1), 3)


def test_zero_count_with_nan_gradient_changes_nothing_but_mini_step(adam_tx):
    update = jax.jit(adam_tx.update)
    state = adam_tx.init(PARAMS)
    _, state = update(_grads(2.0), state, PARAMS, count=jnp.int32(5))
    _, after = update(_grads(jnp.nan), state, PARAMS, count=jnp.int32(0))
    assert_bit_identical(after.acc_grads, state.acc_grads)
    assert_bit_identical(after.acc_count, state.acc_count)
    assert int(after.mini_step) == int(state.mini_step) + 1
    # ...and the window still ends on schedule, with the one real microbatch.
    updates, after = update(_grads(jnp.inf), after, PARAMS, count=jnp.int32(0))
    assert bool(adam_tx.has_updated(after))
    expected, _ = optax.adam(0.1).update(_grads(2.0), optax.adam(0.1).init(PARAMS))
    jax.tree.map(np.testing.assert_allclose, updates, expected)


def test_all_zero_window_applies_nothing_and_next_window_is_clean(adam_tx):
    update = jax.jit(adam_tx.update)
    state0 = adam_tx.init(PARAMS)
    state = state0
    for _ in range(3):
        updates, state = update(_grads(jnp.nan), state, PARAMS, count=jnp.int32(0))
    assert not bool(adam_tx.has_updated(state))
    for u in jax.tree.leaves(updates):
        np.testing.assert_array_equal(u, 0)
    assert_bit_identical(state.inner_opt_state, state0.inner_opt_state)
    assert int(state.gradient_step) == 0
    assert int(state.mini_step) == 0 and int(state.acc_count) == 0

    for scale, n in [(1.0, 1), (4.0, 3), (jnp.nan, 0)]:
        updates, state = update(_grads(scale), state, PARAMS, count=jnp.int32(n))
    expected, _ = optax.adam(0.1).update(_grads(3.25), optax.adam(0.1).init(PARAMS))
    jax.tree.map(np.testing.assert_allclose, updates, expected)
    assert int(state.gradient_step) == 1


@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf, -jnp.inf])
def test_nonfinite_window_is_not_handed_to_the_inner_optimizer(bad):
    # adam would carry a NaN in its moments into every later update.
    tx = mm.MaskedMultiSteps(optax.adam(1.0), 2)
    update = jax.jit(tx.update)
    state = tx.init(PARAMS)
    _, state = update(_grads(1.0), state, PARAMS, count=jnp.int32(2))
    inner_before = state.inner_opt_state
    updates, state = update(_grads(bad), state, PARAMS, count=jnp.int32(2))
    assert not bool(tx.has_updated(state))
    assert int(state.num_nonfinite_windows) == 1
    assert int(state.gradient_step) == 0 and int(state.mini_step) == 0
    assert int(state.acc_count) == 0
    for u in jax.tree.leaves(updates):
        np.testing.assert_array_equal(u, 0.0)
    assert_bit_identical(state.inner_opt_state, inner_before)
    # The run goes on: the next window is clean and applied.
    _, state = update(_grads(1.0), state, PARAMS, count=jnp.int32(1))
    updates, state = update(_grads(4.0), state, PARAMS, count=jnp.int32(3))
    assert bool(tx.has_updated(state)) and int(state.gradient_step) == 1
    for u in jax.tree.leaves(updates):
        assert np.all(np.isfinite(u)) and np.all(u != 0)


@pytest.mark.parametrize("window_stats", [False, True])
def test_huge_finite_window_is_applied_and_one_inf_element_is_not(window_stats):
    # Each leaf's sum (and the squared norm) overflows to inf although every
    # element is finite: the finiteness test must not take that for a bad window.
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 2, window_stats=window_stats)
    update = jax.jit(tx.update)
    huge = _grads(3e38)
    state = tx.init(PARAMS)
    _, state = update(huge, state, PARAMS, count=jnp.int32(2))
    updates, state = update(huge, state, PARAMS, count=jnp.int32(5))
    assert bool(tx.has_updated(state)) and int(state.num_nonfinite_windows) == 0
    jax.tree.map(lambda u: np.testing.assert_array_equal(u, np.float32(-3e38)), updates)

    one_inf = {**huge, "b": huge["b"].at[1].set(jnp.inf)}
    _, state = update(huge, state, PARAMS, count=jnp.int32(2))
    updates, state = update(one_inf, state, PARAMS, count=jnp.int32(5))
    assert not bool(tx.has_updated(state))
    assert int(state.num_nonfinite_windows) == 1
    assert all(np.all(u == 0) for u in jax.tree.leaves(updates))


def test_finiteness_test_under_vmap_takes_each_window_on_its_own():
    # Under vmap the test's conditional becomes a select over the batch.
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 1)
    huge = _grads(3e38)
    one_inf = {**huge, "b": huge["b"].at[1].set(jnp.inf)}
    grads = jax.tree.map(lambda *x: jnp.stack(x), huge, one_inf, _grads(2.0))

    def step(g):
        return tx.update(g, tx.init(PARAMS), PARAMS, count=jnp.int32(3))

    updates, states = jax.jit(jax.vmap(step))(grads)
    np.testing.assert_array_equal(states.gradient_step, [1, 0, 1])
    np.testing.assert_array_equal(states.num_nonfinite_windows, [0, 1, 0])
    for u in jax.tree.leaves(updates):
        np.testing.assert_array_equal(u[0], np.float32(-3e38))
        np.testing.assert_array_equal(u[1], 0.0)
        np.testing.assert_array_equal(u[2], -2.0)


@pytest.mark.parametrize(
    "dtype", [jnp.float32, jnp.bfloat16, jnp.float16, jnp.complex64]
)
def test_the_finiteness_test_is_exact_for_every_float_dtype(dtype):
    # Largest finite values (whose sums overflow) pass; one inf, -inf or NaN
    # anywhere fails, in any leaf, under jit as eagerly.
    from masked_multistep._running_mean import all_finite

    big = jnp.full((5, 3), jnp.finfo(dtype).max, dtype)
    tree = {"a": big, "b": -big[0], "n": jnp.arange(3)}  # an integer leaf aside
    check = jax.jit(all_finite)
    assert bool(check(tree)) and bool(all_finite(tree))
    for bad in (jnp.inf, -jnp.inf, jnp.nan):
        for key in ("a", "b"):
            spoilt = {**tree, key: tree[key].at[(1,) * tree[key].ndim].set(bad)}
            assert not bool(check(spoilt)), (bad, key)
            assert not bool(all_finite(spoilt)), (bad, key)
    if jnp.issubdtype(dtype, jnp.complexfloating):
        spoilt = {**tree, "b": tree["b"].at[0].set(complex(0, np.inf))}
        assert not bool(check(spoilt))


def test_the_finiteness_test_adds_no_conditional_to_the_step():
    # The window's conditional and, inside it, the one that applies or holds
    # the window: nothing else (an elementwise fallback behind a conditional of
    # its own added a kernel per leaf, compiled though rarely run).
    tx = mm.MaskedMultiSteps(optax.adam(1e-3), 4)
    state = tx.init(PARAMS)
    hlo = (
        jax.jit(functools.partial(tx.update, count=jnp.int32(3)))
        .lower(_grads(1.0), state, PARAMS)
        .compile()
        .as_text()
    )
    assert hlo.count(" conditional(") == 2


def test_nonfinite_gradient_spoils_its_window_only():
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 2)
    update = jax.jit(tx.update)
    state = tx.init(PARAMS)
    _, state = update(_grads(1.0), state, PARAMS, count=jnp.int32(2))
    updates, state = update(_grads(jnp.nan), state, PARAMS, count=jnp.int32(2))
    assert not bool(tx.has_updated(state))
    assert int(state.num_nonfinite_windows) == 1
    assert all(np.all(u == 0) for u in jax.tree.leaves(updates))
    # optax.MultiSteps keeps `(1 - emit) * NaN == NaN` in its accumulator forever;
    # here the next window starts clean.
    _, state = update(_grads(1.0), state, PARAMS, count=jnp.int32(1))
    updates, state = update(_grads(4.0), state, PARAMS, count=jnp.int32(3))
    for u in jax.tree.leaves(updates):
        np.testing.assert_allclose(u, -3.25)


def test_optax_multisteps_keeps_nan_forever():
    # The behaviour the previous test improves on (documents the difference).
    tx = optax.MultiSteps(optax.sgd(1.0), 2)
    state = tx.init(PARAMS)
    for g in [1.0, jnp.nan, 1.0, 4.0]:
        updates, state = tx.update(_grads(g), state, PARAMS)
    assert all(np.all(np.isnan(u)) for u in jax.tree.leaves(updates))


# A window without tokens is not a non-finite window, even where the
# accumulator's scratch still holds the NaN of the window before.
def test_an_empty_window_after_a_nonfinite_one_is_not_counted_as_nonfinite():
    tx = mm.MaskedMultiSteps(optax.adam(0.1), 2)
    p = jnp.zeros(3)
    step = jax.jit(tx.update)
    state = tx.init(p)
    for g in (jnp.full(3, jnp.nan), jnp.ones(3)):
        _, state = step(g, state, p, count=jnp.float32(2))
    assert int(state.num_nonfinite_windows) == 1
    assert int(state.gradient_step) == 0
    # A window of two empty microbatches (their 0/0 means are NaN).
    for _ in range(2):
        updates, state = step(jnp.full(3, jnp.nan), state, p, count=jnp.float32(0))
    assert int(state.num_nonfinite_windows) == 1
    assert int(state.gradient_step) == 0
    assert not bool(mm.has_updated(state))
    assert float(jnp.abs(updates).max()) == 0.0
    # And an empty window on a fresh state.
    state = tx.init(p)
    for _ in range(2):
        _, state = step(jnp.ones(3), state, p, count=jnp.float32(0))
    assert int(state.num_nonfinite_windows) == 0
