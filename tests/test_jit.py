"""Behaviour under jit: no retrace, stable state avals, donation, distinct buffers."""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import backend_compiles

import masked_multistep as mm

PARAMS = {"w": jnp.ones((4, 3)), "b": jnp.zeros(3, jnp.bfloat16)}


def _avals(tree):
    return jax.tree.map(lambda x: jax.typeof(jnp.asarray(x)), tree)


@pytest.mark.parametrize("count_dtype", [jnp.int32, jnp.float32])
def test_state_avals_are_stable_and_steps_do_not_retrace(count_dtype):
    tx = mm.MaskedMultiSteps(
        optax.adamw(1e-3),
        3,
        should_skip_update_fn=optax.skip_not_finite,
        count_dtype=count_dtype,
    )

    chex.clear_trace_counter()

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(params, state, grads, count, value):
        updates, state = tx.update(grads, state, params, count=count, value=value)
        return optax.apply_updates(params, updates), state

    params, state = PARAMS, tx.init(PARAMS)
    init_avals = _avals(state)
    for i in range(7):
        grads = jax.tree.map(lambda p, i=i: jnp.full_like(p, i), PARAMS)
        params, state = step(
            params, state, grads, jnp.asarray(i % 3, count_dtype), jnp.float32(i)
        )
        assert _avals(state) == init_avals
    assert int(state.gradient_step) == 2


def test_python_int_counts_cost_one_trace_not_one_per_value():
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 2)
    traces = []

    @jax.jit
    def step(state, count):
        traces.append(1)
        return tx.update(PARAMS, state, count=count)[1]

    state = tx.init(PARAMS)
    for n in range(5):
        state = step(state, n)
    assert len(traces) == 1


def _counting(inner, calls):
    """``inner``, recording each trace (or call) of its ``init`` and ``update``."""

    def init(params):
        calls.append("init")
        return inner.init(params)

    def update(updates, state, params=None, **extra_args):
        calls.append("update")
        return inner.update(updates, state, params, **extra_args)

    return optax.GradientTransformationExtraArgs(init, update)


@pytest.mark.parametrize("how", ["update", "apply_gradients", "update, value="])
def test_a_compiled_step_traces_the_inner_optimizer_once(how):
    # Its updates' shapes (for the conditional's other branch) come from the
    # same trace as the window's update, and the inner state's structure from
    # `init`'s; a step that passes `value=` to one that does not read it
    # (adam) too.
    calls = []
    tx = mm.MaskedMultiSteps(_counting(optax.adam(1e-3), calls), 2)
    state = tx.init(PARAMS)
    assert calls == ["init"]
    calls.clear()

    def step(params, state, grads):
        extra = {"value": jnp.float32(1.0)} if how.endswith("value=") else {}
        if how == "apply_gradients":
            return tx.apply_gradients(grads, state, params, count=jnp.int32(3))
        updates, state = tx.update(grads, state, params, count=jnp.int32(3), **extra)
        return optax.apply_updates(params, updates), state

    jax.jit(step).trace(PARAMS, state, PARAMS)
    assert calls == ["update"]
    # And the compiled step gives the inner optimizer's result.
    plain = mm.MaskedMultiSteps(optax.adam(1e-3), 2)
    params, want, plain_state = PARAMS, PARAMS, plain.init(PARAMS)
    for _ in range(2):
        params, state = jax.jit(step)(params, state, PARAMS)
        want, plain_state = plain.apply_gradients(PARAMS, plain_state, want, count=3)
    assert int(state.gradient_step) == 1
    chex.assert_trees_all_close(params, want, rtol=1e-6)


def test_an_inner_update_under_its_own_jit_that_ignores_the_value_is_traced_once():
    # The value reaches the update's `jax.jit` call as an operand; what that
    # call does with it is read from the call's own jaxpr (as jax 0.11 and
    # later keep the wrapper's own `jax.jit(..., inline=True)` call).
    calls = []
    adam = optax.adam(1e-3)
    inner = optax.GradientTransformationExtraArgs(adam.init, jax.jit(adam.update))
    tx = mm.MaskedMultiSteps(_counting(inner, calls), 2)
    state = tx.init(PARAMS)
    calls.clear()

    def step(params, state):
        return tx.apply_gradients(
            PARAMS, state, params, count=jnp.int32(3), value=jnp.float32(1.0)
        )

    jaxpr = jax.make_jaxpr(step)(PARAMS, state)
    assert calls == ["update"]
    assert "jit" in str(jaxpr)  # (the update's own call)


def test_a_jaxpr_of_an_unknown_form_is_taken_as_reading_the_value(monkeypatch):
    # Where jax's jaxprs change, the check errs on the side of the value read:
    # the update is traced without it too, as before the check.
    from masked_multistep import _inner

    def unknown(jaxpr, var):
        raise AttributeError("'JaxprEqn' object has no attribute 'primitive'")

    monkeypatch.setattr(_inner, "_reads", unknown)
    calls = []
    tx = mm.MaskedMultiSteps(_counting(optax.adam(1e-3), calls), 2)
    state = tx.init(PARAMS)
    calls.clear()
    step = lambda s: tx.update(PARAMS, s, PARAMS, count=3, value=jnp.float32(1.0))
    jax.jit(step).trace(state)
    assert calls == ["update"] * 2


@pytest.mark.parametrize("kind", ["needs it", "reads it if given", "never reads it"])
def test_whether_a_nan_loss_holds_the_window_is_read_from_the_update(kind):
    # An update that reads the value is traced without it too, to learn
    # whether it needs it, so whether a window whose loss is NaN is held:
    # reduce_on_plateau needs it; one that reads it only where it is given
    # runs on such a window, as does one that requires the keyword but never
    # reads it (its results cannot depend on the loss), traced once.
    calls = []
    if kind == "needs it":
        inner = optax.chain(optax.sgd(1.0), optax.contrib.reduce_on_plateau())
    else:

        def update(updates, state, params=None, value=None):
            del params
            scale = 1.0 if value is None else 1.0 + 0.0 * jnp.nan_to_num(value)
            return jax.tree.map(lambda u: -scale * u, updates), state

        def update_unread(updates, state, params=None, *, value):
            del params, value
            return jax.tree.map(lambda u: -u, updates), state

        unread = kind == "never reads it"
        inner = optax.GradientTransformationExtraArgs(
            lambda p: (), update_unread if unread else update
        )
    tx = mm.MaskedMultiSteps(_counting(inner, calls), 2)
    state = tx.init(PARAMS)
    calls.clear()

    @jax.jit
    def step(params, state, value):
        return tx.apply_gradients(
            PARAMS, state, params, count=jnp.int32(3), value=value
        )

    params = PARAMS
    for value in (1.0, jnp.nan):  # the window's loss is NaN
        params, state = step(params, state, jnp.float32(value))
    assert calls == ["update"] * (1 if kind == "never reads it" else 2)
    held = kind == "needs it"
    assert int(state.gradient_step) == (0 if held else 1)
    assert int(state.num_nonfinite_windows) == (1 if held else 0)


def test_init_state_has_no_shared_buffers():
    tx = mm.MaskedMultiSteps(optax.adam(1e-3), 2)
    leaves = jax.tree.leaves(tx.init(PARAMS))
    pointers = [x.unsafe_buffer_pointer() for x in leaves]
    assert len(set(pointers)) == len(pointers)


def _converted(how):
    """A state with statistics and a budget of the tokens seen (two
    `TokenTotal`s), as each conversion returns it."""
    tx = mm.MaskedMultiSteps(
        optax.adam(1e-3),
        tokens_per_window=lambda seen: 8.0 + 0 * seen,
        window_stats=True,
    )
    running = tx.init(PARAMS)
    _, running = tx.update(PARAMS, running, PARAMS, count=jnp.int32(3))
    if how == "from_other_settings":
        return tx, mm.from_other_settings(running, tx.init(PARAMS), tokens_seen=100)
    if how == "from_optax_multisteps":
        old = optax.MultiSteps(optax.adam(1e-3), 4)
        _, old_state = old.update(PARAMS, old.init(PARAMS), PARAMS)
        return tx, mm.from_optax_multisteps(
            old_state, tx, PARAMS, acc_count=4, tokens_seen=100
        )
    if how == "from_state_0_1":
        saved = mm.state_0_1_target(running)
        return tx, mm.from_state_0_1(saved, tx.init(PARAMS), tokens_seen=100)
    return tx, mm.from_device_count(running, tx.init(PARAMS))


@pytest.mark.parametrize(
    "how",
    ["from_other_settings", "from_optax_multisteps", "from_state_0_1"]
    + ["from_device_count"],
)
def test_a_converted_state_has_no_shared_buffers_and_can_be_donated(how):
    # The tokens seen were set as one TokenTotal in both places that hold one
    # (the budget's, the statistics'): "Attempt to donate the same buffer twice".
    tx, state = _converted(how)
    pointers = [x.unsafe_buffer_pointer() for x in jax.tree.leaves(state)]
    assert len(set(pointers)) == len(pointers)
    step = jax.jit(
        lambda s: tx.update(PARAMS, s, PARAMS, count=jnp.int32(3))[1],
        donate_argnums=0,
    )
    step(state)


def test_state_can_be_donated_every_step():
    tx = mm.MaskedMultiSteps(optax.adam(1e-3), 2)

    def step(params, state, grads):
        updates, state = tx.update(grads, state, params, count=jnp.int32(3))
        return optax.apply_updates(params, updates), state

    # filterwarnings=error turns "donated buffers were not usable" into a failure.
    donated = jax.jit(step, donate_argnums=(0, 1))
    plain = jax.jit(step)
    params = jax.tree.map(jnp.array, PARAMS)
    state = tx.init(params)
    ref_params, ref_state = jax.tree.map(jnp.array, PARAMS), tx.init(PARAMS)
    for i in range(4):
        grads = jax.tree.map(lambda p, i=i: jnp.full_like(p, i + 1), PARAMS)
        # `updated` is write-only: jit prunes it from the inputs, so there is
        # nothing to donate; every other state buffer is consumed in place.
        old_leaves = jax.tree.leaves(state._replace(updated=None))
        params, state = donated(params, state, grads)
        ref_params, ref_state = plain(ref_params, ref_state, grads)
        assert all(x.is_deleted() for x in old_leaves)
    jax.tree.map(np.testing.assert_array_equal, params, ref_params)
    jax.tree.map(np.testing.assert_array_equal, state, ref_state)


@pytest.mark.default_emitters
def test_compiled_state_in_place_with_donation():
    # Every state buffer is aliased input-to-output: no copy of the state per step.
    tx = mm.MaskedMultiSteps(optax.adam(1e-3), 4)

    def step(params, state, grads):
        updates, state = tx.update(grads, state, params, count=jnp.int32(3))
        return optax.apply_updates(params, updates), state

    params = {"w": jnp.ones((256, 256))}
    state = tx.init(params)
    compiled = (
        jax.jit(step, donate_argnums=(0, 1)).lower(params, state, params).compile()
    )
    mem = compiled.memory_analysis()
    state_bytes = sum(
        x.nbytes for x in jax.tree.leaves((params, state._replace(updated=None)))
    )
    assert mem.alias_size_in_bytes >= state_bytes


@pytest.mark.parametrize("how", ["vmap", "grad"])
def test_an_eager_vmap_or_derivative_step_compiles_nothing_once_warm(how):
    # Under `vmap` or a derivative without `jit` the step runs operation by
    # operation, each kernel compiled once: the inner update is not wrapped in
    # a `jax.jit` there (a new one on every call would compile on every call).
    # Under `vmap` the second member's microbatches hold no tokens: the
    # window's conditional is batched, its predicate differing between them.
    tx = mm.MaskedMultiSteps(optax.adam(1e-2), 2)

    if how == "vmap":
        states = jax.vmap(lambda _: tx.init(PARAMS))(jnp.arange(2))
        grads = jax.tree.map(lambda p: jnp.stack([p, 2 * p]), PARAMS)

        def step(states, i):
            counts = jnp.array([1 + i % 2, 0], jnp.int32)
            update = lambda g, s, c: tx.update(g, s, PARAMS, count=c)
            return jax.vmap(update)(grads, states, counts)[1]

        want = [4, 0]
    else:
        states = tx.init(PARAMS)

        def step(state, i):
            # d(updates)/d(grads): the window's end runs on JVP tracers.
            def summed(grads):
                updates, state_ = tx.update(grads, state, PARAMS, count=1 + i % 2)
                return sum(
                    jnp.sum(u.astype(jnp.float32)) for u in jax.tree.leaves(updates)
                ), state_

            return jax.grad(summed, has_aux=True)(PARAMS)[1]

        want = 4
    for i in range(4):
        states = step(states, i)
    with backend_compiles() as compiles:
        for i in range(4, 8):
            states = step(states, i)
    assert compiles == []
    assert states.gradient_step.tolist() == want


@pytest.mark.parametrize("with_value", [False, True])
@pytest.mark.parametrize("reduction", [None, "deferred"])
def test_a_step_on_a_device_mesh_traces_the_inner_optimizer_once(reduction, with_value):
    # The params replicated over an Auto mesh: the window's mean carries the
    # mesh in its type, in the shapes' evaluation as at the window's end.
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    params = jax.device_put(PARAMS, jax.sharding.NamedSharding(mesh, jax.P()))
    calls = []
    tx = mm.MaskedMultiSteps(
        _counting(optax.adam(1e-3), calls),
        2,
        reduction=None if reduction is None else mm.deferred(mesh, "data"),
    )
    state = tx.init(params)
    calls.clear()
    if reduction is None:
        grads, count = params, jnp.int32(3)
    else:
        grads = jax.tree.map(lambda p: jnp.stack([p] * 8), PARAMS)
        count = jnp.full(8, 3, jnp.int32)
    # (The loss as `value=`: one per device with a deferred reduction.)
    extra = {"value": jnp.ones(jnp.shape(count), jnp.float32)} if with_value else {}
    step = lambda p, s, g, n: tx.apply_gradients(g, s, p, count=n, **extra)
    jax.jit(step).trace(params, state, grads, count)
    assert calls == ["update"]


def test_the_inner_update_is_inlined_into_the_step():
    # Its trace is reused from the shapes' evaluation but inlined where the
    # window closes: a call of its own, left to XLA to inline, compiled the
    # same instructions in another order (30% slower at 4 x 128², k = 1).
    tx = mm.MaskedMultiSteps(optax.adam(1e-3), 2)
    state = tx.init(PARAMS)
    for step in (
        lambda g, s, p: tx.update(g, s, p, count=jnp.int32(1)),
        lambda g, s, p: tx.apply_gradients(g, s, p, count=jnp.int32(1)),
    ):
        text = jax.jit(step).lower(PARAMS, state, PARAMS).as_text()
        assert "update" not in set(re.findall(r"call @([\w.]+)", text))
    grad_fn = mm.microbatched_value_and_grad(
        lambda p, b: mm.masked_mean(jnp.sum(b["x"] @ p["w"], -1), b["mask"]), 2
    )
    batch = {"x": jnp.ones((4, 4)), "mask": jnp.ones(4, bool)}
    text = jax.jit(grad_fn).lower({"w": jnp.ones((4, 3))}, batch).as_text()
    assert "per_microbatch" not in set(re.findall(r"call @([\w.]+)", text))
