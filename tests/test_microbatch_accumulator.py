"""The optax `Accumulator` behind `microbatched_value_and_grad`.

Its four functions are pure (optax's contract): `finalize` depends on the carry
and on static shapes given when the accumulator is built, never on a value an
earlier `init` wrote. `aggregate` folds a stack of values into one, which is
what `optax.microbatching.micro_vmap` calls it for.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax

import masked_multistep as mm
from masked_multistep._microbatch import _token_weighted_accumulator

B, T, D = 16, 4, 3


def _data():
    rng = np.random.default_rng(0)
    lengths = rng.integers(0, T + 1, size=B)
    lengths[:4] = 0  # with micro_vmap's split, microbatch 0 holds no tokens
    mask = np.arange(T)[None, :] < lengths[:, None]
    batch = {
        "x": jnp.asarray(np.where(mask[..., None], rng.normal(size=(B, T, D)), np.nan)),
        "y": jnp.asarray(rng.normal(size=(B, T)), jnp.float32),
        "mask": jnp.asarray(mask),
    }
    batch["x"] = batch["x"].astype(jnp.float32)
    return jnp.asarray(rng.normal(size=(D,)), jnp.float32), batch


def _loss(w, mb):
    x = jnp.where(mb["mask"][..., None], mb["x"], 0)
    loss, count = mm.masked_mean((jnp.tanh(x @ w) - mb["y"]) ** 2, mb["mask"])
    return loss, (count, {"hits": jnp.sum(mb["mask"], dtype=jnp.int32)})


def _value(w, mb):
    """One microbatch's value as the accumulator takes it."""
    (loss, (count, aux)), grads = jax.value_and_grad(_loss, has_aux=True)(w, mb)
    return loss, count, aux, grads


def test_init_does_not_change_what_finalize_returns():
    w, batch = _data()
    shapes = jax.eval_shape(_value, w, batch)
    acc = _token_weighted_accumulator(shapes, ("sum",), True)
    carry = acc.update(acc.init(shapes), _value(w, batch), 0)
    before = acc.finalize(carry)
    # An init for other dtypes in between (a second trace, say) changes nothing.
    low = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.bfloat16), shapes)
    acc.init(low)
    chex.assert_trees_all_equal(acc.finalize(carry), before, strict=True)
    (loss, (count, aux)), grads = before
    assert (loss.dtype, count.dtype, aux["hits"].dtype, grads.dtype) == (
        jnp.float32,
        jnp.float32,
        jnp.int32,
        jnp.float32,
    )


def test_aggregate_under_micro_vmap_gives_the_full_batch_result():
    """micro_vmap folds rows with `aggregate`, then microbatches with `update`."""
    w, batch = _data()
    acc = _token_weighted_accumulator(
        jax.eval_shape(_value, w, jax.tree.map(lambda x: x[0], batch)),
        ("sum",),
        True,
    )
    per_row = optax.microbatching.micro_vmap(
        lambda row: _value(w, row), microbatch_size=4, accumulator=acc
    )
    (loss, (count, aux)), grads = jax.jit(per_row)(batch)
    (f_loss, (f_count, f_aux)), f_grads = jax.value_and_grad(_loss, has_aux=True)(
        w, batch
    )
    assert count.dtype == jnp.float32 and int(count) == int(f_count)
    assert int(aux["hits"]) == int(f_aux["hits"])
    np.testing.assert_allclose(float(loss), float(f_loss), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grads), np.asarray(f_grads), rtol=1e-5)


def test_aggregate_returns_one_value_of_the_same_structure():
    w, batch = _data()
    stacked = jax.vmap(lambda row: _value(w, row))(batch)
    acc = _token_weighted_accumulator(
        jax.eval_shape(_value, w, jax.tree.map(lambda x: x[0], batch)),
        ("sum",),
        True,
    )
    loss, count, aux, grads = acc.aggregate(stacked)
    counts = np.asarray(stacked[1], np.float64)
    ok = counts > 0
    want = np.sum(counts[ok] * np.asarray(stacked[0], np.float64)[ok]) / counts.sum()
    np.testing.assert_allclose(float(loss), want, rtol=1e-6)
    assert float(count) == counts.sum()
    assert int(aux["hits"]) == int(np.asarray(stacked[2]["hits"]).sum())
    assert grads.shape == w.shape and grads.dtype == w.dtype
