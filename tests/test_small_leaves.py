"""Small parameter leaves reduced together on CPUs: the window's finiteness
test and the statistics' squared norms of the window's mean read the small
leaves of one shape in one kernel (XLA:CPU runs each reduction as a kernel of
its own); a microbatch's fresh gradients are still read one leaf at a time."""

import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import masked_multistep as mm
from masked_multistep import _running_mean
from masked_multistep._sq_norms import tree_sq_norm

# Kernels of compiled programs, as a user compiles them (tests/conftest.py).
pytestmark = pytest.mark.default_emitters

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


def _f64_sq_norm(tree) -> float:
    return sum(
        float(np.sum(np.square(np.asarray(x, np.float64)))) for x in tree.values()
    )


@pytest.fixture
def replicated_mesh():
    # Replicated on a mesh of explicit axes: the type says where every leaf
    # is, so adding them up moves nothing between the 8 devices.
    return jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))


@pytest.fixture
def small_leaf(monkeypatch):
    """Sets the size limit; jax's caches are cleared before and after, as
    they would serve traces made with the other limit."""

    def set_to(limit):
        monkeypatch.setattr(_running_mean, "SMALL_LEAF", limit)
        jax.clear_caches()

    yield set_to
    monkeypatch.undo()
    jax.clear_caches()


def test_small_replicated_leaves_of_one_shape_are_one_kernel(replicated_mesh):
    tree = _tree(np.random.default_rng(0), replicated_mesh)
    with jax.set_mesh(replicated_mesh):
        together = jax.jit(tree_sq_norm).lower(tree).compile()
        # Each leaf alone (as a microbatch's gradients are read).
        apart = jax.jit(lambda t: tree_sq_norm(t, together=False))
        apart = apart.lower(tree).compile()
        assert _kernels(together) <= 3  # two shapes (and their sum)
        assert _kernels(apart) >= LEAVES // 2  # (XLA merges a few)
        for compiled in (together, apart):
            np.testing.assert_allclose(compiled(tree), _f64_sq_norm(tree), rtol=1e-6)
        # Read where they lie: no copy of the leaves.
        temp = [c.memory_analysis().temp_size_in_bytes for c in (together, apart)]
        assert temp[0] <= temp[1] + 64


def test_a_large_leaf_is_reduced_alone(replicated_mesh):
    rng = np.random.default_rng(1)
    # Leaves at the limit, beside small ones.
    tree = _tree(rng, replicated_mesh)
    large = rng.normal(size=(8, _running_mean.SMALL_LEAF)).astype(np.float32)
    tree.update(jax.device_put({f"m{i}": x for i, x in enumerate(large)}))
    tree = jax.device_put(tree, NamedSharding(replicated_mesh, P()))
    with jax.set_mesh(replicated_mesh):
        compiled = jax.jit(tree_sq_norm).lower(tree).compile()
        assert 8 <= _kernels(compiled) <= 8 + 3
        np.testing.assert_allclose(compiled(tree), _f64_sq_norm(tree), rtol=1e-6)


def test_leaves_split_over_devices_are_not_added_up():
    # Added up, leaves split over the devices would be resharded first.
    mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    tree = _tree(np.random.default_rng(2))
    tree = {k: jnp.broadcast_to(v, (4, *v.shape)) for k, v in tree.items()}
    with jax.set_mesh(mesh):
        tree = jax.device_put(tree, NamedSharding(mesh, P("data")))
        compiled = jax.jit(tree_sq_norm).lower(tree).compile()
        assert _kernels(compiled) >= LEAVES // 2
        text = compiled.as_text()
        assert "all-gather" not in text and "all-to-all" not in text
        np.testing.assert_allclose(compiled(tree), _f64_sq_norm(tree), rtol=1e-6)


@pytest.mark.parametrize("stats", [False, True])
def test_a_step_on_many_small_leaves_runs_fewer_kernels_in_no_more_memory(
    replicated_mesh, small_leaf, stats
):
    # The window's finiteness test and (with statistics) the mean's squared
    # norm: one kernel per shape of small leaves instead of one per leaf; the
    # microbatch's gradients are read one by one (read together, they would
    # all be kept alive until the last is computed: more scratch memory). The
    # same updates (sgd's to the last bit where only the test reads them) and
    # statistics to rounding.
    rng = np.random.default_rng(3)
    params = _tree(rng, replicated_mesh)
    plan = [(_tree(rng, replicated_mesh), jnp.float32(n)) for n in (3, 0, 5, 2)]
    runs = []
    with jax.set_mesh(replicated_mesh):
        for limit in (1 << 12, 0):
            small_leaf(limit)
            tx = mm.MaskedMultiSteps(optax.sgd(0.1), 2, window_stats=stats)
            step = jax.jit(
                lambda g, s, p, n, tx=tx: tx.apply_gradients(g, s, p, count=n),
                donate_argnums=1,
            )
            p, s = params, tx.init(params)
            compiled = step.lower(plan[0][0], s, p, plan[0][1]).compile()
            temp = compiled.memory_analysis().temp_size_in_bytes
            for g, n in plan:
                p, s = step(g, s, p, n)
            runs.append((_kernels(compiled), temp, p, s))
    (together, temp, p1, s1), (apart, temp_apart, p2, s2) = runs
    assert together <= apart - LEAVES // 2
    assert temp <= temp_apart
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
        for bad in (jnp.nan, jnp.inf, -jnp.inf):
            broken = dict(tree, l7=tree["l7"].at[3, 1].set(bad))
            assert not bool(jax.jit(_running_mean.all_finite)(broken))
    # Python numbers among the leaves, as before.
    assert bool(_running_mean.all_finite([1.0, jnp.ones(2)]))


def test_in_a_process_of_one_device_unplaced_leaves_are_added_up():
    # With one device nothing can move between devices: leaves placed by no
    # mesh are added up too (with several devices about they are not, the
    # partitioner being free to split them).
    code = textwrap.dedent(
        """
        import re
        import jax, jax.numpy as jnp
        from masked_multistep._sq_norms import tree_sq_norm
        tree = [jnp.ones((8, 4)) for _ in range(30)] + [jnp.ones(4)] * 30
        compiled = jax.jit(tree_sq_norm).lower(tree).compile()
        print(jax.device_count(), len(re.findall(r"= [^=\\n]*\\bfusion\\(",
              compiled.as_text())), float(compiled(tree)))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"},
    ).stdout.split()
    devices, kernels, value = int(out[0]), int(out[1]), float(out[2])
    assert devices == 1 and kernels <= 3 and value == 30 * 32 + 30 * 4
