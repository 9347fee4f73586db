"""Under ``jax_numpy_dtype_promotion="strict"`` the library promotes nothing
implicitly.

Users turn strict promotion on to find the implicit dtype promotions of their
own code; the library's helpers run inside that code (``mm.masked_mean`` in a
loss) and its steps beside it, so they cast explicitly and decide their
computation dtypes by jax's standard rules. The inner optimizer here is
``optax.sgd``, which runs under strict promotion on its own (optax's adam does
not).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import masked_multistep as mm

BF16 = jnp.bfloat16


@pytest.fixture(autouse=True)
def strict():
    with jax.numpy_dtype_promotion("strict"):
        yield


def _both(fn):
    """``fn`` eagerly and jitted."""
    return fn(), jax.jit(fn)()


def test_masked_mean_with_bool_and_integer_masks_and_narrow_values():
    mask = jnp.array([True, True, False, True])
    for values in (jnp.arange(4.0), jnp.arange(4.0).astype(BF16)):
        for m in (mask, mask.astype(jnp.int8), mask.astype(jnp.float32)):
            for loss, count in _both(lambda v=values, m=m: mm.masked_mean(v, m)):
                assert float(loss) == pytest.approx(4 / 3, rel=1e-2)
                assert float(count) == 3


def test_running_mean_update_with_a_float_total_and_an_integer_count():
    for total in (jnp.float32(4), 4.0):
        for count in (jnp.int32(2), jnp.uint8(2)):
            mean, new_total = mm.running_mean_update(
                jnp.zeros(3), total, jnp.full(3, 3.0), count
            )
            np.testing.assert_allclose(mean, 1.0)
            assert float(new_total) == 6 and new_total.dtype == jnp.float32


@pytest.mark.parametrize(
    "dtype, kwargs",
    [
        (BF16, {}),
        (jnp.float16, {"window_stats": True}),
        (jnp.complex64, {}),
        (jnp.float32, {"accumulator_dtype": BF16}),
        (BF16, {"every_k_schedule": lambda step: jnp.asarray(2, BF16)}),
        (
            jnp.float32,
            {
                "every_k_schedule": None,
                "tokens_per_window": mm.token_budget(
                    4, max_microbatches=lambda step: jnp.asarray(2, jnp.float16)
                ),
            },
        ),
    ],
    ids=["bf16", "f16 stats", "complex", "bf16 accumulator", "bf16 k", "f16 cap"],
)
def test_the_wrapper_with_narrow_and_complex_dtypes(dtype, kwargs):
    kwargs = {"every_k_schedule": 2, **kwargs}
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), **kwargs)
    params = {"w": jnp.zeros(3, dtype)}
    for step in (tx.apply_gradients, jax.jit(tx.apply_gradients)):
        state, p = tx.init(params), params
        for g, n in [(1.0, 1), (3.0, 3)]:
            p, state = step({"w": jnp.full(3, g, dtype)}, state, p, count=jnp.int32(n))
        assert p["w"].dtype == dtype
        np.testing.assert_allclose(np.asarray(p["w"], np.complex64), -2.5, rtol=1e-2)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"window_stats": True},
        {"per_leaf_stats": True},
        {"every_k_schedule": None, "norm_test": mm.norm_test(0.5, max_microbatches=2)},
    ],
    ids=["plain", "stats", "leaf stats", "norm test"],
)
def test_the_wrapper_with_real_and_complex_leaves_in_one_tree(kwargs):
    # Each leaf's sums (the finiteness test, the squared norms) were added up
    # implicitly: float32 + complex64 was a TypePromotionError from inside the
    # library.
    kwargs = {"every_k_schedule": 2, **kwargs}
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), **kwargs)
    params = {
        "w": jnp.zeros(3),
        "b": jnp.zeros(2, BF16),
        "z": jnp.zeros(2, jnp.complex64),
    }
    for step in (tx.apply_gradients, jax.jit(tx.apply_gradients)):
        state, p = tx.init(params), params
        for g, n in [(1.0, 1), (3.0, 3)]:
            grads = jax.tree.map(lambda x, g=g: jnp.full_like(x, g), params)
            p, state = step(grads, state, p, count=jnp.int32(n), value=jnp.float32(g))
        assert int(state.gradient_step) == 1
        for leaf, like in zip(jax.tree.leaves(p), jax.tree.leaves(params)):
            assert leaf.dtype == like.dtype
            np.testing.assert_allclose(np.asarray(leaf, np.complex64), -2.5, rtol=1e-2)
        if set(kwargs) & {"window_stats", "per_leaf_stats", "norm_test"}:
            stats = mm.window_stats(state)
            assert float(stats.grad_sq_norm) == pytest.approx(7 * 2.5**2)


def test_microbatched_with_real_and_complex_leaves_and_stats():
    def loss_fn(params, mb):
        pred = mb["x"] @ params["w"] + jnp.real(
            mb["x"].astype(jnp.complex64) @ params["z"]
        )
        return mm.masked_mean(jnp.square(pred), mb["mask"])

    grad_fn = mm.microbatched_value_and_grad(loss_fn, 2, with_stats=True)
    params = {"w": jnp.ones(3), "z": jnp.ones(3, jnp.complex64)}
    batch = {"x": jnp.ones((4, 3)), "mask": jnp.array([True, True, False, True])}
    for (loss, count), grads, stats in _both(lambda: grad_fn(params, batch)):
        assert float(loss) == 36 and float(count) == 3
        assert grads["z"].dtype == jnp.complex64
        assert float(stats.microbatches) == 2


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.uint16])
def test_microbatched_sums_narrow_integer_aux(dtype):
    def loss_fn(params, mb):
        loss, count = mm.masked_mean(mb["x"] @ params, mb["mask"])
        return loss, (count, {"rows": jnp.ones([], dtype)})

    grad_fn = mm.microbatched_value_and_grad(
        loss_fn, num_microbatches=4, has_aux=True, aux_reduction="sum"
    )
    batch = {"x": jnp.ones((8, 3)), "mask": jnp.arange(8) >= 2}
    for (_, (count, aux)), _ in _both(lambda: grad_fn(jnp.ones(3), batch)):
        assert int(count) == 6 and int(aux["rows"]) == 4


def test_noise_scale_estimates_from_integers_and_narrow_floats():
    for args in [(4, 2, 4, 4), (jnp.int32(4), 2, 4, jnp.int32(4))]:
        for var, _, scale in _both(lambda a=args: mm.noise_scale_estimates(*a)):
            assert float(var) == 4.0 and float(scale) == pytest.approx(4 / 3)
    var, _, _ = mm.noise_scale_estimates(jnp.asarray(4, BF16), 2, 4, 4.0)
    assert float(var) == 4.0
    # In the widest of the figures' dtypes, whichever argument holds it: a
    # float32 S beside a float64 ‖ḡ‖² was worked out in float32 (1e40: inf).
    with jax.enable_x64(True):
        for args in [
            (np.float32(4), 2, 4.0, np.float64(1e40)),
            (np.float64(4), 2, 4.0, np.float32(3e38) * np.float32(1)),
        ]:
            for var, true_sq, _ in _both(lambda a=args: mm.noise_scale_estimates(*a)):
                assert var.dtype == jnp.float64 and float(var) == 4.0
                assert float(true_sq) == pytest.approx(float(args[3]) - 1.0)
        _, true_sq, _ = mm.noise_scale_estimates(
            np.float32(3), 2, 3.0, np.float64(1.0000001)
        )
        assert float(true_sq) == pytest.approx(1e-7, rel=1e-6)


def test_weighted_mean_across_with_narrow_gradients():
    mean = jax.vmap(lambda g, n: mm.weighted_mean_across(g, n, "d"), axis_name="d")
    grads = jnp.arange(4.0)[:, None].repeat(3, 1).astype(BF16)
    out = mean(grads, jnp.array([0, 2, 3, 4], jnp.int32))
    np.testing.assert_allclose(np.float32(out[0]), (2 + 6 + 12) / 9, rtol=1e-2)


def test_deferred_with_narrow_gradients_values_and_a_token_budget():
    mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    tx = mm.MaskedMultiSteps(
        optax.sgd(1.0), tokens_per_window=6, reduction=mm.deferred(mesh, "data")
    )
    params = jax.device_put({"w": jnp.zeros(3, BF16)}, NamedSharding(mesh, P()))
    state = tx.init(params)
    counts = jnp.array([2, 0, 1, 1], jnp.int32)
    grads = {"w": jnp.ones((4, 3), BF16)}
    values = jnp.ones(4, BF16)
    for _ in range(2):
        params, state = jax.jit(tx.apply_gradients)(
            grads, state, params, count=counts, value=values
        )
    assert int(state.gradient_step) == 1
    np.testing.assert_allclose(np.float32(params["w"]), -1.0)


def test_from_optax_multisteps_with_narrow_accumulated_gradients():
    params = {"w": jnp.ones(4)}
    with jax.numpy_dtype_promotion("standard"):  # optax.MultiSteps needs it
        old = optax.MultiSteps(optax.sgd(0.1), every_k_schedule=4)
        state = old.init(params)
        for _ in range(2):
            _, state = old.update(params, state, params)
    state = state._replace(
        acc_grads=jax.tree.map(lambda a: a.astype(BF16), state.acc_grads)
    )
    tx = mm.MaskedMultiSteps(optax.sgd(0.1), every_k_schedule=4)
    new = mm.from_optax_multisteps(state, tx, params, acc_count=32)
    np.testing.assert_allclose(new.acc_grads["w"], 1.0)
    assert float(new.acc_count) == 32
