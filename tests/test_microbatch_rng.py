"""Per-microbatch randomness: `grad_fn(params, batch, rng=key)`.

Microbatch j's `loss_fn` gets `rng=jax.random.fold_in(key, j)`: its own
dropout masks, reproducible for a given key.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import masked_multistep as mm

B, D, K = 16, 6, 4


def _dropout_loss(w, mb, rng):
    """Row r's loss is Σ_d w[r, d]·keep[r, d]: its gradient is the dropout mask."""
    keep = jax.random.bernoulli(rng, 0.5, (mb["row"].shape[0], D))
    per_row = jnp.sum(w[mb["row"]] * keep, axis=-1)
    return mm.masked_mean(per_row, jnp.ones_like(per_row, bool))


def _grad_fn():
    return jax.jit(mm.microbatched_value_and_grad(_dropout_loss, K))


@pytest.mark.parametrize("make_key", [jax.random.key, jax.random.PRNGKey])
def test_each_microbatch_draws_its_own_masks(make_key):
    key = make_key(3)
    w = jnp.ones((B, D))
    batch = {"row": jnp.arange(B)}
    (_, count), grads = _grad_fn()(w, batch, rng=key)
    assert int(count) == B
    masks = np.asarray(grads) * B > 0.5  # the gradient of row r is keep / B
    for j in range(K):
        want = jax.random.bernoulli(jax.random.fold_in(key, j), 0.5, (B // K, D))
        np.testing.assert_array_equal(masks[j::K], np.asarray(want))
    # The masks differ across microbatches (one shared key would repeat them).
    assert len({masks[j::K].tobytes() for j in range(K)}) == K


def test_same_key_same_result_other_key_other_result():
    w = jnp.asarray(np.random.default_rng(0).normal(size=(B, D)), jnp.float32)
    batch = {"row": jnp.arange(B)}
    one = _grad_fn()(w, batch, rng=jax.random.key(7))
    again = _grad_fn()(w, batch, rng=jax.random.key(7))
    other = _grad_fn()(w, batch, rng=jax.random.key(8))
    chex.assert_trees_all_equal(one, again)
    assert not np.array_equal(np.asarray(one[1]), np.asarray(other[1]))


def test_without_rng_loss_fn_gets_two_arguments():
    calls = []

    def loss_fn(w, mb, *extra, **kwargs):
        calls.append((len(extra), sorted(kwargs)))
        return mm.masked_mean(w * mb, jnp.ones_like(mb, bool))

    mm.microbatched_value_and_grad(loss_fn, 2)(jnp.array(1.0), jnp.ones(4))
    assert calls and all(c == (0, []) for c in calls)
    calls.clear()
    mm.microbatched_value_and_grad(loss_fn, 2)(
        jnp.array(1.0), jnp.ones(4), rng=jax.random.key(0)
    )
    assert calls and all(c == (0, ["rng"]) for c in calls)


def test_a_loss_fn_that_needs_rng_called_without_it_gets_a_note_saying_how():
    # Python's own error named the missing argument; the note said only how
    # the batch was split, as if the shapes were wrong.
    grad_fn = mm.microbatched_value_and_grad(_dropout_loss, 2)
    with pytest.raises(TypeError, match="missing 1 required positional") as err:
        grad_fn(jnp.ones((4, D)), {"row": jnp.arange(4)})
    note = "\n".join(err.value.__notes__)
    assert "requires an `rng` argument" in note, note
    assert "grad_fn(params, batch, rng=key)" in note, note
    assert "num_microbatches=" not in note, note

    # A loss_fn that fails for another reason keeps the note on the shapes.
    def broken(w, mb, rng=None):
        raise TypeError("something else")

    with pytest.raises(TypeError, match="something else") as err:
        mm.microbatched_value_and_grad(broken, 2)(jnp.ones((4, D)), jnp.ones(4))
    note = "\n".join(err.value.__notes__)
    assert "num_microbatches=2 splits" in note and "`rng`" not in note, note


def test_rng_errors():
    grad_fn = mm.microbatched_value_and_grad(
        lambda w, mb: mm.masked_mean(w * mb, jnp.ones_like(mb, bool)), 2
    )
    with pytest.raises(TypeError, match=r"called with `rng`.*does not accept an `rng`"):
        grad_fn(jnp.array(1.0), jnp.ones(4), rng=jax.random.key(0))
    grad_fn = mm.microbatched_value_and_grad(_dropout_loss, 2)
    with pytest.raises(TypeError, match=r"takes the PRNG key as a keyword.*rng=key"):
        grad_fn(jnp.ones((4, D)), {"row": jnp.arange(4)}, jax.random.key(0))
    with pytest.raises(TypeError, match=r"takes the PRNG key as a keyword.*rng=key"):
        grad_fn(jnp.ones((4, D)), {"row": jnp.arange(4)}, jax.random.PRNGKey(0))
    # Another name for the key, or a misspelt `rng`: Python's error named
    # `_grad_fn.<locals>.grad_fn()` and said nothing of `rng=`.
    for name in ("key", "rngs"):
        with pytest.raises(TypeError, match=rf"{name!r}: a PRNG key goes in grad_fn"):
            grad_fn(jnp.ones((4, D)), {"row": jnp.arange(4)}, **{name: 0})
    with pytest.raises(TypeError, match=r"'rgn': did you mean 'rng'\?"):
        grad_fn(jnp.ones((4, D)), {"row": jnp.arange(4)}, rgn=0)
    # Data as more arguments (it said "takes the PRNG key as a keyword").
    with pytest.raises(
        TypeError, match=r"got 2 more positional .*pack the batch's arrays into one"
    ):
        grad_fn(jnp.ones((4, D)), jnp.arange(4), jnp.ones(4), jnp.ones(4))
    with pytest.raises(TypeError, match=r"`rng` must be a single PRNG key.*float32"):
        grad_fn(jnp.ones((4, D)), {"row": jnp.arange(4)}, rng=jnp.ones(2))
    with pytest.raises(TypeError, match=r"`rng` must be a single PRNG key.*\(2,\)"):
        grad_fn(
            jnp.ones((4, D)),
            {"row": jnp.arange(4)},
            rng=jax.random.split(jax.random.key(0)),
        )
    # A raw key of another size (two raw keys end to end) is named here, not
    # inside jax.random.fold_in.
    with pytest.raises(TypeError, match=r"`rng` must be .*raw keys of shape \(2,\)"):
        grad_fn(jnp.ones((4, D)), {"row": jnp.arange(4)}, rng=jnp.zeros(4, jnp.uint32))
    # A seed passed as a string is named, not jax's conversion error.
    with pytest.raises(TypeError, match=r"`rng` must be a PRNG key .*got str"):
        grad_fn(jnp.ones((4, D)), {"row": jnp.arange(4)}, rng="0")
