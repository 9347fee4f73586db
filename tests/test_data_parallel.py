"""Data parallelism on 8 CPU devices with one gradient reduction per window.

Every device keeps its own gradient (``mm.per_device_value_and_grad``); the
devices are combined once, token-weighted. Checked here: the numbers equal a
single-device full-batch run (a device whose rows hold no tokens and a
microbatch with no tokens anywhere included), and the compiled HLO holds the
gradient-sized cross-device reduction once, not once per microbatch.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.tree as otu
import pytest
from _helpers import backend_compiles, collectives, large
from _recording import records_value
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import masked_multistep as mm

AUTO = jax.sharding.AxisType.Auto
EXPLICIT = jax.sharding.AxisType.Explicit
NDEV, ROWS, K, T, D, H = 8, 2, 4, 4, 3, 16
TOL = {"rtol": 1e-5, "atol": 1e-6}


@pytest.fixture(scope="module")
def mesh(request):
    """The devices on one data axis: AxisType.Auto, or (parametrized
    indirectly with ``"explicit"``) jax.make_mesh's default AxisType.Explicit,
    under which every array's sharding is part of its type."""
    assert len(jax.devices()) == NDEV, "conftest sets jax_num_cpu_devices=8"
    axis_type = EXPLICIT if getattr(request, "param", "auto") == "explicit" else AUTO
    return jax.make_mesh((NDEV,), ("data",), axis_types=(axis_type,))


# The main paths again on an AxisType.Explicit data axis.
both_axis_types = pytest.mark.parametrize("mesh", ["auto", "explicit"], indirect=True)


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
    return loss, (
        count,
        {"loss": loss, "rows": jnp.sum(mb["mask"].any(-1)), "tokens": count * 1.0},
    )


AUX_REDUCTION = {"loss": "mean", "rows": "sum", "tokens": "sum"}


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


@functools.cache
def _jitted_value_and_grad(loss_fn, has_aux):
    return jax.jit(jax.value_and_grad(loss_fn, has_aux=has_aux))


def _full_batch(loss_fn, batch, has_aux=False):
    device = jax.devices()[0]
    return _jitted_value_and_grad(loss_fn, has_aux)(
        jax.device_put(_params(), device), jax.device_put(batch, device)
    )


@both_axis_types
def test_per_device_gradients_are_each_devices_own_and_not_reduced(mesh):
    batch = _batch(NDEV * ROWS, seed=1, empty_device=5)
    grad_fn = jax.jit(mm.per_device_value_and_grad(_loss, mesh, "data"))
    sharded = jax.device_put(batch, NamedSharding(mesh, P("data")))
    (loss, count), grads = grad_fn(_params(), sharded)

    assert (loss.shape, count.shape) == ((NDEV,), (NDEV,))
    assert grads["w1"].shape == (NDEV, H, D)
    assert grads["w1"].sharding.is_equivalent_to(NamedSharding(mesh, P("data")), 3)
    # (Read on the host: an explicitly sharded array refuses eager indexing.)
    (loss, count), grads = jax.device_get(((loss, count), grads))
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


@both_axis_types
@pytest.mark.parametrize("empty", ["device", "microbatch"])
def test_data_parallel_microbatching_equals_full_batch_and_reduces_once(mesh, empty):
    batch = _batch(
        NDEV * ROWS * K,
        seed=2,
        empty_device=3 if empty == "device" else None,
        empty_microbatch=1 if empty == "microbatch" else None,
    )
    # On the mesh: under explicit sharding jax's own value_and_grad refuses
    # params on one device beside a batch sharded over the data axis.
    params = jax.device_put(_params(), NamedSharding(mesh, P()))
    sharded = jax.device_put(batch, NamedSharding(mesh, P("data")))
    grad_fn = jax.jit(
        mm.data_parallel_value_and_grad(_loss, mesh, "data", num_microbatches=K)
    )
    out = grad_fn(params, sharded)
    (f_loss, f_count), f_grads = _full_batch(_loss, batch, True)
    # Token totals come back in float32, as from microbatched_value_and_grad.
    full = (f_loss, f_count.astype(jnp.float32)), f_grads
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


def test_data_parallel_statistics_treat_each_device_microbatch_as_a_batch(mesh):
    """with_stats=True: the statistics of one window whose microbatches are the
    D·k device microbatches (those with tokens), as a single-device
    MaskedMultiSteps window fed them one by one records them; the results
    unchanged, and still one gradient-sized reduction per call."""
    batch = _batch(NDEV * ROWS * K, seed=7, empty_device=3)
    params = _params()
    sharded = jax.device_put(batch, NamedSharding(mesh, P("data")))
    with_stats = jax.jit(
        mm.data_parallel_value_and_grad(
            _loss, mesh, "data", num_microbatches=K, with_stats=True
        )
    )
    plain = jax.jit(
        mm.data_parallel_value_and_grad(_loss, mesh, "data", num_microbatches=K)
    )
    (loss, count), grads, stats = with_stats(params, sharded)
    chex.assert_trees_all_equal(((loss, count), grads), plain(params, sharded))

    per_device = NDEV * ROWS * K // NDEV
    ref_tx = mm.MaskedMultiSteps(optax.sgd(0.1), NDEV * K, window_stats=True)
    ref = ref_tx.init(params)
    ref_update = jax.jit(ref_tx.update)
    for d in range(NDEV):
        for j in range(K):
            rows = d * per_device + np.arange(j, per_device, K)
            mb = jax.tree.map(lambda x, rows=rows: x[rows], batch)
            (mb_loss, mb_count), mb_grads = _full_batch(_loss, mb, has_aux=True)
            _, ref = ref_update(mb_grads, ref, params, count=mb_count, value=mb_loss)
    want = mm.window_stats(ref)
    assert bool(ref_tx.has_updated(ref))
    assert int(stats.microbatches) == int(want.microbatches) <= (NDEV - 1) * K
    assert float(stats.tokens) == float(want.tokens) == float(count)
    for name in ("loss", "grad_sq_norm", "grad_var_trace", "true_grad_sq_norm"):
        np.testing.assert_allclose(
            getattr(stats, name), getattr(want, name), rtol=1e-5, err_msg=name
        )
    np.testing.assert_allclose(stats.noise_scale, want.noise_scale, rtol=1e-4)

    found = large(
        collectives(with_stats.lower(params, sharded).compile().as_text()), 64
    )
    assert [(c.kind, c.where) for c in found] == [("all-reduce", "step")], found
    assert PARAM_BYTES <= sum(c.bytes for c in found) <= PARAM_BYTES + 16, found
    # The statistics' sums join the call's reductions: as many collectives of
    # any size as without them (K summed as an int32 was one more all-reduce).
    every = [
        sorted(
            (c.kind, c.where)
            for c in collectives(fn.lower(params, sharded).compile().as_text())
        )
        for fn in (plain, with_stats)
    ]
    assert every[0] == every[1], every


def test_data_parallel_aux_is_token_weighted_and_summed(mesh):
    batch = _batch(NDEV * ROWS * K, seed=3, empty_device=0)
    sharded = jax.device_put(batch, NamedSharding(mesh, P("data")))
    grad_fn = jax.jit(
        mm.data_parallel_value_and_grad(
            _loss_aux,
            mesh,
            "data",
            num_microbatches=K,
            has_aux=True,
            aux_reduction=AUX_REDUCTION,
        )
    )
    (loss, (count, aux)), grads = grad_fn(_params(), sharded)
    (f_loss, (f_count, f_aux)), f_grads = _full_batch(_loss_aux, batch, True)
    chex.assert_trees_all_close(
        (loss, count, aux["loss"], aux["tokens"], grads),
        (f_loss, f_count, f_aux["loss"], f_aux["tokens"], f_grads),
        **TOL,
    )
    assert aux["rows"].dtype == f_aux["rows"].dtype
    assert int(aux["rows"]) == int(f_aux["rows"])  # integers are summed
    # A floating aux leaf needs to be told how it combines.
    with pytest.raises(TypeError, match=r"aux\['loss'\] is floating"):
        mm.data_parallel_value_and_grad(_loss_aux, mesh, has_aux=True)(
            _params(), sharded
        )


def test_per_device_rng_gives_every_device_its_own_key(mesh):
    """With rng=, device d runs microbatched_value_and_grad with
    fold_in(rng, d): the devices draw different masks, reproducibly."""

    def noisy(params, mb, rng):
        keep = jax.random.bernoulli(rng, 0.5, mb["mask"].shape)
        return _loss(params, {**mb, "mask": mb["mask"] & keep})

    batch = _batch(NDEV * ROWS * 2, seed=7)
    batch["mask"][:] = True
    sharded = jax.device_put(batch, NamedSharding(mesh, P("data")))
    grad_fn = jax.jit(
        mm.per_device_value_and_grad(noisy, mesh, "data", num_microbatches=2)
    )
    key = jax.random.key(3)
    (_, count), grads = grad_fn(_params(), sharded, rng=key)
    (_, again), _ = grad_fn(_params(), sharded, rng=key)
    np.testing.assert_array_equal(count, again)
    assert len(set(np.asarray(count).tolist())) > 1  # not the same mask everywhere
    d = 4
    rows = jax.tree.map(lambda x: x[d * 2 * ROWS : (d + 1) * 2 * ROWS], batch)
    (_, own_count), own = jax.jit(mm.microbatched_value_and_grad(noisy, 2))(
        _params(), rows, rng=jax.random.fold_in(key, d)
    )
    assert float(count[d]) == float(own_count)
    chex.assert_trees_all_close(jax.tree.map(lambda g: g[d], grads), own, **TOL)
    # The key under another name is named (Python's error named an inner
    # function, and not `rng=`).
    for make in (mm.per_device_value_and_grad, mm.data_parallel_value_and_grad):
        with pytest.raises(TypeError, match=r"'key': a PRNG key goes in grad_fn"):
            make(noisy, mesh, "data", num_microbatches=2)(_params(), sharded, key=key)


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
    # The number of microbatches where the axis belongs (it is keyword-only).
    for grad_fn in (mm.data_parallel_value_and_grad, mm.per_device_value_and_grad):
        with pytest.raises(TypeError, match=r"got the int 4: .*`num_microbatches=4`"):
            grad_fn(_loss, mesh, 4)
        with pytest.raises(TypeError, match=r"`mesh` must be a jax.sharding.Mesh"):
            grad_fn(_loss, "mesh", 4)
    with pytest.raises(TypeError, match=r"`num_microbatches` must be"):
        mm.per_device_value_and_grad(_loss, mesh, num_microbatches=2.0)
    with pytest.raises(TypeError, match=r"`with_stats` must be a bool, got 1"):
        mm.data_parallel_value_and_grad(_loss, mesh, with_stats=1)
    grad_fn = mm.per_device_value_and_grad(_loss, mesh, num_microbatches=2)
    batch = jax.tree.map(lambda a: a[:NDEV], _batch(NDEV * ROWS, seed=5))
    with pytest.raises(ValueError, match=r"divisible by .*devices \(8\) times .*2.*"):
        grad_fn(_params(), batch)
    # Leaves of different sizes: the caller's sizes, not a device's share.
    batch = _batch(NDEV * ROWS, seed=5)
    batch["x"] = batch["x"][: NDEV * ROWS // 2]
    sizes = r"share their leading .*\['mask'\]: 16.*\['x'\]: 8"
    with pytest.raises(ValueError, match=sizes):
        grad_fn(_params(), batch)


@pytest.mark.parametrize(
    "axis_types",
    [None, (AUTO, EXPLICIT), (EXPLICIT, AUTO)],
    ids=["explicit", "auto_data", "auto_model"],
)
def test_params_sharded_over_a_model_axis_train_data_parallel(axis_types):
    """jax.make_mesh's default: every axis AxisType.Explicit, the params sharded
    over a model axis and the batch over the data axis; and the two mixed
    meshes. Each device's own gradient, the in-jit loop, and the deferred
    window give the full batch's numbers, with the accumulator sharded as the
    params are. (With an automatic data axis beside the explicit model one,
    the in-jit loop's carry started replicated where the gradients are split:
    "select cases must have the same shardings".)"""
    if axis_types is None:
        grid = jax.make_mesh((NDEV // 2, 2), ("data", "model"))
        assert grid.axis_types == (EXPLICIT, EXPLICIT)
    else:
        grid = jax.make_mesh((NDEV // 2, 2), ("data", "model"), axis_types=axis_types)
    model_explicit = grid.axis_types[1] == EXPLICIT
    batches = _microbatches()[:K]
    whole = {key: np.concatenate([b[key] for b in batches]) for key in batches[0]}
    placement = {"w1": P("model"), "w2": P()}
    (ref_loss, ref_count), ref = _full_batch(_loss, whole, has_aux=True)
    ref_params, ref_state = _single_device_run(batches)
    with jax.set_mesh(grid):
        params = _params_on(grid, placement)

        def by_device(batch):
            # The rows of `batches`, regrouped onto half as many devices.
            return jax.device_put(batch, NamedSharding(grid, P("data")))

        for grad_fn in (
            mm.data_parallel_value_and_grad(_loss, grid, "data", num_microbatches=K),
            mm.microbatched_value_and_grad(_loss, K),
        ):
            (loss, count), grads = jax.jit(grad_fn)(params, by_device(whole))
            if model_explicit:
                assert jax.typeof(grads["w1"]).sharding.spec == P("model", None)
            assert grads["w1"].sharding.is_equivalent_to(params["w1"].sharding, 2)
            assert float(count) == float(ref_count)
            chex.assert_trees_all_close((loss, grads), (ref_loss, ref), **TOL)

        tx = _tx(mm.deferred(grid, "data"), window_stats=True)
        state = mm.TrainState.create(apply_fn=None, params=params, tx=tx)
        laid_out = NamedSharding(grid, P("data", "model", None))
        assert state.opt_state.acc_grads["w1"].sharding.is_equivalent_to(laid_out, 3)
        device_grads = mm.per_device_value_and_grad(_loss, grid, "data")

        @jax.jit
        def train_step(state, mb):
            (loss, count), grads = device_grads(state.params, mb)
            return state.apply_gradients(grads=grads, count=count, value=loss)

        for mb in batches:
            state = train_step(state, by_device(mb))
    chex.assert_trees_all_close(state.params, ref_params, **TOL)
    stats = mm.window_stats(state.opt_state)
    np.testing.assert_allclose(stats.loss, ref_state.inner_opt_state[1], **TOL)
    # Every device's share with tokens is a small batch.
    shares = [
        m.reshape(NDEV // 2, -1).any(1).sum() for m in (b["mask"] for b in batches)
    ]
    assert int(stats.microbatches) == sum(shares)


@pytest.mark.parametrize("method", ["update", "apply_gradients"])
@pytest.mark.parametrize(
    ("w1", "model_axis"),
    [(P("model"), EXPLICIT), (P(("data", "model")), EXPLICIT), (P("model"), AUTO)],
    ids=["tp", "fsdp_tp", "tp_auto_model"],
)
def test_deferred_on_a_data_by_model_mesh_without_set_mesh(w1, model_axis, method):
    """Jitted deferred steps on a data × model mesh (an explicit data axis),
    called without `jax.set_mesh`. With `w1` split over an explicit model axis
    ("tp") each device's running mean is split over it, and its zeros for an
    empty microbatch must be too: with jax 0.12 they were not (`zeros_like`
    under `jit` without a mesh set loses explicit axes), and the running mean's
    select failed to trace ("select `which` must be scalar or have the same
    sharding as cases"). With `w1` split over both axes ("fsdp_tp") the updates
    between windows were typed replicated. With an automatic model axis
    ("tp_auto_model") the first step was refused by an error that blamed
    `tx.init`, called eagerly and right: the step's check of the state traced
    the reduction's state without the mesh. Trains as one device on the full
    batch, the params and updates laid out as the params."""
    grid = jax.make_mesh(
        (NDEV // 2, 2), ("data", "model"), axis_types=(EXPLICIT, model_axis)
    )
    batches = _microbatches()
    ref_params, _ = _single_device_run(batches)
    placement = {"w1": w1, "w2": P()}
    params = _params_on(grid, placement)
    tx = _tx(mm.deferred(grid, "data"), window_stats=True)
    state = tx.init(params)
    grad_fn = mm.per_device_value_and_grad(_loss, grid, "data")

    @jax.jit
    def step(params, state, mb):
        (loss, count), grads = grad_fn(params, mb)
        if method == "apply_gradients":
            return tx.apply_gradients(grads, state, params, count=count, value=loss)
        updates, state = tx.update(grads, state, params, count=count, value=loss)
        assert (
            jax.typeof(updates["w1"]).sharding.spec
            == jax.typeof(params["w1"]).sharding.spec
        )
        return optax.apply_updates(params, updates), state

    for mb in batches:
        params, state = step(
            params, state, jax.device_put(mb, NamedSharding(grid, P("data")))
        )
    assert params["w1"].sharding.is_equivalent_to(NamedSharding(grid, w1), 2)
    # Each device's running mean of `w1` stays split over the model axis, as
    # per_device_value_and_grad's gradients are; split over both axes, it is
    # held whole over "data" only (it was whole over "model" too: a gather of
    # every microbatch's gradient, and twice the memory).
    acc = NamedSharding(grid, P("data", "model"))
    assert state.acc_grads["w1"].sharding.is_equivalent_to(acc, 3)
    assert int(state.gradient_step) == len(batches) // K
    chex.assert_trees_all_close(jax.device_get(params), ref_params, **TOL)


@pytest.mark.parametrize(
    "axis_types",
    [(EXPLICIT, EXPLICIT), (EXPLICIT, AUTO), (AUTO, EXPLICIT)],
    ids=["explicit", "explicit_data", "explicit_model"],
)
def test_eager_deferred_steps_on_explicit_axes_without_set_mesh(axis_types):
    """Deferred steps called without `jit` on a data × model mesh with
    explicit axes, and no `jax.set_mesh`: jax's eager `vmap` could not make
    the per-device running means' scalars ("Please enter your `jit` into a
    mesh context", or "cannot reshape array of size 1" beside an automatic
    axis), and beside an automatic data axis the gradients' reshard named it
    (jax 0.10.2, also under `jax.set_mesh`). A step sets the reduction's mesh
    itself where none is set; one window trains as one device."""
    grid = jax.make_mesh((NDEV // 2, 2), ("data", "model"), axis_types=axis_types)
    batches = _microbatches()[:K]
    ref_params, _ = _single_device_run(batches)
    placement = {"w1": P("model"), "w2": P()}
    params = _params_on(grid, placement)
    tx = _tx(mm.deferred(grid, "data"))
    state = tx.init(params)
    grad_fn = mm.per_device_value_and_grad(_loss, grid, "data")
    for mb in batches:
        (loss, count), grads = grad_fn(params, mb)
        params, state = tx.apply_gradients(
            grads, state, params, count=count, value=loss
        )
    assert int(state.gradient_step) == 1
    assert jax.sharding.get_abstract_mesh().empty
    chex.assert_trees_all_close(jax.device_get(params), ref_params, **TOL)


def test_eager_deferred_steps_keep_a_param_split_over_data_and_model_together():
    """Outside `jit` on automatic axes the window's mean of a dimension split
    over ("data", "model") together came back split over "model" alone; the
    inner optimizer built adam's moments in that layout, replicated over the
    data axis, and the params followed. The mean is placed as its param."""
    grid = jax.make_mesh((NDEV // 2, 2), ("data", "model"), axis_types=(AUTO, AUTO))
    joint = NamedSharding(grid, P(("data", "model")))
    params = {"b": jax.device_put(np.ones(NDEV, np.float32), joint)}
    tx = mm.MaskedMultiSteps(optax.adam(1e-2), 1, reduction=mm.deferred(grid, "data"))
    state = tx.init(params)
    grads = {
        "b": jax.device_put(
            np.ones((NDEV // 2, NDEV), np.float32),
            NamedSharding(grid, P("data", "model")),
        )
    }
    count = jax.device_put(
        np.ones(NDEV // 2, np.float32), NamedSharding(grid, P("data"))
    )
    for _ in range(3):
        updates, state = tx.update(grads, state, params, count=count)
        params = optax.apply_updates(params, updates)
        for x in (state.inner_opt_state[0].mu["b"], params["b"]):
            assert x.sharding.is_equivalent_to(joint, 1), x.sharding
    # Adam's first steps on a constant gradient: -lr each.
    np.testing.assert_allclose(params["b"], 1 - 3e-2, rtol=1e-5)


@pytest.mark.parametrize("axis_type", [AUTO, EXPLICIT], ids=["auto", "explicit"])
def test_gradients_per_device_run_eagerly_on_a_data_by_model_mesh(axis_type):
    """Outside `jit`, on a data × model mesh, both functions failed in jax
    ("out_specs refers to 'model'"); and on explicit axes a batch not laid
    out over the data axis (replicated, or host arrays) was a shard_map
    error: it is laid out over it, as automatic sharding
    does."""
    grid = jax.make_mesh((NDEV // 2, 2), ("data", "model"), axis_types=(axis_type,) * 2)
    batch = _microbatches()[0]
    (ref_loss, ref_count), ref = _full_batch(_loss, batch, has_aux=True)
    per_device = mm.per_device_value_and_grad(_loss, grid, "data")
    combined = mm.data_parallel_value_and_grad(_loss, grid, "data")

    def eager(f, mb):
        return f(_params(), mb)

    placed = [jax.device_put(batch, NamedSharding(grid, s)) for s in (P("data"), P())]
    with jax.set_mesh(grid):
        for mb in (*placed, batch):  # (numpy arrays, on no device yet)
            for call in (eager, jax.jit(eager, static_argnums=0)):
                (loss, count), grads = call(combined, mb)
                assert float(count) == float(ref_count)
                chex.assert_trees_all_close((loss, grads), (ref_loss, ref), **TOL)
                (_, counts), device_grads = call(per_device, mb)
                counts = np.asarray(counts)
                assert counts.shape == (NDEV // 2,)
                assert counts.sum() == float(ref_count)
                mean = jax.tree.map(
                    lambda g, n=counts: np.tensordot(n, np.asarray(g), 1) / n.sum(),
                    device_grads,
                )
                chex.assert_trees_all_close(mean, ref, **TOL)


@pytest.mark.parametrize("axis_type", [AUTO, EXPLICIT], ids=["auto", "explicit"])
def test_a_jitted_init_lays_the_device_axis_out_over_the_devices(axis_type):
    """`jax.jit(tx.init)`: under jit `jnp.zeros(..., device=)` is ignored, and
    the running means of every device came back replicated on each (D times
    the memory). On explicit axes the state is laid out as the eager init's;
    on Auto ones the device axis at least is sharded (the params' own
    sharding is not in their type there: pass out_shardings for it)."""
    grid = jax.make_mesh((NDEV // 2, 2), ("data", "model"), axis_types=(axis_type,) * 2)
    params = {
        "w1": jax.device_put(_params()["w1"], NamedSharding(grid, P("model"))),
        "w2": jax.device_put(_params()["w2"], NamedSharding(grid, P())),
    }
    for stats in (False, True):
        tx = _tx(mm.deferred(grid, "data"), window_stats=stats)
        with jax.set_mesh(grid):
            eager, jitted = tx.init(params), jax.jit(tx.init)(params)
        per_device = (eager.acc_grads, eager.reduction_state)
        for e, j in zip(
            jax.tree.leaves(per_device),
            jax.tree.leaves((jitted.acc_grads, jitted.reduction_state)),
            strict=True,
        ):
            if axis_type == EXPLICIT:
                assert j.sharding.is_equivalent_to(e.sharding, e.ndim), (e, j)
            assert j.sharding.spec[0] == "data", j.sharding


def test_fsdp_params_on_an_explicit_axis_train_deferred_and_data_parallel():
    """Params sharded over an AxisType.Explicit data axis (FSDP): each device's
    own gradient needs the whole params, which the library gathers (the
    compiler does it under automatic sharding; shard_map refused the sharded
    input under explicit sharding), and data_parallel_value_and_grad returns
    the gradients sharded as the params are, for an accumulator built from
    them (jax refused to mix the two shardings). No jax.set_mesh needed."""
    grid = jax.make_mesh((NDEV,), ("data",))
    fsdp = NamedSharding(grid, P("data"))
    params = jax.device_put(_params(), fsdp)
    batches = _microbatches()
    data = NamedSharding(grid, P("data"))

    tx = _tx(mm.deferred(grid, "data"))
    step = jax.jit(_deferred_step(grid, tx))
    deferred, state = params, tx.init(params)
    for mb in batches:
        deferred, state = step(deferred, state, jax.device_put(mb, data))
    assert jax.typeof(deferred["w1"]).sharding.spec == P("data", None)
    ref_params, _ = _single_device_run(batches)
    chex.assert_trees_all_close(deferred, ref_params, **TOL)

    whole = {key: np.concatenate([b[key] for b in batches[:K]]) for key in batches[0]}
    grad_fn = jax.jit(
        mm.data_parallel_value_and_grad(_loss, grid, "data", num_microbatches=K)
    )
    (loss, count), grads = grad_fn(params, jax.device_put(whole, data))
    assert jax.typeof(grads["w1"]).sharding.spec == P("data", None)
    (ref_loss, ref_count), ref = _full_batch(_loss, whole, has_aux=True)
    assert float(count) == float(ref_count)
    chex.assert_trees_all_close((loss, grads), (ref_loss, ref), **TOL)


@pytest.mark.parametrize("method", ["update", "apply_gradients"])
@pytest.mark.parametrize(
    "inner",
    [
        lambda: optax.sgd(0.5),
        lambda: optax.chain(optax.clip_by_global_norm(0.1), optax.sgd(0.5)),
        # A state that keeps the window's mean; a select between the mean and
        # a state laid out as the params.
        lambda: optax.chain(_keeps_its_input(), optax.sgd(0.5)),
        lambda: optax.optimistic_gradient_descent(0.5),
    ],
    ids=["sgd", "clip-sgd", "keeps-mean", "optimistic"],
)
def test_fsdp_deferred_with_an_inner_optimizer_keeping_no_state_of_the_params(
    inner, method
):
    """FSDP params on an explicit data axis, deferred, an inner optimizer whose
    updates or state follow the window's mean (sgd keeps no state laid out as
    the params, as adam's moments are): the mean of the devices' means was
    replicated, the updates between windows zeros placed as the params;
    ``update`` failed to trace ("cond branches must have equal output
    types"), and a select between the mean and a state laid out as the params
    failed in both. The mean is laid out as the params now. Both methods
    train as one device on the full batch."""
    grid = jax.make_mesh((NDEV,), ("data",))
    data = NamedSharding(grid, P("data"))
    batches = _microbatches()
    grad_fn = mm.per_device_value_and_grad(_loss, grid, "data")
    tx = mm.MaskedMultiSteps(inner(), K, reduction=mm.deferred(grid, "data"))

    @jax.jit
    def step(params, state, mb):
        (loss, count), grads = grad_fn(params, mb)
        if method == "apply_gradients":
            return tx.apply_gradients(grads, state, params, count=count)
        updates, state = tx.update(grads, state, params, count=count)
        assert jax.typeof(updates["w1"]).sharding.spec == P("data", None)
        return optax.apply_updates(params, updates), state

    params = jax.device_put(_params(), data)
    state = tx.init(params)
    for mb in batches:
        params, state = step(params, state, jax.device_put(mb, data))

    ref_tx = mm.MaskedMultiSteps(inner(), K)

    @jax.jit
    def ref_step(params, state, mb):
        (_, count), grads = jax.value_and_grad(_loss, has_aux=True)(params, mb)
        return ref_tx.apply_gradients(grads, state, params, count=count)

    ref, ref_state = _params(), ref_tx.init(_params())
    for mb in batches:
        ref, ref_state = ref_step(ref, ref_state, mb)
    assert int(state.gradient_step) == int(ref_state.gradient_step) == len(batches) // K
    chex.assert_trees_all_close(jax.device_get(params), ref, **TOL)


@pytest.mark.parametrize("jitted", [True, False], ids=["jit", "eager"])
def test_per_device_inputs_built_by_hand_meet_the_explicit_accumulator(jitted):
    """On an explicit data axis the accumulator's device axis is sharded over
    "data" in its type; per-device gradients, counts and values stacked by hand
    (replicated, or on one device) are resharded to it (jax's vmap refused the
    two shardings of the device axis), and give what sharded ones give."""
    grid = jax.make_mesh((NDEV,), ("data",))
    data = NamedSharding(grid, P("data"))
    rng = np.random.default_rng(11)
    grads = [{"w": rng.normal(size=(NDEV, 3)).astype(np.float32)} for _ in range(K)]
    counts = [rng.integers(0, 5, size=NDEV).astype(np.float32) for _ in range(K)]
    values = [rng.uniform(1, 2, size=NDEV).astype(np.float32) for _ in range(K)]
    runs = []
    with jax.set_mesh(grid):  # eager steps on an explicit mesh need it
        params = jax.device_put(
            {"w": np.zeros(3, np.float32)}, NamedSharding(grid, P())
        )
        for place in (lambda x: jax.device_put(x, data), jnp.asarray):
            tx = mm.MaskedMultiSteps(optax.adam(0.1), K, reduction=mm.deferred(grid))
            step = jax.jit(tx.apply_gradients) if jitted else tx.apply_gradients
            p, state = params, tx.init(params)
            for g, n, v in zip(grads, counts, values, strict=True):
                p, state = step(
                    jax.tree.map(place, g), state, p, count=place(n), value=place(v)
                )
            assert int(state.gradient_step) == 1
            runs.append(jax.device_get((p, state.inner_opt_state)))
    chex.assert_trees_all_equal(*runs)


def test_unreduced_gradients_are_refused_with_the_deferred_recipe():
    """Gradients with respect to params resharded to ``P(reduced=...)`` come
    back unreduced (a partial sum on every device); jax refused them deep in
    the running mean (a ShardingTypeError in a `select`)."""
    grid = jax.make_mesh((NDEV,), ("data",))
    batch = _batch(NDEV * ROWS, seed=3)
    with jax.set_mesh(grid):
        params = jax.device_put(_params(), NamedSharding(grid, P()))
        sharded = jax.device_put(batch, NamedSharding(grid, P("data")))

        def partial_sums(params, mb):
            reduced = jax.sharding.reshard(params, P(reduced={"data"}))
            return jax.value_and_grad(_loss, has_aux=True)(reduced, mb)

        (loss, count), grads = jax.jit(partial_sums)(params, sharded)
        assert jax.typeof(grads["w1"]).sharding.spec.unreduced == {"data"}
        tx = mm.MaskedMultiSteps(optax.sgd(0.1), 2)
        state = tx.init(params)
        match = (
            r"gradient at \['w1'\] is unreduced over the mesh axes \['data'\].*"
            r"mm.per_device_value_and_grad.*reduction=mm.deferred"
        )
        for call in (
            lambda: jax.jit(tx.update)(grads, state, params, count=count),
            lambda: tx.apply_gradients(grads, state, params, count=count),
        ):
            with pytest.raises(ValueError, match=match):
                call()


def test_a_state_for_another_number_of_devices_is_refused(mesh):
    half = jax.make_mesh(
        (NDEV // 2,), ("data",), axis_types=(AUTO,), devices=jax.devices()[: NDEV // 2]
    )
    tx = mm.MaskedMultiSteps(optax.sgd(0.1), 2, reduction=mm.deferred(mesh, "data"))
    other = mm.MaskedMultiSteps(optax.sgd(0.1), 2, reduction=mm.deferred(half, "data"))
    w = jnp.zeros(3)
    with pytest.raises(ValueError, match=r"running means for 4 devices.*has 8"):
        tx.update(jnp.ones((NDEV, 3)), other.init(w), w, count=jnp.ones(NDEV))


def test_an_optax_multisteps_state_converts_into_the_deferred_mode_at_a_window_start(
    mesh,
):
    params = {"w": jnp.zeros(3)}
    old = optax.MultiSteps(optax.sgd(0.1), 2)
    tx = mm.MaskedMultiSteps(optax.sgd(0.1), 2, reduction=mm.deferred(mesh, "data"))
    state = mm.from_optax_multisteps(old.init(params), tx, params)
    chex.assert_trees_all_equal_shapes(state, tx.init(params))
    _, mid = old.update({"w": jnp.ones(3)}, old.init(params), params)
    with pytest.raises(ValueError, match=r"reduction=mm.deferred.*mini_step 1"):
        mm.from_optax_multisteps(mid, tx, params, acc_count=4)
    with pytest.raises(ValueError, match=r"`params` must be the params"):
        mm.from_optax_multisteps(old.init(params), tx, {"w": jnp.zeros(4)})


# ------------------------------------------------ the wrapper, deferred mode

WINDOWS = 2
EMPTY_DEVICE = 2  # its rows hold no tokens in any microbatch
EMPTY_MICROBATCH = 1  # no tokens on any device


def _keeps_its_input():
    """A transformation whose state is its last input (laid out as the params
    by ``init``), passed through."""
    return optax.GradientTransformation(
        lambda params: jax.tree.map(jnp.zeros_like, params),
        lambda updates, state, params=None: (updates, updates),
    )


def _params_on(grid, placement):
    """:func:`_params`, each leaf laid out on ``grid`` by its spec in ``placement``."""
    return {
        key: jax.device_put(value, NamedSharding(grid, placement[key]))
        for key, value in _params().items()
    }


def _microbatches():
    out = []
    for i in range(K * WINDOWS):
        mb = _batch(NDEV * ROWS, seed=10 + i, empty_device=EMPTY_DEVICE)
        if i == EMPTY_MICROBATCH:
            mb["mask"][:] = False
        out.append(mb)
    return out


def _tx(reduction=None, **kwargs):
    """adamw, then the window's loss recorded in ``inner_opt_state[1]``."""
    return mm.MaskedMultiSteps(
        optax.chain(optax.adamw(1e-1, weight_decay=1e-2), records_value()),
        K,
        reduction=reduction,
        **kwargs,
    )


@functools.cache
def _reference_step():
    """The reference's wrapper and jitted step (one compile per process)."""
    tx = _tx()

    @jax.jit
    def step(params, state, mb):
        (loss, count), grads = jax.value_and_grad(_loss, has_aux=True)(params, mb)
        return tx.apply_gradients(grads, state, params, count=count, value=loss)

    return tx, step


def _single_device_run(batches):
    """The reference: one device, each microbatch's full batch, no reduction."""
    device = jax.devices()[0]
    tx, step = _reference_step()
    params = jax.device_put(_params(), device)
    state = tx.init(params)
    for mb in batches:
        params, state = step(params, state, jax.device_put(mb, device))
    assert int(state.gradient_step) == len(batches) // K
    return params, state


def _deferred_step(mesh, tx):
    grad_fn = mm.per_device_value_and_grad(_loss, mesh, "data")

    def step(params, state, mb):
        (loss, count), grads = grad_fn(params, mb)
        updates, state = tx.update(grads, state, params, count=count, value=loss)
        return optax.apply_updates(params, updates), state

    return step


def _assert_once_per_window(compiled_text, synced_counts=False):
    found = large(collectives(compiled_text), min_bytes=4 * H)
    assert [(c.kind, c.where) for c in found] == [("all-reduce", "branch")], found
    # (XLA may fold a scalar of the window's, e.g. its loss, into it.)
    assert PARAM_BYTES <= found[0].bytes <= PARAM_BYTES + 16, found
    small = [c for c in collectives(compiled_text) if c not in found]
    if not synced_counts:
        # With a window of k microbatches and no skip function nothing needs a
        # microbatch's global count before the window closes: the devices
        # agree on the window's token total, invalid counts and loss at its
        # end, beside the gradients. Between window ends, no communication.
        assert small, "the window's scalar totals are reduced at its end"
        assert all(c.kind == "all-reduce" and c.where == "branch" for c in small)
        assert all(c.bytes <= 16 for c in small), small
        return
    # Token budgets, skip functions and statistics need every microbatch's
    # global count: per microbatch, scalar all-reduces only: the global token
    # count with the number of bad counts (8 bytes), the loss's global mean
    # (`value=`) and the skip function's verdict.
    step = [c for c in small if c.where == "step"]
    assert {c.kind for c in step} == {"all-reduce"}, small
    assert 8 in {c.bytes for c in step} and max(c.bytes for c in step) <= 8, small


@both_axis_types
@pytest.mark.parametrize("synced", [False, True], ids=["per-window", "synced"])
def test_plain_loop_deferred_equals_single_device_and_reduces_once(mesh, synced):
    """Params and the window's loss equal one device's full-batch run, whether
    the devices agree on the counts only at the window's end (the default for
    a window of k microbatches) or on every microbatch (a skip function needs
    them)."""
    batches = _microbatches()
    skip = optax.skip_not_finite if synced else None
    tx = _tx(mm.deferred(mesh, "data"), should_skip_update_fn=skip)
    step = jax.jit(_deferred_step(mesh, tx), donate_argnums=(0, 1))
    params = jax.device_put(_params(), NamedSharding(mesh, P()))
    state = tx.init(params)
    data = NamedSharding(mesh, P("data"))
    assert state.acc_grads["w1"].shape == (NDEV, H, D)
    assert state.acc_grads["w1"].sharding.is_equivalent_to(data, 3)
    assert state.reduction_state.counts.sharding.is_equivalent_to(data, 1)
    _assert_once_per_window(
        step.lower(params, state, jax.device_put(batches[0], data)).compile().as_text(),
        synced_counts=synced,
    )
    with backend_compiles() as compiles:
        for i, mb in enumerate(batches):
            params, state = step(params, state, jax.device_put(mb, data))
            counts = np.asarray(state.reduction_state.counts)
            assert counts[EMPTY_DEVICE] == 0
            _check_window_totals(i, counts, state, synced)
    # tx.init puts its scalars (and adam's count) on the mesh, replicated, and
    # the accumulator as jit returns it: the first step's state is laid out as
    # every later one's, so every step runs what `step.lower(...)` compiled
    # above (the second step compiled it again). On an explicit data axis the
    # accumulator's spec names each dimension, as the step's type does: one
    # that differed only in spelling (P("data") for P("data", None, None))
    # took a second entry of jit's cache.
    assert not compiles, compiles
    assert _specs(state) == _specs(tx.init(params))

    ref_params, ref_state = _single_device_run(batches)
    assert int(state.gradient_step) == WINDOWS
    chex.assert_trees_all_close(params, ref_params, **TOL, strict=True)
    assert not np.allclose(params["w1"], _params()["w1"])
    # The last window's token-weighted loss, as its inner optimizer saw it.
    loss, ref_loss = state.inner_opt_state[1], ref_state.inner_opt_state[1]
    assert np.isfinite(ref_loss)
    np.testing.assert_allclose(loss, ref_loss, **TOL)


@pytest.mark.parametrize(
    ("types", "spec"),
    [
        ((EXPLICIT, EXPLICIT), P("model", None)),
        ((EXPLICIT, AUTO), P("model", None)),
        ((EXPLICIT, AUTO), P(None, None)),
        ((AUTO, EXPLICIT), P("model", None)),
        ((AUTO, AUTO), P(None, "model")),
    ],
    ids=["EE", "EA", "EA-replicated", "AE", "AA"],
)
def test_the_state_is_laid_out_as_a_step_returns_it_on_2d_meshes(types, spec):
    # The accumulator's spec is spelt as the compiled step spells it: in full
    # where every axis it names is explicit (another spelling, equivalent, took
    # a second entry in jit's cache). Where an auto axis is named, jax spells
    # the output as an input of the same sharding (here the gradients, spelt
    # like the params), else without trailing Nones, as `init` does.
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=types)
    with jax.set_mesh(mesh):
        params = {"w": jax.device_put(jnp.ones((4, 6)), NamedSharding(mesh, spec))}
        tx = mm.MaskedMultiSteps(optax.adam(0.1), 2, reduction=mm.deferred(mesh))
        state = tx.init(params)
        grads = jax.device_put(
            {"w": jnp.ones((4, 4, 6))}, NamedSharding(mesh, P("data", *spec))
        )
        counts = jax.device_put(jnp.arange(1.0, 5.0), NamedSharding(mesh, P("data")))
        step = jax.jit(lambda g, s, p, c: tx.update(g, s, p, count=c))
        _, after = step(grads, state, params, counts)
        if AUTO not in types:
            step(grads, after, params, counts)
            assert step._cache_size() == 1
    # (The inner state follows the params, laid out by the user.)
    own = lambda s: _specs(s._replace(inner_opt_state=()))
    assert own(after) == own(state)


@pytest.mark.parametrize(
    ("types", "spec"),
    [((EXPLICIT, AUTO), P()), ((AUTO, EXPLICIT), P(None, "model"))],
    ids=["EA", "AE-model"],
)
def test_a_jitted_init_shards_the_accumulator_on_a_mesh_with_auto_axes_too(types, spec):
    # On an explicit data axis beside an auto model axis, `jax.jit(tx.init)`
    # replicated the accumulator (every device held all D running means):
    # jax's device_put under jit does there. (On an auto data axis beside an
    # explicit model axis, params split over the model axis: placed too.)
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=types)
    tx = mm.MaskedMultiSteps(optax.sgd(0.1), 2, reduction=mm.deferred(mesh))
    with jax.set_mesh(mesh):
        params = {"w": jax.device_put(jnp.ones((4, 6)), NamedSharding(mesh, spec))}
        state = jax.jit(tx.init)(params)
        eager = tx.init(params)
    got, want = state.acc_grads["w"].sharding, eager.acc_grads["w"].sharding
    assert want.spec[0] == "data" and got.is_equivalent_to(want, 3)


def test_a_jitted_init_on_a_mixed_mesh_without_the_mesh_set_warns_or_fails():
    # jax replicates the accumulator there (device_put under jit), and a
    # reshard needs the mesh set: said, not silent. On an automatic data axis
    # the steps run on the replicated state (every device holds every
    # device's running mean); on an explicit one the first step failed inside
    # jax ("Mapped away dimension of inputs passed to vmap should be sharded
    # the same"), after the warning: refused at once.
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AUTO, EXPLICIT))
    tx = mm.MaskedMultiSteps(optax.sgd(0.1), 2, reduction=mm.deferred(mesh))
    params = jax.device_put(jnp.ones((4, 6)), NamedSharding(mesh, P(None, "model")))
    with pytest.warns(UserWarning, match=r"under `jax.set_mesh\(mesh\)`"):
        state = jax.jit(tx.init)({"w": params})
    grad_fn = mm.per_device_value_and_grad(
        lambda p, b: mm.masked_mean(b["x"] @ p["w"], b["mask"]), mesh
    )
    batch = {"x": jnp.ones((8, 4)), "mask": jnp.ones((8, 6), bool)}
    batch = jax.device_put(batch, NamedSharding(mesh, P("data")))

    @jax.jit
    def step(params, state, batch):
        (loss, count), grads = grad_fn(params, batch)
        return tx.apply_gradients(grads, state, params, count=count, value=loss)

    trained = {"w": params}
    for _ in range(2):
        trained, state = step(trained, state, batch)
    assert int(state.gradient_step) == 1
    assert not np.array_equal(trained["w"], params)
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(EXPLICIT, AUTO))
    tx = mm.MaskedMultiSteps(optax.sgd(0.1), 2, reduction=mm.deferred(mesh))
    with pytest.raises(ValueError, match=r"cannot lay the accumulator out over the"):
        jax.jit(tx.init)({"w": jnp.ones((4, 6))})


@pytest.mark.parametrize(
    "build",
    [
        mm.deferred,
        functools.partial(mm.per_device_value_and_grad, _loss),
        functools.partial(mm.data_parallel_value_and_grad, _loss),
    ],
    ids=["deferred", "per_device", "data_parallel"],
)
def test_data_axes_of_both_types_are_refused_when_built(build):
    # The first update, or the first call, failed in jax's reshard ("cannot
    # contain axis names that are of type Auto"), whatever the batch's layout.
    mesh = jax.make_mesh((4, 2), ("a", "b"), axis_types=(EXPLICIT, AUTO))
    with pytest.raises(
        ValueError, match=r"`axis_name` must name data axes of one type"
    ):
        build(mesh, ("a", "b"))


def _specs(tree):
    """Every leaf's sharding spec, as spelt (equivalent specs may differ)."""
    return [x.sharding.spec for x in jax.tree.leaves(tree)]


def _check_window_totals(i, counts, state, synced):
    if (i + 1) % K == 0:
        assert not counts.any() and int(state.acc_count) == 0
    elif synced:  # mid-window: per-device totals add up to the global one
        assert counts.sum() == int(state.acc_count) > 0
    else:  # the global total is formed only when the window closes
        assert counts.sum() > 0 and int(state.acc_count) == 0


def test_automatic_sharding_reduces_every_microbatch(mesh):
    """What the deferred mode saves: without it, the compiler all-reduces every
    microbatch's gradient at the step's top level."""
    tx = _tx()

    def step(params, state, mb):
        (loss, count), grads = jax.value_and_grad(_loss, has_aux=True)(params, mb)
        return tx.apply_gradients(grads, state, params, count=count, value=loss)

    params = jax.device_put(_params(), NamedSharding(mesh, P()))
    mb = jax.device_put(_microbatches()[0], NamedSharding(mesh, P("data")))
    text = jax.jit(step).lower(params, tx.init(params), mb).compile().as_text()
    found = large(collectives(text), min_bytes=4 * H)
    assert {c.where for c in found} == {"step"}, found
    assert sum(c.bytes for c in found) >= PARAM_BYTES


@both_axis_types
@pytest.mark.parametrize("window_stats", [False, True], ids=["", "stats"])
def test_train_state_deferred_equals_single_device(mesh, window_stats):
    """With window statistics too, nothing crosses devices between window ends:
    every device keeps its share of them until the window closes."""
    batches = _microbatches()
    tx = _tx(mm.deferred(mesh, "data"), window_stats=window_stats)
    grad_fn = mm.per_device_value_and_grad(_loss, mesh, "data")
    state = mm.TrainState.create(
        apply_fn=None, params=jax.device_put(_params(), NamedSharding(mesh, P())), tx=tx
    )

    @jax.jit
    def train_step(state, mb):
        (loss, count), grads = grad_fn(state.params, mb)
        return state.apply_gradients(grads=grads, count=count, value=loss)

    _assert_once_per_window(
        train_step.lower(
            state, jax.device_put(batches[0], NamedSharding(mesh, P("data")))
        )
        .compile()
        .as_text()
    )
    for mb in batches:
        state = train_step(state, jax.device_put(mb, NamedSharding(mesh, P("data"))))
    assert (int(state.step), int(state.gradient_step)) == (K * WINDOWS, WINDOWS)
    ref_params, ref_state = _single_device_run(batches)
    chex.assert_trees_all_close(state.params, ref_params, **TOL, strict=True)
    if window_stats:
        last = mm.window_stats(state.opt_state)
        tokens = sum(int(mb["mask"].sum()) for mb in batches[-K:])
        assert float(last.tokens) == tokens
        # Every device's share with tokens is a small batch (one device empty).
        assert int(last.microbatches) == K * (NDEV - 1)
        np.testing.assert_allclose(last.loss, ref_state.inner_opt_state[1], **TOL)
        assert np.isfinite(last.grad_var_trace) and last.grad_var_trace > 0


@pytest.mark.filterwarnings("ignore:The inner optimizer needs `value=`")
def test_train_state_refuses_params_a_deferred_gradient_would_reshape(mesh):
    # A multi_transform branch without the wrapper got the per-device (D, ...)
    # gradients, and optax.apply_updates broadcast its params to (D, ...):
    # silently, until a later step failed somewhere else.
    tx = optax.multi_transform(
        {"train": _tx(mm.deferred(mesh, "data")), "freeze": optax.set_to_zero()},
        {"w1": "train", "w2": "freeze"},
    )
    grad_fn = mm.per_device_value_and_grad(_loss, mesh, "data")
    state = mm.TrainState.create(
        apply_fn=None, params=jax.device_put(_params(), NamedSharding(mesh, P())), tx=tx
    )
    mb = jax.device_put(_microbatches()[0], NamedSharding(mesh, P("data")))
    (_, count), grads = grad_fn(state.params, mb)
    # jax's default, under which the suite's "raise" did not catch it either.
    with (
        jax.numpy_rank_promotion("allow"),
        pytest.raises(
            ValueError,
            match=rf"shape of params\['w2'\] \({H},\) -> \({NDEV}, {H}\).*"
            "keep the wrapper outermost",
        ),
    ):
        state.apply_gradients(grads=grads, count=count)


@both_axis_types
def test_nnx_optimizer_deferred_equals_single_device(mesh):
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, params):
            self.w1 = nnx.Param(params["w1"])
            self.w2 = nnx.Param(params["w2"])

        def __call__(self, mb):
            return _loss({"w1": self.w1[...], "w2": self.w2[...]}, mb)

    batches = _microbatches()
    model = MLP(jax.device_put(_params(), NamedSharding(mesh, P())))
    optimizer = nnx.Optimizer(model, _tx(mm.deferred(mesh, "data")), wrt=nnx.Param)
    graphdef, _ = nnx.split(model)
    grad_fn = mm.per_device_value_and_grad(
        lambda params, mb: nnx.merge(graphdef, params)(mb), mesh, "data"
    )

    @nnx.jit
    def train_step(model, optimizer, mb):
        (loss, count), grads = grad_fn(nnx.state(model, nnx.Param), mb)
        optimizer.update(model, grads, count=count, value=loss)

    _assert_once_per_window(
        train_step.lower(
            model, optimizer, jax.device_put(batches[0], NamedSharding(mesh, P("data")))
        )
        .compile()
        .as_text()
    )
    for mb in batches:
        train_step(model, optimizer, jax.device_put(mb, NamedSharding(mesh, P("data"))))
    assert int(optimizer.opt_state.gradient_step[...]) == WINDOWS
    ref_params, _ = _single_device_run(batches)
    chex.assert_trees_all_close(
        {"w1": model.w1[...], "w2": model.w2[...]}, ref_params, **TOL, strict=True
    )


@both_axis_types
def test_nnx_deferred_checkpoint_mid_window_restores_with_a_mesh_template(
    mesh, tmp_path
):
    """The README's NNX checkpoint on a mesh: nnx.Optimizer's own step counter
    starts on one device, and orbax restores each array onto its template's
    devices, so the template puts every leaf on the mesh; the resumed run is
    bit-identical."""
    import orbax.checkpoint as ocp
    from flax import nnx

    def make():
        model = nnx.Linear(D, 1, rngs=nnx.Rngs(0))
        tx = mm.MaskedMultiSteps(optax.adamw(1e-1), K, reduction=mm.deferred(mesh))
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

    model, optimizer = make()
    graphdef, _ = nnx.split(model)
    grad_fn = mm.per_device_value_and_grad(
        lambda params, mb: mm.masked_mean(
            (nnx.merge(graphdef, params)(mb["x"])[..., 0] - mb["y"]) ** 2, mb["mask"]
        ),
        mesh,
        "data",
    )

    @nnx.jit
    def train_step(model, optimizer, mb):
        (loss, count), grads = grad_fn(nnx.state(model, nnx.Param), mb)
        optimizer.update(model, grads, count=count, value=loss)

    rng = np.random.default_rng(0)
    batches = [
        jax.device_put(
            {
                "x": rng.normal(size=(NDEV * ROWS, D)).astype(np.float32),
                "y": rng.normal(size=(NDEV * ROWS,)).astype(np.float32),
                "mask": rng.random(NDEV * ROWS) < 0.7,
            },
            NamedSharding(mesh, P("data")),
        )
        for _ in range(2 * K)
    ]
    for mb in batches[: K + 1]:  # one window and one microbatch into the next
        train_step(model, optimizer, mb)
    assert int(optimizer.opt_state.mini_step[...]) == 1
    checkpointer = ocp.StandardCheckpointer()
    path = tmp_path / "ckpt"
    checkpointer.save(path, {"model": nnx.state(model), "opt": nnx.state(optimizer)})
    checkpointer.wait_until_finished()
    for mb in batches[K + 1 :]:
        train_step(model, optimizer, mb)

    resumed_model, resumed_optimizer = make()

    def on_mesh(x):  # as the README's recipe
        if isinstance(x.sharding, NamedSharding):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P()))

    template = {"model": nnx.state(resumed_model), "opt": nnx.state(resumed_optimizer)}
    restored = checkpointer.restore(path, jax.tree.map(on_mesh, template))
    nnx.update(resumed_model, restored["model"])
    nnx.update(resumed_optimizer, restored["opt"])
    for mb in batches[K + 1 :]:
        train_step(resumed_model, resumed_optimizer, mb)
    assert int(resumed_optimizer.opt_state.gradient_step[...]) == 2
    chex.assert_trees_all_equal(
        nnx.state((model, optimizer)), nnx.state((resumed_model, resumed_optimizer))
    )
    checkpointer.close()


def test_deferred_boxed_gradients_are_refused_with_the_unbox_hint(mesh):
    """Boxes serve placement; per-device gradients boxed with the params' names
    do not match the accumulator's (device axis in front): named, not a bare
    tree-structure mismatch."""
    import flax.linen as nn

    params = {"w": nn.Partitioned(jnp.zeros((4, 3)), names=(None, None))}
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 2, reduction=mm.deferred(mesh, "data"))
    state = tx.init(params)
    grads = {"w": nn.Partitioned(jnp.ones((NDEV, 4, 3)), names=(None, None))}
    with pytest.raises(
        ValueError,
        match=r"boxed with the params' sharding names.*"
        r"train on unboxed params and gradients \(nn.unbox\)",
    ):
        tx.update(grads, state, params, count=jnp.ones(NDEV))
    # The caller's boxes are left as they were.
    assert grads["w"].names == (None, None)


def test_deferred_accumulator_names_its_device_axis_in_flax_metadata():
    """Params boxed with sharding names (linen's nn.Partitioned, NNX's
    out_sharding): flax places optimizer state by the boxes' names, so the
    per-device accumulator's names lead with the device axis (a dim sharded over
    the data axis itself, FSDP-style, held whole), as its sharding does. The
    params' own names made flax shard the device axis over "model" (an error
    for 2 devices over 4) or replicate it."""
    import flax.linen as nn
    from flax import nnx

    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AUTO, AUTO))
    tx = mm.MaskedMultiSteps(optax.adam(0.1), 2, reduction=mm.deferred(mesh, "data"))
    for names, want in [
        (("model", None), P("data", "model", None)),
        (("data", "model"), P("data", None, "model")),
    ]:
        dense = nn.Dense(
            8,
            kernel_init=nn.with_partitioning(nn.initializers.ones, names),
            use_bias=False,
        )

        def init_fn(rng, dense=dense):
            params = dense.init(rng, jnp.ones((2, 8)))["params"]
            return mm.TrainState.create(apply_fn=dense.apply, params=params, tx=tx)

        specs = nn.get_partition_spec(jax.eval_shape(init_fn, jax.random.key(0)))
        assert specs.opt_state.acc_grads["kernel"] == want
        shardings = jax.tree.map(
            lambda spec: NamedSharding(mesh, spec),
            specs,
            is_leaf=lambda x: isinstance(x, P),
        )
        state = jax.jit(init_fn, out_shardings=shardings)(jax.random.key(0))
        assert state.opt_state.acc_grads["kernel"].value.sharding.spec == want

        class Model(nnx.Module):
            def __init__(self, names=names):
                self.w = nnx.Param(jnp.ones((8, 4)), out_sharding=names)

        with jax.set_mesh(mesh):
            optimizer = nnx.Optimizer(Model(), tx, wrt=nnx.Param)
        acc = optimizer.opt_state.acc_grads["w"]
        assert acc.get_metadata()["out_sharding"] == tuple(want)
        assert acc[...].sharding.spec == want and acc[...].shape == (2, 8, 4)

        # Names for the optimizer state alone (`optimizer_sharding`, which
        # nnx.Optimizer makes its state's `out_sharding`): the accumulator's
        # lead with the device axis too. Without it, flax split the device
        # axis over "model" (jax's IndivisibleError for 2 devices over 4).
        class OptimizerNames(nnx.Module):
            def __init__(self, names=names):
                self.w = nnx.Param(
                    jnp.ones((8, 4)),
                    out_sharding=(None, None),
                    optimizer_sharding=names,
                )

        with jax.set_mesh(mesh):
            optimizer = nnx.Optimizer(OptimizerNames(), tx, wrt=nnx.Param)
        acc = optimizer.opt_state.acc_grads["w"]
        assert acc.get_metadata()["out_sharding"] == tuple(want)
        assert acc[...].shape == (2, 8, 4)
        assert (
            nnx.get_partition_spec(nnx.state(optimizer))["opt_state"]["acc_grads"][
                "w"
            ].get_value()
            == want
        )


@pytest.mark.default_emitters
@both_axis_types
def test_fsdp_reduce_every_microbatch_or_defer_is_a_memory_choice(mesh):
    """Params sharded over the data axis (FSDP): reducing every microbatch keeps
    the accumulator at 1/D of the gradients per device; deferring needs a full
    local buffer per device. Compiled figures, per device. (On an explicit
    axis, mm.per_device_value_and_grad gathers the params itself, as the
    compiler does under automatic sharding.)"""
    width = 64
    param_bytes = 2 * width * width * 4

    def loss(p, b):
        h = jnp.tanh(b["x"] @ p["w1"]) @ p["w2"]
        return mm.masked_mean((h - b["y"]) ** 2, b["mask"])

    fsdp = NamedSharding(mesh, P("data"))
    params = jax.device_put({"w1": jnp.eye(width), "w2": jnp.eye(width)}, fsdp)
    rng = np.random.default_rng(6)
    batch = jax.device_put(
        {
            "x": rng.normal(size=(NDEV * ROWS, width)).astype(np.float32),
            "y": rng.normal(size=(NDEV * ROWS, width)).astype(np.float32),
            "mask": rng.random((NDEV * ROWS, width)) < 0.8,
        },
        fsdp,
    )
    figures = {}
    for name, reduction in [("every", None), ("deferred", mm.deferred(mesh))]:
        tx = mm.MaskedMultiSteps(optax.adam(1e-3), K, reduction=reduction)
        state = tx.init(params)
        if reduction is None:
            grad_fn = jax.value_and_grad(loss, has_aux=True)
        else:
            grad_fn = mm.per_device_value_and_grad(loss, mesh)

        def step(params, state, batch, tx=tx, grad_fn=grad_fn):
            (_, count), grads = grad_fn(params, batch)
            return tx.apply_gradients(grads, state, params, count=count)

        compiled = (
            jax.jit(step, donate_argnums=(0, 1)).lower(params, state, batch).compile()
        )
        memory = compiled.memory_analysis()
        device = jax.devices()[0]
        acc = sum(
            s.data.nbytes
            for x in jax.tree.leaves(state.acc_grads)
            for s in x.addressable_shards
            if s.device == device
        )
        found = large(collectives(compiled.as_text()), min_bytes=4 * width)
        reduced = [c for c in found if c.kind != "all-gather"]
        figures[name] = (
            acc,
            memory.argument_size_in_bytes,
            memory.argument_size_in_bytes + memory.temp_size_in_bytes,
        )
        if reduction is None:
            assert {c.where for c in reduced} == {"step"}, found
        else:
            assert {c.where for c in reduced} == {"branch"}, found
    assert figures["every"][0] == param_bytes // NDEV
    assert figures["deferred"][0] == param_bytes
    # The full local accumulator shows in the compiled arguments, and under
    # automatic sharding in the whole footprint too. (Under explicit sharding
    # the step that reduces every microbatch gathers its weights into larger
    # temporaries, e.g. 84 KB against 54 KB here.)
    extra = [d - e for d, e in zip(figures["deferred"], figures["every"])]
    assert extra[1] >= (1 - 1 / NDEV) * param_bytes, figures
    if mesh.axis_types == (AUTO,):
        assert extra[2] >= (1 - 1 / NDEV) * param_bytes, figures
    else:
        assert extra[2] > 0, figures


def test_deferred_composes_with_optax_chain(mesh):
    """An inner chain sees the global mean; the wrapper inside an outer chain
    takes the per-device counts as an extra argument."""
    batches = _microbatches()[:K]
    inner = optax.chain(optax.clip_by_global_norm(0.5), optax.sgd(0.1))
    data = NamedSharding(mesh, P("data"))
    grad_fn = mm.per_device_value_and_grad(_loss, mesh, "data")
    results = []
    for outer in (False, True):
        wrapper = mm.MaskedMultiSteps(inner, K, reduction=mm.deferred(mesh, "data"))
        tx = optax.chain(wrapper.gradient_transformation()) if outer else wrapper
        params = jax.device_put(_params(), NamedSharding(mesh, P()))
        state = tx.init(params)

        @jax.jit
        def step(params, state, mb, tx=tx):
            (_, count), grads = grad_fn(params, mb)
            updates, state = tx.update(grads, state, params, count=count)
            return optax.apply_updates(params, updates), state

        for mb in batches:
            params, state = step(params, state, jax.device_put(mb, data))
        results.append(params)

    device = jax.devices()[0]
    full = jax.tree.map(lambda *xs: np.concatenate(xs), *batches)
    _, grads = jax.value_and_grad(_loss, has_aux=True)(
        _params(), jax.device_put(full, device)
    )
    updates, _ = inner.update(grads, inner.init(_params()))
    expected = optax.apply_updates(_params(), updates)
    for params in results:
        chex.assert_trees_all_close(params, expected, **TOL)


def test_deferred_bad_input(mesh):
    tx = _tx(mm.deferred(mesh, "data"))
    params = _params()
    state = tx.init(params)
    per_device = jax.tree.map(lambda p: jnp.stack([p] * NDEV), params)
    counts = jnp.arange(NDEV)
    with pytest.raises(ValueError, match=r"leading device axis of size 8.*\(16, 3\)"):
        tx.update(params, state, params, count=counts)
    with pytest.raises(
        ValueError, match=r"`count` \(every device's .*shape \(8,\), got shape \(\)"
    ):
        tx.update(per_device, state, params, count=jnp.array(3))
    # Not an array at all: the wrong kind, as without the deferred reduction.
    for count in ("abc", [1] * NDEV):
        with pytest.raises(
            TypeError, match=r"`count` \(every device's .*shape \(8,\), got .* of type"
        ):
            tx.update(per_device, state, params, count=count)
    with pytest.raises(
        ValueError,
        match=r"`count` \(every device's .*\)\[3\] must be non-negative, got -1",
    ):
        tx.update(per_device, state, params, count=counts.at[3].set(-1))
    with pytest.raises(TypeError, match=r"got a bool"):
        tx.update(per_device, state, params, count=True)
    with pytest.raises(TypeError, match=r"integer or floating array, got dtype bool"):
        tx.update(per_device, state, params, count=counts > 2)
    with pytest.raises(ValueError, match=r"`value` is a scalar or one value per"):
        tx.update(per_device, state, params, count=counts, value=jnp.ones(3))
    # Per-device values as a list: not numbers is the wrong kind; a Python int
    # too large for any array, a wrong value.
    with pytest.raises(TypeError, match=r"`value` must be a real number, got \["):
        tx.update(per_device, state, params, count=counts, value=[None] * NDEV)
    with pytest.raises(ValueError, match=r"`value` holds a number too large, got"):
        tx.update(per_device, state, params, count=counts, value=[10**400] * NDEV)
    with pytest.raises(TypeError, match=r"`reduction` must be None or mm.deferred"):
        mm.MaskedMultiSteps(optax.sgd(1.0), 2, reduction="deferred")
    # One gradient for all devices, where a parameter's leading size is the
    # device count (so it passes for a device axis): the shape check says why.
    square = {"w": jnp.ones((NDEV, 3))}
    with pytest.raises(
        ValueError,
        match=r"\(8, 3\), but the state expects \(8, 8, 3\): the state keeps one "
        r"running mean per device.*mm.per_device_value_and_grad",
    ):
        tx.update(square, tx.init(square), square, count=counts)
    # Per-device gradients into a wrapper without the deferred reduction.
    plain = _tx(None)
    with pytest.raises(
        ValueError,
        match=r"\(8, 16, 3\).*expects \(16, 3\): one per device\?.*"
        r"reduction=mm.deferred.*Per-example gradients are not taken",
    ):
        plain.update(per_device, plain.init(params), params, count=jnp.int32(3))
    # per_device_value_and_grad's float32 counts with an int32 count_dtype.
    int_counts = mm.MaskedMultiSteps(
        optax.sgd(1.0), K, reduction=mm.deferred(mesh, "data"), count_dtype=jnp.int32
    )
    with pytest.raises(TypeError, match=r"count.astype\(int32\)"):
        int_counts.update(
            per_device,
            int_counts.init(params),
            params,
            count=counts.astype(jnp.float32),
        )
    # Under jit, where the devices agree on every microbatch's count (here:
    # a skip function needs it), a bad per-device count skips the microbatch
    # on every device.
    synced = mm.MaskedMultiSteps(
        optax.sgd(1.0),
        K,
        reduction=mm.deferred(mesh, "data"),
        should_skip_update_fn=optax.skip_not_finite,
    )
    _, new = jax.jit(lambda s, c: synced.update(per_device, s, params, count=c))(
        synced.init(params), counts.at[3].set(-1)
    )
    assert int(new.num_invalid_counts) == 1 and int(new.mini_step) == 0
    assert not np.asarray(new.reduction_state.counts).any()


def test_deferred_per_window_invalid_count_drops_that_devices_share(mesh):
    """Where the devices agree only at the window's end, a traced bad count on
    one device drops that device's share: the window equals the same window
    with that device's count 0, and the bad count is tallied when it closes."""
    tx = _tx(mm.deferred(mesh, "data"))
    params = jax.device_put(_params(), NamedSharding(mesh, P()))
    data = NamedSharding(mesh, P("data"))
    grad_fn = mm.per_device_value_and_grad(_loss, mesh, "data")
    batches = [jax.device_put(mb, data) for mb in _microbatches()[:K]]

    def run(bad_count):
        @jax.jit
        def step(params, state, mb, i):
            (loss, count), grads = grad_fn(params, mb)
            count = jnp.where(i == 2, count.at[5].set(bad_count), count)
            return tx.apply_gradients(grads, state, params, count=count, value=loss)

        state = tx.init(params)
        out = params
        for i, mb in enumerate(batches):
            out, state = step(out, state, mb, i)
            if i == 2:
                assert int(state.mini_step) == 3  # the microbatch still counts
                assert int(state.num_invalid_counts) == 0  # tallied at the end
                assert int(state.reduction_state.invalid[5]) == int(bad_count != 0)
        return out, state

    got, state = run(-1.0)
    assert int(state.num_invalid_counts) == 1 and int(state.gradient_step) == 1
    assert not np.asarray(state.reduction_state.invalid).any()
    want, ref = run(0.0)
    assert int(ref.num_invalid_counts) == 0
    chex.assert_trees_all_equal(got, want)
    nan, state = run(jnp.nan)
    chex.assert_trees_all_equal(nan, want)
    assert int(state.num_invalid_counts) == 1


def test_deferred_count_contract(mesh):
    """Per-device counts follow the single-device contract: converted by value
    (float32 by default), summed without wrapping, a device without tokens
    ignored by the skip function even when its gradient is NaN."""
    params = {"w": jnp.zeros(3)}
    grads = {"w": jnp.ones((NDEV, 3)).at[5].set(jnp.nan)}
    counts = np.arange(NDEV, dtype=np.uint64) * (2**40)  # wider than any int32
    counts[5] = 0
    tx = mm.MaskedMultiSteps(
        optax.sgd(1.0),
        2,
        reduction=mm.deferred(mesh, "data"),
        should_skip_update_fn=optax.skip_not_finite,
    )
    state = tx.init(params)
    assert state.reduction_state.counts.dtype == jnp.float32
    _, state = tx.update(grads, state, params, count=counts)
    expected = np.float32(counts.astype(np.float64))
    np.testing.assert_array_equal(state.reduction_state.counts, expected)
    assert float(state.acc_count) == float(np.float32(expected.sum()))
    assert int(state.mini_step) == 1 and int(state.num_invalid_counts) == 0

    # int32 totals: per-device counts that fit, a global total that does not,
    # is an invalid microbatch (skipped, counted), never a wrapped total.
    ones = {"w": jnp.ones((NDEV, 3))}
    tx = mm.MaskedMultiSteps(
        optax.sgd(1.0),
        2,
        reduction=mm.deferred(mesh, "data"),
        count_dtype=jnp.int32,
        should_skip_update_fn=optax.skip_not_finite,
    )
    state = tx.init(params)
    big = jnp.full((NDEV,), 2**30, jnp.int32)
    _, new = jax.jit(tx.update)(ones, state, params, count=big)
    assert int(new.num_invalid_counts) == 1 and int(new.acc_count) == 0
    fits = big.at[1:].set(0).at[1].set(2**30 - 1)
    _, new = jax.jit(tx.update)(ones, state, params, count=fits)
    assert int(new.num_invalid_counts) == 0 and int(new.acc_count) == 2**31 - 1

    # Agreeing only at the window's end: a device whose own total would
    # overflow drops that share (counted); a window whose global total does
    # not fit applies no update and counts once; neither ever wraps.
    tx = mm.MaskedMultiSteps(
        optax.sgd(1.0), 2, reduction=mm.deferred(mesh, "data"), count_dtype=jnp.int32
    )
    step = jax.jit(tx.update)
    none = jnp.zeros((NDEV,), jnp.int32)
    _, new = step(ones, tx.init(params), params, count=big)
    _, new = step(ones, new, params, count=none)
    assert (int(new.num_invalid_counts), int(new.gradient_step)) == (1, 0)
    assert not tx.has_updated(new)
    first = none.at[0].set(2**30).at[1].set(2**29)
    _, new = step(ones, tx.init(params), params, count=first)
    updates, new = step(
        {"w": jnp.full((NDEV, 3), 7.0)}, new, params, count=none.at[0].set(2**30)
    )
    assert (int(new.num_invalid_counts), int(new.gradient_step)) == (1, 1)
    np.testing.assert_array_equal(updates["w"], -np.ones(3))  # the 7s dropped


def test_deferred_skip_function_sees_token_weighted_device_norms(mesh):
    """A sum of squares over what the skip function sees is the token-weighted
    mean of the devices' squared norms: a device count independent bound on the
    microbatch's ‖ḡ‖², exact when the devices agree, so optax.skip_large_updates
    decides as on one device (it summed the devices' squared norms)."""
    params = {"w": jnp.zeros(3)}
    counts = jnp.arange(NDEV, dtype=jnp.float32).at[2].set(0)
    rows = np.random.default_rng(0).normal(size=(NDEV, 3)).astype(np.float32)
    grads = {"w": jnp.asarray(rows).at[2].set(jnp.nan)}

    def seen(updates, gradient_step, params):
        del gradient_step, params
        return jnp.zeros([], bool), {"sq": otu.norm(updates, squared=True)}

    tx = mm.MaskedMultiSteps(
        optax.sgd(1.0),
        2,
        reduction=mm.deferred(mesh, "data"),
        should_skip_update_fn=seen,
    )
    _, state = jax.jit(tx.update)(grads, tx.init(params), params, count=counts)
    w = np.asarray(counts, np.float64) / float(counts.sum())
    sq = np.square(rows.astype(np.float64)).sum(1)
    sq[2] = 0.0
    np.testing.assert_allclose(state.skip_state["sq"], (w * sq).sum(), rtol=1e-6)
    mean = (w[:, None] * np.where(w[:, None] > 0, rows, 0)).sum(0)
    assert float(state.skip_state["sq"]) >= np.square(mean).sum()

    # Devices that agree: the single-device decision (‖g‖² = 1 <= 2).
    skip = functools.partial(optax.skip_large_updates, max_squared_norm=2.0)
    tx = mm.MaskedMultiSteps(
        optax.sgd(1.0),
        1,
        reduction=mm.deferred(mesh, "data"),
        should_skip_update_fn=skip,
    )
    same = {"w": jnp.tile(jnp.array([1.0, 0.0, 0.0]), (NDEV, 1))}
    updates, state = tx.update(same, tx.init(params), params, count=jnp.full(NDEV, 5))
    assert bool(tx.has_updated(state))
    np.testing.assert_allclose(updates["w"], [-1.0, 0.0, 0.0])


def test_deferred_skip_function_state_starts_from_the_device_axis_view(mesh):
    """`tx.init` builds the skip function's state from gradients shaped as
    `update` hands them over, with the device axis: a rule on each device's
    share, and a state shaped like the gradients, work from the first call."""
    params = {"w": jnp.zeros((4, 3))}

    def per_device(updates, gradient_step, params):
        del gradient_step, params
        sq = jnp.sum(updates["w"] ** 2, axis=(1, 2))  # one per device
        return jnp.any(sq > 10.0), {"largest": jnp.max(jnp.abs(updates["w"]), 0)}

    tx = mm.MaskedMultiSteps(
        optax.sgd(1.0),
        2,
        reduction=mm.deferred(mesh, "data"),
        should_skip_update_fn=per_device,
    )
    state = tx.init(params)
    assert state.skip_state["largest"].shape == (4, 3)
    grads = {"w": jnp.ones((NDEV, 4, 3)).at[5].set(2.0)}
    counts = jnp.ones(NDEV)
    for _ in range(2):
        updates, state = jax.jit(tx.update)(grads, state, params, count=counts)
    assert bool(tx.has_updated(state))
    np.testing.assert_allclose(updates["w"], -9.0 / 8, rtol=1e-6)
    # Each device's view is its gradient scaled by sqrt(n_d / n).
    np.testing.assert_allclose(state.skip_state["largest"], 2.0 / np.sqrt(8), rtol=1e-6)


def test_deferred_nonfinite_window_never_reaches_the_inner_optimizer(mesh):
    """A device with tokens and a NaN gradient makes the combined mean NaN: the
    window is counted and dropped, adam's moments stay clean, and the next
    window updates normally. A NaN on a device without tokens is ignored."""
    tx = _tx(mm.deferred(mesh, "data"))
    params = _params()
    state = tx.init(params)
    step = jax.jit(tx.update)
    ones = jax.tree.map(lambda p: jnp.ones((NDEV, *p.shape)), params)
    nan_on_3 = jax.tree.map(lambda g: g.at[3].set(jnp.nan), ones)
    counts, loss = jnp.ones(NDEV), jnp.float32(1.0)  # _tx's recorder needs value=
    for i in range(K):
        grads = nan_on_3 if i == 1 else ones
        _, state = step(grads, state, params, count=counts, value=loss)
    assert int(state.num_nonfinite_windows) == 1 and int(state.gradient_step) == 0
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(state.inner_opt_state))
    for _ in range(K):
        updates, state = step(
            nan_on_3, state, params, count=counts.at[3].set(0), value=loss
        )
    assert int(state.num_nonfinite_windows) == 1 and int(state.gradient_step) == 1
    assert all(np.isfinite(u).all() and u.any() for u in jax.tree.leaves(updates))


@pytest.mark.filterwarnings("ignore:The inner optimizer needs `value=`")
@both_axis_types
def test_deferred_per_window_loss_is_the_windows_token_weighted_mean(mesh):
    """Agreeing only at the window's end, the loss handed to the inner
    optimizer is Σ nᵢᵈ vᵢᵈ / Σ nᵢᵈ over every device and microbatch that passed
    one, from per-device values or one scalar per microbatch; a device without
    tokens adds nothing, even with a NaN loss."""
    tx = _tx(mm.deferred(mesh, "data"))
    params = _params()
    grads = jax.tree.map(lambda p: jnp.ones((NDEV, *p.shape)), params)
    rng = np.random.default_rng(3)
    counts = rng.integers(0, 5, size=(K, NDEV)).astype(np.float32)
    counts[:, 2] = 0  # device 2 never has tokens ...
    values = rng.normal(size=(K, NDEV)).astype(np.float32)
    values[:, 2] = np.nan  # ... and reports a NaN loss
    scalars = rng.normal(size=K).astype(np.float32)
    step = jax.jit(tx.update)
    for per_device in (True, False):
        state = tx.init(params)
        for i in range(K):
            value = values[i] if per_device else scalars[i]
            if i == 1:  # a microbatch that passes no value
                _, state = step(grads, state, params, count=counts[i])
            else:
                _, state = step(grads, state, params, count=counts[i], value=value)
            assert float(state.value_count) == 0  # formed when the window closes
        assert tx.has_updated(state)
        passed = [i for i in range(K) if i != 1]
        if per_device:
            weights, losses = counts[passed], values[passed]
        else:
            weights = counts[passed].sum(1)
            losses = scalars[passed]
        want = np.nansum(weights * np.where(weights > 0, losses, 0)) / weights.sum()
        np.testing.assert_allclose(state.inner_opt_state[1], want, rtol=1e-6)


def test_deferred_per_window_empty_window_applies_nothing(mesh):
    """A window in which no device has tokens (NaN gradients everywhere)
    applies no update, leaves adam's state alone and counts nothing as
    non-finite; the next window updates normally."""
    tx = _tx(mm.deferred(mesh, "data"))
    params = _params()
    state = tx.init(params)
    step = jax.jit(tx.update)
    nan = jax.tree.map(lambda p: jnp.full((NDEV, *p.shape), jnp.nan), params)
    ones = jax.tree.map(lambda p: jnp.ones((NDEV, *p.shape)), params)
    for _ in range(K):
        updates, state = step(nan, state, params, count=jnp.zeros(NDEV), value=1.0)
    assert not tx.has_updated(state) and int(state.gradient_step) == 0
    assert int(state.num_nonfinite_windows) == 0
    assert all(not np.asarray(u).any() for u in jax.tree.leaves(updates))
    chex.assert_trees_all_equal(state.inner_opt_state, tx.init(params).inner_opt_state)
    for _ in range(K):  # _tx's recorder needs value=
        updates, state = step(ones, state, params, count=jnp.ones(NDEV), value=1.0)
    assert tx.has_updated(state) and int(state.gradient_step) == 1
    assert all(np.isfinite(u).all() and u.any() for u in jax.tree.leaves(updates))


def test_the_wrapper_picks_the_deferred_variant_from_its_rules(mesh):
    """A per-window variant built by hand (it keeps no global counts between
    window ends) is rebuilt for rules that need them: a token budget never
    closed a window with it, and a skip function's verdicts were ignored."""
    given = mm.deferred(mesh, "data")._per_window()
    params = {"w": jnp.zeros(2)}
    ones = {"w": jnp.ones((NDEV, 2))}
    counts = jnp.ones(NDEV)
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), tokens_per_window=16, reduction=given)
    state = tx.init(params)
    for _ in range(4):
        params, state = tx.apply_gradients(ones, state, params, count=counts)
    assert int(state.gradient_step) == 2
    tx = mm.MaskedMultiSteps(
        optax.sgd(1.0), 2, reduction=given, should_skip_update_fn=optax.skip_not_finite
    )
    nan_on_one = {"w": jnp.ones((NDEV, 2)).at[3].set(jnp.nan)}
    state = tx.init(params)
    for g in (ones, nan_on_one, ones):
        params, state = tx.apply_gradients(g, state, params, count=counts)
    assert (int(state.gradient_step), int(state.num_nonfinite_windows)) == (1, 0)


def _int32_window_of_3(mesh):
    """A deferred wrapper with int32 counts and statistics, windows of 3, its
    params, fresh state and every device's gradient of ones."""
    tx = mm.MaskedMultiSteps(
        optax.sgd(1.0),
        3,
        count_dtype=jnp.int32,
        reduction=mm.deferred(mesh, "data"),
        window_stats=True,
    )
    params = {"w": jnp.zeros(2)}
    return tx, params, tx.init(params), {"w": jnp.ones((NDEV, 2))}


def test_a_window_whose_combined_total_overflows_is_dropped_whole(mesh):
    """Every device's int32 total fits, their sum does not: known only when the
    window closes (no device sees the others' counts sooner), so the window is
    dropped whole, its statistics included (they kept its microbatches and loss
    beside 0 tokens)."""
    tx, params, state, grads = _int32_window_of_3(mesh)
    for n in (2**27, 2**27, 2):
        count = jnp.full(NDEV, n, jnp.int32)
        params, state = tx.apply_gradients(
            grads, state, params, count=count, value=jnp.ones(NDEV)
        )
    stats = mm.window_stats(state)
    assert int(state.gradient_step) == 0 and int(state.num_invalid_counts) == 1
    assert int(stats.windows) == 1 and int(stats.tokens) == 0
    assert int(stats.microbatches) == 0 and np.isnan(float(stats.loss))
    assert not np.asarray(params["w"]).any()


def test_a_state_converted_from_optax_multisteps_compiles_once(mesh):
    """Its new scalars sat on one device, not on the mesh as `tx.init`'s: the
    first jitted step was traced again for the second."""
    replicated = NamedSharding(mesh, P())
    params = jax.device_put({"w": jnp.zeros(3)}, replicated)
    old = optax.MultiSteps(optax.adam(0.1), 2)
    tx = mm.MaskedMultiSteps(optax.adam(0.1), 2, reduction=mm.deferred(mesh, "data"))
    state = mm.from_optax_multisteps(old.init(params), tx, params)
    traces = []

    def step(params, state, grads, counts):
        traces.append(1)
        return tx.apply_gradients(grads, state, params, count=counts)

    step = jax.jit(step)
    grads = {"w": jax.device_put(jnp.ones((NDEV, 3)), NamedSharding(mesh, P("data")))}
    counts = jax.device_put(jnp.ones(NDEV), NamedSharding(mesh, P("data")))
    for _ in range(3):
        params, state = step(params, state, grads, counts)
    assert len(traces) == 1


def test_complex_params_combine_across_devices(mesh):
    # As microbatched_value_and_grad accepts complex params, so does the
    # combination over devices (weighted_mean_across takes complex leaves).
    batch = _batch(NDEV * ROWS, seed=7)

    def loss(w, mb):
        x = jnp.where(mb["mask"][..., None], mb["x"], 0)
        return mm.masked_mean(jnp.abs(x @ w) ** 2, mb["mask"])

    w = jnp.asarray([1.0 + 0.5j, -0.3j, 0.2], jnp.complex64)
    sharded = jax.device_put(batch, NamedSharding(mesh, P("data")))
    (value, _), grads = jax.jit(mm.data_parallel_value_and_grad(loss, mesh))(w, sharded)
    (want, _), want_grads = jax.jit(mm.microbatched_value_and_grad(loss, 1))(w, batch)
    assert grads.dtype == jnp.complex64
    np.testing.assert_allclose(value, want, **TOL)
    np.testing.assert_allclose(grads, want_grads, **TOL)


def test_bench_dp_counts_a_branch_once_per_window_and_refuses_a_loop(mesh):
    # bench_dp.py reads reductions per window from the compiled HLO: a
    # collective at the step's top level runs k times, one in the window's
    # closing branch once; one in a loop an unknown number of times, which it
    # once counted as none.
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        import dp_steps
    finally:
        sys.path.pop(0)
    x = jax.device_put(jnp.ones((NDEV, 512)), NamedSharding(mesh, P("data")))

    def spmd(body):
        return jax.jit(
            jax.shard_map(
                body,
                mesh=mesh,
                in_specs=P("data"),
                out_specs=P("data"),
                check_vma=False,
            )
        )

    def in_branch(x):
        return jax.lax.cond(
            x[0, 0] > 0, lambda x: jax.lax.psum(x, "data"), lambda x: x, x
        )

    def in_loop(x):
        return jax.lax.fori_loop(0, 3, lambda _, x: jax.lax.psum(x, "data"), x)

    def in_branch_in_loop(x):
        return jax.lax.fori_loop(0, 3, lambda _, x: in_branch(x), x)

    found = dp_steps.reductions(spmd(in_branch).lower(x).compile().as_text(), k=8)
    assert found["reductions_per_window"] == 1
    assert found["bytes_per_window"] == 512 * 4
    for body in (in_loop, in_branch_in_loop):
        with pytest.raises(ValueError, match="inside a loop"):
            dp_steps.reductions(spmd(body).lower(x).compile().as_text(), k=8)


@pytest.mark.parametrize("synced", [False, True], ids=["per-window", "synced"])
def test_int32_device_counts_whose_low_halves_carry_sum_exactly(mesh, synced):
    # int32 counts are summed exactly across devices in two halves: 8 x 10000
    # = 80000 tokens, whose low 16-bit halves carry past 2**16 (without the
    # carry, 80000 mod 2**16 = 14464: a mean 5.5 times too large).
    tx = mm.MaskedMultiSteps(
        optax.sgd(1.0),
        1,
        count_dtype=jnp.int32,
        reduction=mm.deferred(mesh, "data"),
        should_skip_update_fn=optax.skip_not_finite if synced else None,
        window_stats=True,
    )
    params = {"w": jnp.zeros(2)}
    state = tx.init(params)
    grads = {"w": jnp.arange(1.0, NDEV + 1)[:, None] * jnp.ones((NDEV, 2))}
    counts = jnp.full(NDEV, 10000, jnp.int32)
    updates, state = jax.jit(tx.update)(grads, state, params, count=counts)
    np.testing.assert_allclose(updates["w"], -4.5, rtol=1e-6)  # mean of 1..8
    assert int(mm.window_stats(state).tokens) == 80000


def test_a_dropped_window_has_no_loss_even_where_its_loss_tokens_fit(mesh):
    # The window's total overflows int32 and it is dropped whole: value= came
    # only with its last microbatch, whose tokens fit, and still the window
    # reports no loss (it applied nothing).
    tx, params, state, grads = _int32_window_of_3(mesh)
    step = jax.jit(tx.apply_gradients)
    for n in (2**27, 2**27):
        params, state = step(grads, state, params, count=jnp.full(NDEV, n, jnp.int32))
    params, state = jax.jit(tx.apply_gradients)(  # value= with the last one only
        grads, state, params, count=jnp.full(NDEV, 2, jnp.int32), value=jnp.ones(NDEV)
    )
    stats = mm.window_stats(state)
    assert int(state.gradient_step) == 0 and int(state.num_invalid_counts) == 1
    assert int(stats.tokens) == 0 and np.isnan(float(stats.loss))


def test_a_device_whose_own_float_total_overflows_drops_that_share_only(mesh):
    # Device 0's float32 total cannot take its second count (3e38 + 3e38 is
    # inf): that share alone is dropped, counted invalid, and adds neither its
    # value=5 to the loss nor a microbatch to K.
    tx = mm.MaskedMultiSteps(
        optax.sgd(1.0), 2, reduction=mm.deferred(mesh, "data"), window_stats=True
    )
    params = {"w": jnp.zeros(2)}
    state = tx.init(params)
    counts = jnp.asarray([3e38] + [1.0] * (NDEV - 1), jnp.float32)
    grads = {"w": jnp.ones((NDEV, 2))}
    _, state = jax.jit(tx.update)(grads, state, params, count=counts)  # no value=
    value = jnp.asarray([5.0] + [1.0] * (NDEV - 1))
    _, state = jax.jit(tx.update)(grads, state, params, count=counts, value=value)
    stats = mm.window_stats(state)
    assert int(state.num_invalid_counts) == 1  # device 0's second share
    assert int(state.gradient_step) == 1
    assert int(stats.microbatches) == 1 + 2 * (NDEV - 1)  # K: shares kept
    assert float(stats.loss) == 1.0  # device 0's value came with its dropped share
    np.testing.assert_allclose(float(stats.tokens), 3e38, rtol=1e-6)


def test_a_window_whose_float_total_overflows_is_dropped_whole(mesh):
    # Every device's float32 count fits, their sum is inf: the window is
    # dropped (no tokens, no update), not stepped on a zero mean (n / inf).
    tx = mm.MaskedMultiSteps(
        optax.adam(0.1), 1, reduction=mm.deferred(mesh, "data"), window_stats=True
    )
    params = {"w": jnp.zeros(2)}
    state = tx.init(params)
    params, state = jax.jit(tx.apply_gradients)(
        {"w": jnp.ones((NDEV, 2))}, state, params, count=jnp.full(NDEV, 3e38)
    )
    assert int(state.gradient_step) == 0 and int(state.num_invalid_counts) == 1
    assert int(state.inner_opt_state[0].count) == 0
    assert float(mm.window_stats(state).tokens) == 0.0
    assert not np.asarray(params["w"]).any()


def test_several_mesh_axes_count_every_device_of_them():
    # Data parallel over both axes of a 2 x 4 mesh: 8 devices, named as a
    # tuple or a list, each device its own gradient and its own running mean.
    grid = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AUTO, AUTO))
    params = _params()
    batch = jax.device_put(
        _batch(NDEV * ROWS, seed=7), NamedSharding(grid, P(("data", "model")))
    )
    for axes in (("data", "model"), ["data", "model"]):
        (_, count), grads = jax.jit(mm.per_device_value_and_grad(_loss, grid, axes))(
            params, batch
        )
        assert count.shape == (NDEV,)
        assert grads["w1"].shape == (NDEV, *params["w1"].shape)
        tx = mm.MaskedMultiSteps(optax.sgd(0.1), 2, reduction=mm.deferred(grid, axes))
        state = tx.init(jax.device_put(params, NamedSharding(grid, P())))
        assert state.acc_grads["w1"].shape == (NDEV, *params["w1"].shape)


def test_axis_names_that_are_empty_or_repeated_are_refused(mesh):
    for build in (
        lambda axes: mm.per_device_value_and_grad(_loss, mesh, axes),
        lambda axes: mm.data_parallel_value_and_grad(_loss, mesh, axes),
        lambda axes: mm.deferred(mesh, axes),
    ):
        with pytest.raises(ValueError, match=r"must name at least one mesh axis"):
            build(())
        twice = r"names an axis twice: \('data', 'data'\)"
        with pytest.raises(ValueError, match=twice):
            build(("data", "data"))


def test_deferred_skipped_microbatch_leaves_the_window_as_it_was(mesh):
    """A microbatch the skip function rejects changes nothing mid-window: not
    the devices' running means, nor their token totals, nor the global one,
    though every device holds tokens and a finite gradient but one."""
    params = {"w": jnp.zeros(3)}
    tx = mm.MaskedMultiSteps(
        optax.sgd(1.0),
        K,
        reduction=mm.deferred(mesh, "data"),
        should_skip_update_fn=optax.skip_not_finite,
    )
    step = jax.jit(lambda g, s, c: tx.update(g, s, params, count=c)[1])
    counts = jnp.arange(1.0, NDEV + 1)
    grads = {"w": jnp.arange(3.0 * NDEV).reshape(NDEV, 3)}
    before = step(grads, tx.init(params), counts)
    assert int(before.mini_step) == 1 and np.asarray(before.acc_grads["w"]).any()
    bad = {"w": (grads["w"] + 5.0).at[3, 1].set(jnp.nan)}
    after = step(bad, before, 2 * counts)
    assert not bool(before.skip_state["should_skip"])
    assert bool(after.skip_state["should_skip"])
    chex.assert_trees_all_equal(
        (after.acc_grads, after.acc_count, after.reduction_state, after.mini_step),
        (before.acc_grads, before.acc_count, before.reduction_state, before.mini_step),
    )


@pytest.mark.parametrize("flag", [True, np.True_], ids=repr)
def test_deferred_bool_count_is_a_type_error_whatever_its_kind(mesh, flag):
    # numpy's bool is refused as a bool, like Python's: the wrong kind
    # (TypeError), not a per-device array of the wrong shape (ValueError).
    tx = _tx(mm.deferred(mesh, "data"))
    params = _params()
    per_device = jax.tree.map(lambda p: jnp.stack([p] * NDEV), params)
    with pytest.raises(
        TypeError, match=r"`count` \(every device's .* got a bool \(True\)"
    ):
        tx.update(per_device, tx.init(params), params, count=flag)


@pytest.mark.parametrize("with_stats", [False, True])
def test_microbatched_value_and_grad_inside_shard_map_with_the_replication_check(
    mesh, with_stats
):
    """Inside a user's `jax.shard_map` (check_vma on, the params pcast to
    varying as the README's shard_map recipe does), each shard's in-jit loop
    runs on its own rows, and `weighted_mean_across` gives the full batch."""
    batch = _batch(NDEV * ROWS * K, seed=7, empty_device=2, empty_microbatch=1)
    grad_fn = mm.microbatched_value_and_grad(
        _loss_aux,
        K,
        has_aux=True,
        aux_reduction=AUX_REDUCTION,
        with_stats=with_stats,
    )

    def shard_grads(params, rows):
        params = jax.lax.pcast(params, "data", to="varying")
        (loss, (count, aux)), grads = grad_fn(params, rows)[:2]
        grads, total = mm.weighted_mean_across(grads, count, "data")
        loss, _ = mm.weighted_mean_across(loss, count, "data")
        return (loss, total), grads, jax.lax.psum(aux["rows"], "data")

    step = jax.jit(
        jax.shard_map(shard_grads, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())
    )
    sharded = jax.device_put(batch, NamedSharding(mesh, P("data")))
    (loss, count), grads, rows = step(_params(), sharded)

    (f_loss, (f_count, f_aux)), f_grads = _full_batch(_loss_aux, batch, True)
    assert int(count) == int(f_count)
    assert int(rows) == int(f_aux["rows"])
    chex.assert_trees_all_close((loss, grads), (f_loss, f_grads), **TOL)


@pytest.mark.parametrize(
    "make", [mm.per_device_value_and_grad, mm.data_parallel_value_and_grad]
)
def test_a_64_bit_numpy_batch_leaf_that_jax_would_wrap_is_refused(mesh, make):
    batch = _batch(NDEV * ROWS * K, seed=8)
    batch["weight"] = np.full(NDEV * ROWS * K, 3 * 2**30, np.int64)
    with pytest.raises(
        ValueError, match=r"int64 `batch` leaf at batch\['weight'\] holds values"
    ):
        make(_loss, mesh, "data")(_params(), batch)


@pytest.mark.parametrize("synced", [False, True], ids=["per-window", "synced"])
def test_close_window_ends_a_deferred_window_early_as_on_one_device(mesh, synced):
    """``close_window=True`` on the sixth microbatch closes the second window on
    its two microbatches on every device at once, equal to one device's
    full-batch run closed there; a flush with no tokens then changes nothing
    but ``updated``. The one gradient-sized reduction stays in the window's
    close."""
    batches = _microbatches()[: K + 2]
    skip = optax.skip_not_finite if synced else None
    tx = _tx(mm.deferred(mesh, "data"), should_skip_update_fn=skip, window_stats=True)
    grad_fn = mm.per_device_value_and_grad(_loss, mesh, "data")
    data = NamedSharding(mesh, P("data"))

    @jax.jit
    def step(params, state, mb, last):
        (loss, count), grads = grad_fn(params, mb)
        return tx.apply_gradients(
            grads, state, params, count=count, value=loss, close_window=last
        )

    params = jax.device_put(_params(), NamedSharding(mesh, P()))
    state = tx.init(params)
    flag = jnp.asarray(False)
    _assert_once_per_window(
        step.lower(params, state, jax.device_put(batches[0], data), flag)
        .compile()
        .as_text(),
        synced_counts=synced,
    )
    for i, mb in enumerate(batches):
        last = jnp.asarray(i == len(batches) - 1)
        params, state = step(params, state, jax.device_put(mb, data), last)
    assert (int(state.gradient_step), int(state.mini_step)) == (2, 0)
    assert not np.asarray(state.reduction_state.counts).any()

    ref_tx = _tx(window_stats=True)
    device = jax.devices()[0]
    ref_params = jax.device_put(_params(), device)
    ref_state = ref_tx.init(ref_params)
    for i, mb in enumerate(batches):
        (loss, count), grads = _jitted_value_and_grad(_loss, True)(
            ref_params, jax.device_put(mb, device)
        )
        ref_params, ref_state = ref_tx.apply_gradients(
            grads,
            ref_state,
            ref_params,
            count=count,
            value=loss,
            close_window=i == len(batches) - 1,
        )
    chex.assert_trees_all_close(params, ref_params, **TOL, strict=True)
    stats, ref_stats = mm.window_stats(state), mm.window_stats(ref_state)
    tokens = sum(int(mb["mask"].sum()) for mb in batches[K:])
    assert float(stats.tokens) == float(ref_stats.tokens) == tokens
    assert int(stats.windows) == 2
    np.testing.assert_allclose(stats.loss, ref_stats.loss, **TOL)

    # The data ended on the boundary: a count-0 flush is dropped.
    empty = _microbatches()[EMPTY_MICROBATCH]
    after, flushed = step(params, state, jax.device_put(empty, data), jnp.asarray(True))
    chex.assert_trees_all_equal(after, params)
    chex.assert_trees_all_equal(
        flushed._replace(updated=state.updated), state, strict=True
    )
    assert not bool(flushed.updated)


def test_close_window_completes_a_window_whose_combined_total_overflows(mesh):
    """Every device's count fits, their int32 sum does not: the window is
    dropped whole at its end, and still completes (one invalid count), whether
    its rule or close_window=True closes it (the flag drops only windows that
    held no tokens)."""
    tx = mm.MaskedMultiSteps(
        optax.sgd(1.0),
        2,
        count_dtype=jnp.int32,
        reduction=mm.deferred(mesh, "data"),
        window_stats=True,
    )
    step = jax.jit(
        lambda g, s, p, n, last: tx.apply_gradients(g, s, p, count=n, close_window=last)
    )
    data = NamedSharding(mesh, P("data"))
    params = jax.device_put({"w": jnp.zeros(2)}, NamedSharding(mesh, P()))
    grads = {"w": jax.device_put(np.ones((NDEV, 2), np.float32), data)}
    big = jax.device_put(np.full(NDEV, 2**28, np.int32), data)  # sum 2**31
    zero = jax.device_put(np.zeros(NDEV, np.int32), data)
    for flag in (False, True):
        state = tx.init(params)
        _, state = step(grads, state, params, big, jnp.asarray(flag))
        if not flag:
            _, state = step(grads, state, params, zero, jnp.asarray(False))
        stats = mm.window_stats(state)
        assert (int(state.num_invalid_counts), int(stats.windows)) == (1, 1)
        assert (int(state.gradient_step), int(state.mini_step)) == (0, 0)


def _lora_model():
    from flax import nnx

    base = nnx.Linear(D, H, rngs=nnx.Rngs(0))
    model = nnx.LoRA(D, 2, H, base_module=base, rngs=nnx.Rngs(1))
    model.lora_b[...] = 0.1 * jnp.ones((2, H))  # (a zero lora_b: lora_a's grad 0)
    return model


def _lora_loss(model, mb):
    x = jnp.where(mb["mask"][..., None], mb["x"], 0)
    pred = jnp.sum(jnp.tanh(model(x)), axis=-1)
    return mm.masked_mean((pred - mb["y"]) ** 2, mb["mask"])


def test_wrt_takes_the_lora_adapters_on_every_device_and_trains_deferred(mesh):
    """per_device/data_parallel_value_and_grad(..., wrt=nnx.LoRAParam): the
    adapters' gradients alone (every device's own, or reduced once), equal to
    one device's full batch, and a deferred nnx.Optimizer(wrt=nnx.LoRAParam)
    trains them as one device does, the base weights untouched."""
    from flax import nnx

    data = NamedSharding(mesh, P("data"))
    batch = _batch(NDEV * ROWS * K, seed=3, empty_device=2)
    full = mm.microbatched_value_and_grad(_lora_loss, 1, wrt=nnx.LoRAParam)
    model = _lora_model()
    (f_loss, f_count), f_grads = full(model, batch)

    reduced = jax.jit(
        mm.data_parallel_value_and_grad(
            _lora_loss, mesh, "data", num_microbatches=K, wrt=nnx.LoRAParam
        )
    )
    (loss, count), grads = reduced(model, jax.device_put(batch, data))
    assert jax.tree.structure(grads) == jax.tree.structure(f_grads)
    chex.assert_trees_all_close((loss, count, grads), (f_loss, f_count, f_grads), **TOL)

    grad_fn = mm.per_device_value_and_grad(_lora_loss, mesh, "data", wrt=nnx.LoRAParam)
    tx = mm.MaskedMultiSteps(optax.adam(1e-2), K, reduction=mm.deferred(mesh, "data"))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)
    ref_model = _lora_model()
    ref_optimizer = nnx.Optimizer(
        ref_model, mm.MaskedMultiSteps(optax.adam(1e-2), K), wrt=nnx.LoRAParam
    )
    base = np.asarray(model.base_module.kernel[...])
    adapter = np.asarray(model.lora_a[...])

    @nnx.jit
    def step(model, optimizer, mb):
        (_, count), grads = grad_fn(model, mb)
        assert jax.tree.leaves(grads)[0].shape[0] == NDEV
        optimizer.update(model, grads, count=count)

    for mb in _microbatches()[:K]:
        step(model, optimizer, jax.device_put(mb, data))
        (_, n), g = full(ref_model, mb)
        ref_optimizer.update(ref_model, g, count=n)
    assert int(optimizer.opt_state.gradient_step[...]) == 1
    chex.assert_trees_all_close(
        nnx.state(model, nnx.LoRAParam), nnx.state(ref_model, nnx.LoRAParam), **TOL
    )
    np.testing.assert_array_equal(model.base_module.kernel[...], base)
    assert not np.allclose(model.lora_a[...], adapter)


def test_wrt_on_every_device_refuses_a_module_with_other_state(mesh):
    from flax import nnx

    model = nnx.Sequential(_lora_model(), nnx.BatchNorm(H, rngs=nnx.Rngs(0)))
    batch = jax.device_put(_batch(NDEV * ROWS, seed=4), NamedSharding(mesh, P("data")))
    grad_fn = mm.per_device_value_and_grad(
        lambda m, mb: _lora_loss(m.layers[0], mb), mesh, "data", wrt=nnx.LoRAParam
    )
    with pytest.raises(
        TypeError, match="BatchStat at params.layers.1..mean.*nnx.split"
    ):
        grad_fn(model, batch)
    with pytest.raises(TypeError, match="selects variables of an NNX module"):
        grad_fn(_params(), batch)


def test_wrt_gradients_are_laid_out_as_the_selected_params_on_an_explicit_axis():
    """FSDP-style adapters (sharded over the data axis, explicitly): their
    combined gradients come back sharded as they are, as without wrt."""
    from flax import nnx

    grid = jax.make_mesh((NDEV,), ("data",), axis_types=(EXPLICIT,))
    model = _lora_model()
    adapters = nnx.state(model, nnx.LoRAParam)
    adapters["lora_b"] = jax.device_put(
        adapters["lora_b"], NamedSharding(grid, P(None, "data"))
    )
    nnx.update(model, adapters)
    assert jax.typeof(model.lora_b[...]).sharding.spec == P(None, "data")
    batch = jax.device_put(
        _batch(NDEV * ROWS * K, seed=5), NamedSharding(grid, P("data"))
    )
    grad_fn = jax.jit(
        mm.data_parallel_value_and_grad(
            _lora_loss, grid, "data", num_microbatches=K, wrt=nnx.LoRAParam
        )
    )
    _, grads = grad_fn(model, batch)
    assert jax.typeof(grads["lora_b"][...]).sharding.spec == P(None, "data")
    assert jax.typeof(grads["lora_a"][...]).sharding.spec == P(None, None)


@pytest.mark.parametrize("stats", [False, True], ids=["plain", "stats"])
def test_a_state_read_back_to_the_host_returns_to_the_inits_layout(mesh, stats):
    # flax.serialization restores host arrays, which a step on an Auto mesh
    # takes as they are. Without statistics the per-device `sq_norms` and
    # `microbatches` pass through the step unused and stayed replicated from
    # then on: every later state laid out unlike `tx.init`'s (a compile more
    # after the restore, and after any restore onto `tx.init`'s layout).
    from flax import serialization

    params = jax.device_put(_params(), NamedSharding(mesh, P()))
    tx = mm.MaskedMultiSteps(
        optax.adam(1e-2), K, reduction=mm.deferred(mesh, "data"), window_stats=stats
    )
    grad_fn = mm.per_device_value_and_grad(_loss, mesh, "data")

    @jax.jit
    def step(params, state, mb):
        (loss, count), grads = grad_fn(params, mb)
        return tx.apply_gradients(grads, state, params, count=count, value=loss)

    batch = _batch(NDEV * ROWS, 0)
    state = tx.init(params)
    params, state = step(params, state, batch)
    restored = serialization.from_bytes(tx.init(params), serialization.to_bytes(state))
    _, state = step(params, restored, batch)
    for path, got, want in zip(
        *zip(*jax.tree_util.tree_flatten_with_path(state)[0]),
        jax.tree.leaves(tx.init(params)),
        strict=True,
    ):
        assert got.sharding.is_equivalent_to(want.sharding, got.ndim), (
            jax.tree_util.keystr(path),
            got.sharding,
            want.sharding,
        )


@pytest.mark.parametrize("stats", [False, True], ids=["plain", "stats"])
def test_a_deferred_update_inside_shard_map_over_another_axis(stats):
    # With a sharding constraint on the mesh's concrete (Auto) axes, the
    # statistics-free update failed inside shard_map ("Context mesh ... should
    # match the mesh of sharding"), where the statistics' update worked.
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AUTO, AUTO))
    params = {"w": jnp.ones((4, 6))}
    tx = mm.MaskedMultiSteps(
        optax.sgd(1.0), 2, reduction=mm.deferred(mesh, "data"), window_stats=stats
    )

    def two_microbatches(g, state):
        for scale in (1.0, 2.0):
            updates, state = tx.update(
                {"w": g["w"] * scale}, state, params, count=jnp.ones(4)
            )
        return updates, state

    step = jax.jit(
        jax.shard_map(
            two_microbatches,
            mesh=mesh,
            in_specs=(P(), P()),
            out_specs=P(),
            axis_names={"model"},
            check_vma=False,
        )
    )
    updates, state = step({"w": jnp.ones((4, 4, 6))}, tx.init(params))
    np.testing.assert_allclose(updates["w"], -1.5 * np.ones((4, 6)))
    assert int(state.gradient_step) == 1
