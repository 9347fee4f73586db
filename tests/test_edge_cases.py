"""Edge cases of MaskedMultiSteps: empty, skipped, non-finite and odd microbatches."""

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


def test_inner_optimizer_runs_once_per_window():
    calls = []

    def counting_sgd():
        inner = optax.sgd(1.0)

        def update(updates, state, params=None):
            jax.debug.callback(lambda: calls.append(1))
            return inner.update(updates, state, params)

        return optax.GradientTransformation(inner.init, update)

    tx = mm.MaskedMultiSteps(counting_sgd(), 4)
    update = jax.jit(tx.update)
    state = tx.init(PARAMS)
    counts = [1, 2, 3, 4] + [0, 0, 0, 0] + [5, 0, 0, 1]
    for n in counts:
        _, state = update(_grads(1.0), state, PARAMS, count=jnp.int32(n))
    jax.effects_barrier()
    assert len(calls) == 2  # two windows with tokens; the empty one calls nothing
    assert int(state.gradient_step) == 2


def test_inner_schedule_and_weight_decay_advance_per_window():
    schedule = optax.linear_schedule(1.0, 0.0, transition_steps=4)
    tx = mm.MaskedMultiSteps(
        optax.inject_hyperparams(optax.adamw)(learning_rate=schedule), 3
    )
    update = jax.jit(tx.update)
    state = tx.init(PARAMS)
    lrs = []
    for _ in range(9):
        _, state = update(_grads(1.0), state, PARAMS, count=jnp.int32(2))
        lrs.append(float(state.inner_opt_state.hyperparams["learning_rate"]))
    assert lrs == [1.0, 1.0, 1.0, 1.0, 1.0, 0.75, 0.75, 0.75, 0.5]


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


def test_value_is_token_weighted_and_reaches_the_inner_optimizer():
    seen = []

    def recording_sgd():
        inner = optax.sgd(1.0)

        def update(updates, state, params=None, *, value, scale):
            jax.debug.callback(
                lambda v, s: seen.append((float(v), float(s))), value, scale
            )
            return inner.update(jax.tree.map(lambda u: u * scale, updates), state)

        return optax.GradientTransformationExtraArgs(inner.init, update)

    tx = mm.MaskedMultiSteps(recording_sgd(), 3)
    update = jax.jit(tx.update)
    state = tx.init(PARAMS)
    for loss, n in [(1.0, 2), (jnp.nan, 0), (4.0, 6)]:
        updates, state = update(
            _grads(1.0),
            state,
            PARAMS,
            count=jnp.int32(n),
            value=jnp.float32(loss),
            scale=jnp.float32(2.0),
        )
    jax.effects_barrier()
    assert seen == [(pytest.approx(3.25), 2.0)]
    for u in jax.tree.leaves(updates):
        np.testing.assert_allclose(u, -2.0)


def test_reduce_on_plateau_sees_full_batch_loss():
    inner = optax.chain(
        optax.sgd(1.0), optax.contrib.reduce_on_plateau(patience=0, factor=0.5)
    )
    tx = mm.MaskedMultiSteps(inner, 2)
    state = tx.init(PARAMS)
    for loss, n in [(1.0, 1), (3.0, 3)]:
        _, state = tx.update(
            _grads(1.0), state, PARAMS, count=jnp.int32(n), value=jnp.float32(loss)
        )
    plateau_state = state.inner_opt_state[1]
    np.testing.assert_allclose(plateau_state.best_value, 2.5)


@pytest.mark.parametrize("clip", [False, True], ids=["", "clip inside"])
def test_line_search_gets_the_window_gradient_as_grad(clip):
    # A line search takes the loss (`value=`), its gradient at the params
    # (`grad=`) and the loss function (`value_fn=`). Through the wrapper each
    # microbatch passes its own `grad=`; the window's is the mean. Here the
    # closing microbatch's gradient points the other way: a line search fed
    # it accepts steps the window's gradient refuses (params off by up to 13).
    centres = jnp.asarray([[1.0, 2.0, 3.0], [-1e5, -1e5, -1e5]])
    counts = jnp.asarray([1_000_000, 1], jnp.int32)

    def micro_loss(p, i):
        return 0.5 * jnp.sum((p - centres[i]) ** 2)

    def full_loss(p):
        losses = jnp.stack([micro_loss(p, 0), micro_loss(p, 1)])
        return jnp.sum(counts * losses) / jnp.sum(counts)

    # With clipping inside the wrapper the line search's `grad=` stays the
    # unclipped mean, as in the plain chain.
    inner = optax.chain(
        *([optax.clip_by_global_norm(1.0)] if clip else []),
        optax.sgd(5.0),
        optax.scale_by_backtracking_linesearch(max_backtracking_steps=30),
    )
    p_ref = p = jnp.zeros(3)
    s_ref = inner.init(p_ref)
    inner_update = jax.jit(functools.partial(inner.update, value_fn=full_loss))
    tx = mm.MaskedMultiSteps(inner, 2)
    state = tx.init(p)
    update = jax.jit(functools.partial(tx.update, value_fn=full_loss))
    for _ in range(2):
        v, g = jax.value_and_grad(full_loss)(p_ref)
        u, s_ref = inner_update(g, s_ref, p_ref, value=v, grad=g)
        p_ref = optax.apply_updates(p_ref, u)
        for i in range(2):
            v, g = jax.value_and_grad(micro_loss)(p, i)
            u, state = update(g, state, p, count=counts[i], value=v, grad=g)
            p = optax.apply_updates(p, u)
    np.testing.assert_allclose(p, p_ref, rtol=1e-5)


def test_lbfgs_runs_on_each_windows_token_weighted_loss_and_gradient():
    # L-BFGS keeps curvature pairs across windows and its zoom line search
    # calls `value_fn` (here with the window's index, an extra argument it
    # forwards): the wrapper must hand it the window's loss (`value=`,
    # token-weighted over masked microbatches) and mean gradient (`grad=`),
    # so that every window equals one L-BFGS step on the full batch.
    rng = np.random.default_rng(0)
    k, windows = 3, 4
    xs = jnp.asarray(rng.normal(size=(windows, k, 8, 3)), jnp.float32)
    ys = jnp.asarray(rng.normal(size=(windows, k, 8)), jnp.float32)
    masks = jnp.asarray(rng.random((windows, k, 8)) < 0.7)

    def window_loss(p, window):
        per_token = (xs[window] @ p - ys[window]) ** 2
        return mm.masked_mean(per_token, masks[window])[0]

    def micro_loss(p, window, i):
        return mm.masked_mean(
            (xs[window, i] @ p - ys[window, i]) ** 2, masks[window, i]
        )

    inner = optax.lbfgs()
    tx = mm.MaskedMultiSteps(inner, k)
    update = jax.jit(functools.partial(tx.update, value_fn=window_loss))
    inner_update = jax.jit(functools.partial(inner.update, value_fn=window_loss))
    grad_fn = jax.jit(jax.value_and_grad(micro_loss, has_aux=True))
    w = w_ref = jnp.zeros(3)
    state, s_ref = tx.init(w), inner.init(w_ref)
    for window in map(jnp.int32, range(windows)):
        for i in range(k):
            (loss, count), g = grad_fn(w, window, i)
            u, state = update(
                g, state, w, count=count, value=loss, grad=g, window=window
            )
            w = optax.apply_updates(w, u)
        loss, g = jax.value_and_grad(window_loss)(w_ref, window)
        u, s_ref = inner_update(g, s_ref, w_ref, value=loss, grad=g, window=window)
        w_ref = optax.apply_updates(w_ref, u)
        np.testing.assert_allclose(w, w_ref, rtol=1e-5, atol=1e-6)
    assert int(state.gradient_step) == windows


def test_inside_optax_chain_with_count_as_extra_arg():
    base = mm.MaskedMultiSteps(optax.adam(0.1), 2)
    chained = optax.chain(base.gradient_transformation(), optax.scale(2.0))
    assert isinstance(chained, optax.GradientTransformationExtraArgs)
    s_base, s_chain = base.init(PARAMS), chained.init(PARAMS)
    for g, n in [(1.0, 1), (5.0, 3)]:
        u_base, s_base = base.update(_grads(g), s_base, PARAMS, count=jnp.int32(n))
        u_chain, s_chain = chained.update(
            _grads(g), s_chain, PARAMS, count=jnp.int32(n)
        )
    jax.tree.map(lambda a, b: np.testing.assert_allclose(2 * a, b), u_base, u_chain)


def test_apply_gradients_matches_update_then_apply():
    tx = mm.MaskedMultiSteps(optax.adamw(0.1, weight_decay=0.1), 3)
    p1 = p2 = PARAMS
    s1 = s2 = tx.init(PARAMS)
    for i, n in enumerate([1, 4, 0, 2, 2, 7]):
        u, s1 = tx.update(_grads(i - 2.0), s1, p1, count=jnp.int32(n))
        p1 = optax.apply_updates(p1, u)
        p2, s2 = tx.apply_gradients(_grads(i - 2.0), s2, p2, count=jnp.int32(n))
        assert_bit_identical(p1, p2)
        assert_bit_identical(s1._replace(acc_grads=()), s2._replace(acc_grads=()))
        if int(s1.acc_count) > 0:  # the running mean, where it means something
            assert_bit_identical(s1.acc_grads, s2.acc_grads)
        elif bool(s1.updated):
            # `update` wrote the inner update into the dead accumulator's buffer.
            assert_bit_identical(s1.acc_grads, u)


def test_zero_updates_have_the_emitted_dtype_and_structure():
    params = {"w": jnp.ones(3, jnp.bfloat16), "b": jnp.ones(2, jnp.float32)}
    tx = mm.MaskedMultiSteps(optax.adam(0.1), 2)
    state = tx.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    zeros, state = tx.update(grads, state, params, count=jnp.int32(1))
    emitted, state = tx.update(grads, state, params, count=jnp.int32(1))
    assert jax.tree.structure(zeros) == jax.tree.structure(emitted)
    for z, e in zip(jax.tree.leaves(zeros), jax.tree.leaves(emitted)):
        assert z.dtype == e.dtype and z.shape == e.shape
        np.testing.assert_array_equal(z, 0)


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


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize(
    "make_inner",
    [
        lambda: optax.noisy_sgd(0.1, key=0),
        lambda: optax.chain(optax.add_noise(0.01, 0.55, key=1), optax.sgd(0.1)),
    ],
    ids=["noisy_sgd", "add_noise"],
)
def test_an_inner_state_with_a_typed_prng_key_updates_with_and_without_jit(
    make_inner, jit
):
    # The inner state holds a typed PRNG key (key<fry>), which has no `astype`
    # outside jit; the window's update equals the inner optimizer's own step
    # on the token-mean gradient, and its key advances once per window.
    tx = mm.MaskedMultiSteps(make_inner(), 3)
    update = jax.jit(tx.update) if jit else tx.update
    state = tx.init(PARAMS)
    for scale, n in [(1.0, 1), (jnp.nan, 0), (3.0, 3)]:
        updates, state = update(_grads(scale), state, PARAMS, count=jnp.int32(n))
    inner = make_inner()
    expected, inner_state = inner.update(_grads(2.5), inner.init(PARAMS), PARAMS)
    assert int(state.gradient_step) == 1
    chex.assert_trees_all_close(updates, expected, rtol=1e-6)
    for got, want in zip(
        jax.tree.leaves(state.inner_opt_state),
        jax.tree.leaves(inner_state),
        strict=True,
    ):
        if jax.dtypes.issubdtype(want.dtype, jax.dtypes.prng_key):
            np.testing.assert_array_equal(
                jax.random.key_data(got), jax.random.key_data(want)
            )
        else:
            np.testing.assert_allclose(got, want, rtol=1e-6)


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
