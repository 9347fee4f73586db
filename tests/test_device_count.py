"""A deferred window moved onto another number of devices.

``mm.device_count_target`` and ``mm.from_device_count``: a state saved
mid-window on ``D`` devices continues on ``D′`` and its window ends as if
nothing had moved: the same mean gradient (checked against a float64 reference
built from the same rows), token total, loss and statistics.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import backend_compiles
from flax import serialization
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import masked_multistep as mm

AUTO = jax.sharding.AxisType.Auto
ROWS, K, H = 24, 4, 5  # 24 rows split evenly over 1, 2, 3, 4 or 8 devices
MOVE_AFTER = 2  # microbatches before the state moves
EMPTY_ROWS = slice(6, 12)  # no tokens in any microbatch
EMPTY_MICROBATCH = 1  # no tokens anywhere
LOCAL = 0  # one device, no reduction=


def _mesh(n):
    return jax.make_mesh((n,), ("data",), axis_types=(AUTO,), devices=jax.devices()[:n])


def _rows():
    """Every row's mean gradient, token count and loss, per microbatch."""
    rng = np.random.default_rng(0)
    grads = rng.normal(size=(K, ROWS, H))
    counts = rng.integers(1, 9, size=(K, ROWS)).astype(np.float64)
    counts[:, EMPTY_ROWS] = 0
    counts[EMPTY_MICROBATCH] = 0
    grads[counts == 0] = np.nan  # a row without tokens: 0/0
    losses = rng.uniform(1, 2, size=(K, ROWS))
    return grads, counts, losses


def _per_device(i, n):
    """Microbatch ``i`` as ``n`` devices see it: each its rows' token-weighted
    mean gradient, its count and its loss (``n = LOCAL``: one device)."""
    n = max(n, 1)
    grads, counts, losses = (x[i] for x in _rows())
    g = grads.reshape(n, ROWS // n, H)
    c = counts.reshape(n, ROWS // n)
    v = losses.reshape(n, ROWS // n)
    total = c.sum(1)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.nansum(g * c[..., None], 1) / total[:, None]
        loss = (v * c).sum(1) / total
    return mean, total, loss


def _tx(n, stats=True, skip=None):
    return mm.MaskedMultiSteps(
        optax.sgd(1.0),
        K,
        reduction=None if n == LOCAL else mm.deferred(_mesh(n), "data"),
        window_stats=stats,
        should_skip_update_fn=skip,
    )


def _step(tx, params, state, i, n):
    mean, count, loss = _per_device(i, n)
    if n == LOCAL:  # the whole microbatch, no device axis
        put = lambda x: jnp.asarray(x[0], jnp.float32)  # noqa: E731
    else:
        data = NamedSharding(_mesh(n), P("data"))
        put = lambda x: jax.device_put(jnp.asarray(x, jnp.float32), data)  # noqa: E731
    return jax.jit(tx.update)(
        {"w": put(mean)}, state, params, count=put(count), value=put(loss)
    )


def _run(old, new, stats=True, skip=None):
    """``MOVE_AFTER`` microbatches on ``old`` devices, the rest on ``new``."""
    params = {"w": jnp.zeros(H)}
    tx = _tx(old, stats, skip)
    state = tx.init(params)
    for i in range(MOVE_AFTER):
        updates, state = _step(tx, params, state, i, old)
    tx = _tx(new, stats, skip)
    template = tx.init(params)
    _step(tx, params, template, MOVE_AFTER, new)  # compiles the new mesh's step
    moved = mm.from_device_count(state, template)
    chex.assert_trees_all_equal_shapes_and_dtypes(moved, template)
    with backend_compiles() as compiles:  # placed as `init` places it
        for i in range(MOVE_AFTER, K):
            updates, moved = _step(tx, params, moved, i, new)
    assert not compiles, compiles
    return updates, moved


def _shares(old, new):
    """Every (microbatch, device) share the window saw: gradients, counts."""
    shares = [_per_device(i, old if i < MOVE_AFTER else new) for i in range(K)]
    g = np.concatenate([s[0] for s in shares])
    c = np.concatenate([s[1] for s in shares])
    v = np.concatenate([s[2] for s in shares])
    return g[c > 0], c[c > 0], v[c > 0]


def _check_window(updates, state, old, new):
    """The update is the full batch's mean; the statistics are those of a
    window whose shares came from both device counts (each share a small
    batch of its own), against float64."""
    g, c, v = _shares(old, new)
    mean = (g * c[:, None]).sum(0) / c.sum()
    np.testing.assert_allclose(updates["w"], -mean, rtol=1e-5, atol=1e-6)
    assert int(state.gradient_step) == 1
    stats = mm.window_stats(state)
    n = c.sum()
    sq = float(mean @ mean)
    s = float((c * ((g - mean) ** 2).sum(1)).sum())
    assert int(stats.tokens) == n and int(stats.microbatches) == len(c)
    np.testing.assert_allclose(stats.loss, (v * c).sum() / n, rtol=1e-6)
    np.testing.assert_allclose(stats.grad_sq_norm, sq, rtol=1e-5)
    np.testing.assert_allclose(stats.grad_var_trace, s / (len(c) - 1), rtol=1e-5)


@pytest.mark.parametrize(
    ("old", "new"),
    [(8, 4), (8, 3), (2, 8), (LOCAL, 4), (8, LOCAL)],
    ids=["8-4", "8-3", "2-8", "local-4", "8-local"],
)
def test_a_window_moved_mid_way_ends_with_the_full_batch_mean(old, new):
    """Onto fewer devices, more, and between one device without a reduction
    and a deferred one whose devices agree at the window's end."""
    _check_window(*_run(old, new), old, new)


@pytest.mark.parametrize(("old", "new"), [(8, 3), (LOCAL, 3)], ids=["8-3", "local-3"])
def test_the_synced_variant_moves_too(old, new):
    """With a skip function the devices agree on every microbatch's count:
    ``acc_count`` and the statistics' sums are the window's, the per-device
    state only counts."""
    _check_window(*_run(old, new, skip=optax.skip_not_finite), old, new)


@pytest.mark.parametrize("stats", [False, True], ids=["plain", "stats"])
def test_a_window_moves_onto_a_fixed_token_budget(stats):
    """A window of k microbatches (whose devices agree at its end) continued
    under a fixed token budget (whose devices agree on every microbatch):
    without statistics the conversion failed inside jax ("pjit
    out_shardings"), the per-window tallies having no place in the target.
    Moved on again without a reduction, the window is the one moved there
    directly."""
    params = {"w": jnp.zeros(H)}
    tx = _tx(8, stats)
    state = tx.init(params)
    for i in range(MOVE_AFTER):
        _, state = _step(tx, params, state, i, 8)
    budget = mm.MaskedMultiSteps(
        optax.sgd(1.0),
        tokens_per_window=10**6,
        reduction=mm.deferred(_mesh(3), "data"),
        window_stats=stats,
    )
    moved = mm.from_device_count(state, budget.init(params))
    assert moved.reduction_state.counts.shape == (3,)
    local = _tx(LOCAL, stats).init(params)
    direct = mm.from_device_count(state, local)
    again = mm.from_device_count(moved, local)
    chex.assert_trees_all_close(again, direct, rtol=1e-6)


def test_onto_the_same_devices_the_run_continues_bit_for_bit():
    """Moved in the second window (the first one's update left in the
    accumulator as scratch), onto the same 4 devices: every later step and
    the final state equal the uninterrupted run's."""
    params = {"w": jnp.zeros(H)}
    tx = _tx(4)
    state = tx.init(params)
    for i in range(K + 1):
        _, state = _step(tx, params, state, i % K, 4)
    moved = mm.from_device_count(state, tx.init(params))
    for i in range(1, K):
        want = _step(tx, params, state, i, 4)
        got = _step(tx, params, moved, i, 4)
        chex.assert_trees_all_equal(got, want)
        state, moved = want[1], got[1]
    assert int(state.gradient_step) == 2


@pytest.mark.parametrize("devices", [4, 8])
def test_swapped_arguments_are_named(devices):
    """`from_device_count(template, restored)` kept the fresh state's values:
    on the same devices the checkpoint's window and optimizer state were lost
    without a word."""
    params = {"w": jnp.zeros(H)}
    tx = _tx(4)
    running = tx.init(params)
    for i in range(K + 1):
        _, running = _step(tx, params, running, i % K, 4)
    restored = mm.from_device_count(running, _tx(devices).init(params))
    with pytest.raises(
        ValueError,
        match=r"holds a run in progress \(gradient_step=1, "
        r"mini_step=1\).*are the arguments swapped\?",
    ):
        mm.from_device_count(_tx(devices).init(params), restored)
    # A template in progress with a restored state in progress too is taken.
    mm.from_device_count(running, running)
    # device_count_target's two arguments swapped (it printed the whole state
    # as the number of devices).
    with pytest.raises(TypeError, match=r"`template` is one \(4\): are the arguments"):
        mm.device_count_target(4, running)  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match=r"`template` must hold exactly one"):
        mm.device_count_target(4, 8)


@pytest.mark.parametrize("new", [4, 3])
def test_orbax_restores_into_the_target_and_converts(tmp_path, new):
    """Restored on 4 of 8 devices the old axis stays sharded (two running
    means per device); on 3 it is replicated; both convert as in memory."""
    import orbax.checkpoint as ocp

    params = {"w": jnp.zeros(H)}
    tx = _tx(8)
    state = tx.init(params)
    for i in range(MOVE_AFTER):
        _, state = _step(tx, params, state, i, 8)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", {"params": params, "opt_state": state})
    checkpointer.wait_until_finished()

    template = {"params": params, "opt_state": _tx(new).init(params)}
    target = mm.device_count_target(template, 8)
    acc = target["opt_state"].acc_grads["w"]
    assert acc.shape == (8, H)
    assert acc.sharding.spec == (P("data") if new == 4 else P(None))
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
    restored = checkpointer.restore(tmp_path / "ckpt", abstract)
    checkpointer.close()
    moved = mm.from_device_count(restored, template)
    in_memory = mm.from_device_count(state, template["opt_state"])
    chex.assert_trees_all_equal(moved, {"params": params, "opt_state": in_memory})
    want = template["opt_state"].acc_grads["w"].sharding
    assert moved["opt_state"].acc_grads["w"].sharding.is_equivalent_to(want, 2)


@pytest.mark.parametrize("stats", [False, True], ids=["plain", "stats"])
def test_an_nnx_optimizer_state_moves(stats):
    """``nnx.state(optimizer)`` holds the wrapper's fields by name; the
    converted state goes back with ``nnx.update``. With statistics, the open
    window's sums (in their packed vectors, held by name) move too."""
    from flax import nnx

    def make(n):
        model = nnx.Linear(H, 1, rngs=nnx.Rngs(0))
        return model, nnx.Optimizer(model, _tx(n, stats=stats), wrt=nnx.Param)

    model, optimizer = make(8)
    # Device d's gradient is d everywhere, over d tokens.
    ramp = jax.tree.map(
        lambda p: jnp.arange(8.0).reshape(8, *[1] * p.ndim) * jnp.ones((8, *p.shape)),
        nnx.state(model, nnx.Param),
    )
    nnx.jit(lambda m, o, g: o.update(m, g, count=jnp.arange(8.0)))(
        model, optimizer, ramp
    )
    _, resumed = make(2)
    state = mm.from_device_count(nnx.state(optimizer), nnx.state(resumed))
    nnx.update(resumed, state)
    acc = resumed.opt_state.acc_grads["kernel"][...]
    counts = resumed.opt_state.reduction_state.counts[...]
    # Devices 0-3 (0 + 1 + 2 + 3 tokens) and 4-7 (22 tokens): Σ d² / Σ d.
    np.testing.assert_allclose(counts, [6.0, 22.0])
    np.testing.assert_allclose(acc[:, 0, 0], [14 / 6, 126 / 22], rtol=1e-6)
    assert int(resumed.opt_state.mini_step[...]) == 1
    # And back onto one device without a reduction, whose nnx.state has no
    # reduction_state at all: the window's 28 tokens, mean Σ d² / Σ d.
    _, local = make(LOCAL)
    nnx.update(local, mm.from_device_count(nnx.state(resumed), nnx.state(local)))
    assert float(local.opt_state.acc_count[...]) == 28.0
    np.testing.assert_allclose(
        local.opt_state.acc_grads["kernel"][...][0, 0], 140 / 28, rtol=1e-6
    )
    if stats:
        # Seven devices held tokens, each a small batch: d tokens of a
        # gradient d in each of the kernel's and bias's H + 1 entries.
        moved = local.opt_state.stats
        assert int(moved.tallies[...][0]) == 7
        want = sum(d * d**2 * (H + 1) for d in range(8))
        np.testing.assert_allclose(moved.sums[...][0], want, rtol=1e-6)
    # ... and from there onto 2 devices again: all of it on the first.
    nnx.update(resumed, mm.from_device_count(nnx.state(local), nnx.state(resumed)))
    np.testing.assert_allclose(resumed.opt_state.reduction_state.counts[...], [28, 0])


def test_bad_input_is_refused_by_name():
    params = {"w": jnp.zeros(H)}
    template = _tx(4).init(params)
    saved = _tx(8).init(params)
    with pytest.raises(ValueError, match=r"`num_devices` must be >= 1, got 0"):
        mm.device_count_target(template, 0)
    with pytest.raises(TypeError, match=r"`num_devices` must be an integer"):
        mm.device_count_target(template, 2.0)
    local = mm.MaskedMultiSteps(optax.sgd(1.0), K).init(params)
    with pytest.raises(ValueError, match=r"`template` holds no per-device state"):
        mm.device_count_target(local, 8)
    with pytest.raises(ValueError, match=r"exactly one MaskedMultiStepsState"):
        mm.from_device_count(saved, {"a": template, "b": template})
    with pytest.raises(ValueError, match=r"`stats` does not match the template's"):
        mm.from_device_count(_tx(8, stats=False).init(params), template)
    wrong = saved._replace(acc_grads={"w": jnp.zeros((8, H + 1))})
    with pytest.raises(ValueError, match=r"shape \(8, 6\) at \['w'\] where \(8, 5\)"):
        mm.from_device_count(wrong, template)
    for field, value in [("counts", -jnp.ones(8)), ("invalid", -jnp.ones(8, int))]:
        negative = saved._replace(
            reduction_state=saved.reduction_state._replace(**{field: value})
        )
        with pytest.raises(ValueError, match=r"negative or not finite"):
            mm.from_device_count(negative, template)
    short = saved._replace(
        reduction_state=saved.reduction_state._replace(invalid=jnp.ones(4, int))
    )
    with pytest.raises(ValueError, match=r"reduction_state.invalid has shape \(4,\)"):
        mm.from_device_count(short, template)
    renamed = _tx(8).init({"v": jnp.zeros(H)})
    with pytest.raises(ValueError, match=r"holds \[\"\['v'\]\"\] where the templ"):
        mm.from_device_count(renamed, template)
    with pytest.raises(TypeError, match=r"eagerly"):
        jax.jit(mm.from_device_count)(saved, template)
    # An abstract template without shardings cannot say where the arrays go.
    with pytest.raises(TypeError, match=r"`template`'s arrays must say where they"):
        mm.from_device_count(saved, jax.eval_shape(_tx(4).init, params))
    # A restore target passed where the restored state goes.
    with pytest.raises(TypeError, match=r"`restored` holds jax.ShapeDtypeStructs"):
        mm.from_device_count(mm.device_count_target(template, 8), template)
    with pytest.raises(ValueError, match=r"elsewhere than the template"):
        mm.from_device_count(saved, (template,))


def test_an_integer_total_that_no_longer_fits_is_refused():
    """Two int32 devices of 2³⁰ tokens each cannot become one device's total."""
    params = {"w": jnp.zeros(H)}

    def tx(n):
        return mm.MaskedMultiSteps(
            optax.sgd(1.0), K, reduction=mm.deferred(_mesh(n)), count_dtype=jnp.int32
        )

    saved = tx(2).init(params)
    saved = saved._replace(
        reduction_state=saved.reduction_state._replace(
            counts=jnp.full(2, 2**30, jnp.int32)
        )
    )
    with pytest.raises(ValueError, match=r"beyond the count dtype on one of the 1"):
        mm.from_device_count(saved, tx(1).init(params))
    same = mm.from_device_count(saved, tx(2).init(params))
    assert int(same.reduction_state.counts[0]) == 2**30
    # A float32 run onto an int32 template: the error says how to change it.
    with pytest.raises(
        ValueError,
        match=r"acc_count holds dtype float32 where the template has int32 \(to "
        r"change `count_dtype`.*mm.from_other_settings, then convert onto",
    ):
        mm.from_device_count(_tx(2, stats=False).init(params), tx(1).init(params))
    # That route, followed.
    local = mm.MaskedMultiSteps(optax.sgd(1.0), K, window_stats=False)
    moved = mm.from_device_count(_tx(2, stats=False).init(params), local.init(params))
    moved = mm.from_other_settings(
        moved,
        mm.MaskedMultiSteps(optax.sgd(1.0), K, count_dtype=jnp.int32).init(params),
    )
    moved = mm.from_device_count(moved, tx(1).init(params))
    assert moved.acc_count.dtype == moved.reduction_state.counts.dtype == jnp.int32


def test_another_mesh_over_the_same_devices_takes_the_templates_placement():
    """In memory, onto a 4x2 mesh of the same 8 devices (params sharded over
    "model"), and onto the same 4 devices in another order: every leaf as the
    template places it, so the step compiled for the template runs as it is."""
    params = {"w": jnp.zeros((4, 2))}
    old = mm.MaskedMultiSteps(optax.adam(0.1), K, reduction=mm.deferred(_mesh(8)))
    state = old.init(jax.device_put(params, NamedSharding(_mesh(8), P())))
    grid = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AUTO, AUTO))
    tx = mm.MaskedMultiSteps(optax.adam(0.1), K, reduction=mm.deferred(grid, "data"))
    new_params = jax.device_put(params, NamedSharding(grid, P(None, "model")))
    template = tx.init(new_params)
    moved = mm.from_device_count(state, template)
    for a, b in zip(jax.tree.leaves(moved), jax.tree.leaves(template), strict=True):
        assert a.sharding == b.sharding, (a.sharding, b.sharding)
    step = jax.jit(tx.update)
    grads = {"w": jax.device_put(jnp.ones((4, 4, 2)), template.acc_grads["w"].sharding)}
    count = jax.device_put(jnp.ones(4), NamedSharding(grid, P("data")))
    step(grads, template, new_params, count=count)
    with backend_compiles() as compiles:
        step(grads, moved, new_params, count=count)
    assert not compiles, compiles

    reordered = jax.make_mesh(
        (4,), ("data",), axis_types=(AUTO,), devices=jax.devices()[:4][::-1]
    )
    small = _tx(4, stats=False).init({"w": jnp.zeros(H)})
    back = mm.MaskedMultiSteps(optax.sgd(1.0), K, reduction=mm.deferred(reordered))
    template = back.init({"w": jnp.zeros(H)})
    moved = mm.from_device_count(small, template)
    assert moved.acc_grads["w"].sharding == template.acc_grads["w"].sharding


def test_a_train_state_moves_onto_a_template_with_another_tx():
    """`mm.TrainState` keeps `tx` static: a state restored against the saved
    run's TrainState converts onto the new one's, `step` included."""
    params = {"w": jnp.zeros(H)}
    saved = mm.TrainState.create(apply_fn=None, params=params, tx=_tx(8, stats=False))
    mean, count, _ = _per_device(0, 8)
    saved = saved.apply_gradients(
        grads={"w": jnp.asarray(mean, jnp.float32)},
        count=jnp.asarray(count, jnp.float32),
    )
    new = mm.TrainState.create(apply_fn=None, params=params, tx=_tx(3, stats=False))
    moved = mm.from_device_count(saved, new)
    assert moved.tx is new.tx and int(moved.opt_state.mini_step) == 1
    counts = moved.opt_state.reduction_state.counts
    np.testing.assert_allclose(counts.sum(), count.sum())
    devices = set(jax.devices()[:3])
    for leaf in jax.tree.leaves(moved):
        assert leaf.sharding.device_set <= devices


def _saved(n=8, stats=True, **fields):
    """A state saved mid-window on ``n`` devices, with these per-device fields."""
    state = _tx(n, stats).init({"w": jnp.zeros(H)})
    rs = state.reduction_state
    return state._replace(
        mini_step=jnp.int32(1),
        reduction_state=rs._replace(
            **{k: jnp.asarray(v, getattr(rs, k).dtype) for k, v in fields.items()}
        ),
    )


def test_counts_of_another_length_than_the_accumulator_are_named():
    # The device count is read off the counts: the error blamed the first
    # other per-device field ("reduction_state.invalid has shape (8,) where
    # (5,) was expected").
    saved = _saved(counts=np.full(8, 2.0))
    rs = saved.reduction_state._replace(counts=jnp.full(5, 2.0))
    with pytest.raises(
        ValueError, match=r"reduction_state\.counts has shape \(5,\) where \(8,\)"
    ):
        mm.from_device_count(
            saved._replace(reduction_state=rs), _tx(4).init({"w": jnp.zeros(H)})
        )


def test_old_devices_join_new_device_floor_d_times_new_over_old():
    # 8 onto 3 (not the reshape that 8 onto 2 or 4 takes): devices 0-2, 3-5
    # and 6-7, each group's means token-weighted; 3 onto 8: devices 0, 2, 5.
    d = np.arange(8.0)
    state = _tx(8, stats=False).init({"w": jnp.zeros(())})
    saved = state._replace(
        mini_step=jnp.int32(1),
        acc_grads={"w": jnp.asarray(d)},
        reduction_state=state.reduction_state._replace(counts=jnp.asarray(d + 1)),
    )
    moved = mm.from_device_count(saved, _tx(3, stats=False).init({"w": jnp.zeros(())}))
    np.testing.assert_array_equal(moved.reduction_state.counts, [6, 15, 15])
    want = [np.average(g, weights=g + 1) for g in (d[:3], d[3:6], d[6:])]
    np.testing.assert_allclose(moved.acc_grads["w"], want, rtol=1e-6)
    grown = mm.from_device_count(moved, _tx(8, stats=False).init({"w": jnp.zeros(())}))
    np.testing.assert_array_equal(
        grown.reduction_state.counts, [6, 0, 15, 0, 0, 15, 0, 0]
    )


def test_the_loss_moves_with_its_own_weights_not_the_token_counts():
    # `value=` on some microbatches only: a device's loss weighs by the tokens
    # behind its loss (value_counts), not by all its tokens. 2 tokens on each
    # of 8 devices; only devices 0 and 7 saw a loss (1 and 5): the window's
    # loss so far is 3, over 4 tokens.
    params = {"w": jnp.zeros(H)}
    saved = _saved(
        counts=[2.0] * 8,
        value_counts=[2, 0, 0, 0, 0, 0, 0, 2],
        value=[1.0, 0, 0, 0, 0, 0, 0, 5.0],
    )
    local = mm.from_device_count(saved, _tx(LOCAL).init(params))
    assert float(local.acc_value) == 3.0 and float(local.value_count) == 4.0
    rs = mm.from_device_count(saved, _tx(3).init(params)).reduction_state
    np.testing.assert_array_equal(rs.value_counts, [2, 0, 2])  # 0-2 | 3-5 | 6-7
    np.testing.assert_allclose(rs.value, [1, 0, 5])
    # From one device (16 tokens, 4 of them with a loss): the first device's.
    rs = mm.from_device_count(local, _tx(3).init(params)).reduction_state
    np.testing.assert_array_equal(rs.counts, [16, 0, 0])
    np.testing.assert_array_equal(rs.value_counts, [4, 0, 0])


def test_invalid_counts_are_kept_and_regrouped():
    # The run's num_invalid_counts survives every move; the window's
    # per-device invalid counts are regrouped, or added to it.
    params = {"w": jnp.zeros(H)}
    saved = _saved(counts=[2.0] * 8, invalid=[1, 0, 0, 0, 0, 0, 0, 2])
    saved = saved._replace(num_invalid_counts=jnp.int32(5))
    three = mm.from_device_count(saved, _tx(3).init(params))
    assert int(three.num_invalid_counts) == 5
    np.testing.assert_array_equal(three.reduction_state.invalid, [1, 0, 2])
    local = mm.from_device_count(saved, _tx(LOCAL).init(params))
    assert int(local.num_invalid_counts) == 8  # 5 + the window's 1 + 2
    back = mm.from_device_count(local, _tx(3).init(params))
    assert int(back.num_invalid_counts) == 8
    np.testing.assert_array_equal(back.reduction_state.invalid, [0, 0, 0])


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("sq_norms", -1.0),
        ("sq_norms", -np.inf),
        ("microbatches", -1),
        ("value_counts", -1.0),
    ],
)
def test_every_per_device_tally_is_checked(field, value):
    fields = {"counts": np.full(8, 2.0), field: np.r_[value, np.zeros(7)]}
    with pytest.raises(ValueError, match=r"negative or not finite"):
        mm.from_device_count(_saved(**fields), _tx(4).init({"w": jnp.zeros(H)}))


@pytest.mark.parametrize("bad", [np.nan, 1e20], ids=["nan", "square-overflows"])
@pytest.mark.parametrize("new", [2, LOCAL], ids=["2", "local"])
def test_a_window_whose_squared_norms_are_not_finite_moves(bad, new):
    # A gradient not finite (NaN) or whose square overflows float32 (1e20)
    # left the per-device squared norms' sums NaN or inf, and the state a
    # step made was refused as corrupt. It moves; its window ends as it would
    # have without the move: dropped (NaN) or applied (1e20, the statistics
    # inf).
    def run(n_after):
        tx = _tx(4)
        params = {"w": jnp.zeros(H)}
        state = tx.init(params)
        grads = {"w": jnp.ones((4, H)).at[3].set(bad)}
        params, state = jax.jit(tx.apply_gradients)(
            grads, state, params, count=jnp.full(4, 5.0)
        )
        if n_after is not None:
            tx = _tx(n_after)
            state = mm.from_device_count(state, tx.init(params))
            # The tallies moved as they were: NaN, or inf past float32.
            if n_after == LOCAL:
                moved = state.stats.weighted_sq_norms
            else:  # old devices 2 and 3 (the bad one) are new device 1
                moved = state.reduction_state.sq_norms[1]
            assert (np.isnan if np.isnan(bad) else np.isposinf)(moved)
        params = {"w": jnp.asarray(np.asarray(params["w"]))}  # uncommitted
        shape = () if n_after == LOCAL else (n_after or 4,)
        for _ in range(K - 1):  # 4 tokens per microbatch, however many devices
            count = jnp.full(shape, 4.0 / (shape[0] if shape else 1))
            params, state = jax.jit(tx.apply_gradients)(
                {"w": jnp.ones((*shape, H))}, state, params, count=count
            )
        return params, state

    want_params, want = run(None)
    params, state = run(new)
    assert bool(state.updated) == bool(want.updated) == (bad == 1e20)
    assert int(state.num_nonfinite_windows) == int(want.num_nonfinite_windows)
    np.testing.assert_allclose(params["w"], want_params["w"], rtol=1e-6)
    np.testing.assert_array_equal(
        mm.window_stats(state).grad_sq_norm, mm.window_stats(want).grad_sq_norm
    )


@functools.cache
def _stepped_once(skip):
    """The state after one step on ``LOCAL`` devices (8 with a skip function),
    and a template on 4: one trace and run per layout, for every field below."""
    n = LOCAL if skip is None else 8
    params = {"w": jnp.zeros(H)}
    tx = _tx(n, skip=skip)
    _, state = _step(tx, params, tx.init(params), 0, n)
    return state, _tx(4, skip=skip).init(params)


@pytest.mark.parametrize(
    "field",
    [
        "acc_count",
        "value_count",
        "num_invalid_counts",
        "mini_step",
        "gradient_step",
        "num_nonfinite_windows",
        "stats.microbatches",
        "stats.weighted_sq_norms",
        "stats.last.microbatches",
        "stats.last.windows",
    ],
)
@pytest.mark.parametrize("skip", [None, optax.skip_not_finite], ids=["local", "synced"])
def test_the_windows_own_figures_are_checked_too(field, skip):
    # Without a per-device layout (no reduction, or the layout a skip function
    # asks for) only the per-device counts were checked: a negative or NaN
    # window total, loss weight, tally or step counter moved into a state that
    # later conversions and `from_other_settings` refuse.
    state, template = _stepped_once(skip)
    if field.startswith("stats.last."):
        last = state.stats.last
        name = field.split(".")[2]
        last = last._replace(**{name: -jnp.ones_like(getattr(last, name))})
        bad = state._replace(stats=state.stats.replaced(last=last))
    elif field.startswith("stats."):
        name = field.split(".")[1]
        stats = state.stats.replaced(
            **{name: -jnp.ones_like(getattr(state.stats, name))}
        )
        bad = state._replace(stats=stats)
    else:
        bad = state._replace(**{field: -jnp.ones_like(getattr(state, field))})
    refused = r"negative or not finite|must be an integer|must not be negative"
    with pytest.raises(ValueError, match=refused):
        mm.from_device_count(bad, template)
    mm.from_device_count(state, template)  # as a step left it


def test_an_integer_total_that_no_longer_fits_one_device_without_a_reduction():
    # From the synced layout (a skip function) onto a wrapper without a
    # reduction: two devices' 2³⁰ tokens do not fit one int32 total.
    params = {"w": jnp.zeros(H)}

    def tx(n):
        return mm.MaskedMultiSteps(
            optax.sgd(1.0),
            K,
            count_dtype=jnp.int32,
            reduction=None if n == LOCAL else mm.deferred(_mesh(n)),
            should_skip_update_fn=optax.skip_not_finite,
        )

    saved = tx(2).init(params)
    saved = saved._replace(
        reduction_state=saved.reduction_state._replace(
            counts=jnp.full(2, 2**30, jnp.int32)
        )
    )
    with pytest.raises(ValueError, match=r"beyond the count dtype on one of the 1"):
        mm.from_device_count(saved, tx(LOCAL).init(params))


def test_leaves_outside_the_state_are_matched_by_path_not_position():
    # A renamed param outside the wrapper state (as many leaves) is refused,
    # not filled with another param's values.
    restored = {
        "params": {"a": jnp.zeros(2), "b": jnp.ones(3)},
        "opt_state": _tx(8).init({"w": jnp.zeros(H)}),
    }
    template = {
        "params": {"a": jnp.zeros(2), "c": jnp.zeros(3)},
        "opt_state": _tx(3).init({"w": jnp.zeros(H)}),
    }
    with pytest.raises(ValueError, match=r"missing \[\"\['params'\]\['c'\]\"\]"):
        mm.from_device_count(restored, template)


def test_a_restored_train_state_step_moves_onto_the_new_devices():
    # `step` restored as an array on the saved run's 8 devices (orbax, against
    # the saved TrainState) moves too: a jitted step on 3 devices takes it.
    params = {"w": jnp.zeros(H)}
    saved = mm.TrainState.create(apply_fn=None, params=params, tx=_tx(8, stats=False))
    saved = saved.replace(
        step=jax.device_put(jnp.int32(1), NamedSharding(_mesh(8), P()))
    )
    new = mm.TrainState.create(apply_fn=None, params=params, tx=_tx(3, stats=False))
    moved = mm.from_device_count(saved, new)
    assert moved.step.sharding.device_set <= set(jax.devices()[:3])
    mean, count, _ = _per_device(0, 3)
    step = jax.jit(
        lambda s: s.apply_gradients(
            grads={"w": jnp.asarray(mean, jnp.float32)},
            count=jnp.asarray(count, jnp.float32),
        )
    )
    assert int(step(moved).step) == 2


def test_an_inner_state_of_the_same_size_but_another_shape_is_refused():
    # adam's moments of shape (1, H) for an (H,) param: compared by size only,
    # they passed, and after a window the params were (1, H).
    def tx(n):
        return mm.MaskedMultiSteps(
            optax.adam(0.1),
            2,
            reduction=None if n == LOCAL else mm.deferred(_mesh(n), "data"),
        )

    params = {"w": jnp.zeros(H)}
    saved = tx(8).init(params)
    adam, *rest = saved.inner_opt_state
    adam = adam._replace(mu={"w": jnp.zeros((1, H))}, nu={"w": jnp.zeros((1, H))})
    saved = saved._replace(inner_opt_state=(adam, *rest))
    with pytest.raises(ValueError, match=r"`inner_opt_state` does not match"):
        mm.from_device_count(saved, tx(LOCAL).init(params))


def test_a_state_of_another_device_count_points_to_the_conversion():
    # flax.serialization keeps the saved shapes: a state of 8 devices restored
    # against a 4-device template reaches `update`, whose error says how to
    # continue it on 4.
    params = {"w": jnp.zeros(H)}
    tx = _tx(4)
    template = tx.init(params)
    restored = serialization.from_bytes(
        template, serialization.to_bytes(_tx(8).init(params))
    )
    grads = {"w": jnp.zeros((4, H))}
    with pytest.raises(
        ValueError, match=r"running means for 8 devices.*mm\.from_device_count"
    ):
        tx.update(grads, restored, params, count=jnp.ones(4))


@pytest.mark.parametrize("abstract", [False, True], ids=["concrete", "abstract"])
def test_a_typed_prng_key_in_the_state_moves_both_ways(abstract):
    # optax.noisy_sgd keeps a typed key in its state, which has no numpy form:
    # moving a deferred state onto one device without a reduction, or a state
    # without one onto an abstract deferred template, failed in jax ("JAX array
    # with PRNGKey dtype cannot be converted to a NumPy array").
    params = {"w": jnp.zeros(3)}
    inner = optax.noisy_sgd(0.1, eta=0.0, key=jax.random.key(7))
    deferred = mm.MaskedMultiSteps(inner, 4, reduction=mm.deferred(_mesh(2), "data"))
    local = mm.MaskedMultiSteps(inner, 4)

    def like(template):
        if not abstract:
            return template
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
            template,
        )

    def key_data(state):
        (key,) = [
            x
            for x in jax.tree.leaves(state.inner_opt_state)
            if jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
        ]
        return np.asarray(jax.random.key_data(key))

    g = {"w": jnp.array([[1.0, 1.0, 1.0], [3.0, 3.0, 3.0]])}
    _, state = deferred.update(
        g, deferred.init(params), params, count=jnp.array([1.0, 3.0])
    )
    moved = mm.from_device_count(state, like(local.init(params)))
    np.testing.assert_array_equal(moved.acc_grads["w"], [2.5, 2.5, 2.5])
    assert float(moved.acc_count) == 4.0
    np.testing.assert_array_equal(key_data(moved), key_data(state))

    _, state = local.update({"w": jnp.ones(3)}, local.init(params), params, count=2.0)
    moved = mm.from_device_count(state, like(deferred.init(params)))
    np.testing.assert_array_equal(moved.reduction_state.counts, [2.0, 0.0])
    np.testing.assert_array_equal(key_data(moved), key_data(state))
    # ... and the window continues there.
    updates, _ = deferred.update(
        {"w": jnp.ones((2, 3))}, moved, params, count=jnp.array([1.0, 1.0])
    )
    assert updates["w"].shape == (3,)


def test_several_wrappers_are_named_with_where_they_are():
    # One deferred wrapper per optax.multi_transform branch: the error said
    # only "found 2"; each branch's state converts on its own.
    mesh = _mesh(2)
    params = {"a": jnp.zeros(2), "b": jnp.zeros(3)}

    def branches(reduction):
        def wrapper():
            return mm.MaskedMultiSteps(optax.sgd(1.0), 3, reduction=reduction)

        return optax.multi_transform(
            {"x": wrapper(), "y": wrapper()}, {"a": "x", "b": "y"}
        )

    deferred, local = branches(mm.deferred(mesh, "data")), branches(None)
    g = {
        "a": jnp.array([[1.0, 1.0], [3.0, 3.0]]),
        "b": jnp.array([[1.0] * 3, [5.0] * 3]),
    }
    _, state = deferred.update(
        g, deferred.init(params), params, count=jnp.array([1.0, 3.0])
    )
    template = local.init(params)
    paths = (
        r"found 2, at `template.inner_states\['x'\].inner_state`, "
        r"`template.inner_states\['y'\].inner_state`: convert each on its own"
    )
    with pytest.raises(ValueError, match=paths):
        mm.from_device_count(state, template)
    with pytest.raises(ValueError, match=paths):
        mm.device_count_target(deferred.init(params), 2)
    for branch, leaf, mean in [("x", "a", 2.5), ("y", "b", 4.0)]:
        moved = mm.from_device_count(
            state.inner_states[branch].inner_state,
            template.inner_states[branch].inner_state,
        )
        np.testing.assert_array_equal(
            moved.acc_grads[leaf], np.full_like(params[leaf], mean)
        )
    # The optimizer passed for its state.
    with pytest.raises(
        ValueError, match=r"found 0: that is the optimizer, not its state"
    ):
        mm.from_device_count(state, local)


@pytest.mark.parametrize("new", [4, LOCAL])
def test_a_group_whose_tokens_pass_2_to_the_126_keeps_its_mean(new):
    # XLA divides the counts by their group's broadcast total as a product
    # with its reciprocal, a float32 subnormal past 2**126 ≈ 8.5e37, flushed
    # to 0: the moved window's mean was zeros, applied as an update.
    params = {"w": jnp.zeros(2)}
    old = mm.MaskedMultiSteps(
        optax.sgd(1.0), 2, reduction=mm.deferred(_mesh(8), "data")
    )
    target = mm.MaskedMultiSteps(
        optax.sgd(1.0), 2, reduction=mm.deferred(_mesh(new), "data") if new else None
    )
    data = NamedSharding(_mesh(8), P("data"))
    counts = np.array([0, 0, 1e38, 1e38, 0, 0, 1e38, 0], np.float32)
    _, state = jax.jit(lambda g, s, c: old.update(g, s, params, count=c))(
        jax.device_put({"w": jnp.ones((8, 2))}, data),
        old.init(params),
        jax.device_put(counts, data),
    )
    moved = mm.from_device_count(state, target.init(params))
    means = np.asarray(moved.acc_grads["w"])
    if new:
        np.testing.assert_allclose(means[[1, 3]], 1.0, rtol=1e-6)
    else:
        np.testing.assert_allclose(means, 1.0, rtol=1e-6)
