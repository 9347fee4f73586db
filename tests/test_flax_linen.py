"""`mm.TrainState`: flax linen training with token-weighted accumulation.

The central claim: k microbatches with skewed masks (one of them empty) through
``mm.TrainState`` give the params of one full-batch step of the inner optimizer
on the full batch's token-mean loss; flax's ``TrainState`` with
``optax.MultiSteps`` does not.
"""

import functools
import subprocess
import sys
import textwrap

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _flax_data import D_IN, D_OUT, INNER, TOL, K, T, make_windows, microbatches
from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT
from flax.training import train_state as flax_train_state

import masked_multistep as mm

MODEL = nn.Dense(D_OUT)


def loss_fn(params, x, y, mask):
    """Token-mean squared error, and the token count behind it."""
    # The NaN padding must not reach the gradient through `apply` either.
    x = jnp.where(mask[..., None], x, 0.0)
    per_token = jnp.sum((MODEL.apply({"params": params}, x) - y) ** 2, axis=-1)
    return mm.masked_mean(per_token, mask)


grad_fn = jax.value_and_grad(loss_fn, has_aux=True)


@functools.cache
def init_params():
    x = jnp.zeros((1, T, D_IN))
    return jax.jit(MODEL.init)(jax.random.key(0), x)["params"]


@functools.cache
def full_batch_reference():
    """One adamw step per window on the full batch's token-mean loss."""

    @jax.jit
    def step(state, x, y, mask):
        _, grads = grad_fn(state.params, x, y, mask)
        return state.apply_gradients(grads=grads)

    state = flax_train_state.TrainState.create(
        apply_fn=MODEL.apply, params=init_params(), tx=optax.adamw(**INNER)
    )
    for window in make_windows():
        state = step(state, *window)
    return state.params


def make_tx(path):
    mm_tx = mm.MaskedMultiSteps(optax.adamw(**INNER), every_k_schedule=K)
    if path == "fast":
        return mm_tx
    # A transformation without extra-args support in front: the chain drops
    # `count` for it and hands it to MaskedMultiSteps.
    return optax.chain(optax.zero_nans(), mm_tx.gradient_transformation())


@pytest.mark.parametrize("path", ["fast", "chain"])
def test_microbatches_match_one_full_batch_step(path):
    windows = make_windows()
    state = mm.TrainState.create(
        apply_fn=MODEL.apply, params=init_params(), tx=make_tx(path)
    )
    chex.clear_trace_counter()

    @jax.jit
    @chex.assert_max_traces(n=1)  # the state round-trips through jit unchanged
    def step(state, x, y, mask):
        (loss, count), grads = grad_fn(state.params, x, y, mask)
        return state.apply_gradients(grads=grads, count=count, value=loss)

    for w, window in enumerate(windows):
        for i, mb in enumerate(microbatches(window)):
            before = state.params
            state = step(state, *mb)
            assert int(state.mini_step) == (i + 1) % K
            if i < K - 1:
                # Between windows the params do not move at all.
                chex.assert_trees_all_equal(state.params, before, strict=True)
        assert int(state.gradient_step) == w + 1

    assert int(state.step) == 2 * K  # `step` counts microbatches
    expected = full_batch_reference()
    chex.assert_trees_all_close(state.params, expected, strict=True, **TOL)
    # A nonzero update happened, so the comparison is not vacuous.
    assert not np.allclose(state.params["kernel"], init_params()["kernel"])


def test_flax_train_state_with_optax_multisteps_disagrees():
    """The bug: equal-weight averaging of microbatch means is not the token mean."""
    windows = make_windows()
    state = flax_train_state.TrainState.create(
        apply_fn=MODEL.apply,
        params=init_params(),
        tx=optax.MultiSteps(optax.adamw(**INNER), every_k_schedule=K),
    )

    @jax.jit
    def step(state, x, y, mask):
        _, grads = grad_fn(state.params, x, y, mask)
        return state.apply_gradients(grads=grads)

    for window in windows:
        for mb in microbatches(window):
            state = step(state, *mb)
    expected = full_batch_reference()
    error = max(
        float(jnp.max(jnp.abs(a - b)))
        for a, b in zip(
            jax.tree.leaves(state.params), jax.tree.leaves(expected), strict=True
        )
    )
    assert error > 1000 * TOL["atol"], error


class _Recorder(optax.GradientTransformationExtraArgs):
    """Identity on the updates; keeps the `value` and `scale` it was last given."""

    def __new__(cls):
        def init(params):
            del params
            return {"value": jnp.zeros([]), "scale": jnp.zeros([])}

        def update(updates, state, params=None, *, value, scale, **extra):
            del state, params, extra
            return updates, {"value": value, "scale": scale}

        return super().__new__(cls, init, update)


class _Spy(mm.MaskedMultiSteps):
    """Records which entry point `TrainState` used."""

    calls: list[str] = []

    def update(self, *args, **kwargs):
        self.calls.append("update")
        return super().update(*args, **kwargs)

    def apply_gradients(self, *args, **kwargs):
        self.calls.append("apply_gradients")
        return super().apply_gradients(*args, **kwargs)


class _StateWithStats(mm.TrainState):
    batch_stats: dict


@pytest.mark.parametrize("path", ["fast", "chain"])
def test_value_and_extra_args_reach_the_inner_optimizer(path):
    """`value` is token-averaged; `extra_args` are forwarded, fields ``replace``-d.

    The fast path goes through the fused `MaskedMultiSteps.apply_gradients`
    (params untouched between windows), the chain through `update`.
    """
    _Spy.calls = []
    mm_tx = _Spy(_Recorder(), every_k_schedule=3)
    tx = mm_tx if path == "fast" else optax.chain(mm_tx.gradient_transformation())
    state = _StateWithStats.create(
        apply_fn=None, params={"w": jnp.zeros(2)}, tx=tx, batch_stats={"n": 0}
    )

    @jax.jit
    def step(state, loss, count, i):
        return state.apply_gradients(
            grads={"w": jnp.ones(2)},
            count=count,
            value=loss,
            extra_args={"scale": jnp.array(0.5)},
            batch_stats={"n": i + 1},
        )

    losses, counts = [2.0, 7.0, 1.0], [3, 0, 1]
    for i, (loss, count) in enumerate(zip(losses, counts, strict=True)):
        state = step(state, jnp.array(loss), jnp.array(count), jnp.array(i))
    inner = state.opt_state if path == "fast" else state.opt_state[0]
    np.testing.assert_allclose(
        inner.inner_opt_state["value"], (3 * 2.0 + 1 * 1.0) / 4, rtol=1e-6
    )
    assert float(inner.inner_opt_state["scale"]) == 0.5
    assert int(state.batch_stats["n"]) == 3
    assert int(state.step) == 3
    assert _Spy.calls == ["apply_gradients" if path == "fast" else "update"]


def test_missing_count_raises():
    state = mm.TrainState.create(
        apply_fn=None, params=jnp.zeros(2), tx=mm.MaskedMultiSteps(optax.sgd(1.0), 2)
    )
    with pytest.raises(TypeError, match=r"count=None"):
        state.apply_gradients(grads=jnp.ones(2))


def test_gradient_step_needs_one_masked_multisteps_state():
    # Any optax transformation works; it ignores `count`. Without a wrapper
    # anywhere in it nothing accumulates, which `create` warns about.
    with pytest.warns(
        UserWarning,
        match=r"^`tx` holds no mm.MaskedMultiSteps: .*"
        r"updates the params on every call.*microbatched_value_and_grad",
    ):
        state = mm.TrainState.create(
            apply_fn=None, params=jnp.zeros(2), tx=optax.sgd(1)
        )
    state = state.apply_gradients(grads=jnp.ones(2), count=jnp.array(1))
    np.testing.assert_array_equal(state.params, -jnp.ones(2))
    # The error says what `tx` is instead.
    with pytest.raises(
        ValueError,
        match=r"gradient_step reads .* found 0 in a TrainState; this state's `tx` "
        r"is chain\(identity, scale\), no MaskedMultiSteps: .*"
        r"tx=mm.MaskedMultiSteps\(opt, every_k_schedule=k\)`$",
    ):
        state.gradient_step  # noqa: B018
    with pytest.raises(ValueError, match="mini_step reads .* found 0 .* no Masked"):
        state.mini_step  # noqa: B018
    # A wrapper's `tx` beside another state: the state is what is wrong.
    wrapper = mm.MaskedMultiSteps(optax.sgd(1.0), 2)
    other = state.replace(
        tx=wrapper, opt_state=optax.MultiSteps(optax.sgd(1.0), 2).init(state.params)
    )
    with pytest.raises(ValueError, match=r"from_optax_multisteps.*\)`$"):
        other.gradient_step  # noqa: B018


def test_overwrite_with_gradient_params_are_replaced_by_their_gradient():
    params = {
        "params": {"w": jnp.zeros(2)},
        OVERWRITE_WITH_GRADIENT: {"s": jnp.ones(1)},
    }
    grads = {
        "params": {"w": jnp.ones(2)},
        OVERWRITE_WITH_GRADIENT: {"s": jnp.full(1, 7.0)},
    }
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 1)
    state = mm.TrainState.create(apply_fn=None, params=params, tx=tx)
    state = state.apply_gradients(grads=grads, count=jnp.array(3))
    np.testing.assert_array_equal(state.params["params"]["w"], -jnp.ones(2))
    np.testing.assert_array_equal(state.params[OVERWRITE_WITH_GRADIENT]["s"], [7.0])


def test_package_imports_without_flax():
    script = textwrap.dedent(
        """
        import sys
        sys.modules["flax"] = None  # makes `import flax` raise ImportError
        import masked_multistep as mm
        # Without flax `__all__` leaves TrainState out: `import *` works.
        assert "TrainState" not in mm.__all__, mm.__all__
        exec("from masked_multistep import *", {})
        mm.MaskedMultiSteps, mm.masked_mean  # the rest works without flax
        try:
            mm.TrainState
        except ImportError as err:
            assert "which is not installed: `pip install flax`" in str(err), err
        else:
            raise AssertionError("mm.TrainState without flax did not raise")
        try:
            from masked_multistep import TrainState
        except ImportError as err:
            assert "needs flax" in str(err), err
        else:
            raise AssertionError("importing TrainState without flax did not raise")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr


class _NormedNet(nn.Module):
    @nn.compact
    def __call__(self, x, mask):
        h = nn.Dense(8)(x)
        h = nn.BatchNorm(use_running_average=False, momentum=0.9)(
            h, mask=mask[..., None]
        )
        return nn.Dense(1)(nn.relu(h))[..., 0]


def test_linen_batch_stats_as_mean_aux_the_readme_recipe():
    # The README's recipe for linen BatchNorm under microbatched_value_and_grad:
    # the updated statistics as "mean" aux, BatchNorm masked like the loss. The
    # running mean is the full batch's update; the variance the microbatches'
    # (it misses the spread between them); an empty microbatch is left out and
    # an empty batch keeps the old statistics through the `where`.
    model = _NormedNet()
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(8, 6, 3)), jnp.float32)
    mask = jnp.asarray(np.arange(6) < rng.integers(1, 7, size=(8, 1)))
    mask = mask.at[1].set(False).at[5].set(False)  # microbatch 1 (rows 1, 5): empty
    variables = model.init(jax.random.key(0), x, mask)
    params, stats = variables["params"], variables["batch_stats"]

    def loss_fn(params, mb):
        y, new = model.apply(
            {"params": params, "batch_stats": stats},
            mb["x"],
            mb["mask"],
            mutable=["batch_stats"],
        )
        loss, n = mm.masked_mean(y**2, mb["mask"])
        return loss, (n, new["batch_stats"])

    grad_fn = jax.jit(
        mm.microbatched_value_and_grad(loss_fn, 4, has_aux=True, aux_reduction="mean")
    )
    (_, (_, new)), _ = grad_fn(params, {"x": x, "mask": mask})
    full = jax.value_and_grad(loss_fn, has_aux=True)(params, {"x": x, "mask": mask})
    full_new = full[0][1][1]
    np.testing.assert_allclose(
        new["BatchNorm_0"]["mean"], full_new["BatchNorm_0"]["mean"], rtol=1e-5
    )
    var, full_var = new["BatchNorm_0"]["var"], full_new["BatchNorm_0"]["var"]
    assert np.all(np.isfinite(var)) and np.all(var <= full_var * (1 + 1e-5))
    (_, (count, new)), _ = grad_fn(params, {"x": x, "mask": jnp.zeros_like(mask)})
    kept = jax.tree.map(lambda n, o: jnp.where(count > 0, n, o), new, stats)
    chex.assert_trees_all_equal(kept, stats)
