"""Under ``jax_debug_nans`` and ``jax_debug_infs`` a healthy run never stops
inside the library.

Those flags stop at the first operation that makes a NaN (or inf), eagerly, or
at a jitted step whose outputs hold one: the tool for finding where a NaN
first appears in training. The library's own placeholders must not be found
first: its state holds sums and totals, never a NaN of its own (the
statistics' undefined estimates are made NaN where they are read), and an
eager step makes no NaN in passing. Checked here for windows with one
microbatch, without tokens, without ``value=``, closing on tokens or the norm
test or a token budget computed as an array, and with a deferred reduction
across devices.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import masked_multistep as mm

# Windows of two: (3, 0) holds one microbatch with tokens (K = 1), (4, 5) two,
# (0, 0) none, (2, 1) two.
COUNTS = [3, 0, 4, 5, 0, 0, 2, 1]
PARAMS = {"w": jnp.arange(4.0), "b": jnp.float32(1)}

CONFIGS = {
    "plain": {},
    "no value": {"value": False},
    "stats": {"window_stats": True},
    "stats, no value": {"window_stats": True, "value": False},
    "token windows": {"tokens_per_window": 6, "window_stats": True},
    "token budget warmup": {
        # A budget computed as an array (the README's warmup in tokens).
        "tokens_per_window": lambda seen: jnp.interp(
            seen, jnp.array([0.0, 20.0]), jnp.array([4.0, 8.0])
        ),
    },
    "norm test": {"norm_test": 0.5},
}


def _grads(i):
    # Finite, as `mm.masked_mean` gives also for an all-masked microbatch.
    return {"w": jnp.sin(jnp.arange(4.0) + i), "b": jnp.float32(i % 3 - 1)}


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_a_healthy_run_makes_no_nan_and_its_state_holds_none(config, jit):
    config = dict(config)
    with_value = config.pop("value", True)
    kwargs = {"every_k_schedule": 4 if "norm_test" in config else 2, **config}
    tx = mm.MaskedMultiSteps(optax.adam(0.1), **kwargs)
    step = jax.jit(tx.apply_gradients) if jit else tx.apply_gradients
    with jax.debug_nans(True), jax.debug_infs(True):
        params, state = PARAMS, tx.init(PARAMS)
        chex.assert_tree_all_finite(state)
        for i, n in enumerate(COUNTS):
            value = {"value": jnp.float32(0.5 * i)} if with_value else {}
            params, state = step(_grads(i), state, params, count=jnp.int32(n), **value)
            chex.assert_tree_all_finite((params, state))
        assert int(state.gradient_step) > 0
        if "window_stats" in config or "norm_test" in config:
            # An eager read makes its placeholders without stopping.
            stats = mm.window_stats(state)
            assert int(stats.windows) > 0
            assert np.isnan(stats.loss) != with_value
    if kwargs == {"every_k_schedule": 2, "window_stats": True}:
        # The last window's two microbatches define every estimate, the
        # window (3, 0) before it none but its token total and norm.
        assert np.isfinite(stats.grad_var_trace)
        state = tx.init(PARAMS)
        for i, n in enumerate(COUNTS[:2]):
            params, state = step(_grads(i), state, params, count=jnp.int32(n))
        stats = mm.window_stats(state)
        assert float(stats.tokens) == 3 and np.isfinite(stats.grad_sq_norm)
        for name in ("loss", "grad_var_trace", "true_grad_sq_norm", "noise_scale"):
            assert np.isnan(getattr(stats, name)), name
        assert np.isnan(stats.smoothed_noise_scale)


def test_the_state_before_any_window_reads_as_undefined():
    tx = mm.MaskedMultiSteps(optax.sgd(0.1), 2, window_stats=True)
    with jax.debug_nans(True):
        state = tx.init(PARAMS)
        stats = mm.window_stats(state)
    chex.assert_tree_all_finite(state)
    assert (int(stats.tokens), int(stats.windows), float(stats.tokens_seen)) == (
        0,
        0,
        0.0,
    )
    for name in mm.WindowStats._fields[2:-2]:
        assert np.isnan(getattr(stats, name)), name


def _loss(params, mb):
    pred = mb["x"] @ params["w"] + params["b"]
    return mm.masked_mean((pred - mb["y"]) ** 2, mb["mask"])


@pytest.mark.parametrize("window_stats", [False, True], ids=["", "stats"])
def test_deferred_across_devices_makes_no_nan(window_stats):
    """Four devices, one of them without tokens in every microbatch, and a
    microbatch without tokens anywhere."""
    mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    tx = mm.MaskedMultiSteps(
        optax.adam(0.1),
        2,
        reduction=mm.deferred(mesh, "data"),
        window_stats=window_stats,
    )
    grad_fn = mm.per_device_value_and_grad(_loss, mesh, "data")

    @jax.jit
    def step(params, state, mb):
        (loss, count), grads = grad_fn(params, mb)
        return tx.apply_gradients(grads, state, params, count=count, value=loss)

    rng = np.random.default_rng(0)
    params = jax.device_put(PARAMS, NamedSharding(mesh, P()))
    rows = jnp.arange(8) // 2  # two rows per device
    with jax.debug_nans(True), jax.debug_infs(True):
        state = tx.init(params)
        for i in range(6):
            mask = (rows != 3) & (i != 2)  # device 3 holds padding only
            mb = {
                "x": jnp.asarray(rng.normal(size=(8, 4)), jnp.float32),
                "y": jnp.asarray(rng.normal(size=(8,)), jnp.float32),
                "mask": mask,
            }
            mb = jax.device_put(mb, NamedSharding(mesh, P("data")))
            params, state = step(params, state, mb)
            chex.assert_tree_all_finite((params, state))
        assert int(state.gradient_step) == 3
        if window_stats:
            assert np.isfinite(mm.window_stats(state).loss)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_in_jit_microbatching_with_an_empty_microbatch_makes_no_nan(jit):
    grad_fn = mm.microbatched_value_and_grad(_loss, num_microbatches=4)
    if jit:
        grad_fn = jax.jit(grad_fn)
    batch = {
        "x": jnp.ones((8, 4)),
        "y": jnp.zeros((8,)),
        "mask": jnp.arange(8) >= 2,  # the first microbatch is padding only
    }
    with jax.debug_nans(True), jax.debug_infs(True):
        (loss, count), grads = grad_fn(PARAMS, batch)
    assert int(count) == 6
    chex.assert_tree_all_finite((loss, grads))
