"""`mm.from_optax_multisteps`: a run switches from optax.MultiSteps mid-run.

Each test runs the same microbatches twice: with ``MaskedMultiSteps`` from the
start, and with ``optax.MultiSteps`` up to a switch point, then converted and
continued with ``MaskedMultiSteps``. With equal counts the two accumulators hold
the same running mean bit for bit (both divide by the exact step count), so at
the switch the converted ``acc_grads`` must equal the all-along one exactly.
Inner updates made before the switch ran inside optax's program, which XLA may
fuse differently, so after a completed window the params and inner state are
compared to a few float32 ulps (as in test_optax_parity.py); a switch inside the
first window leaves nothing to differ, and everything must be bit-identical.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import masked_multistep as mm

K = 4
N = 7  # tokens per microbatch before the switch
WINDOWS = 3


def inner():
    return optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(0.05, weight_decay=0.1)
    )


def params0():
    return {"w": jnp.linspace(-1.0, 1.0, 6).reshape(2, 3), "b": jnp.ones(3)}


def grads_of(i):
    rng = np.random.default_rng(i)
    return {
        "w": jnp.asarray(rng.normal(size=(2, 3)), jnp.float32),
        "b": jnp.asarray(rng.normal(size=3), jnp.float32),
    }


def masked_step(tx):
    @jax.jit
    def step(params, state, grads, count):
        return tx.apply_gradients(grads, state, params, count=count)

    return step


def optax_step(tx):
    @jax.jit
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step


# Built once, so that the parametrized cases share their compiled steps.
TX = mm.MaskedMultiSteps(inner(), every_k_schedule=K)
STEP = masked_step(TX)
OLD = {}
for _mean in (True, False):
    _old = optax.MultiSteps(inner(), every_k_schedule=K, use_grad_mean=_mean)
    OLD[_mean] = (_old, optax_step(_old))


def assert_ulps(a, b, ulps=4):
    eps = float(jnp.finfo(jnp.float32).eps)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert jnp.asarray(x).dtype == jnp.asarray(y).dtype
        np.testing.assert_allclose(
            np.asarray(x, np.float64),
            np.asarray(y, np.float64),
            rtol=ulps * eps,
            atol=eps,
        )


def assert_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert jnp.asarray(x).dtype == jnp.asarray(y).dtype
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize(
    "switch, use_grad_mean",
    [(0, True), (2, True), (4, True), (6, True), (9, True), (2, False), (3, False)],
)
def test_switching_equals_masked_multisteps_all_along(switch, use_grad_mean):
    """Equal counts before the switch; skewed counts after it.

    With ``use_grad_mean=False`` optax.MultiSteps hands the inner optimizer a
    *sum*, so only a switch inside the first window can match the reference.
    """
    counts = [N] * switch + [1, 30, 0, 12, 5, 9, 2, 40, 3, 3, 8, 1][switch:]
    tx, step = TX, STEP

    # The reference: MaskedMultiSteps from the start.
    params, state = params0(), tx.init(params0())
    at_switch = None
    for i, n in enumerate(counts):
        if i == switch:
            at_switch = (params, state)
        params, state = step(params, state, grads_of(i), jnp.int32(n))
    ref_params, ref_state = params, state

    # optax.MultiSteps up to the switch, then converted.
    old, old_step = OLD[use_grad_mean]
    params, old_state = params0(), old.init(params0())
    for i in range(switch):
        params, old_state = old_step(params, old_state, grads_of(i))
    mini = switch % K
    state = mm.from_optax_multisteps(
        old_state,
        tx,
        params,
        acc_count=N * mini if mini else None,
        use_grad_mean=use_grad_mean,
    )
    assert isinstance(state, mm.MaskedMultiStepsState)
    assert jax.tree.structure(state) == jax.tree.structure(at_switch[1])
    dtypes = lambda tree: [jnp.asarray(x).dtype for x in jax.tree.leaves(tree)]
    assert dtypes(state) == dtypes(at_switch[1])
    assert int(state.mini_step) == mini == int(at_switch[1].mini_step)
    assert int(state.gradient_step) == switch // K
    assert int(state.acc_count) == int(at_switch[1].acc_count) == N * mini
    assert bool(tx.has_updated(state)) == bool(old.has_updated(old_state))
    if mini and use_grad_mean:
        assert_equal(state.acc_grads, at_switch[1].acc_grads)
    elif mini:  # the sum divided by m: not the running mean's rounding
        assert_ulps(state.acc_grads, at_switch[1].acc_grads)

    for i in range(switch, len(counts)):
        params, state = step(params, state, grads_of(i), jnp.int32(counts[i]))
    assert int(state.gradient_step) == int(ref_state.gradient_step) == WINDOWS
    if switch < K and use_grad_mean:
        assert_equal((params, state), (ref_params, ref_state))
    else:
        assert_ulps(
            (params, state.inner_opt_state), (ref_params, ref_state.inner_opt_state)
        )


def test_window_boundary_state_continues_like_a_fresh_window():
    """At a boundary the accumulator is empty and has_updated matches optax."""
    old = optax.MultiSteps(optax.adam(0.1), every_k_schedule=2)
    params = {"w": jnp.ones(3)}
    old_state = old.init(params)
    for g in (1.0, -3.0):
        updates, old_state = old.update({"w": jnp.full(3, g)}, old_state, params)
        params = optax.apply_updates(params, updates)
    tx = mm.MaskedMultiSteps(optax.adam(0.1), every_k_schedule=2)
    state = mm.from_optax_multisteps(old_state, tx, params)
    assert bool(tx.has_updated(state)) and bool(old.has_updated(old_state))
    assert int(state.acc_count) == 0 and int(state.mini_step) == 0
    assert_equal(state.inner_opt_state, old_state.inner_opt_state)
    # The same result with acc_count=0 given explicitly.
    assert_equal(state, mm.from_optax_multisteps(old_state, tx, params, acc_count=0))


def test_float_count_dtype_keeps_fractional_weights():
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 3, count_dtype=jnp.float32)
    old = optax.MultiSteps(optax.sgd(1.0), 3)
    params = jnp.zeros(())
    old_state = old.init(params)
    _, old_state = old.update(jnp.array(2.0), old_state, params)
    state = mm.from_optax_multisteps(old_state, tx, params, acc_count=0.5)
    assert state.acc_count.dtype == jnp.float32 and float(state.acc_count) == 0.5
    # Too large for float32: refused, not stored as inf (which would refuse
    # every later count and never close the window).
    with pytest.raises(ValueError, match="`acc_count` is too large .* got 1e\\+39"):
        mm.from_optax_multisteps(old_state, tx, params, acc_count=1e39)
    for g, n in [(5.0, 1.0), (-1.0, 0.5)]:
        params, state = tx.apply_gradients(
            jnp.array(g), state, params, count=jnp.float32(n)
        )
    np.testing.assert_allclose(params, -(0.5 * 2 + 1 * 5 - 0.5) / 2.0, rtol=1e-6)


def _mid_window():
    old = optax.MultiSteps(optax.adam(0.1), every_k_schedule=3)
    params = {"w": jnp.ones(2)}
    state = old.init(params)
    _, state = old.update({"w": jnp.ones(2)}, state, params)
    return old, state, params


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({}, ValueError, "middle of a window \\(mini_step=1\\): pass `acc_count=`"),
        ({"acc_count": 0}, ValueError, "`acc_count` is 0, but"),
        ({"acc_count": -3}, ValueError, "`acc_count` must be finite and >= 0, got -3"),
        ({"acc_count": float("nan")}, ValueError, "must be finite and >= 0, got nan"),
        ({"acc_count": True}, TypeError, "`acc_count` must be a real number, got True"),
        ({"acc_count": "7"}, TypeError, "`acc_count` must be a real number"),
        ({"acc_count": np.ones(2)}, ValueError, "`acc_count` must be a scalar"),
        ({"acc_count": 2.5}, ValueError, "`acc_count` is fractional \\(2.5\\)"),
        # Refused, not wrapped to 5 or -2**31 (int32) or rounded to inf (float32).
        ({"acc_count": 2**32 + 5}, ValueError, "at most 2147483647 .* got 4294967301"),
        ({"acc_count": 2**31}, ValueError, "at most 2147483647 .* got 2147483648"),
        ({"acc_count": np.int64(2**31)}, ValueError, "at most 2147483647"),
        ({"acc_count": 3, "use_grad_mean": 1}, TypeError, "`use_grad_mean` must be"),
        # A Python int no numpy dtype holds (was "got dtype object").
        ({"acc_count": 10**40}, ValueError, "`acc_count` must be at most 2147483647"),
        ({"acc_count": 10**400}, ValueError, "`acc_count` must be finite"),
        ({"acc_count": -(10**40)}, ValueError, "`acc_count` must be finite and >= 0"),
    ],
)
def test_bad_acc_count_is_refused(kwargs, error, message):
    _, state, params = _mid_window()
    tx = mm.MaskedMultiSteps(optax.adam(0.1), 3, count_dtype=jnp.int32)
    with pytest.raises(error, match=message):
        mm.from_optax_multisteps(state, tx, params, **kwargs)


@pytest.mark.parametrize(
    "field, value",
    [
        # Were wrapped to -2**31 + 5, truncated to 7 and kept negative.
        ("gradient_step", np.int64(2**31 + 5)),
        ("gradient_step", np.float32(7.5)),
        ("gradient_step", np.int32(-3)),
        ("mini_step", np.int64(2**40)),  # was numpy's OverflowError
    ],
)
def test_step_counters_out_of_int32_are_refused_by_name(field, value):
    _, state, params = _mid_window()
    tx = mm.MaskedMultiSteps(optax.adam(0.1), 3)
    with pytest.raises(ValueError, match=rf"`state.{field}` must be an integer in"):
        mm.from_optax_multisteps(
            state._replace(**{field: value}), tx, params, acc_count=3
        )


def test_mismatches_are_refused():
    old, state, params = _mid_window()
    tx = mm.MaskedMultiSteps(optax.adam(0.1), 3)
    # An abstract state or count (a restore target, `jax.eval_shape`'s): was
    # "must be an integer ..., got ShapeDtypeStruct(...) of dtype object".
    abstract = jax.eval_shape(lambda: state)
    with pytest.raises(TypeError, match="`state` holds jax.ShapeDtypeStructs"):
        mm.from_optax_multisteps(abstract, tx, params, acc_count=3)
    shape = jax.ShapeDtypeStruct((), jnp.float32)
    with pytest.raises(TypeError, match="`acc_count` holds jax.ShapeDtypeStructs"):
        mm.from_optax_multisteps(state, tx, params, acc_count=shape)
    with pytest.raises(TypeError, match="`state` must be an optax.MultiStepsState"):
        mm.from_optax_multisteps(tx.init(params), tx, params, acc_count=3)
    with pytest.raises(TypeError, match="`tx` must be a masked_multistep"):
        mm.from_optax_multisteps(state, old, params, acc_count=3)
    with pytest.raises(ValueError, match="the inner optimizer that optax.MultiSteps"):
        mm.from_optax_multisteps(
            state, mm.MaskedMultiSteps(optax.sgd(0.1), 3), params, acc_count=3
        )
    with pytest.raises(ValueError, match="should_skip_update_fn"):
        skipping = mm.MaskedMultiSteps(
            optax.adam(0.1), 3, should_skip_update_fn=optax.skip_not_finite
        )
        mm.from_optax_multisteps(state, skipping, params, acc_count=3)
    with pytest.raises(ValueError, match="shape \\(2,\\) where .* has \\(5,\\)"):
        mm.from_optax_multisteps(state, tx, {"w": jnp.ones(5)}, acc_count=3)
    with pytest.raises(ValueError, match="window boundary .* `acc_count` is 4"):
        fresh = old.init(params)
        mm.from_optax_multisteps(fresh, tx, params, acc_count=4)
    with pytest.raises(TypeError, match="must be called eagerly"):
        jax.jit(lambda s: mm.from_optax_multisteps(s, tx, params, acc_count=3))(state)


@pytest.mark.parametrize("axis_type", ["Explicit", "Auto"])
def test_a_state_read_back_as_numpy_is_placed_like_tx_init(axis_type):
    # An optax.MultiSteps state read with flax.serialization holds numpy
    # arrays: its accumulator was put replicated, whole on every device, and
    # on an Explicit mesh the first step failed on mismatched shardings.
    from flax import serialization
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    kind = getattr(jax.sharding.AxisType, axis_type)
    mesh = jax.make_mesh((len(jax.devices()),), ("d",), axis_types=(kind,))
    sharded = NamedSharding(mesh, P("d"))
    params = {"w": jax.device_put(jnp.arange(16.0), sharded)}
    old = optax.MultiSteps(optax.adam(0.1), every_k_schedule=4)
    state = old.init(params)
    for g in (1.0, 2.0):
        grads = {"w": jax.device_put(jnp.full(16, g), sharded)}
        _, state = jax.jit(old.update)(grads, state, params)
    read = serialization.from_bytes(old.init(params), serialization.to_bytes(state))
    assert isinstance(read.acc_grads["w"], np.ndarray)
    tx = mm.MaskedMultiSteps(optax.adam(0.1), every_k_schedule=4)
    fresh = tx.init(params)
    from_jax = mm.from_optax_multisteps(state, tx, params, acc_count=8)
    from_numpy = mm.from_optax_multisteps(read, tx, params, acc_count=8)
    for a, b, f in zip(
        jax.tree.leaves(from_numpy),
        jax.tree.leaves(from_jax),
        jax.tree.leaves(fresh),
        strict=True,
    ):
        assert isinstance(a, jax.Array)
        assert a.sharding.is_equivalent_to(f.sharding, a.ndim), (a.sharding, f)
        np.testing.assert_array_equal(a, b)
    step = jax.jit(tx.apply_gradients)
    grads = {"w": jax.device_put(jnp.ones(16), sharded)}
    got = step(grads, from_numpy, params, count=jnp.float32(4))
    want = step(grads, from_jax, params, count=jnp.float32(4))
    jax.tree.map(np.testing.assert_array_equal, got, want)


def test_a_chain_state_is_refused_with_where_its_multisteps_state_is():
    params = {"w": jnp.zeros(2)}
    old = optax.chain(optax.clip(1.0), optax.MultiSteps(optax.adam(0.1), 3))
    tx = mm.MaskedMultiSteps(optax.adam(0.1), 3)
    with pytest.raises(TypeError, match=r"got tuple: it holds one at \[1\]"):
        mm.from_optax_multisteps(old.init(params), tx, params)


def test_a_state_restored_without_a_target_says_to_restore_against_the_old_one():
    # A checkpoint restored without a target holds dicts: the error said only
    # "got dict".
    params = {"w": jnp.zeros(2)}
    old = optax.MultiSteps(optax.adam(0.1), 3).init(params)
    by_name = {field: getattr(old, field) for field in old._fields}
    tx = mm.MaskedMultiSteps(optax.adam(0.1), 3)
    with pytest.raises(
        TypeError,
        match=r"got dict: it holds the state's fields by name only.*restore it "
        r"against the old optimizer's state",
    ):
        mm.from_optax_multisteps(by_name, tx, params, acc_count=4)


def test_tokens_seen_continues_a_token_budget_warmup_and_the_statistics():
    # A batch-size warmup in tokens (4 tokens per window until 32 seen, then
    # 12): after 4 windows of 2 microbatches of 4 tokens (32 seen) under
    # optax.MultiSteps (k = 2), the switched run with tokens_seen=32 closes
    # its windows where a MaskedMultiSteps run from the start does; without
    # it the warmup starts over.
    def budget(seen):
        return jnp.where(seen < 32, 4.0, 12.0)

    def grads(i):
        return {"w": jnp.full(2, float(i % 5) - 2.0)}

    params = {"w": jnp.zeros(2)}
    old = optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2)
    old_state = old.init(params)
    p_old = params
    for i in range(8):
        updates, old_state = old.update(grads(i), old_state, p_old)
        p_old = optax.apply_updates(p_old, updates)
    assert int(old_state.gradient_step) == 4 and int(old_state.mini_step) == 0

    tx = mm.MaskedMultiSteps(
        optax.sgd(0.1), tokens_per_window=budget, window_stats=True
    )
    kept = mm.from_optax_multisteps(old_state, tx, p_old, tokens_seen=32)
    lost = mm.from_optax_multisteps(old_state, tx, p_old)
    assert float(mm.window_stats(kept).tokens_seen) == 32
    assert float(mm.window_stats(lost).tokens_seen) == 0
    closes = {}
    for name, state in (("kept", kept), ("lost", lost)):
        p, seen = p_old, []
        for i in range(8, 14):
            p, state = tx.apply_gradients(grads(i), state, p, count=jnp.float32(4))
            seen.append(bool(state.updated))
        closes[name] = seen
    assert closes["kept"] == [False, False, True, False, False, True]
    assert closes["lost"] == [True] * 6
    with pytest.raises(ValueError, match=r"`tokens_seen` must be a whole number"):
        mm.from_optax_multisteps(old_state, tx, p_old, tokens_seen=2.5)
    with pytest.raises(TypeError, match=r"`tokens_seen` must be a whole number"):
        mm.from_optax_multisteps(old_state, tx, p_old, tokens_seen="32")


def test_the_skip_state_carries_over():
    # What should_skip_update_fn returned last (here: a non-finite microbatch,
    # skipped) is the optax.MultiSteps state's, not a fresh one.
    params = {"w": jnp.ones(2)}
    old = optax.MultiSteps(
        optax.adam(0.1), every_k_schedule=3, should_skip_update_fn=optax.skip_not_finite
    )
    old_state = old.init(params)
    for g in (1.0, np.nan):
        _, old_state = old.update({"w": jnp.full(2, g)}, old_state, params)
    assert int(old_state.skip_state["num_not_finite"]) == 2
    tx = mm.MaskedMultiSteps(
        optax.adam(0.1), every_k_schedule=3, should_skip_update_fn=optax.skip_not_finite
    )
    state = mm.from_optax_multisteps(old_state, tx, params, acc_count=4)
    assert_equal(state.skip_state, old_state.skip_state)


def test_the_accumulator_keeps_the_wrappers_accumulator_dtype():
    # optax.MultiSteps accumulates float32 gradients in float32; a wrapper
    # that accumulates in bfloat16 gets its mean in bfloat16, and its next
    # step runs the program a step from tx.init runs.
    params = {"w": jnp.zeros(2)}
    old = optax.MultiSteps(optax.sgd(1.0), every_k_schedule=3)
    old_state = old.init(params)
    for g in (1.0, 3.0):
        _, old_state = old.update({"w": jnp.full(2, g)}, old_state, params)
    tx = mm.MaskedMultiSteps(
        optax.sgd(1.0), every_k_schedule=3, accumulator_dtype=jnp.bfloat16
    )
    state = mm.from_optax_multisteps(old_state, tx, params, acc_count=8)
    assert state.acc_grads["w"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(state.acc_grads["w"].astype(jnp.float32), [2.0, 2.0])
    grads = {"w": jnp.full(2, 6.0)}
    step = jax.jit(lambda s: tx.apply_gradients(grads, s, params, count=4))
    step(tx.init(params))
    compiled = step._cache_size()
    new_params, _ = step(state)
    assert step._cache_size() == compiled
    np.testing.assert_allclose(new_params["w"], -(8 * 2.0 + 4 * 6.0) / 12, rtol=1e-2)
