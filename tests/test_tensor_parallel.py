"""The wrapper inside ``jax.shard_map`` with the parameters split over a mesh axis.

Tensor parallelism by hand: each shard holds slices of the parameters, of the
state and of the gradients, and the window (its token counts, its loss) is the
same on every shard. The window's finiteness, the statistics' squared norms and a
skip function's verdict and state are the whole gradient's, so every shard's
slices end as one device's run on the whole arrays (for an inner optimizer that
reduces within no leaf and over no leaves: adam, sgd); along an axis where the
window differs (counts, losses or states of the shards' own), nothing is
combined.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import masked_multistep as mm

N = 8  # shards of the "model" axis
EXPLICIT = jax.sharding.AxisType.Explicit


def _mesh():
    return jax.make_mesh((N,), ("model",), axis_types=(EXPLICIT,))


def _params(mesh):
    return {
        "w": jax.device_put(jnp.zeros((N, 3)), NamedSharding(mesh, P("model"))),
        "b": jax.device_put(jnp.zeros(3), NamedSharding(mesh, P())),
    }


def _grads(i, nan_row=None):
    rng = np.random.default_rng(i)
    w = rng.normal(size=(N, 3)).astype(np.float32)
    if nan_row is not None:
        w[nan_row, 1] = np.nan  # in one shard's slice only
    return {"w": jnp.asarray(w), "b": jnp.asarray(rng.normal(size=3), jnp.float32)}


def _spec(tree):
    return jax.tree.map(lambda x: P(*x.sharding.spec), tree)


def _sharded_run(tx, schedule):
    """``tx.update`` inside shard_map over "model", on every (grads, count) of
    ``schedule``; the params, state and gradients split as the params are."""
    mesh = _mesh()
    params = _params(mesh)
    state = tx.init(params)
    specs = _spec(params), _spec(state)

    def body(params, state, grads, count):
        updates, state = tx.update(grads, state, params, count=count)
        return optax.apply_updates(params, updates), state

    step = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(*specs, specs[0], P()),
            out_specs=specs,
        )
    )
    for grads, count in schedule:
        grads = jax.device_put(grads, jax.tree.map(lambda x: x.sharding, params))
        params, state = step(params, state, grads, jnp.float32(count))
    return params, state


def _one_device_run(tx, schedule):
    params = {"w": jnp.zeros((N, 3)), "b": jnp.zeros(3)}
    state = tx.init(params)
    step = jax.jit(
        lambda p, s, g, n: (
            optax.apply_updates(p, tx.update(g, s, p, count=n)[0]),
            tx.update(g, s, p, count=n)[1],
        )
    )
    for grads, count in schedule:
        params, state = step(params, state, grads, jnp.float32(count))
    return params, state


def _assert_same_run(got, want):
    (p, s), (p_want, s_want) = got, want
    chex.assert_trees_all_close(p, p_want, rtol=1e-6, atol=1e-7)
    for field in ("gradient_step", "mini_step", "num_nonfinite_windows", "updated"):
        np.testing.assert_array_equal(getattr(s, field), getattr(s_want, field))
    if isinstance(s.stats, tuple) and s.stats:
        got, want = mm.window_stats(s), mm.window_stats(s_want)
        for name, a, b in zip(got._fields, got, want, strict=True):
            # Sums of squares over the shards, added in another order than on
            # one device, agree to float32 rounding; tr Σ̂ and |G|²̂ are
            # differences of such sums (and B_simple their ratio): they cancel,
            # relative and absolute (3.7e-6 relative seen).
            cancels = name in ("grad_var_trace", "true_grad_sq_norm") or "noise" in name
            rtol = 1e-5 if cancels else 2e-6
            np.testing.assert_allclose(
                np.asarray(a, np.float64),
                np.asarray(b, np.float64),
                rtol,
                1e-5,
                err_msg=name,
            )


@pytest.mark.parametrize(
    "settings",
    [{}, {"window_stats": True}, {"per_leaf_stats": True}],
    ids=["plain", "stats", "per_leaf"],
)
def test_split_params_end_as_one_devices_run(settings):
    # Shard 3's slice is NaN in the second window: the window is skipped on
    # every shard (each shard's own test let the others apply it).
    schedule = [(_grads(i, nan_row=3 if i == 3 else None), 1 + i % 4) for i in range(8)]
    tx = mm.MaskedMultiSteps(optax.adam(0.1), 2, **settings)
    got, want = _sharded_run(tx, schedule), _one_device_run(tx, schedule)
    _assert_same_run(got, want)
    assert int(got[1].num_nonfinite_windows) == 1
    assert int(got[1].gradient_step) == 3
    if settings:
        # The whole gradient's squared norm, not a slice's (140 against
        # 0, 1, 4, ..., 49 for arange).
        assert np.isfinite(float(mm.window_stats(got[1]).grad_sq_norm))


def test_a_skip_functions_verdict_and_state_are_the_shards_together():
    # A NaN in one shard's slice skips the microbatch on every shard (the
    # others counted it, and their counts and windows parted).
    schedule = [(_grads(i, nan_row=5 if i == 2 else None), 3) for i in range(6)]
    tx = mm.MaskedMultiSteps(
        optax.adam(0.1),
        2,
        window_stats=True,
        should_skip_update_fn=optax.skip_not_finite,
    )
    got, want = _sharded_run(tx, schedule), _one_device_run(tx, schedule)
    _assert_same_run(got, want)
    assert int(got[1].gradient_step) == 2 and int(got[1].num_nonfinite_windows) == 0
    chex.assert_trees_all_equal(got[1].skip_state, want[1].skip_state)


@pytest.mark.parametrize("leaf", ["w", "b"])
def test_a_skip_function_counts_a_replicated_leaf_once(leaf):
    # `b` is the same on every shard: summed over the shards, a NaN in it was
    # counted 8 times (`num_not_finite`), and its squared norm 8 times in
    # skip_large_updates' `norm_squared`.
    def nan_at(i):
        g = _grads(i)
        if i == 2:
            g[leaf] = g[leaf].at[(5, 1) if leaf == "w" else 1].set(jnp.nan)
        return g

    schedule = [(nan_at(i), 3) for i in range(3)]
    tx = mm.MaskedMultiSteps(
        optax.adam(0.1), 2, should_skip_update_fn=optax.skip_not_finite
    )
    got, want = _sharded_run(tx, schedule), _one_device_run(tx, schedule)
    _assert_same_run(got, want)
    chex.assert_trees_all_equal(got[1].skip_state, want[1].skip_state)
    assert int(got[1].skip_state["num_not_finite"]) == 1

    def large(g, s, p):
        return optax.skip_large_updates(g, s, p, max_squared_norm=1e6)

    schedule = [(_grads(i), 3) for i in range(3)]
    tx = mm.MaskedMultiSteps(optax.adam(0.1), 2, should_skip_update_fn=large)
    got, want = _sharded_run(tx, schedule), _one_device_run(tx, schedule)
    np.testing.assert_allclose(
        got[1].skip_state["norm_squared"], want[1].skip_state["norm_squared"], 1e-6
    )


def test_an_inner_global_norm_over_slices_is_named():
    # optax.clip_by_global_norm inside the wrapper sees each shard's slices:
    # the replicated `b`'s update would differ between the shards. It failed
    # in jax's cond ("branches must have equal output types ... pcast").
    tx = mm.MaskedMultiSteps(
        optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0)), 2
    )
    with pytest.raises(
        ValueError,
        match=r"update of grads\['b'\] differs between the shards of \['model'\] "
        r"while that gradient and its parameter do not.*clip_by_global_norm",
    ):
        _sharded_run(tx, [(_grads(0), 3)])


def test_the_norm_test_decides_on_the_whole_gradient():
    rng = np.random.default_rng(0)
    signal = rng.normal(size=(N, 3)).astype(np.float32)
    schedule = [
        (
            {
                "w": jnp.asarray(signal + 0.3 * rng.normal(size=(N, 3)), jnp.float32),
                "b": jnp.asarray(rng.normal(size=3), jnp.float32),
            },
            4,
        )
        for _ in range(12)
    ]
    tx = mm.MaskedMultiSteps(optax.sgd(0.1), 6, norm_test=0.5)
    got, want = _sharded_run(tx, schedule), _one_device_run(tx, schedule)
    _assert_same_run(got, want)
    assert int(want[1].gradient_step) > 2  # the test closed windows before k


def test_microbatched_statistics_inside_shard_map_are_the_whole_gradients():
    mesh = _mesh()
    params = _params(mesh)
    rng = np.random.default_rng(1)
    batch = {
        "x": jnp.asarray(rng.normal(size=(8, 5, N)), jnp.float32),
        "mask": jnp.asarray(rng.random((8, 5)) < 0.7),
    }

    def loss_fn(p, mb):
        h = jnp.tanh(mb["x"] @ p["w"]) + p["b"][None, None]
        return mm.masked_mean(jnp.sum(h**2, -1), mb["mask"])

    grad_fn = mm.microbatched_value_and_grad(loss_fn, 4, with_stats=True)

    def shard_loss(p, mb):
        # This shard's row of `w` meets its column of `x`; the partial
        # products are summed over the shards.
        x = jax.lax.dynamic_slice_in_dim(mb["x"], jax.lax.axis_index("model"), 1, -1)
        h = jnp.tanh(jax.lax.psum(x @ p["w"], "model")) + p["b"][None, None]
        return mm.masked_mean(jnp.sum(h**2, -1), mb["mask"])

    sharded = jax.jit(
        jax.shard_map(
            mm.microbatched_value_and_grad(shard_loss, 4, with_stats=True),
            mesh=mesh,
            in_specs=(_spec(params), P()),
            out_specs=((P(), P()), _spec(params), P()),
        )
    )
    (_, count), grads, stats = sharded(params, batch)
    whole = {"w": jnp.zeros((N, 3)), "b": jnp.zeros(3)}
    (_, want_count), want_grads, want_stats = jax.jit(grad_fn)(whole, batch)
    assert float(count) == float(want_count)
    chex.assert_trees_all_close(grads, want_grads, rtol=1e-5, atol=1e-7)
    for a, b in zip(stats, want_stats):
        np.testing.assert_allclose(
            np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=1e-5
        )


def test_shards_with_counts_of_their_own_keep_windows_of_their_own():
    # An ensemble over a mesh axis: each member's gradients and counts are its
    # own; nothing is combined across members (a NaN in member 3's only skips
    # member 3's window).
    mesh = jax.make_mesh(
        (4,),
        ("ensemble",),
        axis_types=(jax.sharding.AxisType.Auto,),
        devices=jax.devices()[:4],
    )
    tx = mm.MaskedMultiSteps(optax.adam(0.1), 2, window_stats=True)
    params = jax.device_put(jnp.zeros((4, 3)), NamedSharding(mesh, P("ensemble")))
    state = jax.vmap(tx.init)(params)
    specs = P("ensemble"), jax.tree.map(lambda _: P("ensemble"), state)

    def body(p, s, g, n):
        s = jax.tree.map(lambda x: x[0], s)
        u, s = tx.update(g[0], s, p[0], count=n[0])
        return (p + u[None]), jax.tree.map(lambda x: x[None], s)

    step = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(*specs, P("ensemble"), P("ensemble")),
            out_specs=specs,
        )
    )
    rng = np.random.default_rng(2)
    grads = [rng.normal(size=(4, 3)).astype(np.float32) for _ in range(4)]
    grads[1][3, 0] = np.nan
    counts = [rng.integers(1, 5, size=4).astype(np.float32) for _ in range(4)]
    p, s = params, state
    for g, n in zip(grads, counts):
        p, s = step(p, s, jnp.asarray(g), jnp.asarray(n))
    for member in range(4):
        q, t = jnp.zeros(3), tx.init(jnp.zeros(3))
        for g, n in zip(grads, counts):
            u, t = tx.update(jnp.asarray(g[member]), t, q, count=jnp.float32(n[member]))
            q = q + u
        np.testing.assert_allclose(np.asarray(p)[member], q, rtol=1e-6)
        assert int(s.num_nonfinite_windows[member]) == int(t.num_nonfinite_windows)
        np.testing.assert_allclose(
            np.asarray(s.stats.last.grad_sq_norm)[member],
            t.stats.last.grad_sq_norm,
            rtol=1e-6,
        )
    assert np.asarray(s.num_nonfinite_windows).tolist() == [0, 0, 0, 1]


def _data_mesh(n=4):
    return jax.make_mesh(
        (n,),
        ("data",),
        axis_types=(jax.sharding.AxisType.Auto,),
        devices=jax.devices()[:n],
    )


def test_data_parallel_shards_with_a_constant_count_keep_their_own_statistics():
    # A scalar mask makes the count the same on every shard while each shard's
    # gradients are its own: the shards' losses differ, so they are not slices
    # of one gradient (their squared norms were summed over "data").
    n = 4
    mesh = _data_mesh(n)

    def loss_fn(w, batch):
        return mm.masked_mean((batch["x"] @ w - batch["y"]) ** 2, True)

    grad_fn = mm.microbatched_value_and_grad(loss_fn, 2, with_stats=True)

    def shard(w, batch):
        (_, _), _, stats = grad_fn(jax.lax.pcast(w, "data", to="varying"), batch)
        return jnp.asarray(stats.grad_sq_norm)[None]

    rng = np.random.default_rng(0)
    batch = {
        "x": jnp.asarray(rng.normal(size=(4 * n, 3)), jnp.float32),
        "y": jnp.asarray(rng.normal(size=(4 * n,)), jnp.float32),
    }
    w = jnp.ones(3)
    got = jax.jit(
        jax.shard_map(shard, mesh=mesh, in_specs=(P(), P("data")), out_specs=P("data"))
    )(w, batch)
    want = []
    for d in range(n):
        rows = {key: x[4 * d : 4 * d + 4] for key, x in batch.items()}
        want.append(float(grad_fn(w, rows)[2].grad_sq_norm))
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_ensemble_members_fed_one_batch_skip_alone():
    # The count is the shared batch's, the same for every member: the members'
    # states (their windows) differ, so a NaN in member 3's gradient skips
    # member 3's microbatch alone (every member skipped it).
    m = 4
    mesh = jax.make_mesh(
        (m,),
        ("ens",),
        axis_types=(jax.sharding.AxisType.Auto,),
        devices=jax.devices()[:m],
    )
    tx = mm.MaskedMultiSteps(
        optax.sgd(1.0),
        2,
        window_stats=True,
        should_skip_update_fn=optax.skip_not_finite,
    )
    params = jax.device_put(jnp.zeros((m, 3)), NamedSharding(mesh, P("ens")))
    state = jax.vmap(tx.init)(params)
    specs = P("ens"), jax.tree.map(lambda _: P("ens"), state)

    def body(p, s, g, n):
        u, s = tx.update(g[0], jax.tree.map(lambda x: x[0], s), p[0], count=n)
        return p + u[None], jax.tree.map(lambda x: x[None], s)

    step = jax.jit(
        jax.shard_map(
            body, mesh=mesh, in_specs=(*specs, P("ens"), P()), out_specs=specs
        )
    )
    rng = np.random.default_rng(0)
    grads = [rng.normal(size=(m, 3)).astype(np.float32) for _ in range(4)]
    grads[0][3, 0] = np.nan
    counts = [3, 5, 2, 4]
    p, s = params, state
    for g, n in zip(grads, counts):
        p, s = step(p, s, jnp.asarray(g), jnp.float32(n))
    for member in range(m):
        q, t = jnp.zeros(3), tx.init(jnp.zeros(3))
        for g, n in zip(grads, counts):
            u, t = tx.update(jnp.asarray(g[member]), t, q, count=jnp.float32(n))
            q = q + u
        np.testing.assert_allclose(np.asarray(p)[member], q, rtol=1e-6)
        np.testing.assert_allclose(
            np.asarray(s.stats.last.sq_deviation)[member],
            t.stats.last.sq_deviation,
            rtol=1e-6,
        )


@pytest.mark.parametrize("mistake", ["grads", "grads, params=None", "value"])
def test_a_data_parallel_figure_left_unreduced_is_named(mistake):
    # The count summed over the shards, the gradients (or the loss) forgotten:
    # each replica would apply its own shard's gradient to the replicated
    # parameters, or the one window take each shard's own loss.
    n = 4
    mesh = _data_mesh(n)
    tx = mm.MaskedMultiSteps(optax.sgd(0.1), 1)

    def shard_step(w, state, batch):
        def loss_fn(w):
            return mm.masked_mean((batch["x"] @ w - batch["y"]) ** 2, batch["mask"])

        wv = jax.lax.pcast(w, "data", to="varying")
        (loss, count), grads = jax.value_and_grad(loss_fn, has_aux=True)(wv)
        if mistake == "value":
            grads, total = mm.weighted_mean_across(grads, count, "data")
            return tx.update(grads, state, w, count=total, value=loss)
        params = None if "None" in mistake else w
        return tx.update(grads, state, params, count=jax.lax.psum(count, "data"))

    rng = np.random.default_rng(0)
    batch = {
        "x": jnp.asarray(rng.normal(size=(4 * n, 8, 3)), jnp.float32),
        "y": jnp.asarray(rng.normal(size=(4 * n, 8)), jnp.float32),
        "mask": jnp.asarray(rng.random((4 * n, 8)) < 0.5),
    }
    w = jnp.ones(3)
    step = jax.shard_map(
        shard_step, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P())
    )
    match = (
        r"`value` differs between the shards of \['data'\] while the wrapper's "
        r"state is the same on every shard.*weighted_mean_across\(loss, count"
        if mistake == "value"
        else r"grads differs between the shards of \['data'\] while its parameter "
        r"and the wrapper's state do not: a gradient not yet reduced.*"
        r"weighted_mean_across"
    )
    with pytest.raises(ValueError, match=match):
        jax.jit(step)(w, tx.init(w), batch)


def test_shards_with_windows_of_their_own_and_replicated_params_run():
    # Each data shard keeps a window of its own (its state sharded over
    # "data"), the params replicated, the updates averaged at the window's
    # end by hand: the gradient varies where its accumulator does.
    n = 4
    mesh = _data_mesh(n)
    tx = mm.MaskedMultiSteps(optax.sgd(0.1), 2)
    w = jnp.ones(3)
    state = jax.vmap(lambda _: tx.init(w))(jnp.arange(n))
    specs = jax.tree.map(lambda _: P("data"), state)

    def shard_step(w, state, g):
        u, state = tx.update(g[0], jax.tree.map(lambda x: x[0], state), w, count=3)
        return w + jax.lax.pmean(u, "data"), jax.tree.map(lambda x: x[None], state)

    step = jax.jit(
        jax.shard_map(
            shard_step,
            mesh=mesh,
            in_specs=(P(), specs, P("data")),
            out_specs=(P(), specs),
        )
    )
    grads = jnp.asarray(np.random.default_rng(0).normal(size=(n, 3)), jnp.float32)
    for _ in range(2):
        w, state = step(w, state, grads)
    np.testing.assert_allclose(w, 1 - 0.1 * grads.mean(0), rtol=1e-6)
