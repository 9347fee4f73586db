"""A checkpoint of the 0.1 state layout: a clear error, then a way to continue.

The 0.1 state is rebuilt here as a NamedTuple of the 0.1 fields (what orbax
and flax.serialization wrote for it): the same name, the same field order, an
int32 token total.
"""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from _helpers import assert_bit_identical
from flax import nnx, serialization

import masked_multistep as mm

State01 = collections.namedtuple("MaskedMultiStepsState", mm.STATE_0_1_FIELDS)

GRADS = [(1.0, 5), (-2.0, 1), (4.0, 2), (0.5, 3), (3.0, 1), (-1.0, 4)]


def _as_0_1(state):
    """The 0.1 layout of a state: its 0.1 fields, the token total in int32."""
    fields = {name: getattr(state, name) for name in mm.STATE_0_1_FIELDS}
    fields["acc_count"] = state.acc_count.astype(jnp.int32)
    return State01(**fields)


def _run(tx, params, state, grads, value=None):
    extra = {} if value is None else {"value": jnp.float32(value)}
    for g, n in grads:
        params, state = tx.apply_gradients(
            {"w": jnp.full(2, g, jnp.float32)},
            state,
            params,
            count=jnp.int32(n),
            **extra,
        )
    return params, state


def test_0_1_checkpoint_fails_clearly_then_converts_and_continues(tmp_path):
    tx = mm.MaskedMultiSteps(optax.adam(0.1), every_k_schedule=3)
    params0 = {"w": jnp.zeros(2)}
    # Four microbatches: one window applied, one microbatch of the next pending.
    params, state = _run(tx, params0, tx.init(params0), GRADS[:4])
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(
        tmp_path / "ckpt", {"params": params, "opt_state": _as_0_1(state)}
    )
    checkpointer.wait_until_finished()

    template = {"params": params0, "opt_state": tx.init(params0)}
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template)
    # The current layout against a 0.1 checkpoint: an error naming the new fields.
    with pytest.raises(ValueError, match="num_nonfinite_windows"):
        checkpointer.restore(tmp_path / "ckpt", abstract)

    old_target = {
        "params": params0,
        "opt_state": mm.state_0_1_target(template["opt_state"]),
    }
    restored = checkpointer.restore(
        tmp_path / "ckpt", jax.tree.map(ocp.utils.to_shape_dtype_struct, old_target)
    )
    checkpointer.close()
    converted = mm.from_state_0_1(restored["opt_state"], template["opt_state"])
    assert isinstance(converted, mm.MaskedMultiStepsState)
    assert converted.acc_count.dtype == state.acc_count.dtype
    assert int(converted.mini_step) == 1 and float(converted.acc_count) == 3.0

    # Continuing from the converted state is the uninterrupted run.
    want, want_state = _run(tx, params, state, GRADS[4:])
    got, got_state = _run(tx, restored["params"], converted, GRADS[4:])
    assert bool(tx.has_updated(got_state))
    np.testing.assert_array_equal(got["w"], want["w"])
    for a, b in zip(jax.tree.leaves(got_state), jax.tree.leaves(want_state)):
        np.testing.assert_array_equal(a, b)


def test_0_1_flax_serialization_fails_clearly_then_converts():
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), every_k_schedule=2)
    params = {"w": jnp.zeros(2)}
    _, state = _run(tx, params, tx.init(params), GRADS[:1], value=2.5)
    data = serialization.to_bytes(_as_0_1(state))
    template = tx.init(params)
    with pytest.raises(ValueError, match="field names"):
        serialization.from_bytes(template, data)
    restored = serialization.from_bytes(mm.state_0_1_target(template), data)
    converted = mm.from_state_0_1(restored, template)
    for a, b in zip(jax.tree.leaves(converted), jax.tree.leaves(state)):
        np.testing.assert_array_equal(a, b)


def test_from_state_0_1_refuses_what_is_not_a_0_1_state():
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), every_k_schedule=2)
    template = tx.init({"w": jnp.zeros(2)})
    with pytest.raises(ValueError, match="not a masked_multistep 0.1 state"):
        mm.from_state_0_1(template._asdict(), template)
    with pytest.raises(TypeError, match="`restored` must be"):
        mm.from_state_0_1(list(mm.STATE_0_1_FIELDS), template)
    # The restore target in place of what the restore returns (was a dtype
    # mismatch, "holds dtype object where the template has int32").
    abstract = jax.eval_shape(lambda: mm.state_0_1_target(template))
    with pytest.raises(TypeError, match="`restored` holds jax.ShapeDtypeStructs"):
        mm.from_state_0_1(abstract, template)
    # The 0.1 state as the NamedTuple flax.serialization restores reads as
    # its fields.
    as_tuple = mm.from_state_0_1(_as_0_1(template), template)
    as_dict = mm.from_state_0_1(_as_0_1(template)._asdict(), template)
    jax.tree.map(np.testing.assert_array_equal, as_tuple, as_dict)
    # A state inside a chain: the error says where the wrapper's own one is.
    chained = (optax.EmptyState(), template)
    with pytest.raises(TypeError, match=r"it holds one at \[1\]"):
        mm.state_0_1_target(chained)
    with pytest.raises(TypeError, match="`template` must be"):
        mm.state_0_1_target({"w": 1})
    # The 0.1 fields as the template too (read as a state held by name, it
    # failed in a tree walk: "'SequenceKey' object has no attribute 'key'").
    with pytest.raises(TypeError, match="`template` must be this version's state"):
        mm.from_state_0_1(_as_0_1(template)._asdict(), _as_0_1(template)._asdict())
    # A template for other params (or with per-device accumulators, which 0.1
    # did not have): refused here, not at the next update.
    old = mm.state_0_1_target(template)
    other = tx.init({"w": jnp.zeros(3)})
    with pytest.raises(ValueError, match=r"`restored\['acc_grads'\]` does not match"):
        mm.from_state_0_1(old, other)


def test_0_1_fields_take_the_template_dtypes_and_the_count_contract():
    # 0.1 could accumulate in bfloat16 and count in float; flax.serialization
    # restores the saved dtypes (orbax casts to the target's).
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), every_k_schedule=2, count_dtype=jnp.int32)
    params = {"w": jnp.zeros(2)}
    template = tx.init(params)
    old = {
        **mm.state_0_1_target(template),
        "mini_step": np.int32(1),
        "acc_grads": {"w": np.full(2, 2.0, jnp.bfloat16)},
        "acc_count": np.float32(3.0),
    }
    state = mm.from_state_0_1(old, template)
    assert state.acc_grads["w"].dtype == jnp.float32  # was bfloat16: refused later
    assert state.acc_count.dtype == jnp.int32 and int(state.acc_count) == 3
    updates, _ = tx.update({"w": jnp.full(2, 6.0)}, state, params, count=1)
    np.testing.assert_allclose(updates["w"], -(3 * 2 + 1 * 6) / 4)
    # A fractional total into integer counts was truncated (0.5 to 0: the
    # pending gradient dropped); values a dtype cannot hold, another kind.
    for field, value, match in [
        ("acc_count", np.float32(0.5), r"`restored\['acc_count'\]` is fractional"),
        ("acc_count", np.float32(-1.0), r"`restored\['acc_count'\]` must be"),
        ("mini_step", np.int64(2**40), r"`restored\['mini_step'\]` .* do not fit"),
        # Another signedness casts there and back to the same bits (3e9 as
        # int32 is -1294967296): compared by value.
        ("mini_step", np.uint32(3e9), r"uint32 where .* do not fit it: 3000000000"),
        ("acc_grads", {"w": np.ones(2, np.int32)}, r"holds dtype int32 where"),
    ]:
        with pytest.raises(ValueError, match=match):
            mm.from_state_0_1({**old, field: value}, template)
    # The abstract template is for state_0_1_target; filling new fields with
    # ShapeDtypeStructs failed inside optax at the next update.
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template)
    with pytest.raises(TypeError, match="`template` must be the concrete state"):
        mm.from_state_0_1(old, abstract)


@pytest.mark.parametrize("window_stats", [False, True])
def test_a_converted_0_1_state_sits_where_init_puts_it(window_stats):
    # Params on a mesh: init replicates its scalars there. A converted state
    # whose counts sat uncommitted on one device made the step compile twice.
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    params = {
        "w": jax.device_put(
            jnp.ones((8, 2)),
            jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")),
        )
    }
    tx = mm.MaskedMultiSteps(optax.sgd(0.1), 3, window_stats=window_stats)
    step = jax.jit(lambda p, s, n: tx.apply_gradients(p, s, p, count=n))
    template = tx.init(params)
    step(params, template, jnp.float32(1))
    old = {
        **mm.state_0_1_target(template),
        "mini_step": jax.device_put(jnp.int32(1), replicated),
        "acc_count": jax.device_put(jnp.int32(3), replicated),
    }
    state = mm.from_state_0_1(old, template)
    for got, want in zip(
        jax.tree.leaves(state), jax.tree.leaves(template), strict=True
    ):
        assert got.sharding == want.sharding
    compiled = step._cache_size()
    step(params, state, jnp.float32(1))
    assert step._cache_size() == compiled


def test_a_0_1_state_of_sharded_params_read_with_flax_serialization():
    # flax.serialization gives numpy leaves; those of parameter size are put
    # shard by shard where the template's are (FSDP-style params).
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    params = {"w": jax.device_put(jnp.arange(16.0).reshape(8, 2), sharded)}
    tx = mm.MaskedMultiSteps(optax.adam(0.1), 3)
    template = tx.init(params)
    old = {
        **mm.state_0_1_target(template),
        "mini_step": jnp.int32(1),
        "acc_count": jnp.int32(3),
        "acc_grads": {"w": jnp.arange(16.0).reshape(8, 2) / 10},
    }
    restored = serialization.from_bytes(
        mm.state_0_1_target(template), serialization.to_bytes(old)
    )
    state = mm.from_state_0_1(restored, template)
    assert state.acc_grads["w"].sharding == sharded
    np.testing.assert_array_equal(state.acc_grads["w"], old["acc_grads"]["w"])
    for got, want in zip(
        jax.tree.leaves(state), jax.tree.leaves(template), strict=True
    ):
        assert got.sharding == want.sharding
    jax.jit(lambda s: tx.apply_gradients(params, s, params, count=1))(state)


def _saved_and_restored(tmp_path, fields, target):
    """The 0.1 state ``fields`` saved with orbax (under ``opt_state``) and
    restored against ``target``."""
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", {"opt_state": State01(**fields)})
    checkpointer.wait_until_finished()
    restored = checkpointer.restore(tmp_path / "ckpt", {"opt_state": target})
    checkpointer.close()
    return restored["opt_state"]


def _restored_and_converted(tmp_path, fields, target, template, ok):
    """The 0.1 state ``fields`` (a token total of 3, or 0.5 where not ``ok``)
    restored against ``target`` and converted against ``template``: the int32
    state, or ``None`` where the fractional total was refused."""
    restored = _saved_and_restored(tmp_path, fields, target)
    if not ok:
        with pytest.raises(ValueError, match=r"is fractional \(0.5\)"):
            mm.from_state_0_1(restored, template)
        return None
    state = mm.from_state_0_1(restored, template)
    assert state.acc_count.dtype == jnp.int32 and int(state.acc_count) == 3
    return state


@pytest.mark.parametrize("total, ok", [(3.0, True), (0.5, False)])
def test_orbax_restores_a_float_0_1_total_in_its_own_dtype(tmp_path, total, ok):
    # A 0.1 run that counted in float32, continued with int32 counts: orbax
    # casts to the target's dtype, so against the template's int32 a total of
    # 0.5 became 0 (the pending gradient dropped) before any check; with the
    # 0.1 count dtype in the target it is read as it was saved.
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), every_k_schedule=2, count_dtype=jnp.int32)
    params = {"w": jnp.zeros(2)}
    template = tx.init(params)
    fields = {name: getattr(template, name) for name in mm.STATE_0_1_FIELDS}
    fields.update(
        mini_step=jnp.int32(1),
        acc_count=jnp.float32(total),
        acc_grads={"w": jnp.full(2, 4.0)},
    )
    assert mm.state_0_1_target(template)["acc_count"].dtype == jnp.int32
    target = mm.state_0_1_target(template, count_dtype=jnp.float32)
    assert target["acc_count"].dtype == jnp.float32
    state = _restored_and_converted(
        tmp_path,
        fields,
        jax.tree.map(ocp.utils.to_shape_dtype_struct, target),
        template,
        ok,
    )
    if state is None:
        return
    assert state.acc_count.sharding == template.acc_count.sharding
    updates, _ = tx.update({"w": jnp.zeros(2)}, state, params, count=jnp.int32(1))
    np.testing.assert_allclose(updates["w"], -(3 * 4.0) / 4)
    with pytest.raises(ValueError, match="`count_dtype` must be one of"):
        mm.state_0_1_target(template, count_dtype=jnp.float16)


def test_from_state_0_1_refuses_to_be_traced():
    # Under jit its checks (token total, step counters) cannot read the values:
    # a fractional or negative total passed as it was.
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), every_k_schedule=3, count_dtype=jnp.int32)
    template = tx.init({"w": jnp.zeros(2)})
    old = {**mm.state_0_1_target(template), "acc_count": jnp.float32(2.5)}
    with pytest.raises(TypeError, match="must be called eagerly"):
        jax.jit(mm.from_state_0_1)(old, template)


def test_from_state_0_1_takes_the_tokens_seen():
    tx = mm.MaskedMultiSteps(
        optax.sgd(1.0),
        tokens_per_window=lambda seen: jnp.where(seen < 100, 2.0, 8.0),
        window_stats=True,
    )
    template = tx.init({"w": jnp.zeros(2)})
    old = mm.state_0_1_target(template)
    state = mm.from_state_0_1(old, template, tokens_seen=2**30 + 1)
    assert int(mm.window_stats(state).tokens_seen) == 2**30 + 1
    assert int(state.policy_state) == 2**30 + 1  # the budget's tokens seen
    assert int(mm.window_stats(mm.from_state_0_1(old, template)).tokens_seen) == 0


def test_0_1_integers_are_compared_with_both_ends_of_the_dtype():
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), every_k_schedule=2)
    template = tx.init({"w": jnp.zeros(2)})
    old = mm.state_0_1_target(template)
    # Below int32's range: as int32 this would be 1, and pass the counters' check.
    with pytest.raises(ValueError, match=r"do not fit it: -4294967295"):
        mm.from_state_0_1({**old, "mini_step": np.int64(-(2**32) + 1)}, template)
    # int32's largest value fits.
    state = mm.from_state_0_1({**old, "gradient_step": np.int64(2**31 - 1)}, template)
    assert int(state.gradient_step) == 2**31 - 1


def test_0_1_a_leaf_of_the_same_size_but_another_shape_is_refused():
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), every_k_schedule=2)
    template = tx.init({"w": jnp.zeros(2)})
    old = {
        **mm.state_0_1_target(template),
        "acc_grads": {"w": np.zeros((1, 2), np.float32)},
    }
    with pytest.raises(ValueError, match=r"`restored\['acc_grads'\]` does not match"):
        mm.from_state_0_1(old, template)


def test_a_0_1_state_of_params_on_no_particular_device_stays_uncommitted():
    # Params left where jax puts them: tx.init's state is uncommitted, and so
    # is a 0.1 state read back with flax.serialization (numpy leaves) and
    # converted, so that the step compiled for the one runs the other.
    params = {"w": jnp.arange(4.0)}
    tx = mm.MaskedMultiSteps(optax.adam(0.1), 3)
    template = tx.init(params)
    old = {
        **mm.state_0_1_target(template),
        "mini_step": jnp.int32(1),
        "acc_count": jnp.int32(3),
        "acc_grads": {"w": jnp.arange(4.0) / 10},
    }
    restored = serialization.from_bytes(
        mm.state_0_1_target(template), serialization.to_bytes(old)
    )
    state = mm.from_state_0_1(restored, template)
    for got, want in zip(
        jax.tree.leaves(state), jax.tree.leaves(template), strict=True
    ):
        assert not got._committed and not want._committed
    step = jax.jit(lambda p, s: tx.apply_gradients(p, s, p, count=1))
    step(params, template)
    compiled = step._cache_size()
    step(params, state)
    assert step._cache_size() == compiled


def test_the_0_1_fields_are_the_ones_a_0_1_checkpoint_holds():
    # The 0.1 layout as 0.1 wrote it, spelt out (not derived from
    # mm.STATE_0_1_FIELDS): its target must take exactly these fields.
    fields_0_1 = (
        "mini_step",
        "gradient_step",
        "inner_opt_state",
        "acc_grads",
        "acc_count",
        "acc_value",
        "updated",
        "num_invalid_counts",
        "skip_state",
    )
    assert mm.STATE_0_1_FIELDS == fields_0_1
    written_by_0_1 = collections.namedtuple("MaskedMultiStepsState", fields_0_1)
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), every_k_schedule=2)
    template = tx.init({"w": jnp.zeros(2)})
    old = {name: getattr(template, name) for name in fields_0_1}
    old.update(
        mini_step=jnp.int32(1),
        acc_count=jnp.int32(4),
        acc_grads={"w": jnp.full(2, 3.0)},
        num_invalid_counts=jnp.int32(2),
    )
    data = serialization.to_bytes(written_by_0_1(**old))
    restored = serialization.from_bytes(mm.state_0_1_target(template), data)
    state = mm.from_state_0_1(restored, template)
    assert int(state.num_invalid_counts) == 2 and int(state.mini_step) == 1
    np.testing.assert_array_equal(state.acc_grads["w"], [3.0, 3.0])


@pytest.mark.parametrize("skip", [False, True], ids=["no_skip", "skip_not_finite"])
@pytest.mark.parametrize("window_stats", [False, True])
def test_a_0_1_state_mid_window_converts_to_the_state_it_was(window_stats, skip):
    # One microbatch pending, no `value=` passed (acc_value stays 0): every
    # field, the value weight, the statistics and what should_skip_update_fn
    # returned last (a non-finite microbatch, skipped) included, comes back
    # as the current layout holds it.
    tx = mm.MaskedMultiSteps(
        optax.sgd(1.0),
        every_k_schedule=3,
        window_stats=window_stats,
        should_skip_update_fn=optax.skip_not_finite if skip else None,
    )
    params = {"w": jnp.zeros(2)}
    grads = GRADS[:1] + ([(np.nan, 2)] if skip else [])
    _, state = _run(tx, params, tx.init(params), grads)
    assert float(state.acc_value) == 0.0 and float(state.value_count) == 0.0
    converted = mm.from_state_0_1(_as_0_1(state), tx.init(params))
    assert jax.tree.structure(converted) == jax.tree.structure(state)
    for a, b in zip(jax.tree.leaves(converted), jax.tree.leaves(state), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("total, ok", [(3.0, True), (0.5, False)])
def test_an_abstract_template_gives_a_target_in_the_0_1_count_dtype(
    tmp_path, total, ok
):
    # The orbax restore of the module docstring, with the abstract template
    # (`ocp.utils.to_shape_dtype_struct`) and params on a mesh: the token
    # total is read in the 0.1 count dtype, where the template's sits, so a
    # fractional total is refused instead of truncated to 0.
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    params = {"w": jax.device_put(jnp.arange(16.0).reshape(8, 2), sharded)}
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), every_k_schedule=2, count_dtype=jnp.int32)
    template = tx.init(params)
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template)
    for like in (template, abstract):
        target = mm.state_0_1_target(like, count_dtype=jnp.float32)
        assert target["acc_count"].dtype == jnp.float32
        assert target["acc_count"].sharding == template.acc_count.sharding
    fields = {name: getattr(template, name) for name in mm.STATE_0_1_FIELDS}
    fields.update(mini_step=jnp.int32(1), acc_count=jnp.float32(total))
    target = mm.state_0_1_target(abstract, count_dtype=jnp.float32)
    _restored_and_converted(tmp_path, fields, target, template, ok)


@pytest.mark.parametrize("name", ["mini_step", "gradient_step", "num_invalid_counts"])
def test_a_0_1_step_counter_of_minus_one_is_refused(name):
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), every_k_schedule=3)
    template = tx.init({"w": jnp.zeros(2)})
    old = {**mm.state_0_1_target(template), name: jnp.int32(-1)}
    with pytest.raises(ValueError, match=rf"`restored\['{name}'\]` must be .* got -1"):
        mm.from_state_0_1(old, template)


def _nnx_optimizer(window_stats):
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    tx = mm.MaskedMultiSteps(
        optax.adam(0.1),
        # Windows of 8 tokens until 8 are seen, then of 4.
        tokens_per_window=lambda seen: jnp.where(seen < 8, 8.0, 4.0),
        window_stats=window_stats,
    )
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)


@nnx.jit
def _nnx_step(model, optimizer, g, n):
    grads = jax.tree.map(lambda p: jnp.full_like(p, g), nnx.state(model, nnx.Param))
    optimizer.update(model, grads, count=n, value=2 * g)


def _nnx_run(model, optimizer, grads):
    for g, n in grads:
        _nnx_step(model, optimizer, jnp.float32(g), jnp.int32(n))


@pytest.mark.parametrize("window_stats", [False, True])
def test_a_0_1_nnx_optimizer_checkpoint_converts_and_continues(tmp_path, window_stats):
    # An nnx.Optimizer's checkpoint holds `nnx.state(optimizer)`: in 0.1 its
    # `opt_state` held the 0.1 fields by name (the empty `skip_state` left
    # out), each array in an NNX variable, the token total in int32.
    model, optimizer = _nnx_optimizer(window_stats)
    _nnx_run(model, optimizer, GRADS[:4])  # a window of 8 tokens, then 3 pending
    state = nnx.state(optimizer)
    old = {k: v for k, v in state["opt_state"].items() if k in mm.STATE_0_1_FIELDS}
    old["acc_count"] = jax.tree.map(lambda x: x.astype(jnp.int32), old["acc_count"])
    saved = nnx.State({**state, "opt_state": nnx.State(old)})
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(
        tmp_path / "ckpt", {"model": nnx.state(model), "optimizer": saved}
    )
    checkpointer.wait_until_finished()

    resumed_model, resumed = _nnx_optimizer(window_stats)
    template = nnx.state(resumed)
    target = mm.state_0_1_target(template["opt_state"], count_dtype=jnp.int32)
    assert sorted(target) == sorted(old)
    restored = checkpointer.restore(
        tmp_path / "ckpt",
        jax.tree.map(
            ocp.utils.to_shape_dtype_struct,
            {
                "model": nnx.state(resumed_model),
                "optimizer": nnx.State({**template, "opt_state": target}),
            },
        ),
    )
    checkpointer.close()
    # The tokens of the window completed before the checkpoint: the budget
    # continues from them.
    converted = mm.from_state_0_1(
        restored["optimizer"]["opt_state"], template["opt_state"], tokens_seen=8
    )
    assert jax.tree.structure(converted) == jax.tree.structure(template["opt_state"])
    nnx.update(resumed_model, restored["model"])
    nnx.update(resumed, nnx.State({**restored["optimizer"], "opt_state": converted}))
    assert int(resumed.opt_state.mini_step[...]) == 1
    assert float(resumed.opt_state.acc_count[...]) == 3.0

    # The rest of the run is the uninterrupted one. 0.1 kept no statistics:
    # the window that was pending counts its one microbatch, and the moving
    # averages start afresh.
    for step in (GRADS[4:5], GRADS[5:]):  # a window of 3 + 1 tokens, one of 4
        _nnx_run(model, optimizer, step)
        _nnx_run(resumed_model, resumed, step)
        assert bool(mm.has_updated(resumed.opt_state))
        if window_stats:
            got = mm.window_stats(resumed.opt_state)
            want = mm.window_stats(optimizer.opt_state)
            for name in (
                *("tokens", "microbatches", "loss", "grad_sq_norm"),
                *("grad_var_trace", "noise_scale", "tokens_seen"),
            ):
                assert_bit_identical(getattr(got, name), getattr(want, name))
        assert_bit_identical(nnx.state(resumed_model), nnx.state(model))
    got, want = nnx.state(resumed), nnx.state(optimizer)
    if window_stats:
        got["opt_state"].pop("stats")
        want["opt_state"].pop("stats")
    assert_bit_identical(got, want)
