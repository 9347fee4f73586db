"""What the inner optimizer sees: one update per window, the window's loss and
mean gradient as `value=` and `grad=`, its schedule, its state and its updates."""

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
    # Without `grad=` the line search failed inside optax ("missing 1 required
    # keyword-only argument: 'grad'"): the error says to pass one.
    with pytest.raises(
        TypeError,
        match=r"^the inner optimizer is a line search that needs `grad=`: pass one "
        r"with each microbatch, e.g. `grad=grads`.*; it said: .*'grad'",
    ):
        update(g, state, w, count=count, value=loss, window=jnp.int32(0))


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


# Every optimizer of optax's and optax.contrib's that takes gradients alone or
# with `value=` (lbfgs, sam and reduce_on_plateau are tested above and in
# test_counts; dpsgd wants per-example gradients, sophia a loss function,
# lookahead its own params): inside the wrapper, a window of microbatches with
# unequal token counts steps it as the full batch's gradient does.
_CATALOG = {
    **{
        name: (lambda name=name: getattr(optax, name)(1e-2))
        for name in [
            "adabelief", "adafactor", "adagrad", "adam", "adamax", "adamaxw",
            "adamw", "adan", "amsgrad", "fromage", "lamb", "lars", "lion", "nadam",
            "nadamw", "novograd", "optimistic_adam_v2",
            "optimistic_gradient_descent", "radam", "rmsprop", "rprop",
            "sign_sgd", "signum", "sm3", "yogi",
        ]
    },
    "adadelta": lambda: optax.adadelta(1e-1),
    "noisy_sgd": lambda: optax.noisy_sgd(1e-2, key=jax.random.key(0)),
    "polyak_sgd": lambda: optax.polyak_sgd(1.0),
    "sgd_nesterov": lambda: optax.sgd(1e-2, momentum=0.9, nesterov=True),
    **{
        f"contrib.{name}": (lambda name=name: getattr(optax.contrib, name)(1e-2))
        for name in [
            "acprop", "ademamix", "adopt", "madgrad", "momo", "momo_adam", "muon",
            "schedule_free_adamw", "schedule_free_sgd", "simplified_ademamix",
        ]
    },
    **{
        f"contrib.{name}": (lambda name=name: getattr(optax.contrib, name)())
        for name in ["cocob", "dadapt_adamw", "dog", "dowg", "prodigy"]
    },
    "contrib.mechanize": lambda: optax.contrib.mechanize(optax.adam(1e-2)),
    "contrib.galore": lambda: optax.contrib.galore(1e-2, rank=2),
}  # fmt: skip
_NEEDS_VALUE = {"polyak_sgd", "contrib.momo", "contrib.momo_adam"}


@pytest.mark.parametrize("name", sorted(_CATALOG))
def test_every_optax_optimizer_steps_on_the_full_batch_gradient(name):
    k, rows, width = 3, 6, 4
    rng = np.random.default_rng(0)
    params = {
        "w": jnp.asarray(rng.normal(size=(width, width)), jnp.float32),
        "b": jnp.asarray(rng.normal(size=(width,)), jnp.float32),
    }
    x = rng.normal(size=(2 * k, rows, width)).astype(np.float32)
    y = rng.normal(size=(2 * k, rows, width)).astype(np.float32)
    mask = np.arange(rows) < np.array([[1], [6], [3], [5], [2], [4]])  # unequal

    def loss(p, x, y, mask):
        per_row = jnp.sum((jnp.tanh(x @ p["w"] + p["b"][None]) - y) ** 2, axis=-1)
        return mm.masked_mean(per_row, mask)

    opt = _CATALOG[name]()
    tx = mm.MaskedMultiSteps(opt, k)
    value_and_grad = jax.value_and_grad(loss, has_aux=True)
    value = (lambda v: {"value": v}) if name in _NEEDS_VALUE else (lambda v: {})

    @jax.jit
    def both(params):
        # Two windows through the wrapper, microbatch by microbatch ...
        p, state = params, tx.init(params)
        for i in range(2 * k):
            (v, n), g = value_and_grad(p, x[i], y[i], mask[i])
            updates, state = tx.update(g, state, p, count=n, **value(v))
            p = optax.apply_updates(p, updates)
        # ... and on each window's whole batch.
        q, inner = params, opt.init(params)
        for w in range(2):
            window = slice(w * k, (w + 1) * k)
            flat = [a[window].reshape(k * rows, -1) for a in (x, y)]
            (v, _), g = value_and_grad(q, *flat, mask[window].reshape(-1))
            updates, inner = opt.update(g, inner, q, **value(v))
            q = optax.apply_updates(q, updates)
        return p, q

    accumulated, full_batch = both(params)
    assert not jax.tree.all(jax.tree.map(jnp.array_equal, full_batch, params))
    chex.assert_trees_all_close(accumulated, full_batch, rtol=1e-5, atol=1e-6)
