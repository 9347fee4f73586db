"""Against optax.MultiSteps: wrong with masks, identical with equal counts."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import masked_multistep as mm


def test_optax_multisteps_is_wrong_with_masks_and_this_is_right():
    # Three microbatches holding 2, 6 and 24 real tokens; per token the loss is
    # 0.5 * (w - x)^2, so a microbatch's mean gradient at w = 0 is -mean(x).
    counts = [2, 6, 24]
    token_values = [np.full(n, x) for n, x in zip(counts, [1.0, 10.0, 100.0])]
    microbatch_grads = [-float(v.mean()) for v in token_values]
    full_batch_grad = -float(np.concatenate(token_values).mean())
    assert full_batch_grad == pytest.approx(-76.9375)

    def run(tx, **kw):
        params = jnp.zeros(())
        state = tx.init(params)
        for g, n in zip(microbatch_grads, counts):
            updates, state = tx.update(
                jnp.float32(g), state, params, **({"count": jnp.int32(n)} | kw)
            )
        return float(updates)

    sgd = optax.sgd(-1.0)  # updates == accumulated gradient
    optax_grad = run(optax.MultiSteps(sgd, 3))
    masked_grad = run(mm.MaskedMultiSteps(sgd, 3))
    assert optax_grad == pytest.approx(-37.0)  # mean of means: 52% off
    assert abs(optax_grad - full_batch_grad) / abs(full_batch_grad) > 0.5
    assert masked_grad == pytest.approx(full_batch_grad, rel=1e-6)


INNERS = {
    "sgd": lambda: optax.sgd(0.1),
    "momentum": lambda: optax.sgd(0.1, momentum=0.9),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=1e-3),
    "clip_adam": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)),
}


def _grads(rng, params, dtype):
    return jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), dtype), params)


F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16


@pytest.mark.parametrize(
    "inner,grad_dtype,param_dtype",
    [(name, F32, F32) for name in sorted(INNERS)]
    + [("adamw", g, p) for g, p in [(BF16, F32), (F16, F32), (F16, F16), (BF16, BF16)]]
    + [("clip_adam", BF16, F32), ("momentum", F16, F16)],
)
def test_equal_counts_match_optax_multisteps(inner, grad_dtype, param_dtype):
    k, windows = 3, 3
    rng = np.random.default_rng(0)
    params0 = {
        "w": jnp.asarray(rng.normal(size=(4, 3)), param_dtype),
        "b": jnp.zeros((3,), param_dtype),
    }
    ours = mm.MaskedMultiSteps(INNERS[inner](), k)
    theirs = optax.MultiSteps(INNERS[inner](), k, use_grad_mean=True)

    def step(tx, extra):
        def f(grads, state, params):
            updates, state = tx.update(grads, state, params, **extra)
            return updates, state, optax.apply_updates(params, updates)

        return jax.jit(f)

    ours_step = step(ours, {"count": jnp.int32(7)})
    theirs_step = step(theirs, {})
    p_ours, p_theirs = params0, params0
    s_ours, s_theirs = ours.init(params0), theirs.init(params0)
    for _ in range(k * windows):
        grads = _grads(rng, params0, grad_dtype)
        u_ours, s_ours, p_ours = ours_step(grads, s_ours, p_ours)
        u_theirs, s_theirs, p_theirs = theirs_step(grads, s_theirs, p_theirs)
        # Same arithmetic (running mean, divided by the exact step count); XLA
        # may fuse the inner optimizer differently, so allow a few ulps.
        jax.tree.map(
            lambda a, b: (_same_aval(a, b), _close_ulps(a, b)),
            (u_ours, p_ours, s_ours.inner_opt_state),
            (u_theirs, p_theirs, s_theirs.inner_opt_state),
        )
        assert int(s_ours.mini_step) == int(s_theirs.mini_step)
        assert int(s_ours.gradient_step) == int(s_theirs.gradient_step)
        assert bool(ours.has_updated(s_ours)) == bool(theirs.has_updated(s_theirs))
    assert int(s_ours.gradient_step) == windows


def _close_ulps(a, b, ulps=4):
    a, b = jnp.asarray(a), jnp.asarray(b)
    eps = float(jnp.finfo(a.dtype).eps) if jnp.issubdtype(a.dtype, jnp.floating) else 0
    np.testing.assert_allclose(
        np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=ulps * eps, atol=eps
    )


def _same_aval(a, b):
    assert jnp.asarray(a).dtype == jnp.asarray(b).dtype
    assert jnp.shape(a) == jnp.shape(b)


def test_equal_counts_match_optax_multisteps_under_scan():
    k, steps = 4, 12
    params = {"w": jnp.ones((5,)), "v": jnp.arange(3.0)}
    grads = jax.tree.map(
        lambda p: jax.random.normal(jax.random.key(1), (steps, *p.shape)), params
    )
    ours = mm.MaskedMultiSteps(optax.adam(0.1), k)
    theirs = optax.MultiSteps(optax.adam(0.1), k)

    def train(tx, extra):
        def body(carry, g):
            params, state = carry
            updates, state = tx.update(g, state, params, **extra)
            params = optax.apply_updates(params, updates)
            return (params, state), (tx.has_updated(state), state.gradient_step)

        return jax.jit(lambda p: jax.lax.scan(body, (p, tx.init(p)), grads))(params)

    (p_ours, _), (upd_ours, gs_ours) = train(ours, {"count": jnp.int32(5)})
    (p_theirs, _), (upd_theirs, gs_theirs) = train(theirs, {})
    jax.tree.map(_close_ulps, p_ours, p_theirs)
    np.testing.assert_array_equal(upd_ours, upd_theirs)
    np.testing.assert_array_equal(gs_ours, gs_theirs)
    assert int(np.sum(upd_ours)) == steps // k


def test_equal_counts_running_mean_is_optax_multisteps_bit_for_bit():
    # With equal counts the running mean, compiled, is optax.MultiSteps'
    # `acc + (g - acc) / j` to the bit, inside a window (j = 1 .. 15, most not
    # powers of two) and in every leaf: what makes a mid-window
    # `mm.from_optax_multisteps` switch end the window exactly as if
    # MaskedMultiSteps had run all along. (Both rely on XLA compiling the
    # division by the broadcast scalar j alike; run op by op, outside `jit`,
    # optax's division by an integer scalar rounds differently in the last bit.)
    k = 16
    params = {
        "w": jnp.zeros((33, 7)),
        "b": jnp.zeros((5,)),
        "s": jnp.zeros(()),
        "h": jnp.zeros((9,), jnp.bfloat16),
    }
    ours = mm.MaskedMultiSteps(optax.sgd(0.1), k)
    theirs = optax.MultiSteps(optax.sgd(0.1), k)
    step_ours = jax.jit(lambda g, s: ours.update(g, s, params, count=jnp.int32(3))[1])
    step_theirs = jax.jit(lambda g, s: theirs.update(g, s, params)[1])
    s_ours, s_theirs = ours.init(params), theirs.init(params)
    for i in range(k - 1):
        keys = jax.random.split(jax.random.key(i), 4)
        grads = {
            name: (10.0 * jax.random.normal(key, p.shape)).astype(p.dtype)
            for key, (name, p) in zip(keys, sorted(params.items()))
        }
        s_ours, s_theirs = step_ours(grads, s_ours), step_theirs(grads, s_theirs)
        for name in params:
            np.testing.assert_array_equal(
                np.asarray(s_ours.acc_grads[name], np.float32),
                np.asarray(s_theirs.acc_grads[name], np.float32),
                err_msg=f"leaf {name} after microbatch {i + 1}",
            )
