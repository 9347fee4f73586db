"""Reverse-mode derivatives through an empty microbatch or shard.

`jax.grad` through the outputs of `microbatched_value_and_grad` (a
gradient-norm penalty) and of `weighted_mean_across` must be finite and equal
those of a reference that simply leaves the empty microbatch (shard) out.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import masked_multistep as mm

B, T, D = 16, 4, 3
# Rows 1, 5, 9, 13 (microbatch 1 of k = 4; microbatches 1 and 5 of k = 8) and
# rows 4 to 7 (shards 2 and 3 of 8 shards of 2 rows) hold no tokens.
LENGTHS = np.array([4, 0, 1, 3, 0, 0, 0, 0, 4, 0, 2, 3, 1, 0, 4, 2])


def _data():
    rng = np.random.default_rng(0)
    mask = np.arange(T)[None, :] < LENGTHS[:, None]
    x = np.where(mask[..., None], rng.normal(size=(B, T, D)), np.nan)
    batch = {
        "x": jnp.asarray(x, jnp.float32),
        "y": jnp.asarray(rng.normal(size=(B, T)), jnp.float32),
        "mask": jnp.asarray(mask),
    }
    params = {
        "w": jnp.asarray(rng.normal(size=(D, 5)), jnp.float32),
        "v": jnp.asarray(rng.normal(size=(5,)), jnp.float32),
    }
    return params, batch


def _loss(params, mb):
    x = jnp.where(mb["mask"][..., None], mb["x"], 0)
    pred = jnp.tanh(x @ params["w"]) @ params["v"]
    loss, count = mm.masked_mean((pred - mb["y"]) ** 2, mb["mask"])
    small, _ = mm.masked_mean((jnp.abs(pred) < 1).astype(jnp.float32), mb["mask"])
    return loss, (count, {"small": small * jnp.sum(params["v"])})


def _penalty(value_and_grad):
    """loss + ‖grads‖² + aux: a gradient-norm penalty, differentiated below."""

    def objective(params, batch):
        (loss, (_, aux)), grads = value_and_grad(params, batch)
        norm2 = sum(jnp.sum(g**2) for g in jax.tree.leaves(grads))
        return loss + norm2 + aux["small"]

    return objective


def _rows(batch, rows):
    return jax.tree.map(lambda x: x[np.asarray(rows)], batch)


@pytest.mark.parametrize("k", [4, 8])
def test_grad_of_gradient_norm_penalty_skips_the_empty_microbatch(k):
    params, batch = _data()
    grad_fn = mm.microbatched_value_and_grad(
        _loss, k, has_aux=True, aux_reduction="mean"
    )
    got = jax.jit(jax.grad(_penalty(grad_fn)))(params, batch)
    # Reference: the full batch without the empty rows (the same tokens).
    full = jax.value_and_grad(_loss, has_aux=True)
    keep = np.flatnonzero(LENGTHS > 0)
    want = jax.jit(jax.grad(_penalty(full)))(params, _rows(batch, keep))
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(got))
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6, strict=True)


def test_grad_through_weighted_mean_across_skips_the_empty_shard():
    params, batch = _data()
    shards = jax.tree.map(lambda x: x.reshape(8, 2, *x.shape[1:]), batch)

    def objective(params, shards):
        def one(mb):
            (loss, (count, _)), grads = jax.value_and_grad(_loss, has_aux=True)(
                params, mb
            )
            (loss, grads), _ = mm.weighted_mean_across((loss, grads), count, "s")
            return loss + sum(jnp.sum(g**2) for g in jax.tree.leaves(grads))

        return jax.vmap(one, axis_name="s")(shards)[0]

    empty = [2, 3]
    assert (LENGTHS.reshape(8, 2)[empty] == 0).all()
    keep = [s for s in range(8) if s not in empty]
    got = jax.jit(jax.grad(objective))(params, shards)
    want = jax.jit(jax.grad(objective))(params, _rows(shards, keep))
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(got))
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6, strict=True)


def test_grad_with_respect_to_float_counts_ignores_an_empty_nan_shard():
    """d mean / d weights (data-mixture weights, say) with a NaN empty shard."""
    means = jnp.array([1.0, 4.0, jnp.nan, -2.0])
    weights = jnp.array([1.5, 2.0, 0.0, 0.5])

    def mean_of(weights, means):
        mean, _ = jax.vmap(
            lambda g, n: mm.weighted_mean_across(g, n, "s"), axis_name="s"
        )(means, weights)
        return mean[0]

    got = jax.grad(mean_of)(weights, means)
    keep = np.array([0, 1, 3])
    want = jax.grad(mean_of)(weights[keep], means[keep])
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(np.asarray(got)[keep], np.asarray(want), rtol=1e-6)
    # Zero weight: the mean is constant on that side, the derivative 0.
    assert float(got[2]) == 0.0
