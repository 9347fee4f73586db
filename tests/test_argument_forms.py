"""Arguments in the forms users pass them: numpy and jax scalars of valid
values are taken; invalid ones are refused by name, never taken silently."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import masked_multistep as mm

PARAMS = {"w": jnp.zeros(3)}
FLAGS = [np.True_, np.False_, jnp.array(True), np.array(False)]


def _loss_fn(params, batch):
    return mm.masked_mean(batch["x"] * params["w"][None, :], batch["mask"])


BATCH = {"x": jnp.arange(12.0).reshape(4, 3), "mask": jnp.ones((4, 3), bool)}


@pytest.mark.parametrize("flag", FLAGS, ids=repr)
def test_numpy_and_jax_bools_are_taken_as_flags(flag):
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 2, window_stats=flag)
    state = tx.init(PARAMS)
    assert (state.stats != ()) == bool(flag)  # () without statistics
    fn = mm.microbatched_value_and_grad(
        _loss_fn, num_microbatches=2, has_aux=np.False_, with_stats=flag
    )
    assert len(fn(PARAMS, BATCH)) == (3 if bool(flag) else 2)
    _, _, spread = mm.running_mean_update(
        jnp.zeros(()),
        jnp.float32(1),
        jnp.ones(()),
        jnp.float32(1),
        with_sq_deviation=np.True_,
    )
    assert float(spread) == 0.5  # 1·(1/2)·‖1 − 0‖²


@pytest.mark.parametrize("flag", [1, 0, "yes", None, jnp.array([True])], ids=repr)
def test_anything_else_is_not_a_flag(flag):
    with pytest.raises(TypeError, match="`window_stats` must be a bool, got"):
        mm.MaskedMultiSteps(optax.sgd(1.0), 2, window_stats=flag)
    with pytest.raises(TypeError, match="`has_aux` must be a bool, got"):
        mm.microbatched_value_and_grad(_loss_fn, num_microbatches=2, has_aux=flag)
    with pytest.raises(TypeError, match="`with_sq_deviation` must be a bool, got"):
        mm.running_mean_update(
            jnp.zeros(()), 0.0, jnp.ones(()), 1.0, with_sq_deviation=flag
        )
    multisteps = optax.MultiSteps(optax.sgd(1.0), 2)
    with pytest.raises(TypeError, match="`use_grad_mean` must be a bool, got"):
        mm.from_optax_multisteps(
            multisteps.init(PARAMS),
            mm.MaskedMultiSteps(optax.sgd(1.0), 2),
            PARAMS,
            use_grad_mean=flag,
        )


def test_a_traced_flag_is_refused_as_not_concrete():
    @jax.jit
    def build(flag):
        mm.MaskedMultiSteps(optax.sgd(1.0), 2, window_stats=flag)

    with pytest.raises(TypeError, match="`window_stats` must be a concrete bool"):
        build(jnp.array(True))


@pytest.mark.parametrize("k", [np.int64(2), jnp.array(2), np.array(2, np.uint8)])
def test_num_microbatches_as_a_numpy_or_jax_integer(k):
    (loss, count), grads = mm.microbatched_value_and_grad(_loss_fn, num_microbatches=k)(
        PARAMS, BATCH
    )
    assert int(count) == 12
    np.testing.assert_allclose(grads["w"], jnp.sum(BATCH["x"], 0) / 12, rtol=1e-6)


def test_stats_decay_default_in_float32_is_the_default():
    # The moving averages run in float32: np.float32(0.9) is the default 0.9.
    for decay in (np.float32(0.9), jnp.array(0.9)):
        mm.MaskedMultiSteps(optax.sgd(1.0), 2, stats_decay=decay)
    with pytest.raises(ValueError, match="which are off"):
        mm.MaskedMultiSteps(optax.sgd(1.0), 2, stats_decay=np.float32(0.8))


def test_a_float_k_of_numpy_says_what_k_may_be():
    with pytest.raises(
        TypeError,
        match=r"`every_k_schedule` must be an integer or a callable of the gradient "
        r"step, got .* of dtype float32",
    ):
        mm.MaskedMultiSteps(optax.sgd(1.0), np.float32(8))


@pytest.mark.parametrize("skip", [lambda g, s, p: False, lambda g, s, p: None])
def test_a_skip_function_returning_no_pair_is_named(skip):
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 2, should_skip_update_fn=skip)
    with pytest.raises(
        TypeError, match=r"`should_skip_update_fn` must return a pair `\(should_skip"
    ):
        tx.init(PARAMS)


@pytest.mark.parametrize("total", [-5.0, -1, float("nan"), float("inf")])
@pytest.mark.parametrize("jit", [False, True])
def test_a_total_that_is_no_sum_of_weights_moves_nothing(total, jit):
    # -5 used to move the mean away from the value (5 -> 7.67).
    dtype = jnp.int32 if isinstance(total, int) else jnp.float32
    update = jax.jit(mm.running_mean_update) if jit else mm.running_mean_update
    mean, new_total = update(
        jnp.float32(5.0),
        jnp.asarray(total, dtype),
        jnp.float32(1.0),
        jnp.asarray(2, dtype),
    )
    assert float(mean) == 5.0
    np.testing.assert_equal(np.asarray(new_total), np.asarray(total, dtype))


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_non_finite_mask_weight_is_a_value_error(bad):
    with pytest.raises(ValueError, match=r"`mask` holds 1 non-finite weight"):
        mm.masked_mean(jnp.array([1.0, 2.0, 3.0]), jnp.array([0.5, 0.5, bad]))
    # Under jit the count is not finite: an invalid count for the wrapper.
    _, count = jax.jit(mm.masked_mean)(
        jnp.array([1.0, 2.0, 3.0]), jnp.array([0.5, 0.5, bad])
    )
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 2)
    update = jax.jit(lambda s, n: tx.update({"w": jnp.ones(3)}, s, PARAMS, count=n))
    _, state = update(tx.init(PARAMS), count)
    assert int(state.num_invalid_counts) == 1 and float(state.acc_count) == 0


def test_negative_step_counters_of_a_0_1_state_are_refused():
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 3)
    template = tx.init(PARAMS)
    for name in ("mini_step", "gradient_step", "num_invalid_counts"):
        old = {**mm.state_0_1_target(template), name: jnp.int32(-2)}
        # mini_step -2 with k = 3 would close the first window after 5.
        with pytest.raises(ValueError, match=rf"`restored\['{name}'\]` must be an"):
            mm.from_state_0_1(old, template)


@pytest.mark.parametrize(
    "acc_count, example",
    [(jnp.bfloat16(5), "3001 tokens sum to 3008"), (np.float16(5), "2049 tokens")],
)
def test_a_narrow_float_acc_count_is_refused_like_a_count(acc_count, example):
    multisteps = optax.MultiSteps(optax.sgd(1.0), 3)
    state = multisteps.init(PARAMS)._replace(mini_step=jnp.int32(1))
    with pytest.raises(TypeError, match=rf"`acc_count` has dtype .*{example}"):
        mm.from_optax_multisteps(
            state, mm.MaskedMultiSteps(optax.sgd(1.0), 3), PARAMS, acc_count=acc_count
        )


def test_a_python_int_value_is_taken_by_value():
    # 2**31 does not fit int32, which jnp.asarray would have made of it.
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 1, window_stats=True)
    _, state = tx.update(
        {"w": jnp.ones(3)}, tx.init(PARAMS), PARAMS, count=1, value=2**31
    )
    assert float(mm.window_stats(state).loss) == 2.0**31
    # One beyond float64's range is infinite, as such a float is.
    _, state = tx.update(
        {"w": jnp.ones(3)}, tx.init(PARAMS), PARAMS, count=1, value=10**400
    )
    assert float(mm.window_stats(state).loss) == float("inf")


@pytest.mark.parametrize("k", [jnp.array(2), np.uint8(40)], ids=repr)
def test_per_device_functions_check_the_batch_against_k_as_an_integer(k):
    # A 0-d jax k reached the batch check under jit as a tracer; 8 devices
    # times np.uint8(40) wrapped to 64 and passed a 64-row batch.
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    batch = {"x": jnp.ones((64, 3)), "mask": jnp.ones((64, 3), bool)}
    fn = mm.data_parallel_value_and_grad(_loss_fn, mesh, num_microbatches=k)
    if int(k) == 2:
        (_, count), _ = jax.jit(fn)(PARAMS, batch)
        assert int(count) == 192
    else:
        with pytest.raises(
            ValueError, match=r"devices \(8\) times `num_microbatches` \(40\)"
        ):
            fn(PARAMS, batch)


def test_a_traced_k_points_to_what_works():
    # It only named inject_hyperparams' static_args, as if the wrapper had been
    # built by inject_hyperparams (which it refuses) rather than inside jit.
    @jax.jit
    def build(k):
        mm.MaskedMultiSteps(optax.sgd(1.0), k)

    with pytest.raises(TypeError, match="build the wrapper outside jit"):
        build(jnp.int32(2))
    # The route the message names works: a function that builds the wrapper,
    # its k listed in static_args.
    tx = optax.inject_hyperparams(
        lambda k: mm.MaskedMultiSteps(optax.sgd(1.0), k), static_args=("k",)
    )(k=2)
    state = tx.init(PARAMS)
    for _ in range(2):
        _, state = tx.update({"w": jnp.ones(3)}, state, PARAMS, count=jnp.int32(3))
    assert mm.has_updated(state)


def test_the_masked_mean_pair_as_value_is_named():
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 2)
    loss_and_count = mm.masked_mean(jnp.ones(3), jnp.ones(3, bool))
    with pytest.raises(TypeError, match=r"got a tuple of 2: mm.masked_mean returns"):
        tx.update(
            {"w": jnp.ones(3)},
            tx.init(PARAMS),
            PARAMS,
            count=loss_and_count[1],
            value=loss_and_count,
        )


def test_a_class_as_train_state_tx_says_to_build_one():
    with pytest.raises(TypeError, match="got the class MaskedMultiSteps: build one"):
        mm.TrainState.create(apply_fn=None, params=PARAMS, tx=mm.MaskedMultiSteps)
    # flax's "'NoneType' object has no attribute 'init'".
    with pytest.raises(TypeError, match="`tx` must be an optax Gradient.*NoneType"):
        mm.TrainState.create(apply_fn=None, params=PARAMS, tx=None)


def test_the_masked_mean_pair_as_count_is_named_and_other_tuples_are_not():
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 2)
    pair = mm.masked_mean(jnp.ones(3), jnp.ones(3, bool))
    state = tx.init(PARAMS)
    with pytest.raises(
        TypeError, match=r"returns the pair \(mean, count\); pass `count"
    ):
        tx.update({"w": jnp.ones(3)}, state, PARAMS, count=pair)
    with pytest.raises(TypeError, match=r"got a tuple of 1$"):
        tx.update({"w": jnp.ones(3)}, state, PARAMS, count=1, value=(1.0,))


def test_a_broadcast_mask_counts_the_non_finite_weights_it_was_given():
    with pytest.raises(ValueError, match=r"`mask` holds 1 non-finite weight"):
        mm.masked_mean(jnp.ones(4), jnp.float32(jnp.nan))


@pytest.mark.parametrize(
    "flag", [jnp.array(1), np.array(0), jnp.float32(0.5), np.float64(1.0)], ids=repr
)
def test_a_scalar_number_array_is_not_a_flag(flag):
    # A 0-d array is a flag only with dtype bool: 1, 0 or 0.5 in an array are
    # refused as a plain 1 is, not read through their truth value.
    with pytest.raises(TypeError, match="`window_stats` must be a bool, got"):
        mm.MaskedMultiSteps(optax.sgd(1.0), 2, window_stats=flag)
    with pytest.raises(TypeError, match="`has_aux` must be a bool, got"):
        mm.microbatched_value_and_grad(_loss_fn, num_microbatches=2, has_aux=flag)


def test_a_negative_python_int_value_beyond_float64_keeps_its_sign():
    # Below float64's range the loss is -inf, as such a float is, not +inf.
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 1, window_stats=True)
    _, state = tx.update(
        {"w": jnp.ones(3)}, tx.init(PARAMS), PARAMS, count=1, value=-(10**400)
    )
    assert float(mm.window_stats(state).loss) == float("-inf")
