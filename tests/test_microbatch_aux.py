"""`microbatched_value_and_grad(..., has_aux=True)`: how aux leaves combine.

Flax's examples return metric *sums* as aux; a token-weighted mean of a sum is
silently wrong, so a floating leaf needs `aux_reduction` ("sum" or "mean").
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import masked_multistep as mm

B, T = 8, 4
K = 4
LENGTHS = np.array([4, 0, 1, 3, 2, 0, 4, 1])  # microbatch 1 (rows 1, 5) is empty


def _batch():
    rng = np.random.default_rng(0)
    mask = np.arange(T)[None, :] < LENGTHS[:, None]
    return {
        "x": jnp.asarray(rng.normal(size=(B, T)), jnp.float32),
        "y": jnp.asarray(rng.normal(size=(B, T)), jnp.float32),
        "mask": jnp.asarray(mask),
    }


def _flax_style_loss(w, mb):
    """Returns the loss and, like Flax's lm1b/wmt examples, metric sums."""
    per_token = (w * mb["x"] - mb["y"]) ** 2
    weights = mb["mask"].astype(jnp.float32)
    correct = (jnp.abs(w * mb["x"] - mb["y"]) < 1).astype(jnp.float32)
    metrics = {
        "loss": jnp.sum(per_token * weights),
        "accuracy": jnp.sum(correct * weights),
        "denominator": jnp.sum(weights),
        "rows": jnp.float32(mb["x"].shape[0]),  # rows, whatever their tokens
    }
    loss, count = mm.masked_mean(per_token, mb["mask"])
    return loss, (count, metrics)


def test_metric_sums_come_back_as_full_batch_sums():
    batch, w = _batch(), jnp.array(0.7)
    grad_fn = mm.microbatched_value_and_grad(
        _flax_style_loss, K, has_aux=True, aux_reduction="sum"
    )
    (loss, (count, metrics)), grad = jax.jit(grad_fn)(w, batch)
    (f_loss, (f_count, f_metrics)), f_grad = jax.value_and_grad(
        _flax_style_loss, has_aux=True
    )(w, batch)
    chex.assert_trees_all_close(metrics, f_metrics, rtol=1e-6, strict=True)
    assert float(metrics["rows"]) == B  # the empty microbatch's rows count too
    np.testing.assert_allclose(float(loss), float(f_loss), rtol=1e-6)
    np.testing.assert_allclose(float(grad), float(f_grad), rtol=1e-6)
    assert int(count) == int(f_count)
    # The loss is the loss sum over its denominator, as in Flax's examples.
    np.testing.assert_allclose(
        float(metrics["loss"] / metrics["denominator"]), float(loss), rtol=1e-6
    )


def test_float_aux_without_aux_reduction_is_a_clear_error():
    grad_fn = mm.microbatched_value_and_grad(_flax_style_loss, K, has_aux=True)
    with pytest.raises(
        TypeError,
        match=r"aux\['accuracy'\] is floating \(float32\): say how it combines .*"
        r"`aux_reduction`: 'mean' .*'sum'",
    ):
        grad_fn(jnp.array(0.7), _batch())


def test_prefix_mixes_sums_and_means_and_integers_sum_by_default():
    batch, w = _batch(), jnp.array(0.7)

    def loss_fn(w, mb):
        loss, (count, metrics) = _flax_style_loss(w, mb)
        hits = jnp.abs(w * mb["x"] - mb["y"]) < 1
        accuracy, _ = mm.masked_mean(hits.astype(jnp.bfloat16), mb["mask"])
        num_hits = jnp.sum(hits & mb["mask"], dtype=jnp.int32)
        return loss, (count, (metrics, {"accuracy": accuracy, "hits": num_hits}))

    grad_fn = mm.microbatched_value_and_grad(
        loss_fn, K, has_aux=True, aux_reduction=("sum", {"accuracy": "mean"})
    )
    with pytest.raises(ValueError, match=r"`aux_reduction` must be 'sum', 'mean'"):
        grad_fn(w, batch)  # {"accuracy"} is not a prefix of the second dict
    grad_fn = mm.microbatched_value_and_grad(
        loss_fn,
        K,
        has_aux=True,
        aux_reduction=("sum", {"accuracy": "mean", "hits": "sum"}),
    )
    (_, (_, (metrics, means))), _ = jax.jit(grad_fn)(w, batch)
    (_, (_, (f_metrics, f_means))), _ = jax.value_and_grad(loss_fn, has_aux=True)(
        w, batch
    )
    chex.assert_trees_all_close(metrics, f_metrics, rtol=1e-6, strict=True)
    assert means["hits"].dtype == jnp.int32
    assert int(means["hits"]) == int(f_means["hits"])
    assert means["accuracy"].dtype == jnp.float32  # masked_mean promotes bf16
    np.testing.assert_allclose(
        float(means["accuracy"]), float(f_means["accuracy"]), rtol=1e-6
    )


def test_low_precision_sums_accumulate_in_float32():
    """2048 microbatches adding 1 to a bfloat16 sum: bfloat16 itself stops at 256."""
    k = 2048

    def loss_fn(w, mb):
        return w * jnp.sum(mb), (jnp.array(1), jnp.ones((), jnp.bfloat16))

    grad_fn = mm.microbatched_value_and_grad(
        loss_fn, k, has_aux=True, aux_reduction="sum"
    )
    (_, (count, total)), _ = jax.jit(grad_fn)(jnp.array(1.0), jnp.ones(k))
    assert total.dtype == jnp.float32 and float(total) == 2048.0
    assert float(count) == k


def test_narrow_integer_sums_do_not_wrap():
    """Each microbatch's int8 count fits; the total of 8 × 100 does not: it is
    summed and returned in the dtype jnp.sum gives (it came back as 32)."""

    def loss_fn(w, mb):
        aux = {
            "int8": jnp.sum(mb, dtype=jnp.int8),
            "uint8": jnp.sum(mb).astype(jnp.uint8),
            "int16": jnp.sum(mb * 50, dtype=jnp.int16),
            "int32": jnp.sum(mb, dtype=jnp.int32),
        }
        return w * jnp.mean(mb), (jnp.sum(mb, dtype=jnp.float32), aux)

    grad_fn = mm.microbatched_value_and_grad(loss_fn, 8, has_aux=True)
    (_, (_, sums)), _ = jax.jit(grad_fn)(jnp.array(1.0), jnp.ones(800, jnp.int8))
    assert {k: (int(v), v.dtype) for k, v in sums.items()} == {
        "int8": (800, jnp.int32),
        "uint8": (800, jnp.uint32),
        "int16": (40_000, jnp.int32),
        "int32": (800, jnp.int32),
    }


def test_low_precision_float_sums_come_back_in_float32():
    """8 × 10000 overflows float16 (65504): the sum comes back as float32."""

    def loss_fn(w, mb):
        return w * jnp.mean(mb), (jnp.float32(mb.size), jnp.float16(10_000))

    grad_fn = mm.microbatched_value_and_grad(
        loss_fn, 8, has_aux=True, aux_reduction="sum"
    )
    (_, (_, total)), _ = jax.jit(grad_fn)(jnp.array(1.0), jnp.ones(8))
    assert total.dtype == jnp.float32 and float(total) == 80_000.0


def test_python_scalars_in_aux():
    """A Python float is a float32 leaf, a Python int an int32 leaf."""

    def loss_fn(w, mb):
        loss, count = mm.masked_mean(w * mb["x"], mb["mask"])
        return loss, (count, {"scale": 0.5, "calls": 1, "tokens": count})

    grad_fn = mm.microbatched_value_and_grad(
        loss_fn, K, has_aux=True, aux_reduction={"scale": "mean", "calls": "sum"}
    )
    with pytest.raises(ValueError, match=r"`aux_reduction` must be 'sum', 'mean'"):
        jax.jit(grad_fn)(jnp.array(2.0), _batch())
    grad_fn = mm.microbatched_value_and_grad(
        loss_fn,
        K,
        has_aux=True,
        aux_reduction={"scale": "mean", "calls": "sum", "tokens": "sum"},
    )
    (_, (count, aux)), _ = jax.jit(grad_fn)(jnp.array(2.0), _batch())
    assert (aux["scale"].dtype, float(aux["scale"])) == (jnp.float32, 0.5)
    assert (aux["calls"].dtype, int(aux["calls"])) == (jnp.int32, K)
    assert (aux["tokens"].dtype, int(aux["tokens"])) == (jnp.int32, LENGTHS.sum())
    assert int(count) == LENGTHS.sum()

    summed = mm.microbatched_value_and_grad(
        lambda w, mb: (w * jnp.sum(mb), (1, (1, 0.25))),
        K,
        has_aux=True,
        aux_reduction="sum",
    )
    (_, (_, (calls, quarter))), _ = jax.jit(summed)(jnp.array(1.0), jnp.ones(B))
    assert (calls.dtype, int(calls)) == (jnp.int32, K)
    assert (quarter.dtype, float(quarter)) == (jnp.float32, 0.25 * K)


@pytest.mark.parametrize(
    ("aux", "reduction", "error", "match"),
    [
        (
            {"n": jnp.array(3)},
            {"n": "mean"},
            TypeError,
            r"aux\['n'\] is an integer \(int32\) but `aux_reduction` says 'mean'",
        ),
        (True, "sum", TypeError, r"`aux` leaves must be .*got the bool True at aux"),
        (
            {"big": 2**40},
            "sum",
            ValueError,
            r"Python int 1099511627776 at aux\['big'\] does not fit in int32",
        ),
        (
            # Was wrapped silently by jax (2**33 summed to 0).
            {"big": np.int64(2**33)},
            "sum",
            ValueError,
            r"^The int64 `aux` leaf at aux\['big'\] holds values beyond int32",
        ),
        (
            {"big": np.array([1, 2**32], np.uint64)},
            "sum",
            ValueError,
            r"uint64 `aux` leaf at aux\['big'\] holds values beyond uint32",
        ),
        (
            {"c": jnp.array(1j)},
            "sum",
            TypeError,
            r"`aux` leaves must be floating or integer arrays, got dtype complex64 "
            r"at aux\['c'\]",
        ),
        (
            {"name": "relu"},
            "sum",
            TypeError,
            r"`aux` leaves must be floating or integer arrays, got str 'relu' "
            r"at aux\['name'\]",
        ),
    ],
)
def test_bad_aux_leaves_at_call(aux, reduction, error, match):
    grad_fn = mm.microbatched_value_and_grad(
        lambda w, mb: (w * jnp.sum(mb), (jnp.array(1), aux)),
        2,
        has_aux=True,
        aux_reduction=reduction,
    )
    with pytest.raises(error, match=match):
        grad_fn(jnp.array(1.0), jnp.ones(4))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"has_aux": True, "aux_reduction": "avg"},
            ValueError,
            r"`aux_reduction` leaves must be 'sum' or 'mean', got 'avg' at "
            r"aux_reduction$",
        ),
        (
            {"has_aux": True, "aux_reduction": {"a": "sum", "b": 1}},
            TypeError,
            r"must be 'sum' or 'mean', got 1 of type int at aux_reduction\['b'\]",
        ),
        (
            {"aux_reduction": "sum"},
            ValueError,
            r"`aux_reduction` .* needs has_aux=True",
        ),
    ],
)
def test_bad_aux_reduction_at_construction(kwargs, error, match):
    with pytest.raises(error, match=match):
        mm.microbatched_value_and_grad(lambda w, mb: (w, 1), 2, **kwargs)


def test_a_numpy_float64_scalar_keeps_its_dtype_under_x64():
    # np.float64 is a Python float subclass: it was taken for one, made
    # float32, and its sum rounded (numpy int64 and 0-d arrays kept theirs).
    value = 1.0 + 2.0**-30

    def loss_fn(w, mb):
        loss, count = mm.masked_mean(w * mb["x"], mb["mask"])
        return loss, (
            count,
            {
                "scalar": np.float64(value),
                "array": np.array(value),
                # (jax takes no longdouble: its float64 value; it was jax's
                # error, naming no leaf.)
                "longdouble": np.longdouble(value),
            },
        )

    grad_fn = mm.microbatched_value_and_grad(
        loss_fn, K, has_aux=True, aux_reduction="sum"
    )
    with jax.enable_x64(True):
        (_, (_, aux)), _ = jax.jit(grad_fn)(jnp.array(2.0), _batch())
        for leaf in aux.values():
            assert leaf.dtype == jnp.float64
            assert float(leaf) == K * value
