"""Each parameter leaf's (and each group's) share of the window statistics."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import masked_multistep as mm
from masked_multistep import _stats, _stats_state
from tests._helpers import assert_bit_identical

K = 3
AUTO = jax.sharding.AxisType.Auto
PER_GROUP = _stats_state.PER_GROUP  # the fields each leaf or group has
SHARED = ("tokens", "microbatches", "loss", "windows")


def _params():
    return {
        "enc": {"w": jnp.zeros((4, 3)), "b": jnp.zeros(3)},
        "dec": {"w": jnp.zeros((3, 2))},
    }


def _plan(seed=0, windows=4):
    """Microbatches of unequal counts, with a count-0 NaN one in each window:
    gradients drawn around a fixed mean, each leaf with its own noise."""
    rng = np.random.default_rng(seed)
    params = _params()
    mean = jax.tree.map(lambda p: rng.normal(size=p.shape), params)
    scale = {"enc": {"w": 0.3, "b": 2.0}, "dec": {"w": 1.0}}
    plan = []
    for _ in range(windows):
        for i in range(K):
            if i == 1:
                grads = jax.tree.map(
                    lambda p: jnp.full(p.shape, jnp.nan, jnp.float32), params
                )
                plan.append((grads, jnp.float32(0)))
                continue
            n = int(rng.integers(1, 40))
            grads = jax.tree.map(
                lambda m, s, n=n: jnp.asarray(
                    m + s * rng.normal(size=m.shape) / np.sqrt(n), jnp.float32
                ),
                mean,
                scale,
            )
            plan.append((grads, jnp.float32(n)))
    return plan


def _run(tx, plan, pick=lambda tree: tree, apply=False):
    """The states and outputs (updates, or with ``apply`` params) after each
    microbatch of ``plan`` (gradients and params restricted by ``pick``),
    under jit."""
    params = pick(_params())
    state = tx.init(params)

    @jax.jit
    def step(grads, state, params, n):
        if apply:
            params, state = tx.apply_gradients(grads, state, params, count=n)
            return params, state
        return tx.update(grads, state, params, count=n)

    states, outs = [], []
    for grads, n in plan:
        out, state = step(pick(grads), state, params, n)
        params = out if apply else params
        states.append(state)
        outs.append(out)
    return states, outs


def _close(a, b, rtol=2e-6):
    """Equal to float32 rounding, leaf by leaf (pytrees of equal structure)."""
    jax.tree.map(
        lambda x, y: np.testing.assert_allclose(
            np.asarray(x), np.asarray(y), rtol=rtol, atol=1e-7
        ),
        a,
        b,
    )


# S = Σ nᵢ‖gᵢ‖² − N‖ḡ‖² cancels (README, "Window statistics"): a sum taken in
# another order moves its float32 rounding by up to about N / B_simple ulps,
# and |G|²̂ = ‖ḡ‖² − tr Σ̂ / N cancels again where the noise dominates.
S_RTOL = 1e-4
RTOL = {
    "grad_sq_norm": 2e-6,
    "grad_var_trace": S_RTOL,
    "true_grad_sq_norm": 1e-3,
    "noise_scale": 1e-3,
    "smoothed_noise_scale": 1e-3,
}


def _close_stats(a, b, pick=lambda tree: tree):
    """The per-group fields of ``a`` (picked) and ``b`` equal to rounding."""
    for name, rtol in RTOL.items():
        _close(pick(getattr(a, name)), getattr(b, name), rtol)


def test_each_leafs_statistics_are_those_of_a_wrapper_on_that_leaf_alone():
    plan = _plan()
    tx = mm.MaskedMultiSteps(optax.sgd(0.1), K, per_leaf_stats=True)
    state = _run(tx, plan)[0][-1]
    per_leaf = mm.window_stats(state, per_leaf=True)
    total = mm.window_stats(state)
    assert int(total.windows) == 4 and int(total.microbatches) == 2
    for path, _ in jax.tree_util.tree_flatten_with_path(_params())[0]:

        def pick(tree, path=path):
            for key in path:
                tree = tree[key.key]
            return tree

        alone = mm.MaskedMultiSteps(optax.sgd(0.1), K, window_stats=True)
        expected = mm.window_stats(_run(alone, plan, pick)[0][-1])
        _close_stats(per_leaf, expected, pick)
        for name in SHARED:
            assert_bit_identical(getattr(per_leaf, name), getattr(expected, name))


def test_groups_by_label_prefix_or_function_are_wrappers_on_their_leaves():
    plan = _plan(seed=1)
    tx = mm.MaskedMultiSteps(optax.sgd(0.1), K, per_leaf_stats=True)
    state = _run(tx, plan)[0][-1]
    by_prefix = mm.window_stats(state, groups={"enc": "encoder", "dec": "decoder"})
    by_function = mm.window_stats(
        state,
        groups=lambda tree: {
            "enc": jax.tree.map(lambda _: "encoder", tree["enc"]),
            "dec": {"w": "decoder"},
        },
    )
    for part, label in [("enc", "encoder"), ("dec", "decoder")]:
        alone = mm.MaskedMultiSteps(optax.sgd(0.1), K, window_stats=True)
        expected = mm.window_stats(_run(alone, plan, lambda t, p=part: t[p])[0][-1])
        _close_stats(by_prefix, expected, lambda x, label=label: x[label])
        assert_bit_identical(by_prefix, by_function)
    # One group of every leaf: the window's own figures.
    one = mm.window_stats(state, groups="all")
    total = mm.window_stats(state)
    _close_stats(one, total, lambda x: x["all"])


def test_the_leaves_add_up_to_the_window_and_the_totals_are_kept_as_without_them():
    plan = _plan(seed=2)
    with_leaves = mm.MaskedMultiSteps(optax.adam(0.1), K, per_leaf_stats=True)
    without = mm.MaskedMultiSteps(optax.adam(0.1), K, window_stats=True)
    states, updates = _run(with_leaves, plan)
    plain_states, plain_updates = _run(without, plan)
    # The statistics never change the updates.
    assert_bit_identical(updates, plain_updates)
    for state, plain in zip(states, plain_states, strict=True):
        total, expected = mm.window_stats(state), mm.window_stats(plain)
        _close_stats(total, expected)
        for name in SHARED:
            assert_bit_identical(getattr(total, name), getattr(expected, name))
    leaves = mm.window_stats(states[-1], per_leaf=True)
    total = mm.window_stats(states[-1])
    for name in ("grad_sq_norm", "grad_var_trace", "true_grad_sq_norm"):
        _close(
            sum(jax.tree.leaves(getattr(leaves, name))), getattr(total, name), S_RTOL
        )


def test_each_leafs_shares_are_one_array_of_the_state():
    # Every array of a jitted call costs the host as much as a scalar: the
    # leaves' five figures are packed into one (5, L) array, read by name.
    params = _params()
    with_leaves = mm.MaskedMultiSteps(optax.sgd(0.1), K, per_leaf_stats=True)
    without = mm.MaskedMultiSteps(optax.sgd(0.1), K, window_stats=True)
    stats = with_leaves.init(params).stats
    assert (
        len(jax.tree.leaves(stats))
        == len(jax.tree.leaves(without.init(params).stats)) + 1
    )
    assert stats.leaves.shares.shape == (len(_stats_state.LeafSums.FIGURES), 3)
    grads, n = _plan()[0]
    _, state = with_leaves.update(grads, with_leaves.init(params), params, count=n)
    leaves = state.stats.leaves
    sq = [float(jnp.sum(jnp.square(g))) for g in jax.tree.leaves(grads)]
    np.testing.assert_allclose(leaves.weighted_sq_norms, float(n) * np.array(sq))
    for name in _stats_state.LeafSums.FIGURES[1:]:  # no window closed yet
        assert_bit_identical(getattr(leaves, name), jnp.zeros(3))
    with pytest.raises(TypeError, match="no figure named 'sq_norms'"):
        leaves.replaced(sq_norms=jnp.zeros(3))


def test_each_leafs_spread_matches_a_float64_two_pass_sum():
    plan = _plan(seed=3, windows=1)
    tx = mm.MaskedMultiSteps(optax.sgd(0.1), K, per_leaf_stats=True)
    state = _run(tx, plan)[0][-1]
    spread = _stats.read_leaf_stats(state.stats, (0, 1, 2)).grad_var_trace  # K = 2
    taken = [(g, float(n)) for g, n in plan if float(n) > 0]
    for leaf in range(3):
        gs = [np.asarray(jax.tree.leaves(g)[leaf], np.float64) for g, _ in taken]
        ns = np.array([n for _, n in taken])
        mean = sum(n * g for n, g in zip(ns, gs)) / ns.sum()
        s = sum(n * np.sum((g - mean) ** 2) for n, g in zip(ns, gs))
        np.testing.assert_allclose(spread[leaf], s / (len(taken) - 1), rtol=S_RTOL)


def test_an_empty_microbatch_leaves_every_leafs_share_bit_identical():
    tx = mm.MaskedMultiSteps(optax.sgd(0.1), K, per_leaf_stats=True)
    params = _params()
    state = tx.init(params)
    grads, n = _plan()[0]
    _, state = tx.update(grads, state, params, count=n)
    nan = jax.tree.map(lambda p: jnp.full(p.shape, jnp.nan), params)
    _, after = tx.update(nan, state, params, count=jnp.float32(0))
    assert_bit_identical(after.stats, state.stats)


def test_apply_gradients_train_state_and_a_read_under_jit_agree():
    plan = _plan(seed=4)
    tx = mm.MaskedMultiSteps(optax.adam(0.1), K, per_leaf_stats=True)
    state = _run(tx, plan)[0][-1]
    applied = _run(tx, plan, apply=True)[0][-1]
    eager = mm.window_stats(state, per_leaf=True)
    assert_bit_identical(mm.window_stats(applied, per_leaf=True), eager)
    traced = jax.jit(lambda s: mm.window_stats(s, per_leaf=True))(state)
    _close_stats(traced, eager)
    # Inside optax.chain (a nested state).
    chained = optax.chain(optax.scale(1.0), tx)
    params = _params()
    nested = chained.init(params)
    for grads, n in plan:
        _, nested = chained.update(grads, nested, params, count=n)
    _close_stats(mm.window_stats(nested, per_leaf=True), eager)


def test_linen_train_state_and_nnx_optimizer_keep_each_leafs_share():
    flax = pytest.importorskip("flax")
    from flax import nnx

    plan = _plan(seed=5, windows=2)
    tx = mm.MaskedMultiSteps(optax.sgd(0.1), K, per_leaf_stats=True)
    expected = mm.window_stats(_run(tx, plan)[0][-1], per_leaf=True)

    ts = mm.TrainState.create(apply_fn=None, params=_params(), tx=tx)
    for grads, n in plan:
        ts = ts.apply_gradients(grads=grads, count=n)
    _close_stats(mm.window_stats(ts, per_leaf=True), expected)
    assert flax is not None

    class Model(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.zeros(3))

    model = Model()
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    for grads, n in plan:
        params = nnx.state(model, nnx.Param)
        optimizer.update(
            model, jax.tree.map(lambda _, g=grads: g["enc"]["b"], params), count=n
        )
    got = mm.window_stats(optimizer, per_leaf=True)
    for name, rtol in RTOL.items():
        _close(getattr(got, name)["w"], getattr(expected, name)["enc"]["b"], rtol)
    by_group = mm.window_stats(optimizer, groups="b")
    for name, rtol in RTOL.items():
        _close(getattr(by_group, name)["b"], getattr(expected, name)["enc"]["b"], rtol)


def test_a_checkpoint_mid_window_resumes_bit_identically(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    plan = _plan(seed=6)
    tx = mm.MaskedMultiSteps(optax.adam(0.1), K, per_leaf_stats=True)
    states, _ = _run(tx, plan)
    saved = states[4]  # mid-window, after one completed window
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "ckpt", saved)
        checkpointer.wait_until_finished()
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, tx.init(_params()))
        restored = checkpointer.restore(tmp_path / "ckpt", abstract)
    assert isinstance(restored.stats.leaves, _stats_state.LeafSums)
    params = _params()
    step = jax.jit(lambda g, s, n: tx.update(g, s, params, count=n)[1])
    state = restored
    for grads, n in plan[5:]:
        state = step(grads, state, n)
    assert_bit_identical(state.stats, states[-1].stats)


def test_reverse_mode_derivatives_through_each_leafs_share_are_finite():
    tx = mm.MaskedMultiSteps(optax.sgd(0.1), 3, per_leaf_stats=True)

    def noise(theta):
        params = {"a": jnp.zeros(2), "b": jnp.zeros(1)}
        state = tx.init(params)
        empty = {"a": jnp.full(2, jnp.nan), "b": jnp.full(1, jnp.nan)}
        for grads, n in [
            ({"a": theta * jnp.ones(2), "b": jnp.ones(1)}, 2.0),
            (empty, 0.0),
            ({"a": jnp.array([1.0, 3.0]), "b": theta * jnp.full(1, 2.0)}, 3.0),
        ]:
            _, state = tx.update(grads, state, params, count=jnp.float32(n))
        stats = mm.window_stats(state, per_leaf=True)
        return stats.grad_var_trace["a"] + stats.grad_sq_norm["b"]

    # Eager on purpose: each step runs only the branch its concrete counts
    # take (jitted, a conditional runs instead).
    value, tangent = jax.jvp(noise, (1.0,), (1.0,))
    grad = jax.grad(noise)(1.0)
    assert np.isfinite(value) and np.isfinite(grad)
    np.testing.assert_allclose(grad, tangent, rtol=1e-5)


def test_errors_name_the_argument_and_what_was_received():
    params = _params()
    with pytest.raises(TypeError, match="`per_leaf_stats`.*'yes'"):
        mm.MaskedMultiSteps(optax.sgd(0.1), K, per_leaf_stats="yes")
    totals_only = mm.MaskedMultiSteps(optax.sgd(0.1), K, window_stats=True)
    with pytest.raises(ValueError, match="per_leaf_stats=True"):
        mm.window_stats(totals_only.init(params), per_leaf=True)
    with pytest.raises(ValueError, match="per_leaf_stats=True"):
        mm.window_stats(totals_only.init(params), groups="all")
    state = mm.MaskedMultiSteps(optax.sgd(0.1), K, per_leaf_stats=True).init(params)
    with pytest.raises(TypeError, match="not both"):
        mm.window_stats(state, per_leaf=True, groups="all")
    with pytest.raises(ValueError, match="`groups` must be a pytree of str labels"):
        mm.window_stats(state, groups={"enc": "e"})
    with pytest.raises(TypeError, match="labels must be str, got 3 of type int"):
        mm.window_stats(state, groups={"enc": 3, "dec": "d"})
    # A list where a leaf's one label belongs (it said the leaf had none).
    with pytest.raises(
        ValueError,
        match=r"the labels for the params' leaf at \['dec'\]\['w'\] are nested",
    ):
        mm.window_stats(state, groups={"enc": "e", "dec": {"w": ["d"]}})
    # Labels in a list for a dict's leaves (it said only that a leaf had none).
    with pytest.raises(
        ValueError,
        match=r"and a label at \[0\], where the params have no leaf \(the labels "
        r"are a list, the params a dict\)",
    ):
        mm.window_stats(state, groups=["e", "d"])
    with pytest.raises(
        TypeError, match=r"`groups` must be a callable of one argument \(the params\)"
    ):
        mm.window_stats(state, groups=lambda params, extra: "all")
    with pytest.raises(TypeError, match="`per_leaf`"):
        mm.window_stats(state, per_leaf=1)
    tx = mm.MaskedMultiSteps(optax.sgd(0.1), K, per_leaf_stats=True)
    assert "per_leaf_stats=True" in repr(tx)
    # Pickling rebuilds it from the constructor's arguments, option included.
    rebuild, args = tx.__reduce__()
    again = rebuild(*args)
    assert repr(again) == repr(tx)
    assert isinstance(again.init(params).stats.leaves, _stats_state.LeafSums)


def test_a_converted_window_counts_its_mean_as_one_microbatch_for_every_leaf():
    """From optax.MultiSteps or a 0.1 checkpoint, mid-window: each leaf's
    statistics are those of a run whose first microbatch is the pending mean,
    with the window's tokens."""
    params = {"a": jnp.zeros(2), "b": jnp.zeros(1)}
    tx = mm.MaskedMultiSteps(optax.sgd(0.1), 2, per_leaf_stats=True)
    pending = {"a": jnp.array([1.0, -2.0]), "b": jnp.array([4.0])}
    last = {"a": jnp.array([3.0, 0.0]), "b": jnp.array([-1.0])}
    direct = tx.init(params)
    for grads, n in [(pending, 6), (last, 2)]:
        _, direct = tx.update(grads, direct, params, count=jnp.float32(n))
    expected = mm.window_stats(direct, per_leaf=True)

    old = optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2)
    old_state = old.init(params)
    _, old_state = old.update(pending, old_state, params)
    from_optax = mm.from_optax_multisteps(old_state, tx, params, acc_count=6)
    template = tx.init(params)
    from_0_1 = mm.from_state_0_1(
        {
            **mm.state_0_1_target(template),
            "mini_step": jnp.int32(1),
            "acc_count": jnp.int32(6),
            "acc_grads": pending,
        },
        template,
    )
    for state in (from_optax, from_0_1):
        _, state = tx.update(last, state, params, count=jnp.float32(2))
        _close_stats(mm.window_stats(state, per_leaf=True), expected)


@pytest.mark.parametrize("per_window", [True, False])
def test_deferred_devices_shares_are_small_batches_for_every_leaf(per_window):
    """With reduction=mm.deferred, each device's share of a microbatch is a
    small batch of every leaf's statistics too: they equal a single-device
    window fed the devices' gradients one by one. Per window (a fixed k), the
    devices keep their leaves' shares until the window closes, and the shares'
    sums join the window's one all-reduce; synced (a token budget), they are
    summed on every microbatch."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from tests._helpers import collectives

    ndev, rows = len(jax.devices()), 2
    mesh = jax.make_mesh((ndev,), ("data",), axis_types=(AUTO,))
    rng = np.random.default_rng(7)

    def loss_fn(params, mb):
        x = jnp.where(mb["mask"][..., None], mb["x"], 0)  # padding holds NaN
        pred = x @ params["w"] + params["b"][0]
        return mm.masked_mean((pred - mb["y"]) ** 2, mb["mask"])

    def batch(empty_device):
        mask = rng.uniform(size=(ndev * rows, 3)) < 0.8
        mask[empty_device * rows : (empty_device + 1) * rows] = False
        x = rng.normal(size=(ndev * rows, 3, 4))
        return {
            "x": jnp.asarray(np.where(mask[..., None], x, np.nan), jnp.float32),
            "y": jnp.asarray(rng.normal(size=(ndev * rows, 3)), jnp.float32),
            "mask": jnp.asarray(mask),
        }

    grad_fn = jax.jit(mm.per_device_value_and_grad(loss_fn, mesh, "data"))
    params = {"w": jnp.asarray(rng.normal(size=4), jnp.float32), "b": jnp.ones(2)}
    data = NamedSharding(mesh, P("data"))
    pieces = [grad_fn(params, jax.device_put(batch(d), data)) for d in (1, 4)]
    rule = {} if per_window else {"tokens_per_window": 1e9}

    def make(**kw):
        reduction = mm.deferred(mesh, "data")
        return mm.MaskedMultiSteps(
            optax.adam(0.1), 2, reduction=reduction, **rule, **kw
        )

    def run(tx):
        state = tx.init(params)
        step = jax.jit(lambda s, g, n: tx.update(g, s, params, count=n))
        outs = []
        for (_, count), grads in pieces:
            updates, state = step(state, grads, count)
            outs.append(updates)
        return outs, state, step

    leaf_tx, totals_tx = make(per_leaf_stats=True), make(window_stats=True)
    leaf_out, with_leaves, leaf_step = run(leaf_tx)
    totals_out, totals, totals_step = run(totals_tx)
    assert_bit_identical(leaf_out, totals_out)
    assert bool(with_leaves.updated)
    _close_stats(mm.window_stats(with_leaves), mm.window_stats(totals))

    ref_tx = mm.MaskedMultiSteps(optax.sgd(0.1), 2 * ndev, per_leaf_stats=True)
    ref = ref_tx.init(params)
    ref_step = jax.jit(lambda g, s, n: ref_tx.update(g, s, params, count=n)[1])
    for (_, count), grads in pieces:
        grads, count = jax.tree.map(np.asarray, grads), np.asarray(count)
        for d in range(ndev):
            ref = ref_step(jax.tree.map(lambda g, d=d: g[d], grads), ref, count[d])
    got = mm.window_stats(with_leaves, per_leaf=True)
    want = mm.window_stats(ref, per_leaf=True)
    assert int(got.microbatches) == int(want.microbatches) == 2 * (ndev - 1)
    _close_stats(got, want)

    if per_window:
        # No collective between window ends; the leaves' sums (4 bytes each,
        # in place of the total's) ride on the window's closing all-reduces.
        def compiled(tx, step):
            (_, count), grads = pieces[0]
            text = step.lower(tx.init(params), grads, count).compile().as_text()
            return sorted((c.kind, c.where, c.bytes) for c in collectives(text))

        base = compiled(totals_tx, totals_step)
        more = compiled(leaf_tx, leaf_step)
        assert {where for _, where, _ in more} == {"branch"}, more
        assert len(more) == len(base), (base, more)
        assert sum(c[2] for c in more) == sum(c[2] for c in base) + 4 * (2 - 1), more


@pytest.mark.parametrize(
    ("old", "new", "budget"),
    [(8, 3, False), (8, 0, False), (0, 4, False), (4, 8, True), (8, 0, True)],
    ids=["8-3", "8-local", "local-4", "synced-4-8", "synced-8-local"],
)
def test_a_window_moved_onto_other_devices_keeps_every_leafs_share(old, new, budget):
    """mm.from_device_count regroups each device's leaf shares with the rest
    of the window: the window ends with every leaf's statistics of the shares
    it saw (old devices' before the move, new ones' after), as a single-device
    window fed those shares one by one."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    rows, steps, move_after = 24, 4, 2
    rng = np.random.default_rng(8)
    grads = rng.normal(size=(steps, rows, 3))
    counts = rng.integers(0, 6, size=(steps, rows)).astype(np.float64)
    grads[counts == 0] = np.nan

    def shares(i, n):
        """Microbatch ``i`` as ``max(n, 1)`` devices see it: each one's mean
        gradient of both leaves, and its count."""
        n = max(n, 1)
        g = grads[i].reshape(n, rows // n, 3)
        c = counts[i].reshape(n, rows // n)
        total = c.sum(1)
        with np.errstate(invalid="ignore", divide="ignore"):
            mean = np.nansum(g * c[..., None], 1) / total[:, None]
        return {"w": mean, "b": 2 * mean[:, :2]}, total

    def make(n):
        rule = {"tokens_per_window": 1e9} if budget else {}
        reduction = None
        if n:
            mesh = jax.make_mesh(
                (n,), ("data",), axis_types=(AUTO,), devices=jax.devices()[:n]
            )
            reduction = mm.deferred(mesh, "data")
        return mm.MaskedMultiSteps(
            optax.sgd(1.0), steps, reduction=reduction, per_leaf_stats=True, **rule
        )

    def step(tx, state, i, n):
        g, c = shares(i, n)
        if n:
            data = NamedSharding(tx._reduction.mesh, P("data"))
            put = lambda x: jax.device_put(jnp.asarray(x, jnp.float32), data)  # noqa: E731
        else:
            put = lambda x: jnp.asarray(x[0], jnp.float32)  # noqa: E731
        return jax.jit(tx.update)(jax.tree.map(put, g), state, params, count=put(c))[1]

    params = {"w": jnp.zeros(3), "b": jnp.zeros(2)}
    tx = make(old)
    state = tx.init(params)
    for i in range(move_after):
        state = step(tx, state, i, old)
    tx = make(new)
    state = mm.from_device_count(state, tx.init(params))
    for i in range(move_after, steps):
        state = step(tx, state, i, new)
    assert bool(state.updated)

    seen = [shares(i, old if i < move_after else new) for i in range(steps)]
    taken = [
        (jax.tree.map(lambda x, d=d: jnp.asarray(x[d], jnp.float32), g), c[d])
        for g, c in seen
        for d in range(len(c))
        if c[d] > 0
    ]
    ref_tx = mm.MaskedMultiSteps(optax.sgd(1.0), len(taken), per_leaf_stats=True)
    ref = ref_tx.init(params)
    for g, c in taken:
        _, ref = ref_tx.update(g, ref, params, count=jnp.float32(c))
    got, want = (
        mm.window_stats(state, per_leaf=True),
        mm.window_stats(ref, per_leaf=True),
    )
    assert int(got.microbatches) == int(want.microbatches) == len(taken)
    _close_stats(got, want)


def test_an_nnx_optimizers_leaf_shares_move_by_name():
    """``nnx.state(optimizer)`` holds the leaves' shares by name too: they
    move between device counts and back onto one device, and a window's
    leaf statistics read from the optimizer after it."""
    from flax import nnx

    def make(n):
        model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
        reduction = None
        if n:
            mesh = jax.make_mesh(
                (n,), ("data",), axis_types=(AUTO,), devices=jax.devices()[:n]
            )
            reduction = mm.deferred(mesh, "data")
        tx = mm.MaskedMultiSteps(
            optax.sgd(0.1), 2, reduction=reduction, per_leaf_stats=True
        )
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

    model, optimizer = make(8)
    # Device d's gradient is d everywhere (bias: 2d), over d tokens.
    ramp = {
        "bias": jnp.arange(8.0)[:, None] * 2 * jnp.ones((8, 1)),
        "kernel": jnp.arange(8.0)[:, None, None] * jnp.ones((8, 3, 1)),
    }
    grads = jax.tree_util.tree_map_with_path(
        lambda path, _: ramp[path[0].key], nnx.state(model, nnx.Param)
    )
    nnx.jit(lambda m, o, g: o.update(m, g, count=jnp.arange(8.0)))(
        model, optimizer, grads
    )
    # Σ_d n_d ‖g_d‖² per leaf (bias, kernel): Σ d · 4d², Σ d · 3d².
    shares = np.array([4.0, 3.0]) * np.sum(np.arange(8.0) ** 3)
    _, resumed = make(2)
    nnx.update(resumed, mm.from_device_count(nnx.state(optimizer), nnx.state(resumed)))
    moved = resumed.opt_state.reduction_state.sq_norms[...]
    assert moved.shape == (2, 2)
    np.testing.assert_allclose(moved.sum(0), shares, rtol=1e-6)
    model, local = make(0)
    nnx.update(local, mm.from_device_count(nnx.state(resumed), nnx.state(local)))
    np.testing.assert_allclose(
        local.opt_state.stats.leaves.weighted_sq_norms[...], shares, rtol=1e-6
    )
    # The window's second microbatch: 4 tokens of 1 everywhere (bias 2).
    one = jax.tree.map(
        lambda p: jnp.ones(p.shape) * (2.0 if p.shape == (1,) else 1.0),
        nnx.state(model, nnx.Param),
    )
    local.update(model, one, count=jnp.float32(4))
    stats = mm.window_stats(local, per_leaf=True)
    assert int(stats.microbatches) == 8  # seven devices with tokens, then one
    assert float(stats.tokens) == 32.0
    # ‖ḡ‖² of the bias: ((Σ d · 2d) + 4 · 2)² / 32² = (280 + 8)² / 32².
    np.testing.assert_allclose(stats.grad_sq_norm["bias"], (288 / 32) ** 2, rtol=1e-6)


@pytest.mark.parametrize("members", [2, 3])
def test_a_batch_of_states_reads_each_members_leaves(members):
    """A batch of states (an ensemble, stacked as ``vmap`` stacks them) read
    outside ``vmap``: each leaf's and each group's figures are the members'
    own, along the batch axis, whether or not the batch has as many members
    as the params have leaves (3 here); a label function sees one member's
    shapes."""
    tx = mm.MaskedMultiSteps(optax.sgd(0.1), K, per_leaf_stats=True)
    states = [_run(tx, _plan(seed=10 + m, windows=2))[0][-1] for m in range(members)]
    batch = jax.tree.map(lambda *xs: jnp.stack(xs), *states)
    seen = []

    def by_rank(tree):
        seen.append(jax.tree.map(lambda x: x.shape, tree))
        return jax.tree.map(lambda x: "matrices" if x.ndim == 2 else "vectors", tree)

    reads = {
        "per leaf": lambda s: mm.window_stats(s, per_leaf=True),
        "prefix": lambda s: mm.window_stats(s, groups={"enc": "e", "dec": "d"}),
        "function": lambda s: mm.window_stats(s, groups=by_rank),
    }
    for read in reads.values():
        got = read(batch)
        for m, state in enumerate(states):
            _close(jax.tree.map(lambda x, m=m: x[m], got), read(state), rtol=1e-6)
    assert seen[0] == jax.tree.map(lambda x: x.shape, _params())
    assert all(shapes == seen[0] for shapes in seen)


def test_a_label_function_sees_the_params_shapes_under_a_deferred_reduction():
    """With ``reduction=mm.deferred(...)`` the accumulator holds one running
    mean per device along a leading axis; a label function still sees the
    params' shapes, as it would without the reduction."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    ndev = len(jax.devices())
    mesh = jax.make_mesh((ndev,), ("data",), axis_types=(AUTO,))
    params = {"w": jnp.zeros((2, 2)), "b": jnp.zeros(2)}
    tx = mm.MaskedMultiSteps(
        optax.sgd(0.1), 1, per_leaf_stats=True, reduction=mm.deferred(mesh, "data")
    )
    data = NamedSharding(mesh, P("data"))
    rng = np.random.default_rng(3)
    grads = {
        "w": rng.normal(size=(ndev, 2, 2)).astype(np.float32),
        "b": 10 + rng.normal(size=(ndev, 2)).astype(np.float32),
    }
    counts = np.arange(1.0, ndev + 1, dtype=np.float32)
    _, state = jax.jit(tx.update)(
        jax.device_put(grads, data),
        tx.init(params),
        params,
        count=jax.device_put(counts, data),
    )
    seen = []

    def by_rank(tree):
        seen.append(jax.tree.map(lambda x: x.shape, tree))
        return jax.tree.map(lambda x: "matrices" if x.ndim == 2 else "vectors", tree)

    groups = mm.window_stats(state, groups=by_rank)
    per_leaf = mm.window_stats(state, per_leaf=True)
    assert seen == [{"w": (2, 2), "b": (2,)}]
    for name in PER_GROUP:
        assert_bit_identical(
            getattr(groups, name)["matrices"], getattr(per_leaf, name)["w"]
        )
        assert_bit_identical(
            getattr(groups, name)["vectors"], getattr(per_leaf, name)["b"]
        )
    mean_b = counts @ grads["b"] / counts.sum()
    np.testing.assert_allclose(
        groups.grad_sq_norm["vectors"], mean_b @ mean_b, rtol=1e-6
    )


def test_a_plain_dict_of_labels_groups_an_nnx_optimizers_leaves():
    """An NNX optimizer's accumulator is an ``nnx.State``: a plain ``dict``
    prefix of labels, and labels mapped over ``nnx.state(model, nnx.Param)``
    (variables holding labels), match it by path."""
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.hidden = nnx.Linear(2, 4, rngs=rngs)
            self.out = nnx.Linear(4, 1, rngs=rngs)

    model = Net(nnx.Rngs(0))
    tx = mm.MaskedMultiSteps(optax.sgd(0.1), 2, per_leaf_stats=True)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    rng = np.random.default_rng(4)
    for n in (3.0, 5.0):
        grads = jax.tree.map(
            lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32),
            nnx.state(model, nnx.Param),
        )
        optimizer.update(model, grads, count=jnp.float32(n))
    by_path = mm.window_stats(
        optimizer,
        groups=lambda tree: jax.tree_util.tree_map_with_path(
            lambda path, _: {"hidden": "h", "out": "o"}[path[0].key], tree
        ),
    )
    assert_bit_identical(
        mm.window_stats(optimizer, groups={"hidden": "h", "out": "o"}), by_path
    )
    labels = jax.tree.map(lambda _: "p", nnx.state(model, nnx.Param))
    assert_bit_identical(
        mm.window_stats(optimizer, groups=labels),
        mm.window_stats(optimizer, groups="p"),
    )
    with pytest.raises(ValueError, match=r"no label for the params' leaf at \['out'\]"):
        mm.window_stats(optimizer, groups={"hidden": "h", "out": None})
    with pytest.raises(ValueError, match=r"a label at \['outt'\], where the params"):
        mm.window_stats(optimizer, groups={"hidden": "h", "out": "o", "outt": "x"})


def _one_window_in_a_branch(params, branches):
    """The state of ``optax.multi_transform`` with an accumulator keeping
    per-leaf statistics on the params labelled "acc" (the rest "frozen"),
    after one window of two microbatches."""
    tx = optax.multi_transform(
        {
            "acc": mm.MaskedMultiSteps(optax.sgd(0.1), 2, per_leaf_stats=True),
            "frozen": optax.set_to_zero(),
        },
        branches,
    )
    state = tx.init(params)
    for n in (3.0, 5.0):
        grads = jax.tree.map(lambda p, n=n: jnp.full(p.shape, n), params)
        _, state = tx.update(grads, state, params, count=jnp.float32(n))
    return state


def test_labels_by_path_pass_over_the_leaves_another_branch_holds():
    """In one branch of ``optax.multi_transform`` the accumulator holds
    ``optax.MaskedNode`` where the other branch's params are: labels matched
    by path (containers other than the params') may name them, as labels
    matched by structure may, and their group is empty (left out)."""
    from flax.core import FrozenDict

    state = _one_window_in_a_branch(
        {"hidden": {"w": jnp.zeros((2, 2)), "b": jnp.zeros(2)}, "out": jnp.zeros(3)},
        {"hidden": "acc", "out": "frozen"},
    )
    by_structure = mm.window_stats(state, groups={"hidden": "h", "out": "o"})
    assert set(by_structure.grad_sq_norm) == {"h"}
    for labels in (
        FrozenDict({"hidden": "h", "out": "o"}),
        FrozenDict({"hidden": FrozenDict({"w": "h", "b": "h"}), "out": "o"}),
    ):
        assert_bit_identical(mm.window_stats(state, groups=labels), by_structure)
    with pytest.raises(ValueError, match=r"a label at \['outt'\], where the params"):
        mm.window_stats(state, groups=FrozenDict({"hidden": "h", "outt": "o"}))


def test_labels_by_path_pass_over_a_subtree_another_branch_holds():
    """optax masks another branch's whole subtree as one ``optax.MaskedNode``:
    labels with the params' full structure name its leaves, below that node,
    and their groups are empty (left out)."""
    from flax.core import FrozenDict

    state = _one_window_in_a_branch(
        {
            "enc": {"w": jnp.zeros((2, 2)), "b": jnp.zeros(2)},
            "dec": {"w": jnp.zeros(3), "s": jnp.zeros(())},
        },
        {"enc": "acc", "dec": "frozen"},
    )
    by_prefix = mm.window_stats(state, groups={"enc": "e", "dec": "d"})
    assert set(by_prefix.grad_sq_norm) == {"e"}
    full = {"enc": {"w": "e", "b": "e"}, "dec": {"w": "d", "s": "t"}}
    assert_bit_identical(mm.window_stats(state, groups=full), by_prefix)
    assert_bit_identical(mm.window_stats(state, groups=FrozenDict(full)), by_prefix)
    with pytest.raises(ValueError, match=r"a label at \['decc'\]\['s'\], where"):
        mm.window_stats(
            state, groups=FrozenDict({"enc": "e", "decc": FrozenDict({"s": "t"})})
        )


def test_a_label_function_that_reads_values_is_told_it_sees_shapes():
    tx = mm.MaskedMultiSteps(optax.sgd(0.1), K, per_leaf_stats=True)
    state = _run(tx, _plan(windows=1))[0][-1]
    by_value = lambda tree: jax.tree.map(  # noqa: E731
        lambda x: "big" if float(jnp.max(x)) > 1 else "small", tree
    )
    with pytest.raises(
        TypeError, match=r"`groups`, a function, is called on abstract arrays"
    ):
        mm.window_stats(state, groups=by_value)
    # A state whose empty reduction state came back as None (a checkpoint
    # restored without a template) has no device axis either.
    by_rank = lambda tree: jax.tree.map(  # noqa: E731
        lambda x: "matrices" if x.ndim == 2 else "vectors", tree
    )
    assert_bit_identical(
        mm.window_stats(state._replace(reduction_state=None), groups=by_rank),
        mm.window_stats(state, groups=by_rank),
    )
    assert set(mm.window_stats(state, groups=by_rank).grad_sq_norm) == {
        "matrices",
        "vectors",
    }


# In-jit microbatching: one call is one window.


def _lm_loss(params, mb):
    hidden = jnp.tanh(mb["x"] @ params["enc"]["w"] + params["enc"]["b"][None])
    pred = hidden @ params["dec"]["w"]
    return mm.masked_mean(jnp.sum((pred - mb["y"]) ** 2, -1), mb["mask"])


def _lm_batch(rows=24, seed=0):
    rng = np.random.default_rng(seed)
    mask = rng.random(rows) < 0.6
    mask[1::4] = False  # microbatch 1 of k = 4 holds padding only
    return {
        "x": jnp.asarray(rng.normal(size=(rows, 4)), jnp.float32),
        "y": jnp.asarray(rng.normal(size=(rows, 2)), jnp.float32),
        "mask": jnp.asarray(mask),
    }


def _lm_params(seed=1):
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), _params()
    )


def _wrapper_fed(microbatches, params):
    """A wrapper's per-leaf read of one window of ``microbatches``."""
    tx = mm.MaskedMultiSteps(optax.sgd(0.0), len(microbatches), per_leaf_stats=True)
    state = tx.init(params)
    grad = jax.value_and_grad(_lm_loss, has_aux=True)
    for mb in microbatches:
        (loss, n), g = grad(params, mb)
        _, state = tx.update(g, state, params, count=n, value=loss)
    return mm.window_stats(state, per_leaf=True)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_in_jit_microbatching_returns_each_leafs_statistics(jit):
    k, params, batch = 4, _lm_params(), _lm_batch()
    grad_fn = mm.microbatched_value_and_grad(
        _lm_loss, k, with_stats=True, per_leaf_stats=True
    )
    grad_fn = jax.jit(grad_fn) if jit else grad_fn
    (loss, count), grads, stats = grad_fn(params, batch)
    # The wrapper fed the same microbatches (batch[j::k]) reads the same.
    microbatches = [jax.tree.map(lambda x, j=j: x[j::k], batch) for j in range(k)]
    expected = _wrapper_fed(microbatches, params)
    _close_stats(stats, expected)
    for name in SHARED:
        np.testing.assert_allclose(getattr(stats, name), getattr(expected, name))
    assert int(stats.microbatches) == k - 1  # the padding-only one is no batch
    # Each leaf's figures are shaped like the gradients, and S, ‖ḡ‖² and |G|²̂
    # add up over the leaves to the call's totals (without leaf statistics).
    assert jax.tree.structure(stats.noise_scale) == jax.tree.structure(grads)
    totals = mm.microbatched_value_and_grad(_lm_loss, k, with_stats=True)
    _, _, total = totals(params, batch)
    for name in ("grad_sq_norm", "grad_var_trace", "true_grad_sq_norm"):
        summed = sum(jax.tree.leaves(getattr(stats, name)))
        np.testing.assert_allclose(summed, getattr(total, name), rtol=RTOL[name])


def test_data_parallel_returns_each_leafs_statistics_in_the_one_reduction():
    mesh = jax.make_mesh((4,), ("data",), axis_types=(AUTO,))
    k, params, batch = 2, _lm_params(), _lm_batch(rows=32)
    batch["mask"] = batch["mask"].at[:8].set(False)  # device 0: padding only
    sharded = jax.device_put(batch, jax.sharding.NamedSharding(mesh, P("data")))

    def grad_fn(per_leaf):
        return jax.jit(
            mm.data_parallel_value_and_grad(
                _lm_loss,
                mesh,
                "data",
                num_microbatches=k,
                with_stats=True,
                per_leaf_stats=per_leaf,
            )
        )

    grad_fns = {per_leaf: grad_fn(per_leaf) for per_leaf in (False, True)}
    _, _, stats = grad_fns[True](params, sharded)
    # Device d's microbatch j holds its rows j, j + k, ... : each a small batch.
    microbatches = [
        jax.tree.map(lambda x, d=d, j=j: x[8 * d : 8 * (d + 1)][j::k], batch)
        for d in range(4)
        for j in range(k)
    ]
    _close_stats(stats, _wrapper_fed(microbatches, params))
    # The leaves' sums join the call's one gradient reduction.
    reductions = [
        _all_reduces(grad_fns[per_leaf].lower(params, sharded).compile().as_text())
        for per_leaf in (False, True)
    ]
    assert len(reductions[0]) == len(reductions[1])


def _all_reduces(hlo):
    return [line for line in hlo.splitlines() if " all-reduce(" in line]


def test_in_jit_leaf_statistics_need_the_statistics():
    with pytest.raises(TypeError, match=r"`per_leaf_stats=True` reads .*pass both"):
        mm.microbatched_value_and_grad(_lm_loss, 2, per_leaf_stats=True)
    mesh = jax.make_mesh((2,), ("data",), axis_types=(AUTO,))
    with pytest.raises(TypeError, match=r"`per_leaf_stats` must be a bool"):
        mm.data_parallel_value_and_grad(
            _lm_loss, mesh, with_stats=True, per_leaf_stats="yes"
        )
