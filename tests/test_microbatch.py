"""`microbatched_value_and_grad`: k microbatches in one jitted call equal the batch.

Checked against `jax.value_and_grad` of the full batch's masked mean loss and,
where the split matters, against a float64 numpy fold over `batch[j::k]`.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import masked_multistep as mm

B, D, H = 16, 3, 5


def _params(dtype=jnp.float32):
    rng = np.random.default_rng(0)
    return {
        "w1": jnp.asarray(rng.normal(size=(D, H)), dtype),
        "b1": jnp.asarray(rng.normal(size=(1, 1, H)), dtype),
        "w2": jnp.asarray(rng.normal(size=(H,)), dtype),
    }


def _batch(mask):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(B, 4, D)).astype(np.float32)
    # Masked-out tokens hold NaN: they must never reach the result.
    x = np.where(np.asarray(mask)[..., None], x, np.nan)
    return {
        "x": jnp.asarray(x),
        "y": jnp.asarray(rng.normal(size=(B, 4)), jnp.float32),
        "mask": jnp.asarray(mask),
    }


def _skewed_mask(k):
    """Per-row token counts from 0 to 4; with k = 4 microbatch 1 is all-masked."""
    lengths = np.array([4, 0, 1, 3, 2, 0, 4, 1, 4, 0, 2, 3, 1, 0, 4, 2])
    if k == 4:
        assert (lengths[1::4] == 0).all()
    return np.arange(4)[None, :] < lengths[:, None]


def _model(params, x):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return h @ params["w2"]


def _loss(params, mb):
    pred = _model(params, jnp.where(mb["mask"][..., None], mb["x"], 0))
    return mm.masked_mean((pred - mb["y"]) ** 2, mb["mask"])


_TRACES = []


def _naive_loss(params, mb):
    """The mean as sum / count: 0/0 = NaN for an all-masked microbatch."""
    _TRACES.append(None)
    pred = _model(params, jnp.where(mb["mask"][..., None], mb["x"], 0))
    err = jnp.where(mb["mask"], (pred - mb["y"]) ** 2, 0.0)
    count = jnp.sum(mb["mask"], dtype=jnp.int32)
    return jnp.sum(err) / count, count


@functools.cache
def _grad_fn(k):
    return jax.jit(mm.microbatched_value_and_grad(_naive_loss, k))


@functools.cache
def _full_grad_fn():
    return jax.jit(_with_float_count(jax.value_and_grad(_loss, has_aux=True)))


def _with_float_count(value_and_grad):
    """``jax.value_and_grad``'s int32 count as the float32 total returned here."""

    def wrapped(*args):
        (loss, count), grads = value_and_grad(*args)
        return (loss, count.astype(jnp.float32)), grads

    return wrapped


@pytest.mark.parametrize("k", [1, 4, 8])
def test_equals_full_batch_value_and_grad(k):
    params, batch = _params(), _batch(_skewed_mask(k))
    full = _full_grad_fn()(params, batch)
    out = _grad_fn(k)(params, batch)
    (loss, count), grads = out
    assert count.dtype == jnp.float32 and count.shape == ()
    assert int(count) == int(np.sum(_skewed_mask(k)))
    assert np.isfinite(float(loss))
    chex.assert_trees_all_close(out, full, rtol=2e-6, atol=1e-6, strict=True)


def test_aux_mean_is_token_weighted_and_int_is_summed():
    mask = _skewed_mask(4)
    params, batch = _params(), _batch(mask)

    def loss_fn(params, mb):
        loss, count = _loss(params, mb)
        pred = _model(params, jnp.where(mb["mask"][..., None], mb["x"], 0))
        hit = jnp.abs(pred - mb["y"]) < 1.0
        accuracy, _ = mm.masked_mean(hit.astype(jnp.float32), mb["mask"])
        aux = {
            "accuracy": accuracy,
            "num_hits": jnp.sum(hit & mb["mask"], dtype=jnp.int32),
            "per_feature": jnp.full((2,), accuracy, jnp.bfloat16),
        }
        return loss, (count, aux)

    (loss, (count, aux)), grads = jax.jit(
        mm.microbatched_value_and_grad(
            loss_fn,
            4,
            has_aux=True,
            aux_reduction={
                "accuracy": "mean",
                "num_hits": "sum",
                "per_feature": "mean",
            },
        )
    )(params, batch)
    (f_loss, (f_count, f_aux)), f_grads = jax.jit(
        jax.value_and_grad(loss_fn, has_aux=True)
    )(params, batch)
    chex.assert_trees_all_close(
        ((loss, count), grads),
        ((f_loss, f_count.astype(jnp.float32)), f_grads),
        rtol=2e-6,
        strict=True,
    )
    # Full-batch values: a masked-mean metric and a summed integer count.
    chex.assert_trees_all_close(
        aux["accuracy"], f_aux["accuracy"], rtol=1e-6, strict=True
    )
    assert aux["num_hits"].dtype == jnp.int32
    assert int(aux["num_hits"]) == int(f_aux["num_hits"])
    assert aux["per_feature"].dtype == jnp.bfloat16
    assert aux["per_feature"].shape == (2,)
    chex.assert_trees_all_close(
        aux["per_feature"].astype(jnp.float32),
        f_aux["accuracy"] * jnp.ones(2),
        rtol=1e-2,
    )


def test_microbatch_j_is_strided_rows():
    """A loss that is non-linear in the microbatch reveals the documented split."""
    k = 4
    rng = np.random.default_rng(2)
    values = rng.normal(size=(B, 3)).astype(np.float32)
    mask = rng.random((B, 3)) < 0.6
    mask[1::k] = False  # one empty microbatch under the strided split

    def loss_fn(w, mb):
        mean, count = mm.masked_mean(mb["v"] * w, mb["m"])
        return mean**2, count

    (loss, count), grad = jax.jit(mm.microbatched_value_and_grad(loss_fn, k))(
        jnp.array(1.5), {"v": jnp.asarray(values), "m": jnp.asarray(mask)}
    )
    # float64 reference: token-weighted mean of (w·mean_j)² over batch[j::k].
    v64, w = values.astype(np.float64), 1.5
    counts = np.array([mask[j::k].sum() for j in range(k)])
    means = np.array(
        [v64[j::k][mask[j::k]].mean() if counts[j] else np.nan for j in range(k)]
    )
    ok = counts > 0
    ref_loss = np.sum(counts[ok] * (w * means[ok]) ** 2) / counts.sum()
    ref_grad = np.sum(counts[ok] * 2 * w * means[ok] ** 2) / counts.sum()
    assert int(count) == mask.sum()
    np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5)
    np.testing.assert_allclose(float(grad), ref_grad, rtol=1e-5)
    # A contiguous split gives a different loss: the test can tell them apart.
    contiguous = [v64[j * 4 : (j + 1) * 4][mask[j * 4 : (j + 1) * 4]] for j in range(k)]
    other = sum(len(c) * (w * c.mean()) ** 2 for c in contiguous if len(c))
    assert abs(other / counts.sum() - ref_loss) > 1e-3


def test_all_masked_batch_gives_zeros():
    params, batch = _params(), _batch(np.zeros((B, 4), bool))
    (loss, count), grads = _grad_fn(4)(params, batch)
    chex.assert_trees_all_close(
        ((loss, count), grads),
        (
            (jnp.zeros(()), jnp.zeros((), jnp.float32)),
            jax.tree.map(jnp.zeros_like, params),
        ),
        strict=True,
    )


def test_dtypes_follow_loss_fn_and_float_counts():
    """bf16 params give bf16 grads (means kept in float32); float weights sum."""
    params = _params(jnp.bfloat16)
    mask = _skewed_mask(4)
    batch = _batch(mask)
    weights = jnp.asarray(np.where(mask, 0.5, 0.0), jnp.float32)

    def loss_fn(params, mb):
        pred = _model(params, jnp.where(mb["mask"][..., None], mb["x"], 0))
        return mm.masked_mean((pred - mb["y"]) ** 2, mb["w"])

    (loss, count), grads = jax.jit(mm.microbatched_value_and_grad(loss_fn, 4))(
        params, {**batch, "w": weights}
    )
    assert loss.dtype == jnp.float32 and count.dtype == jnp.float32
    assert float(count) == 0.5 * mask.sum()
    for g, p in zip(jax.tree.leaves(grads), jax.tree.leaves(params), strict=True):
        assert (g.dtype, g.shape) == (p.dtype, p.shape)
    (f_loss, _), f_grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(
        params, {**batch, "w": weights}
    )
    chex.assert_trees_all_close(grads, f_grads, rtol=2e-2, atol=2e-2, strict=True)
    np.testing.assert_allclose(float(loss), float(f_loss), rtol=1e-2)


def test_no_retrace_on_new_batch_values():
    params = _params()
    _grad_fn(4)(params, _batch(_skewed_mask(4)))
    traced = len(_TRACES)
    _grad_fn(4)(params, _batch(np.ones((B, 4), bool)))
    assert traced > 0 and len(_TRACES) == traced


@pytest.mark.default_emitters
def test_temp_memory_scales_with_the_microbatch():
    """A wide activation-heavy MLP: 8 microbatches need far less scratch memory."""
    batch_size, d_in, width = 4096, 8, 256
    params = {
        "w1": jax.ShapeDtypeStruct((d_in, width), jnp.float32),
        "w2": jax.ShapeDtypeStruct((width, width), jnp.float32),
        "w3": jax.ShapeDtypeStruct((width,), jnp.float32),
    }
    batch = {
        "x": jax.ShapeDtypeStruct((batch_size, d_in), jnp.float32),
        "y": jax.ShapeDtypeStruct((batch_size,), jnp.float32),
        "mask": jax.ShapeDtypeStruct((batch_size,), jnp.bool_),
    }

    def loss_fn(p, mb):
        h = jnp.tanh(jnp.tanh(mb["x"] @ p["w1"]) @ p["w2"])
        return mm.masked_mean((h @ p["w3"] - mb["y"]) ** 2, mb["mask"])

    def temp_bytes(k):
        compiled = (
            jax.jit(mm.microbatched_value_and_grad(loss_fn, k))
            .lower(params, batch)
            .compile()
        )
        return compiled.memory_analysis().temp_size_in_bytes

    one, eight = temp_bytes(1), temp_bytes(8)
    activations = batch_size * width * 4  # one float32 hidden layer
    assert one > 2 * activations  # the full batch's activations are live
    assert eight < 0.5 * one, (eight, one)


@pytest.mark.parametrize(
    ("k", "error", "match"),
    [
        (0, ValueError, r"`num_microbatches` must be >= 1, got 0"),
        (-2, ValueError, r"`num_microbatches` must be >= 1, got -2"),
        (2.0, TypeError, r"`num_microbatches` must be an integer, got 2.0"),
        (True, TypeError, r"`num_microbatches` must be an integer, got True"),
    ],
)
def test_bad_num_microbatches(k, error, match):
    with pytest.raises(error, match=match):
        mm.microbatched_value_and_grad(_loss, k)


def test_bad_constructor_arguments():
    with pytest.raises(TypeError, match=r"`loss_fn` must be callable, got 3"):
        mm.microbatched_value_and_grad(3, 2)
    with pytest.raises(TypeError, match=r"`has_aux` must be a bool, got 1"):
        mm.microbatched_value_and_grad(_loss, 2, has_aux=1)


def test_an_error_in_loss_fn_says_it_saw_one_microbatch():
    # The mask's shape was shown per microbatch ((2, 4) for an (8, 4) mask),
    # shapes the user never made, without saying so.
    grad_fn = mm.microbatched_value_and_grad(
        lambda p, b: mm.masked_mean(b["x"] @ p, b["mask"]), 4
    )
    batch = {"x": jnp.ones((8, 5, 3)), "mask": jnp.ones((8, 4), bool)}
    with pytest.raises(ValueError, match=r"shape \(2, 4\)") as err:
        grad_fn(jnp.ones(3), batch)
    note = "\n".join(getattr(err.value, "__notes__", []))
    assert "num_microbatches=4 splits the batch's 8 rows" in note, note
    assert "4 microbatches of 2" in note, note


@pytest.mark.parametrize(
    ("batch", "match"),
    [
        ({"x": jnp.ones((6, 2))}, r"batch size \(6.*divisible by `num_microbatches`"),
        (
            {"x": jnp.ones((8, 2)), "y": jnp.ones((4,))},
            r"share their leading \(batch\) size, got \['x'\]: 8, \['y'\]: 4",
        ),
        ({"x": jnp.ones((8, 2)), "s": jnp.ones(())}, r"leaf at \['s'\] is a scalar"),
        ({}, r"`batch` must contain at least one array"),
        (
            # jax, without x64, wrapped them into int32 before `loss_fn` saw
            # them (3 * 2**30 became negative; a mask entry of 2**32, 0).
            {"x": jnp.ones((8, 2)), "w": np.full(8, 3 * 2**30, np.int64)},
            r"int64 `batch` leaf at batch\['w'\] holds values beyond int32",
        ),
        (
            {"x": jnp.ones((8, 2)), "w": np.array([2**32] + [0] * 7, np.uint64)},
            r"uint64 `batch` leaf at batch\['w'\] holds values beyond uint32",
        ),
    ],
)
def test_bad_batch(batch, match):
    grad_fn = mm.microbatched_value_and_grad(
        lambda p, mb: (jnp.sum(p), jnp.array(1)), 4
    )
    with pytest.raises(ValueError, match=match):
        grad_fn(jnp.ones(()), batch)


def test_a_64_bit_batch_leaf_whose_values_fit_runs_as_jax_narrows_it():
    def loss_fn(w, mb):
        return mm.masked_mean(w * mb["x"], mb["mask"])

    batch = {"x": np.arange(8.0, dtype=np.float32), "mask": np.arange(8) % 3}
    assert batch["mask"].dtype == np.int64
    (_, count), _ = mm.microbatched_value_and_grad(loss_fn, 4)(jnp.ones(()), batch)
    assert float(count) == 5  # the rows whose mask is not 0


@pytest.mark.parametrize(
    "leaf, shown",
    [("train", r"str 'train'"), (np.array(["a"] * 8), r"ndarray array\(\['a'")],
)
def test_a_batch_leaf_that_is_not_numbers_is_named(leaf, shown):
    grad_fn = mm.microbatched_value_and_grad(
        lambda p, mb: (jnp.sum(p), jnp.array(1)), 4
    )
    with pytest.raises(
        TypeError, match=rf"arrays of numbers .*got {shown}.* at batch\['tag'\]"
    ):
        grad_fn(jnp.ones(()), {"x": jnp.ones((8, 2)), "tag": leaf})


def test_a_batch_on_an_explicit_axis_needs_microbatches_that_split_evenly():
    # jax.make_mesh's default axis type is Explicit: jax cannot reshape 16 rows
    # sharded over 4 devices into 8 microbatches of 2 rows (it raised inside jax).
    mesh = jax.make_mesh(
        (4,),
        ("data",),
        axis_types=(jax.sharding.AxisType.Explicit,),
        devices=jax.devices()[:4],
    )
    rows = jnp.arange(16.0)
    batch = jax.device_put(
        {"x": rows, "mask": rows > 0}, NamedSharding(mesh, P("data"))
    )

    def loss(p, mb):
        return mm.masked_mean(p * mb["x"], mb["mask"])

    with jax.set_mesh(mesh):
        (value, count), grads = jax.jit(mm.microbatched_value_and_grad(loss, 4))(
            jnp.float32(1.0), batch
        )
        assert (float(value), float(count)) == (8.0, 15.0)
        with pytest.raises(
            ValueError,
            match=r"`batch`\['mask'\] is sharded over the AxisType.Explicit mesh axis "
            r"'data' \(4 devices\): each microbatch's 16 // 8 = 2 rows must divide",
        ):
            jax.jit(mm.microbatched_value_and_grad(loss, 8))(jnp.float32(1.0), batch)


@pytest.mark.parametrize(
    ("out", "has_aux", "error", "match"),
    [
        (
            lambda p: (p, jnp.ones(2, jnp.int32)),
            False,
            ValueError,
            r"count returned by `loss_fn` must be a scalar \(a token count\), got "
            r"shape \(2,\)",
        ),
        (
            lambda p: (p, jnp.array(True)),
            False,
            TypeError,
            r"count returned by `loss_fn`.*dtype bool",
        ),
        (
            lambda p: (p * jnp.ones(3), jnp.array(1)),
            False,
            ValueError,
            r"loss returned by `loss_fn` must be a floating scalar.*got a "
            r"float32\[3\] array",
        ),
        (lambda p: p, False, TypeError, r"must return \(mean_loss, count\)"),
        (
            lambda p: (p, jnp.array(1)),
            True,
            TypeError,
            r"has_aux=True, `loss_fn` must return \(mean_loss, \(count, aux\)\)",
        ),
        (
            lambda p: (p, (jnp.array(1), {"ok": jnp.array(True)})),
            True,
            TypeError,
            r"`aux` leaves must be floating or integer arrays, got dtype bool at "
            r"aux\['ok'\]",
        ),
    ],
)
def test_bad_loss_fn_output(out, has_aux, error, match):
    grad_fn = mm.microbatched_value_and_grad(
        lambda p, mb: out(p * jnp.sum(mb)), 2, has_aux=has_aux
    )
    with pytest.raises(error, match=match):
        grad_fn(jnp.ones(()), jnp.ones((4,)))


def _mean(w, mb):
    return mm.masked_mean(w * mb["x"], mb["mask"])


# Common mistakes in what `loss_fn` returns, and the whole error each gets: what
# came back by structure, dtype and shape (never a tracer's class) and the fix.
_RETURN_MISTAKES = {
    "mean only": (
        lambda w, mb: _mean(w, mb)[0],
        False,
        "`loss_fn` must return (mean_loss, count), got a float32[] array; "
        "`mm.masked_mean(values, mask)` returns that pair (to return more, pass "
        "has_aux=True and return (mean_loss, (count, aux)))",
    ),
    "three values": (
        lambda w, mb: (*_mean(w, mb), 0),
        False,
        "`loss_fn` must return (mean_loss, count), got a tuple of 3: (float32[], "
        "int32[], int); `mm.masked_mean(values, mask)` returns that pair (to "
        "return more, pass has_aux=True and return (mean_loss, (count, aux)))",
    ),
    "aux without has_aux": (
        lambda w, mb: (_mean(w, mb)[0], (_mean(w, mb)[1], {"acc": w})),
        False,
        "The count returned by `loss_fn` must be a real scalar (the microbatch's "
        "token count), got a tuple of 2: (int32[], dict); if it is (count, aux), "
        "pass has_aux=True",
    ),
    "metrics without a count": (
        lambda w, mb: (_mean(w, mb)[0], {"acc": w}),
        False,
        "The count returned by `loss_fn` must be a real scalar (the microbatch's "
        "token count), got a dict; `loss_fn` returns (mean_loss, count), and "
        "with has_aux=True (mean_loss, (count, aux)) to return metrics too",
    ),
    "has_aux, aux before the count": (
        lambda w, mb: (_mean(w, mb)[0], ({"acc": w}, _mean(w, mb)[1])),
        True,
        "The count returned by `loss_fn` must be a real scalar (the microbatch's "
        "token count), got a dict; with has_aux=True the second element is "
        "(count, aux), count first",
    ),
    "has_aux on a plain count": (
        _mean,
        True,
        "With has_aux=True, `loss_fn` must return (mean_loss, (count, aux)), got "
        "a tuple of 2: (float32[], int32[]); its second element is a plain "
        "count: drop has_aux=True, or return (mean_loss, (count, aux))",
    ),
    "has_aux with aux but no count": (
        lambda w, mb: (_mean(w, mb)[0], {"acc": w}),
        True,
        "With has_aux=True, `loss_fn` must return (mean_loss, (count, aux)), got "
        "a tuple of 2: (float32[], dict); its second element must be the pair "
        "(count, aux)",
    ),
    "has_aux, mean only": (
        lambda w, mb: _mean(w, mb)[0],
        True,
        "With has_aux=True, `loss_fn` must return (mean_loss, (count, aux)), got "
        "a float32[] array; `mean_loss, count = mm.masked_mean(values, mask)` "
        "gives the first two",
    ),
    "swapped": (
        lambda w, mb: _mean(w, mb)[::-1],
        False,
        "The loss returned by `loss_fn` must be a floating scalar (the "
        "microbatch's mean loss), got an int32[] array; it looks like the "
        "count: return (mean_loss, count)",
    ),
    "per-row loss": (
        lambda w, mb: (jnp.mean(w * mb["x"], -1), jnp.sum(mb["mask"])),
        False,
        "The loss returned by `loss_fn` must be a floating scalar (the "
        "microbatch's mean loss), got a float32[8] array; reduce it with "
        "`mm.masked_mean(values, mask)`, which returns (mean_loss, count)",
    ),
    "no loss": (
        lambda w, mb: (None, _mean(w, mb)[1]),
        False,
        "The loss returned by `loss_fn` must be a floating scalar (the "
        "microbatch's mean loss), got None",
    ),
}


# Wrong kinds of value are TypeErrors; a loss of the wrong shape, a ValueError.
_SHAPE_MISTAKES = {"per-row loss"}


def _mistake_error(mistake):
    return ValueError if mistake in _SHAPE_MISTAKES else TypeError


def _mistake_batch():
    return {"x": jnp.ones((16, 3)), "mask": jnp.ones((16, 3), bool)}


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("mistake", list(_RETURN_MISTAKES))
def test_wrong_loss_fn_return_is_described_with_the_fix(mistake, jit):
    loss_fn, has_aux, message = _RETURN_MISTAKES[mistake]
    grad_fn = mm.microbatched_value_and_grad(loss_fn, 2, has_aux=has_aux)
    grad_fn = jax.jit(grad_fn) if jit else grad_fn
    with pytest.raises(_mistake_error(mistake)) as err:
        grad_fn(jnp.array(2.0), _mistake_batch())
    assert str(err.value) == message
    assert "Tracer" not in str(err.value)


@pytest.mark.parametrize("mistake", list(_RETURN_MISTAKES))
def test_data_parallel_wrong_loss_fn_return_gets_the_same_error(mistake):
    loss_fn, has_aux, message = _RETURN_MISTAKES[mistake]
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    batch = _mistake_batch()
    # 16 rows on 8 devices: 2 rows per device, 1 row per microbatch (the
    # per-row loss then has 1 element, not 8).
    message = message.replace("float32[8]", "float32[1]")
    for make in (mm.data_parallel_value_and_grad, mm.per_device_value_and_grad):
        grad_fn = make(loss_fn, mesh, num_microbatches=2, has_aux=has_aux)
        with pytest.raises(_mistake_error(mistake)) as err:
            jax.jit(grad_fn)(jnp.array(2.0), batch)
        assert str(err.value) == message, make.__name__


def test_counts_are_constants_to_differentiation():
    # Weights computed from the params (a soft mask): the grads weigh each
    # microbatch's own gradient by its count, Σ nᵢ ∇ℓᵢ / Σ nᵢ, and the derivative
    # of the returned loss treats the counts alike, so the two agree.
    x = jnp.array([1.0, 5.0, 2.0, 7.0])

    def loss_fn(p, mb):
        return mm.masked_mean(p["b"] * mb, jax.nn.sigmoid(p["a"] * mb))

    p = {"a": jnp.float32(0.3), "b": jnp.float32(2.0)}
    grad_fn = mm.microbatched_value_and_grad(loss_fn, 2)
    (loss, count), grads = jax.jit(grad_fn)(p, x)
    parts = [jax.value_and_grad(loss_fn, has_aux=True)(p, x[j::2]) for j in range(2)]
    n = [float(c) for (_, c), _ in parts]
    for name in p:
        expected = sum(ni * float(g[name]) for ni, (_, g) in zip(n, parts)) / sum(n)
        np.testing.assert_allclose(grads[name], expected, rtol=1e-5, atol=1e-6)
    d_loss = jax.grad(lambda q: grad_fn(q, x)[0][0])(p)
    chex.assert_trees_all_close(d_loss, grads, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(count, sum(n), rtol=1e-6)


@pytest.mark.parametrize(
    "leaf", ["relu", "float32", object()], ids=["relu", "float32", "object"]
)
def test_a_params_leaf_that_is_not_an_array_is_named(leaf):
    grad_fn = mm.microbatched_value_and_grad(
        lambda p, mb: mm.masked_mean(p["w"] * mb, jnp.ones_like(mb, bool)), 2
    )
    with pytest.raises(TypeError, match=r"got (str|object) .* at params\['act'\]"):
        grad_fn({"w": jnp.float32(1.0), "act": leaf}, jnp.ones(4))


def test_an_integer_params_leaf_is_named_with_the_nnx_recipe_only_for_nnx():
    grad_fn = mm.microbatched_value_and_grad(
        lambda p, mb: mm.masked_mean(p["w"] * mb, jnp.ones_like(mb, bool)), 2
    )
    # A plain dict: the dtype and path, and no NNX recipe that does not apply.
    with pytest.raises(TypeError, match=r"got dtype int32 at params\['n'\]$"):
        grad_fn({"w": jnp.float32(1.0), "n": jnp.int32(1)}, jnp.ones(4))
    nnx = pytest.importorskip("flax.nnx")

    class Counter(nnx.Variable):
        pass

    class Model(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.float32(1.0))
            self.n = Counter(jnp.int32(1))

    _, state = nnx.split(Model())
    with pytest.raises(
        TypeError, match=r"params\['n'\]\S*\. An NNX module .*nnx\.split"
    ):
        grad_fn(state, jnp.ones(4))


def test_an_integer_leaf_of_an_nnx_state_of_plain_arrays_is_named_with_the_recipe():
    # An nnx.State holds NNX state even where its leaves are plain arrays
    # (nnx.State(nnx.to_pure_dict(state))): the integer leaf's error names the
    # split recipe.
    nnx = pytest.importorskip("flax.nnx")
    grad_fn = mm.microbatched_value_and_grad(
        lambda p, mb: mm.masked_mean(p["w"] * mb, jnp.ones_like(mb, bool)), 2
    )
    state = nnx.State({"w": jnp.float32(1.0), "n": jnp.int32(1)})
    with pytest.raises(
        TypeError,
        match=r"got dtype int32 at params\['n'\]\. An NNX module .*nnx\.split",
    ):
        grad_fn(state, jnp.ones(4))


@pytest.mark.parametrize("how", ["microbatched", "with_stats", "data_parallel"])
def test_loss_fn_is_traced_once_per_call(how):
    # The shapes' evaluation and the loop's body share one trace of `loss_fn`
    # and its derivative (a `jax.jit` whose trace cache the body hits).
    traces = []

    def loss_fn(params, batch):
        traces.append(1)
        x = jnp.tanh(batch["x"] @ params["w"])
        return mm.masked_mean(jnp.sum(x**2, -1), batch["mask"])

    params = {"w": jnp.ones((D, H))}
    batch = {"x": jnp.ones((B, D)), "mask": jnp.arange(B) % 3 > 0}
    if how == "data_parallel":
        mesh = jax.make_mesh(
            (8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,)
        )
        grad_fn = mm.data_parallel_value_and_grad(loss_fn, mesh, "data")
        batch = jax.tree.map(lambda x: jnp.concatenate([x] * 4), batch)
    else:
        grad_fn = mm.microbatched_value_and_grad(
            loss_fn, 4, with_stats=how == "with_stats"
        )
    (loss, _), grads = jax.jit(grad_fn)(params, batch)[:2]
    assert len(traces) == 1
    want, want_grads = jax.value_and_grad(lambda p: loss_fn(p, batch)[0])(params)
    np.testing.assert_allclose(loss, want, rtol=1e-6)
    chex.assert_trees_all_close(grads, want_grads, rtol=1e-5)
