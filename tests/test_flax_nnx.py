"""`MaskedMultiSteps` inside ``nnx.Optimizer``: no adapter needed.

``nnx.Optimizer.update(model, grads, **kwargs)`` forwards its keyword arguments
to ``tx.update``, so ``count=`` reaches :class:`MaskedMultiSteps`. The optimizer
state is built by ``tx.init`` on the model's ``nnx.Param`` variables, so the
accumulator keeps their metadata (sharding annotations) as adam's moments do.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _flax_data import D_IN, D_OUT, INNER, TOL, K, T, make_windows, microbatches
from flax import nnx
from jax.sharding import PartitionSpec as P

import masked_multistep as mm


def loss_fn(model, x, y, mask):
    """Token-mean squared error, and the token count behind it."""
    x = jnp.where(mask[..., None], x, 0.0)
    per_token = jnp.sum((model(x) - y) ** 2, axis=-1)
    return mm.masked_mean(per_token, mask)


@nnx.jit
def train_step(model, optimizer, x, y, mask):
    (loss, count), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, x, y, mask)
    optimizer.update(model, grads, count=count, value=loss)


@nnx.jit
def full_batch_step(model, optimizer, x, y, mask):
    _, grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, x, y, mask)
    optimizer.update(model, grads)


def params_of(model):
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def test_microbatches_match_one_full_batch_step():
    windows = make_windows()
    model = nnx.Linear(D_IN, D_OUT, rngs=nnx.Rngs(0))
    reference = nnx.clone(model)
    tx = mm.MaskedMultiSteps(optax.adamw(**INNER), every_k_schedule=K)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    ref_optimizer = nnx.Optimizer(reference, optax.adamw(**INNER), wrt=nnx.Param)
    init = params_of(model)

    for w, window in enumerate(windows):
        for i, mb in enumerate(microbatches(window)):
            before = params_of(model)
            train_step(model, optimizer, *mb)
            if i < K - 1:
                chex.assert_trees_all_equal(params_of(model), before, strict=True)
        assert int(optimizer.opt_state.gradient_step[...]) == w + 1
        full_batch_step(reference, ref_optimizer, *window)

    # nnx.Optimizer.step counts calls of `update`, i.e. microbatches.
    assert int(optimizer.step[...]) == 2 * K
    chex.assert_trees_all_close(
        params_of(model), params_of(reference), strict=True, **TOL
    )
    assert not np.allclose(params_of(model)["kernel"], init["kernel"])


def test_optax_multisteps_disagrees_with_the_full_batch_step():
    """The bug: equal-weight averaging of microbatch means is not the token mean."""
    windows = make_windows()
    model = nnx.Linear(D_IN, D_OUT, rngs=nnx.Rngs(0))
    reference = nnx.clone(model)
    tx = optax.MultiSteps(optax.adamw(**INNER), every_k_schedule=K)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    ref_optimizer = nnx.Optimizer(reference, optax.adamw(**INNER), wrt=nnx.Param)
    for window in windows:
        for mb in microbatches(window):
            full_batch_step(model, optimizer, *mb)
        full_batch_step(reference, ref_optimizer, *window)
    error = np.max(np.abs(params_of(model)["kernel"] - params_of(reference)["kernel"]))
    assert error > 1000 * TOL["atol"], error


def test_sharding_metadata_carries_to_the_accumulator():
    mesh = jax.make_mesh((2,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    with jax.set_mesh(mesh):
        kernel_init = nnx.with_partitioning(
            nnx.initializers.lecun_normal(), (None, "d")
        )
        model = nnx.Linear(D_IN, 4, kernel_init=kernel_init, rngs=nnx.Rngs(0))
        tx = mm.MaskedMultiSteps(optax.adam(1e-2), every_k_schedule=2)
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

        state = optimizer.opt_state
        acc, mu = state.acc_grads["kernel"], state.inner_opt_state[0].mu["kernel"]
        assert isinstance(acc, nnx.OptVariable), type(acc)
        assert acc.get_metadata()["out_sharding"] == (None, "d")
        assert acc.get_metadata() == mu.get_metadata()
        param_specs = nnx.get_partition_spec(nnx.state(model, nnx.Param))
        acc_specs = nnx.get_partition_spec(state.acc_grads)
        assert acc_specs["kernel"].get_value() == P(None, "d")
        assert acc_specs["kernel"].get_value() == param_specs["kernel"].get_value()

        # The placement holds through a jitted, mid-window update.
        x = jnp.ones((2, T, D_IN))
        y = jnp.zeros((2, T, 4))
        train_step(model, optimizer, x, y, jnp.ones((2, T), bool))
        assert not bool(state.updated[...])
        assert acc.get_value().sharding.spec == P(None, "d")
        assert int(state.acc_count[...]) == 2 * T


def test_an_optax_multisteps_optimizer_switches_mid_window():
    # nnx.Optimizer with optax.MultiSteps, half a window in: its `opt_state`
    # (variables) and the model's params (variables) convert as they are, and
    # a new nnx.Optimizer continues as MaskedMultiSteps would have from the
    # start with 16 tokens per earlier microbatch.
    def grads_of(model, i):
        rng = np.random.default_rng(i)
        grads = nnx.state(model, nnx.Param)
        nnx.replace_by_pure_dict(
            grads,
            {
                "kernel": jnp.asarray(rng.normal(size=(D_IN, D_OUT)), jnp.float32),
                "bias": jnp.asarray(rng.normal(size=D_OUT), jnp.float32),
            },
        )
        return grads

    model = nnx.Linear(D_IN, D_OUT, rngs=nnx.Rngs(0))
    reference = nnx.clone(model)
    old = nnx.Optimizer(
        model, optax.MultiSteps(optax.adam(1e-2), every_k_schedule=4), wrt=nnx.Param
    )
    for i in range(6):
        old.update(model, grads_of(model, i))

    tx = mm.MaskedMultiSteps(optax.adam(1e-2), every_k_schedule=4)
    converted = mm.from_optax_multisteps(
        old.opt_state, tx, nnx.state(model, nnx.Param), acc_count=2 * 16
    )
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    nnx.update(optimizer.opt_state, nnx.state(converted))
    optimizer.step[...] = old.step[...]
    counts = [3, 40, 16, 2, 9, 30]
    for i, n in zip(range(6, 12), counts, strict=True):
        optimizer.update(model, grads_of(model, i), count=jnp.array(n))

    ref_optimizer = nnx.Optimizer(reference, tx, wrt=nnx.Param)
    for i, n in enumerate([16] * 6 + counts):
        ref_optimizer.update(reference, grads_of(reference, i), count=jnp.array(n))
    chex.assert_trees_all_close(
        params_of(model), params_of(reference), rtol=1e-6, atol=1e-7
    )
    assert int(optimizer.opt_state.gradient_step[...]) == 3
    assert int(optimizer.step[...]) == 12
