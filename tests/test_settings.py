"""mm.from_other_settings: a running wrapper's state, continued by a wrapper
with another window rule, statistics or count dtype."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import masked_multistep as mm
from tests._helpers import assert_bit_identical

PARAMS = {"w": jnp.zeros(3), "b": jnp.zeros(())}


def _grads(i):
    rng = np.random.default_rng(i)
    return {
        "w": jnp.asarray(rng.normal(size=3), jnp.float32),
        "b": jnp.asarray(rng.normal(), jnp.float32),
    }


def test_a_window_in_progress_continues_under_a_token_budget_with_statistics():
    # Halfway through a window of 4 (the first microbatch passed no value),
    # switch to windows of 20 tokens with statistics: the window closes at 25
    # tokens, on the token mean of all five microbatches, and its loss is the
    # token mean of the values passed.
    old = mm.MaskedMultiSteps(optax.sgd(1.0), 4)
    state = old.init(PARAMS)
    _, state = old.update(_grads(0), state, PARAMS, count=jnp.float32(3))
    _, state = old.update(
        _grads(1), state, PARAMS, count=jnp.float32(5), value=jnp.float32(2.0)
    )
    new = mm.MaskedMultiSteps(optax.sgd(1.0), tokens_per_window=20, window_stats=True)
    state = mm.from_other_settings(state, new.init(PARAMS))
    step = jax.jit(new.update)
    for i, (n, v) in enumerate([(4, 1.0), (6, 3.0), (7, 0.5)], start=2):
        updates, state = step(
            _grads(i), state, PARAMS, count=jnp.float32(n), value=jnp.float32(v)
        )
        assert bool(state.updated) == (i == 4)
    counts = [3, 5, 4, 6, 7]
    expected = jax.tree.map(
        lambda *g: -np.dot(counts, g) / sum(counts), *[_grads(i) for i in range(5)]
    )
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), updates, expected
    )
    stats = mm.window_stats(state)
    assert float(stats.tokens) == 25.0
    # The pending window's mean counts as one microbatch of its 8 tokens.
    assert int(stats.microbatches) == 4
    loss = (5 * 2.0 + 4 * 1.0 + 6 * 3.0 + 7 * 0.5) / (5 + 4 + 6 + 7)
    np.testing.assert_allclose(stats.loss, loss, rtol=1e-6)


def test_a_window_past_its_new_k_closes_on_the_next_microbatch():
    old = mm.MaskedMultiSteps(optax.sgd(1.0), 4)
    state = old.init(PARAMS)
    for i in range(3):
        _, state = old.update(_grads(i), state, PARAMS, count=jnp.float32(i + 1))
    new = mm.MaskedMultiSteps(optax.sgd(1.0), 2, count_dtype=jnp.int32)
    state = mm.from_other_settings(state, new.init(PARAMS))
    assert state.acc_count.dtype == jnp.int32 and int(state.acc_count) == 6
    updates, state = new.update(_grads(3), state, PARAMS, count=jnp.int32(4))
    assert bool(state.updated) and int(state.mini_step) == 0
    expected = jax.tree.map(
        lambda *g: -np.dot([1, 2, 3, 4], g) / 10, *[_grads(i) for i in range(4)]
    )
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), updates, expected
    )


def test_the_same_settings_continue_bit_identically():
    tx = mm.MaskedMultiSteps(
        optax.adam(0.1),
        tokens_per_window=lambda seen: 10 + seen / 4,
        per_leaf_stats=True,
    )
    state = tx.init(PARAMS)
    step = jax.jit(tx.update)
    for i, n in enumerate([4, 0, 9, 3, 5]):
        _, state = step(_grads(i), state, PARAMS, count=jnp.float32(n))
    assert int(state.mini_step) > 0 and int(state.gradient_step) == 1
    moved = mm.from_other_settings(state, tx.init(PARAMS))
    assert_bit_identical(moved, state)
    assert_bit_identical(
        step(_grads(9), moved, PARAMS, count=jnp.float32(8)),
        step(_grads(9), state, PARAMS, count=jnp.float32(8)),
    )


@pytest.mark.parametrize(
    "old_dtype, new_dtype", [(jnp.float32, jnp.int32), (jnp.int32, jnp.float32)]
)
def test_statistics_carry_over_into_another_count_dtype(old_dtype, new_dtype):
    # The last window's token totals are in the count dtype: statistics on
    # both sides were refused ("holds dtype float32 where the template has
    # int32").
    counts = [3, 0, 5, 2, 4, 1, 6, 2]
    old = mm.MaskedMultiSteps(
        optax.adam(0.1), 3, window_stats=True, count_dtype=old_dtype
    )
    new = mm.MaskedMultiSteps(
        optax.adam(0.1), 3, window_stats=True, count_dtype=new_dtype
    )

    def run(tx, state, items):
        for i in items:
            _, state = tx.update(_grads(i), state, PARAMS, count=counts[i])
        return state

    state = run(old, old.init(PARAMS), range(4))
    moved = mm.from_other_settings(state, new.init(PARAMS))
    assert moved.stats.last.tokens.dtype == new_dtype
    for a, b in zip(mm.window_stats(moved), mm.window_stats(state)):
        np.testing.assert_array_equal(
            np.asarray(a, np.float64), np.asarray(b, np.float64)
        )
    # The run continues as one counted in the new dtype from the start.
    want = run(new, new.init(PARAMS), range(8))
    got = run(new, moved, range(4, 8))
    for a, b in zip(mm.window_stats(got), mm.window_stats(want)):
        np.testing.assert_allclose(
            np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=1e-6
        )
    # A fractional total does not fit an integer count dtype.
    if new_dtype == jnp.int32:
        last = state.stats.last._replace(tokens=jnp.float32(2.5))
        fractional = state._replace(stats=state.stats.replaced(last=last))
        with pytest.raises(
            ValueError, match=r"`state\.stats\.last\.tokens` is fractional"
        ):
            mm.from_other_settings(fractional, new.init(PARAMS))


def test_a_custom_policys_state_carries_over():
    # Windows of 2 + (windows closed so far) % 3 microbatches: the policy's
    # state was reset to its init, and later windows closed elsewhere.
    policy = mm.WindowPolicy(
        init=lambda: jnp.int32(0),
        closes=lambda ps, s: s.microbatches >= 2 + ps % 3,
        update=lambda ps, s, closed: ps + closed.astype(jnp.int32),
    )
    tx = mm.MaskedMultiSteps(optax.sgd(0.1), tokens_per_window=policy)
    state = tx.init(PARAMS)
    step = jax.jit(tx.update)
    for i in range(6):
        _, state = step(_grads(i), state, PARAMS, count=jnp.float32(2))
    assert int(state.policy_state) == 2 and int(state.mini_step) == 1
    assert_bit_identical(mm.from_other_settings(state, tx.init(PARAMS)), state)
    # Onto a rule of another layout, the template's.
    budget = mm.MaskedMultiSteps(optax.sgd(0.1), tokens_per_window=lambda seen: 8.0)
    moved = mm.from_other_settings(state, budget.init(PARAMS))
    assert float(moved.policy_state) == 0.0


def test_tokens_seen_carry_into_a_budget_warmup_and_the_statistics():
    old = mm.MaskedMultiSteps(optax.sgd(0.1), 2, window_stats=True)
    state = old.init(PARAMS)
    for i, n in enumerate([30, 12, 7, 1]):
        _, state = old.update(_grads(i), state, PARAMS, count=jnp.float32(n))
    assert float(mm.window_stats(state).tokens_seen) == 50.0
    seen = []
    new = mm.MaskedMultiSteps(
        optax.sgd(0.1),
        tokens_per_window=lambda tokens: seen.append(tokens) or 100.0,
        window_stats=True,
    )
    moved = mm.from_other_settings(state, new.init(PARAMS))
    assert float(mm.window_stats(moved).tokens_seen) == 50.0
    assert float(moved.policy_state) == 50.0
    # The statistics were the template's: they carry over, the last window's
    # figures readable as before.
    assert_bit_identical(mm.window_stats(moved), mm.window_stats(state))
    # Where the old state kept no count, `tokens_seen=` gives it.
    plain = mm.MaskedMultiSteps(optax.sgd(0.1), 2)
    fresh = plain.init(PARAMS)
    given = mm.from_other_settings(fresh, new.init(PARAMS), tokens_seen=2**40 + 1)
    assert int(given.policy_state) == 2**40 + 1
    # A key was jax's unnamed error, and a shape a TypeError.
    for tokens, error, match in [
        (jax.random.key(0), TypeError, r"tokens, got an array of dtype key"),
        ("5", TypeError, r"tokens, got '5' of type str"),
        (np.array([5, 6]), ValueError, r"must be a scalar .* got shape \(2,\)"),
        (jnp.array([5.0]), ValueError, r"must be a scalar .* got shape \(1,\)"),
    ]:
        with pytest.raises(error, match=rf"`tokens_seen` .*{match}"):
            mm.from_other_settings(fresh, new.init(PARAMS), tokens_seen=tokens)


def test_what_cannot_carry_over_is_named():
    tx = mm.MaskedMultiSteps(optax.sgd(0.1), 2)
    state = tx.init(PARAMS)
    other_inner = mm.MaskedMultiSteps(optax.adam(0.1), 2)
    with pytest.raises(ValueError, match=r"`state\.inner_opt_state` does not match"):
        mm.from_other_settings(state, other_inner.init(PARAMS))
    with pytest.raises(ValueError, match=r"`state\.acc_grads` does not match"):
        mm.from_other_settings(state, tx.init({"w": jnp.zeros(4), "b": jnp.zeros(())}))
    with pytest.raises(TypeError, match=r"`template` must be a MaskedMultiStepsState"):
        mm.from_other_settings(state, tx)
    with pytest.raises(TypeError, match=r"must be called eagerly"):
        jax.jit(lambda s: mm.from_other_settings(s, tx.init(PARAMS)))(state)
    # Abstract trees: a template from jax.eval_shape gave a state with
    # ShapeDtypeStruct leaves where the running state had none to carry (a
    # budget's tokens seen; statistics of another kind failed inside), a
    # restore target as the state a dtype error.
    budget = mm.MaskedMultiSteps(
        optax.sgd(0.1), tokens_per_window=mm.token_budget(lambda seen: 10)
    )
    with pytest.raises(TypeError, match=r"leaves in `policy_state`, which `state`"):
        mm.from_other_settings(state, jax.eval_shape(budget.init, PARAMS))
    stats = mm.MaskedMultiSteps(optax.sgd(0.1), 2, window_stats=True)
    with pytest.raises(TypeError, match=r"leaves in `stats`, which `state`"):
        mm.from_other_settings(state, jax.eval_shape(stats.init, PARAMS))
    # Where the running state carries every field, an abstract template serves
    # (no second accumulator and inner state materialised).
    _, half = tx.update(_grads(0), state, PARAMS, count=jnp.float32(2.0))
    longer = mm.MaskedMultiSteps(optax.sgd(0.1), 5)
    assert_bit_identical(
        mm.from_other_settings(half, jax.eval_shape(longer.init, PARAMS)),
        mm.from_other_settings(half, longer.init(PARAMS)),
    )
    # The arguments swapped: the result would have been a fresh state, the
    # running window and the inner state dropped without a word.
    with pytest.raises(
        ValueError,
        match=r"`template` holds a run in progress \(gradient_step=0, mini_step=1\) "
        r"and `state` a state that has taken no step: are the arguments swapped\?",
    ):
        mm.from_other_settings(longer.init(PARAMS), half)
    # Placed as the concrete template's, on a mesh too: the counts made on
    # the host were left uncommitted on one device.
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    on_mesh = jax.device_put(PARAMS, jax.sharding.NamedSharding(mesh, P()))
    running = tx.init(on_mesh)
    _, running = tx.update(_grads(0), running, on_mesh, count=jnp.float32(2.0))
    for template in (jax.eval_shape(longer.init, on_mesh), longer.init(on_mesh)):
        carried = mm.from_other_settings(running, template)
        for leaf in (carried.acc_count, carried.value_count):
            assert leaf.committed and leaf.sharding.is_equivalent_to(
                running.acc_count.sharding, 0
            )
    with pytest.raises(TypeError, match=r"`state` holds jax\.ShapeDtypeStructs"):
        mm.from_other_settings(jax.eval_shape(tx.init, PARAMS), budget.init(PARAMS))
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    deferred = mm.MaskedMultiSteps(optax.sgd(0.1), 2, reduction=mm.deferred(mesh))
    with pytest.raises(ValueError, match=r"`state` has reduction=mm\.deferred.*"):
        mm.from_other_settings(deferred.init(PARAMS), state)
    # A fractional token total does not fit an integer count dtype.
    _, half = tx.update(_grads(0), state, PARAMS, count=jnp.float32(2.5))
    counted = mm.MaskedMultiSteps(optax.sgd(0.1), 2, count_dtype=jnp.int32)
    with pytest.raises(ValueError, match=r"`state\.acc_count`"):
        mm.from_other_settings(half, counted.init(PARAMS))


@pytest.mark.parametrize(
    "name",
    ["mini_step", "gradient_step", "num_invalid_counts", "num_nonfinite_windows"],
)
def test_a_negative_step_counter_is_refused(name):
    # As from_state_0_1 refuses it: mini_step -3 and num_invalid_counts -7
    # carried over made the next window of k = 4 take 7 microbatches.
    tx = mm.MaskedMultiSteps(optax.sgd(0.1), 4)
    corrupt = tx.init(PARAMS)._replace(**{name: jnp.int32(-3)})
    with pytest.raises(
        ValueError,
        match=rf"`state\.{name}` must be an integer in \[0, 2\*\*31 - 1\], got -3",
    ):
        mm.from_other_settings(corrupt, tx.init(PARAMS))


@pytest.mark.parametrize(
    "where, corrupt",
    [
        ("stats.microbatches", lambda s: s.replaced(microbatches=jnp.int32(-2))),
        (
            "stats.last.microbatches",
            lambda s: s.replaced(last=s.last._replace(microbatches=jnp.int32(-1))),
        ),
        (
            "stats.last.windows",
            lambda s: s.replaced(last=s.last._replace(windows=jnp.int32(-1))),
        ),
        (
            "stats.weighted_sq_norms",
            lambda s: s.replaced(weighted_sq_norms=jnp.float32(-1.0)),
        ),
        (
            "stats.leaves.weighted_sq_norms",
            lambda s: s._replace(
                leaves=s.leaves.replaced(
                    weighted_sq_norms=-jnp.ones_like(s.leaves.weighted_sq_norms)
                )
            ),
        ),
    ],
)
def test_negative_statistics_tallies_are_refused(where, corrupt):
    # A window's K of -2 carried over made its noise scale's K - 1 negative:
    # the estimates' signs flipped, silently.
    tx = mm.MaskedMultiSteps(optax.sgd(0.1), 4, window_stats=True, per_leaf_stats=True)
    state = tx.init(PARAMS)
    _, state = tx.update(_grads(0), state, PARAMS, count=jnp.float32(3))
    bad = state._replace(stats=corrupt(state.stats))
    new = mm.MaskedMultiSteps(optax.sgd(0.1), 3, window_stats=True, per_leaf_stats=True)
    with pytest.raises(ValueError, match=rf"`state\.{where}` must not be negative"):
        mm.from_other_settings(bad, new.init(PARAMS))
    # A NaN or inf sum is one a step makes (a gradient not finite): carried.
    nan = state._replace(stats=state.stats.replaced(weighted_sq_norms=jnp.nan))
    moved = mm.from_other_settings(nan, new.init(PARAMS))
    assert np.isnan(float(moved.stats.weighted_sq_norms))


def test_statistics_of_another_kind_start_from_the_pending_mean():
    """Totals only, then each leaf's too: the new statistics count the pending
    window's mean as one microbatch of its tokens, for every leaf, as a wrapper
    fed that mean would."""
    old = mm.MaskedMultiSteps(optax.sgd(1.0), 4, window_stats=True)
    state = old.init(PARAMS)
    for i, n in enumerate([3, 5]):
        _, state = old.update(_grads(i), state, PARAMS, count=jnp.float32(n))
    # Windows of 18 tokens: the pending 8 and the next two microbatches'.
    new = mm.MaskedMultiSteps(optax.sgd(1.0), tokens_per_window=18, per_leaf_stats=True)
    moved = mm.from_other_settings(state, new.init(PARAMS))
    reference = new.init(PARAMS)
    _, reference = new.update(state.acc_grads, reference, PARAMS, count=jnp.float32(8))
    for i, n in [(2, 4), (3, 6)]:
        _, moved = new.update(_grads(i), moved, PARAMS, count=jnp.float32(n))
        _, reference = new.update(_grads(i), reference, PARAMS, count=jnp.float32(n))
    assert bool(moved.updated) and int(mm.window_stats(moved).microbatches) == 3
    for read in (
        mm.window_stats,
        lambda s: mm.window_stats(s, per_leaf=True),
    ):
        got, want = read(moved), read(reference)
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6),
            got._replace(tokens_seen=()),
            want._replace(tokens_seen=()),
        )


def test_an_nnx_optimizer_switches_by_name():
    """``nnx.state(optimizer)["opt_state"]`` in, an ``nnx.State`` out, for
    ``nnx.update`` of an optimizer built with the new wrapper; the window in
    progress closes under the new rule as a plain state's would."""
    from flax import nnx

    model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(
        model, mm.MaskedMultiSteps(optax.sgd(1.0), 4), wrt=nnx.Param
    )
    grads = [
        jax.tree.map(
            lambda p, i=i: jnp.full(p.shape, float(i + 1)), nnx.state(model, nnx.Param)
        )
        for i in range(3)
    ]
    for g, n in zip(grads[:2], (3.0, 5.0), strict=True):
        optimizer.update(model, g, count=jnp.float32(n))
    new_tx = mm.MaskedMultiSteps(
        optax.sgd(1.0), tokens_per_window=10, window_stats=True
    )
    new = nnx.Optimizer(model, new_tx, wrt=nnx.Param)
    state = nnx.state(optimizer)  # its `step` carries over too
    state["opt_state"] = mm.from_other_settings(
        state["opt_state"], nnx.state(new)["opt_state"]
    )
    nnx.update(new, state)
    assert int(new.step[...]) == 2
    before = model.kernel[...]
    new.update(model, grads[2], count=jnp.float32(2))
    assert bool(new.opt_state.updated[...])
    assert float(mm.window_stats(new).tokens) == 10.0
    np.testing.assert_allclose(
        model.kernel[...] - before, -(3 * 1 + 5 * 2 + 2 * 3) / 10, rtol=1e-6
    )
    with pytest.raises(TypeError, match=r"pass the running optimizer's the same way"):
        mm.from_other_settings(optimizer.opt_state, nnx.state(new)["opt_state"])
    # The other way round (it blamed a checkpoint restored without a target).
    with pytest.raises(TypeError, match=r"`state` is an NNX optimizer's state by name"):
        mm.from_other_settings(nnx.state(optimizer)["opt_state"], new.opt_state)
    fresh = nnx.state(nnx.Optimizer(model, new_tx, wrt=nnx.Param))["opt_state"]
    with pytest.raises(ValueError, match=r"are the arguments swapped\?"):
        mm.from_other_settings(fresh, nnx.state(optimizer)["opt_state"])


def test_an_ensembles_states_are_converted_one_member_at_a_time():
    # A batch of states (jax.vmap of init) failed inside a conversion of a
    # counter to a Python int; the error now says how to convert it, and that
    # way gives each member's window as a run of its own would.
    members = 3
    old = mm.MaskedMultiSteps(optax.sgd(1.0), 4, window_stats=True)
    new = mm.MaskedMultiSteps(optax.sgd(1.0), tokens_per_window=10, window_stats=True)

    def step(tx):
        return jax.jit(
            jax.vmap(lambda g, s, p, n: tx.apply_gradients(g, s, p, count=n))
        )

    params = {"w": jnp.zeros((members, 3))}
    params, state = step(old)(
        {"w": jnp.ones((members, 3))},
        jax.vmap(old.init)(params),
        params,
        jnp.array([4.0, 12.0, 0.0]),
    )
    template = jax.vmap(new.init)(params)
    with pytest.raises(
        ValueError, match=r"^`state.mini_step` has shape \(3,\), not \(\): a batch"
    ):
        mm.from_other_settings(state, template)
    converted = [
        mm.from_other_settings(
            jax.tree.map(lambda x, i=i: x[i], state),
            jax.tree.map(lambda x, i=i: x[i], template),
        )
        for i in range(members)
    ]
    state = jax.tree.map(lambda *xs: jnp.stack(xs), *converted)
    params, state = step(new)(
        {"w": jnp.full((members, 3), 3.0)}, state, params, jnp.array([8.0, 1.0, 10.0])
    )
    # Each member's window: (4 tokens of 1, 8 of 3), (12 of 1, 1 of 3), (10 of 3).
    np.testing.assert_allclose(
        params["w"][:, 0], [-(4 + 24) / 12, -(12 + 3) / 13, -3.0], rtol=1e-6
    )
    np.testing.assert_array_equal(state.gradient_step, [1, 1, 1])


def test_a_plain_loop_on_nnx_split_params_keeps_their_variables():
    """A plain optax loop on ``nnx.split`` params: the state holds their
    ``nnx.Param`` nodes, as ``tx.init(params)`` made it; ``find_state`` returns
    it as it is, and both conversions give states that the next step takes
    (no variable stripped, as only an NNX optimizer's own boxes are)."""
    from flax import nnx

    _, params, _ = nnx.split(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), nnx.Param, ...)
    grads = jax.tree.map(jnp.ones_like, params)
    tx = mm.MaskedMultiSteps(optax.adam(0.1), every_k_schedule=4)
    state = tx.init(params)
    params, state = tx.apply_gradients(grads, state, params, count=3)
    assert jax.tree.structure(mm.find_state(state)) == jax.tree.structure(state)

    new = mm.MaskedMultiSteps(optax.adam(0.1), every_k_schedule=2)
    # As it is, or restored as arrays: the result has the template's layout.
    for running in (state, nnx.as_pure(state)):
        switched = mm.from_other_settings(running, new.init(params))
        assert jax.tree.structure(switched) == jax.tree.structure(new.init(params))
        _, switched = new.apply_gradients(grads, switched, params, count=1)
        assert int(switched.gradient_step) == 1

    old = optax.MultiSteps(optax.adam(0.1), every_k_schedule=4)
    _, old_state = old.update(grads, old.init(params), params)
    converted = mm.from_optax_multisteps(old_state, tx, params, acc_count=3)
    assert jax.tree.structure(converted) == jax.tree.structure(tx.init(params))
    _, converted = tx.update(grads, converted, params, count=3)
    assert int(converted.mini_step) == 2
    # A state of arrays (as an nnx.Optimizer's holds, or restored so) with the
    # params as variables converts against the params' arrays.
    pure = nnx.as_pure(old_state)
    converted = mm.from_optax_multisteps(pure, tx, params, acc_count=3)
    want = tx.init(nnx.as_pure(params))
    assert jax.tree.structure(converted) == jax.tree.structure(want)

    # Each leaf's statistics read as arrays, as from any state.
    stats_tx = mm.MaskedMultiSteps(optax.adam(0.1), 1, per_leaf_stats=True)
    _, stats_state = stats_tx.update(grads, stats_tx.init(params), params, count=3)
    per_leaf = mm.window_stats(stats_state, per_leaf=True)
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(per_leaf.grad_sq_norm))
    assert f"{per_leaf.grad_sq_norm['kernel']:.1f}" == "6.0"


@pytest.mark.parametrize("state_as", ["opt_state", "arrays"])
@pytest.mark.parametrize("template_from", ["init of nnx.state", "new opt_state"])
def test_an_nnx_optimizers_opt_state_switches_against_either_template(
    template_from, state_as
):
    """``optimizer.opt_state`` with ``new_tx.init(nnx.state(model,
    nnx.Param))`` or the new optimizer's ``opt_state`` as the template: the
    result holds arrays, as the optimizer's state does, and ``nnx.update``
    loads it; the window in progress closes under the new rule."""
    from flax import nnx

    model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(
        model, mm.MaskedMultiSteps(optax.sgd(1.0), 4), wrt=nnx.Param
    )
    ones = jax.tree.map(jnp.ones_like, nnx.state(model, nnx.Param))
    optimizer.update(model, ones, count=jnp.float32(3))
    new_tx = mm.MaskedMultiSteps(optax.sgd(1.0), tokens_per_window=5)
    new = nnx.Optimizer(model, new_tx, wrt=nnx.Param)
    template = (
        new_tx.init(nnx.state(model, nnx.Param))
        if template_from == "init of nnx.state"
        else new.opt_state
    )
    # As the optimizer holds it, or as arrays (`nnx.as_pure`, or restored so).
    state = optimizer.opt_state
    if state_as == "arrays":
        state = nnx.as_pure(state)
    converted = mm.from_other_settings(state, template)
    assert int(converted.acc_count) == 3
    nnx.update(new.opt_state, nnx.state(converted))
    before = model.kernel[...]
    new.update(model, jax.tree.map(lambda g: 3 * g, ones), count=jnp.float32(2))
    assert bool(new.opt_state.updated[...])
    np.testing.assert_allclose(
        model.kernel[...] - before, -(3 * 1 + 2 * 3) / 5, rtol=1e-6
    )


def test_an_injected_learning_rate_carries_over_until_it_is_set():
    # As documented: the inner state carries over, its hyperparameters too.
    params = {"w": jnp.zeros(())}
    old = mm.MaskedMultiSteps(optax.inject_hyperparams(optax.sgd)(learning_rate=0.1), 4)
    new = mm.MaskedMultiSteps(
        optax.inject_hyperparams(optax.sgd)(learning_rate=1.0), every_k_schedule=2
    )
    state = old.init(params)
    _, state = old.update({"w": jnp.array(1.0)}, state, params, count=1)
    state = mm.from_other_settings(state, new.init(params))
    step = jax.jit(new.update)
    updates, _ = step({"w": jnp.array(2.0)}, state, params, count=1)
    np.testing.assert_allclose(updates["w"], -0.1 * 1.5)  # the old run's rate
    state = optax.tree.set(state, learning_rate=jnp.asarray(1.0))
    updates, _ = step({"w": jnp.array(2.0)}, state, params, count=1)
    np.testing.assert_allclose(updates["w"], -1.0 * 1.5)


def test_a_train_state_takes_the_new_tx_with_the_converted_state():
    # The README's recipe for mm.TrainState: `tx` and `opt_state` replaced
    # together; the window rule is then the new one (k = 4 -> 2).
    params = {"w": jnp.zeros(())}
    state = mm.TrainState.create(
        apply_fn=None, params=params, tx=mm.MaskedMultiSteps(optax.sgd(1.0), 4)
    )
    state = state.apply_gradients(grads={"w": jnp.array(1.0)}, count=1)
    new_tx = mm.MaskedMultiSteps(optax.sgd(1.0), 2)
    state = state.replace(
        tx=new_tx,
        opt_state=mm.from_other_settings(state.opt_state, new_tx.init(params)),
    )
    state = state.apply_gradients(grads={"w": jnp.array(4.0)}, count=3)
    assert int(state.gradient_step) == 1 and int(state.step) == 2
    np.testing.assert_allclose(state.params["w"], -(1.0 + 3 * 4.0) / 4)


def test_an_injected_schedule_is_the_new_txs_at_the_carried_count():
    # Unlike a constant, an injected schedule is a function of the inner step
    # count the state carries: the new tx's applies.
    params = {"w": jnp.zeros(())}

    def wrapper(rate, k):
        inner = optax.inject_hyperparams(optax.sgd)(learning_rate=lambda n: rate)
        return mm.MaskedMultiSteps(inner, k)

    old, new = wrapper(0.1, 4), wrapper(1.0, 2)
    state = old.init(params)
    _, state = old.update({"w": jnp.array(1.0)}, state, params, count=1)
    state = mm.from_other_settings(state, new.init(params))
    updates, _ = jax.jit(new.update)({"w": jnp.array(2.0)}, state, params, count=1)
    np.testing.assert_allclose(updates["w"], -1.0 * 1.5)


def _chained(wrapper):
    # A wrapper inside a chain, beside an element with a state of its own (a
    # schedule's count, which the run carries).
    return optax.chain(wrapper, optax.scale_by_schedule(lambda n: 1.0 / (1.0 + n)))


def test_a_chain_holding_the_wrapper_converts_whole():
    # The template is the new chain's state: the result is the running chain's
    # state with the wrapper's converted, the schedule's count carried over.
    params = {"w": jnp.zeros(())}
    old = _chained(mm.MaskedMultiSteps(optax.sgd(1.0), 4))
    state = old.init(params)
    for g, n in [(1.0, 3), (2.0, 3)]:
        _, state = old.update({"w": jnp.array(g)}, state, params, count=jnp.array(n))
    new = _chained(mm.MaskedMultiSteps(optax.sgd(1.0), tokens_per_window=10))
    carried = mm.from_other_settings(state, new.init(params))
    assert jax.tree.structure(carried) == jax.tree.structure(new.init(params))
    assert_bit_identical(
        carried[0], mm.from_other_settings(state[0], new.init(params)[0])
    )
    assert carried[1].count is state[1].count
    updates, carried = new.update(
        {"w": jnp.array(6.0)}, carried, params, count=jnp.array(4)
    )
    # The window closes at 10 tokens; the schedule is at its third step.
    np.testing.assert_allclose(updates["w"], -(3 * 1 + 3 * 2 + 4 * 6) / 10 / 3)
    assert int(carried[1].count) == 3


def _partitioned(wrapper):
    # The wrapper on one partition of the params, the other frozen.
    return optax.multi_transform(
        {"train": wrapper, "frozen": optax.set_to_zero()},
        lambda params: jax.tree_util.tree_map_with_path(
            lambda path, _: (
                "frozen" if "frozen" in jax.tree_util.keystr(path) else "train"
            ),
            params,
        ),
    )


def test_a_train_state_with_a_multi_transform_takes_the_new_tx():
    params = {"w": jnp.zeros(()), "frozen": jnp.ones(())}
    state = mm.TrainState.create(
        apply_fn=None,
        params=params,
        tx=_partitioned(mm.MaskedMultiSteps(optax.sgd(1.0), 4)),
    )
    grads = lambda g: {"w": jnp.array(g), "frozen": jnp.array(5.0)}  # noqa: E731
    state = state.apply_gradients(grads=grads(1.0), count=1)
    new_tx = _partitioned(mm.MaskedMultiSteps(optax.sgd(1.0), 2))
    with pytest.raises(TypeError, match=r"pass its `opt_state`"):
        mm.from_other_settings(state, new_tx.init(params))
    state = state.replace(
        tx=new_tx,
        opt_state=mm.from_other_settings(state.opt_state, new_tx.init(params)),
    )
    state = state.apply_gradients(grads=grads(4.0), count=3)
    assert int(state.gradient_step) == 1 and int(state.step) == 2
    np.testing.assert_allclose(state.params["w"], -(1.0 + 3 * 4.0) / 4)
    assert float(state.params["frozen"]) == 1.0


def test_an_nnx_optimizer_with_a_multi_transform_switches_by_name():
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.zeros(3))
            self.frozen = nnx.Param(jnp.ones(()))

    model = Model()
    old = nnx.Optimizer(
        model, _partitioned(mm.MaskedMultiSteps(optax.sgd(1.0), 4)), wrt=nnx.Param
    )
    ones = jax.tree.map(jnp.ones_like, nnx.state(model, nnx.Param))
    old.update(model, ones, count=2)
    new = nnx.Optimizer(
        model, _partitioned(mm.MaskedMultiSteps(optax.sgd(1.0), 2)), wrt=nnx.Param
    )
    state = nnx.state(old)
    state["opt_state"] = mm.from_other_settings(
        state["opt_state"], nnx.state(new)["opt_state"]
    )
    nnx.update(new, state)
    new.update(model, jax.tree.map(lambda x: 3 * x, ones), count=6)
    # The window closes on its second microbatch: (2·1 + 6·3) / 8.
    np.testing.assert_allclose(model.w[...], np.full(3, -(2 * 1 + 6 * 3) / 8))
    assert float(model.frozen[...]) == 1.0
    assert int(new.step[...]) == 2
    assert int(mm.find_state(new.opt_state).gradient_step[...]) == 1


def test_a_chain_of_another_structure_is_named():
    params = {"w": jnp.zeros(())}
    old = _chained(mm.MaskedMultiSteps(optax.sgd(1.0), 4))
    state = old.init(params)
    moved = optax.chain(optax.identity(), mm.MaskedMultiSteps(optax.sgd(1.0), 2))
    with pytest.raises(ValueError, match=r"wrapper's state at \[1\], `state` at \[0\]"):
        mm.from_other_settings(state, moved.init(params))
    other = optax.chain(mm.MaskedMultiSteps(optax.sgd(1.0), 2), optax.adam(1.0))
    with pytest.raises(
        ValueError, match=r"`state` outside the wrapper's state at \[0\]"
    ):
        mm.from_other_settings(state, other.init(params))
    with pytest.raises(
        ValueError, match=r"wrapper's state at \[0\], `state` at the root"
    ):
        mm.from_other_settings(state[0], old.init(params))


def test_a_holder_given_the_other_way_or_of_other_dtypes_is_named():
    from flax import nnx

    params = {"w": jnp.zeros(())}
    old = optax.chain(optax.ema(0.9), mm.MaskedMultiSteps(optax.sgd(1.0), 4))
    state = old.init(params)
    # The elements outside the wrapper carry over as they ran: in other
    # dtypes, the step compiled twice and a scan of it failed.
    other = optax.chain(
        optax.ema(0.9, accumulator_dtype=jnp.bfloat16),
        mm.MaskedMultiSteps(optax.sgd(1.0), 2),
    )
    with pytest.raises(
        ValueError, match=r"`state\[0\]\.ema\['w'\]` has dtype float32 where the "
    ):
        mm.from_other_settings(state, other.init(params))
    # By name against bare, and nnx.Optimizer variables against arrays: the
    # paths printed alike ("at [1], `state` at [1]").
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    make = lambda k: nnx.Optimizer(  # noqa: E731
        model, _chained(mm.MaskedMultiSteps(optax.sgd(1.0), k)), wrt=nnx.Param
    )
    running, new = make(4), make(2)
    bare = _chained(mm.MaskedMultiSteps(optax.sgd(1.0), 2)).init(
        nnx.state(model, nnx.Param)
    )
    with pytest.raises(TypeError, match=r"`state` holds the wrapper's state by name"):
        mm.from_other_settings(nnx.state(running)["opt_state"], bare)
    with pytest.raises(TypeError, match=r"`template` holds the wrapper's state by"):
        mm.from_other_settings(running.opt_state, nnx.state(new)["opt_state"])
    with pytest.raises(TypeError, match=r"holds an nnx.Optimizer's variables"):
        mm.from_other_settings(running.opt_state, bare)
    converted = mm.from_other_settings(running.opt_state, new.opt_state)
    nnx.update(new.opt_state, nnx.state(converted))
