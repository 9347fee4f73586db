"""Small parameter leaves reduced together on CPUs: the statistics' squared
norms and the window's finiteness test read many small leaves in one
reduction (XLA:CPU runs each reduction as a kernel of its own)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import masked_multistep as mm
from masked_multistep import _running_mean
from masked_multistep._stats import tree_sq_norm

LEAVES = 40


def _kernels(compiled) -> int:
    """The fused kernels of the compiled program, its conditionals' branches
    included (XLA:CPU runs each on its own)."""
    return len(re.findall(r"= [^=\n]*\bfusion\(", compiled.as_text()))


def _tree(rng, mesh=None):
    tree = {
        f"l{i}": rng.normal(size=(8, 4) if i % 2 else (4,)).astype(np.float32)
        for i in range(LEAVES)
    }
    if mesh is None:
        return jax.tree.map(jnp.asarray, tree)
    return jax.device_put(tree, NamedSharding(mesh, P()))


@pytest.fixture
def replicated_mesh():
    # Replicated on a mesh of explicit axes: the type says where every leaf
    # is, so concatenating them moves nothing between the 8 devices.
    return jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))


def _compiled_sq_norm(tree, small_leaf, monkeypatch):
    monkeypatch.setattr(_running_mean, "SMALL_LEAF", small_leaf)
    jax.clear_caches()  # jax would reuse traces made with the other limit
    return jax.jit(tree_sq_norm).lower(tree).compile()


def test_small_replicated_leaves_are_one_reduction(replicated_mesh, monkeypatch):
    tree = _tree(np.random.default_rng(0), replicated_mesh)
    want = sum(np.sum(np.square(np.asarray(x, np.float64))) for x in tree.values())
    with jax.set_mesh(replicated_mesh):
        together = _compiled_sq_norm(tree, 1 << 14, monkeypatch)
        apart = _compiled_sq_norm(tree, 0, monkeypatch)  # each leaf alone
        assert _kernels(together) <= 3  # (XLA may reduce in two stages)
        assert _kernels(apart) >= LEAVES // 2  # (XLA merges a few)
        np.testing.assert_allclose(together(tree), want, rtol=1e-6)
        np.testing.assert_allclose(apart(tree), want, rtol=1e-6)


def test_a_large_leaf_is_reduced_alone(replicated_mesh, monkeypatch):
    tree = _tree(np.random.default_rng(1), replicated_mesh)
    with jax.set_mesh(replicated_mesh):
        # Every 8 x 4 leaf is at the limit: reduced alone, with the threads.
        compiled = _compiled_sq_norm(tree, 32, monkeypatch)
        assert _kernels(compiled) >= LEAVES // 4


def test_leaves_split_over_devices_are_not_concatenated(monkeypatch):
    # Concatenated, leaves split over the devices would be gathered first.
    mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    tree = _tree(np.random.default_rng(2))
    tree = {k: jnp.broadcast_to(v, (4, *v.shape)) for k, v in tree.items()}
    with jax.set_mesh(mesh):
        tree = jax.device_put(tree, NamedSharding(mesh, P("data")))
        compiled = _compiled_sq_norm(tree, 1 << 14, monkeypatch)
        assert _kernels(compiled) >= LEAVES // 2
        assert "all-gather" not in compiled.as_text()


@pytest.mark.parametrize("stats", [False, True])
def test_a_step_on_many_small_leaves_runs_fewer_kernels_and_agrees(
    replicated_mesh, monkeypatch, stats
):
    # The window's finiteness test and (with statistics) the squared norms:
    # one reduction for the small leaves instead of one per leaf, the same
    # updates (sgd's, to the last bit where only the test reads them) and
    # statistics to rounding.
    rng = np.random.default_rng(3)
    params = _tree(rng, replicated_mesh)
    plan = [(_tree(rng, replicated_mesh), jnp.float32(n)) for n in (3, 0, 5, 2)]
    runs = []
    with jax.set_mesh(replicated_mesh):
        for small_leaf in (1 << 14, 0):
            monkeypatch.setattr(_running_mean, "SMALL_LEAF", small_leaf)
            jax.clear_caches()
            tx = mm.MaskedMultiSteps(optax.sgd(0.1), 2, window_stats=stats)
            step = jax.jit(
                lambda g, s, p, n, tx=tx: tx.apply_gradients(g, s, p, count=n)
            )
            p, s = params, tx.init(params)
            compiled = step.lower(plan[0][0], s, p, plan[0][1]).compile()
            for g, n in plan:
                p, s = step(g, s, p, n)
            runs.append((_kernels(compiled), p, s))
    (together, p1, s1), (apart, p2, s2) = runs
    assert together < apart - LEAVES // 2
    if stats:
        for a, b in zip(mm.window_stats(s1), mm.window_stats(s2), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), p1, p2)
    else:
        jax.tree.map(np.testing.assert_array_equal, p1, p2)
    assert int(s1.gradient_step) == 2


def test_a_non_finite_small_leaf_is_found_among_others(replicated_mesh):
    tree = _tree(np.random.default_rng(4), replicated_mesh)
    with jax.set_mesh(replicated_mesh):
        assert bool(jax.jit(_running_mean.all_finite)(tree))
        for bad in (jnp.nan, jnp.inf):
            broken = dict(tree, l7=tree["l7"].at[3, 1].set(bad))
            assert not bool(jax.jit(_running_mean.all_finite)(broken))
