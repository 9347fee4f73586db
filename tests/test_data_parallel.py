"""Data parallelism on 8 CPU devices with one gradient reduction per window.

Every device keeps its own gradient (``mm.per_device_value_and_grad``); the
devices are combined once, token-weighted. Checked here: the numbers equal a
single-device full-batch run (a device whose rows hold no tokens and a
microbatch with no tokens anywhere included), and the compiled HLO holds the
gradient-sized cross-device reduction once, not once per microbatch.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import collectives, large
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import masked_multistep as mm

AUTO = jax.sharding.AxisType.Auto
NDEV, ROWS, K, T, D, H = 8, 2, 4, 4, 3, 16
TOL = {"rtol": 1e-5, "atol": 1e-6}


@pytest.fixture(scope="module")
def mesh():
    assert len(jax.devices()) == NDEV, "conftest sets jax_num_cpu_devices=8"
    return jax.make_mesh((NDEV,), ("data",), axis_types=(AUTO,))


def _params():
    rng = np.random.default_rng(0)
    return {
        "w1": jnp.asarray(rng.normal(size=(H, D)), jnp.float32),
        "w2": jnp.asarray(rng.normal(size=(H,)), jnp.float32),
    }


PARAM_BYTES = 4 * (H * D + H)


def _loss(params, mb):
    x = jnp.where(mb["mask"][..., None], mb["x"], 0)
    pred = jnp.tanh(x @ params["w1"].T) @ params["w2"]
    return mm.masked_mean((pred - mb["y"]) ** 2, mb["mask"])


def _loss_aux(params, mb):
    loss, count = _loss(params, mb)
    return loss, (count, {"loss": loss, "rows": jnp.sum(mb["mask"].any(-1))})


def _batch(rows, seed, empty_device=None, empty_microbatch=None, k=K):
    """``rows`` skewed rows; optionally no tokens on one device's block of rows,
    or in one (strided, per-device) in-jit microbatch on every device."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, T + 1, size=rows)
    lengths[: rows // 4] = T  # the first devices hold far more tokens
    per_device = rows // NDEV
    if empty_device is not None:
        lengths[empty_device * per_device : (empty_device + 1) * per_device] = 0
    if empty_microbatch is not None:
        local = np.arange(rows) % per_device
        lengths[local % k == empty_microbatch] = 0
    mask = np.arange(T)[None, :] < lengths[:, None]
    x = np.where(mask[..., None], rng.normal(size=(rows, T, D)), np.nan)
    return {
        "x": x.astype(np.float32),
        "y": rng.normal(size=(rows, T)).astype(np.float32),
        "mask": mask,
    }


def _full_batch(loss_fn, batch, has_aux=False):
    device = jax.devices()[0]
    return jax.jit(jax.value_and_grad(loss_fn, has_aux=has_aux))(
        jax.device_put(_params(), device), jax.device_put(batch, device)
    )


def test_per_device_gradients_are_each_devices_own_and_not_reduced(mesh):
    batch = _batch(NDEV * ROWS, seed=1, empty_device=5)
    grad_fn = jax.jit(mm.per_device_value_and_grad(_loss, mesh, "data"))
    sharded = jax.device_put(batch, NamedSharding(mesh, P("data")))
    (loss, count), grads = grad_fn(_params(), sharded)

    assert (loss.shape, count.shape) == ((NDEV,), (NDEV,))
    assert grads["w1"].shape == (NDEV, H, D)
    assert grads["w1"].sharding.is_equivalent_to(NamedSharding(mesh, P("data")), 3)
    for d in range(NDEV):
        rows = jax.tree.map(lambda x, d=d: x[d * ROWS : (d + 1) * ROWS], batch)
        (own_loss, own_count), own = _full_batch(_loss, rows, has_aux=True)
        assert int(count[d]) == int(own_count)
        if d == 5:  # no tokens: zeros, not the NaN of its data
            assert int(count[d]) == 0 and float(loss[d]) == 0.0
            assert all(not np.asarray(g[d]).any() for g in jax.tree.leaves(grads))
            continue
        chex.assert_trees_all_close(
            (loss[d], jax.tree.map(lambda g, d=d: g[d], grads)),
            (own_loss, own),
            **TOL,
        )

    # No cross-device reduction of the gradients in the compiled step.
    hlo = grad_fn.lower(_params(), sharded).compile().as_text()
    assert large(collectives(hlo), min_bytes=4 * H) == []


@pytest.mark.parametrize("empty", ["device", "microbatch"])
def test_data_parallel_microbatching_equals_full_batch_and_reduces_once(mesh, empty):
    batch = _batch(
        NDEV * ROWS * K,
        seed=2,
        empty_device=3 if empty == "device" else None,
        empty_microbatch=1 if empty == "microbatch" else None,
    )
    params = _params()
    sharded = jax.device_put(batch, NamedSharding(mesh, P("data")))
    grad_fn = jax.jit(
        mm.data_parallel_value_and_grad(_loss, mesh, "data", num_microbatches=K)
    )
    out = grad_fn(params, sharded)
    full = _full_batch(_loss, batch, True)
    chex.assert_trees_all_close(out, full, **TOL, strict=True)

    # One gradient-sized all-reduce per call, at the step's top level...
    found = large(collectives(grad_fn.lower(params, sharded).compile().as_text()), 64)
    assert [(c.kind, c.where) for c in found] == [("all-reduce", "step")], found
    assert sum(c.bytes for c in found) >= PARAM_BYTES
    # ... where plain microbatching under automatic sharding reduces in the loop:
    # k all-reduces of the gradients per call.
    plain = jax.jit(mm.microbatched_value_and_grad(_loss, K))
    chex.assert_trees_all_close(plain(params, sharded), out, **TOL)
    found = large(collectives(plain.lower(params, sharded).compile().as_text()), 64)
    assert {c.where for c in found} == {"loop"}, found
    assert sum(c.bytes for c in found) >= PARAM_BYTES


def test_data_parallel_aux_is_token_weighted_and_summed(mesh):
    batch = _batch(NDEV * ROWS * K, seed=3, empty_device=0)
    sharded = jax.device_put(batch, NamedSharding(mesh, P("data")))
    grad_fn = jax.jit(
        mm.data_parallel_value_and_grad(
            _loss_aux, mesh, "data", num_microbatches=K, has_aux=True
        )
    )
    (loss, (count, aux)), grads = grad_fn(_params(), sharded)
    (f_loss, (f_count, f_aux)), f_grads = _full_batch(_loss_aux, batch, True)
    chex.assert_trees_all_close(
        (loss, count, aux["loss"], grads),
        (f_loss, f_count, f_aux["loss"], f_grads),
        **TOL,
    )
    assert int(aux["rows"]) == int(f_aux["rows"])  # integers are summed


def test_all_devices_empty_gives_zeros(mesh):
    batch = _batch(NDEV * ROWS, seed=4)
    batch["mask"][:] = False
    sharded = jax.device_put(batch, NamedSharding(mesh, P("data")))
    (loss, count), grads = jax.jit(mm.data_parallel_value_and_grad(_loss, mesh))(
        _params(), sharded
    )
    assert int(count) == 0 and float(loss) == 0.0
    assert all(not np.asarray(g).any() for g in jax.tree.leaves(grads))


def test_bad_arguments(mesh):
    with pytest.raises(TypeError, match=r"`mesh` must be a jax.sharding.Mesh, got str"):
        mm.per_device_value_and_grad(_loss, "mesh")
    with pytest.raises(ValueError, match=r"`axis_name` must name axes .*got 'batch'"):
        mm.data_parallel_value_and_grad(_loss, mesh, "batch")
    with pytest.raises(TypeError, match=r"`num_microbatches` must be"):
        mm.per_device_value_and_grad(_loss, mesh, num_microbatches=2.0)
    grad_fn = mm.per_device_value_and_grad(_loss, mesh, num_microbatches=2)
    batch = _batch(NDEV * ROWS, seed=5)
    batch["x"] = batch["x"][:NDEV]
    with pytest.raises(ValueError, match=r"divisible by .*devices \(8\) times .*2.*"):
        grad_fn(_params(), batch)
