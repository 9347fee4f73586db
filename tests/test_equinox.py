"""Equinox modules: the wrapper on their arrays, as optax takes them."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import backend_compiles

import masked_multistep as mm

K = 3
# Rows per microbatch that carry a loss: 2, 1 and 4 of 4.
MASK = np.array([[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1]], bool)
# A step of minus the gradient: a gradient of the wrong size shows (adam's first
# step, about the learning rate times the gradient's sign, would hide it).
OPT = optax.sgd(1.0)


def _model():
    # An MLP holds its activation functions as fields (pytree leaves).
    return eqx.nn.MLP(3, 2, 8, 1, key=jax.random.key(0))


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(K, 4, 3)).astype(np.float32)
    y = rng.normal(size=(K, 4, 2)).astype(np.float32)
    return x, y


def _whole_batch():
    x, y = _data()
    return (x.reshape(-1, 3), y.reshape(-1, 2), MASK.reshape(-1))


def _loss(model, x, y, mask):
    per_row = jnp.sum((jax.vmap(model)(x) - y) ** 2, axis=-1)
    return mm.masked_mean(per_row, mask)


def _full_batch(model):
    """The full batch's token-mean loss, its gradient and the step on it."""
    (loss, count), grads = eqx.filter_value_and_grad(_loss, has_aux=True)(
        model, *_whole_batch()
    )
    params = eqx.filter(model, eqx.is_inexact_array)
    updates, _ = OPT.update(grads, OPT.init(params), params)
    return loss, count, grads, eqx.apply_updates(model, updates)


def _assert_close(a, b):
    a, b = eqx.filter(a, eqx.is_inexact_array), eqx.filter(b, eqx.is_inexact_array)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("wrapper", ["masked", "optax"])
def test_a_window_of_an_equinox_module_is_its_full_batch_step(wrapper):
    # The README's loop: state and steps on the module's arrays.
    model = _model()
    if wrapper == "masked":
        tx = mm.MaskedMultiSteps(OPT, K, window_stats=True)
    else:  # equal weights for unequal counts: the test tells them apart
        tx = optax.MultiSteps(OPT, K)
    state = tx.init(eqx.filter(model, eqx.is_inexact_array))

    @eqx.filter_jit
    def step(model, state, x, y, mask):
        (loss, count), grads = eqx.filter_value_and_grad(_loss, has_aux=True)(
            model, x, y, mask
        )
        kwargs = dict(count=count, value=loss) if wrapper == "masked" else {}
        updates, state = tx.update(
            grads, state, eqx.filter(model, eqx.is_inexact_array), **kwargs
        )
        return eqx.apply_updates(model, updates), state

    x, y = _data()
    for i in range(K):
        model, state = step(model, state, x[i], y[i], MASK[i])
        assert bool(tx.has_updated(state)) == (i == K - 1)
    loss, count, _, want = _full_batch(_model())
    assert model.activation is jax.nn.relu  # the module's functions kept
    if wrapper == "optax":
        with pytest.raises(AssertionError):
            _assert_close(model, want)
        return
    _assert_close(model, want)
    stats = mm.window_stats(state)
    assert int(stats.tokens) == int(count) == 7
    np.testing.assert_allclose(stats.loss, loss, rtol=1e-6)


def test_apply_gradients_takes_and_returns_the_arrays():
    model = _model()
    params, static = eqx.partition(model, eqx.is_inexact_array)
    tx = mm.MaskedMultiSteps(OPT, K)
    state = tx.init(params)
    x, y = _data()
    for i in range(K):
        (_, count), grads = eqx.filter_value_and_grad(_loss, has_aux=True)(
            eqx.combine(params, static), x[i], y[i], MASK[i]
        )
        params, state = tx.apply_gradients(grads, state, params, count=count)
    _assert_close(eqx.combine(params, static), _full_batch(_model())[3])


def test_in_jit_microbatching_of_a_partitioned_module():
    model = _model()
    params, static = eqx.partition(model, eqx.is_inexact_array)
    grad_fn = eqx.filter_jit(
        mm.microbatched_value_and_grad(
            lambda params, mb: _loss(eqx.combine(params, static), *mb), K
        )
    )
    # Row r * K + j is row r of microbatch j (the strided split): any order of
    # the rows gives the full batch's token mean.
    (loss, count), grads = grad_fn(params, _whole_batch())
    want_loss, want_count, want_grads, _ = _full_batch(model)
    assert int(count) == int(want_count) == 7
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    _assert_close(grads, want_grads)


@pytest.mark.parametrize("jit", [False, True])
def test_in_jit_microbatching_takes_the_module_whole(jit):
    # As eqx.filter_value_and_grad: its floating arrays differentiated, the
    # rest (functions, integer arrays, PRNG keys) held fixed, None in the
    # gradients, whose structure the wrapper's state is built from.
    model = _model()
    grad_fn = mm.microbatched_value_and_grad(lambda m, mb: _loss(m, *mb), K)
    grad_fn = eqx.filter_jit(grad_fn) if jit else grad_fn
    (loss, count), grads = grad_fn(model, _whole_batch())
    want_loss, want_count, want_grads, want_model = _full_batch(model)
    assert int(count) == int(want_count) == 7
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    assert grads.activation is None
    _assert_close(grads, want_grads)
    params = eqx.filter(model, eqx.is_inexact_array)
    assert jax.tree.structure(grads) == jax.tree.structure(params)
    tx = mm.MaskedMultiSteps(OPT, 1)
    updates, _ = tx.update(grads, tx.init(params), params, count=count)
    _assert_close(eqx.apply_updates(model, updates), want_model)

    class Indexed(eqx.Module):  # an integer array and a PRNG key among its leaves
        weight: jax.Array
        index: jax.Array
        key: jax.Array

        def __call__(self, x):
            return self.weight[self.index] @ x

    def loss(m, mb):
        return mm.masked_mean(jax.vmap(m)(mb[0])[:, 0], mb[1])

    indexed = Indexed(jnp.arange(6.0).reshape(3, 2), jnp.array([2]), jax.random.key(0))
    batch = (jnp.arange(8.0).reshape(4, 2), jnp.array([True, False, True, True]))
    (_, count), grads = mm.microbatched_value_and_grad(loss, 2)(indexed, batch)
    _, want = eqx.filter_value_and_grad(loss, has_aux=True)(indexed, batch)
    assert grads.index is None and grads.key is None and int(count) == 3
    np.testing.assert_allclose(grads.weight, want.weight, rtol=1e-6)
    assert float(jnp.abs(grads.weight[2]).sum()) > 0  # the row it indexes

    # Statistics per leaf: a tree like the gradients.
    stats_fn = mm.microbatched_value_and_grad(
        lambda m, mb: _loss(m, *mb), K, with_stats=True, per_leaf_stats=True
    )
    *_, stats = stats_fn(model, _whole_batch())
    assert jax.tree.structure(stats.grad_sq_norm) == jax.tree.structure(params)
    assert int(stats.microbatches) == K


def test_the_module_whole_compiles_once_and_its_functions_stay_its_own():
    # Its functions are static under eqx.filter_jit: a step compiles once for
    # one module, again for another activation (which the loss then runs).
    traces = []

    def loss(m, mb):
        traces.append(None)
        return _loss(m, *mb)

    grad_fn = eqx.filter_jit(mm.microbatched_value_and_grad(loss, K))
    model = _model()
    (first, _), _ = grad_fn(model, _whole_batch())
    (again, _), _ = grad_fn(model, _whole_batch())
    assert len(traces) == 1 and first == again
    tanh = eqx.tree_at(lambda m: m.activation, model, jnp.tanh)
    (other, _), _ = grad_fn(tanh, _whole_batch())
    assert len(traces) == 2 and other != first
    np.testing.assert_allclose(other, _full_batch(tanh)[0], rtol=1e-6)


class _Indexed(eqx.Module):
    weight: jax.Array
    index: jax.Array  # an integer array: not differentiable

    def __call__(self, x):
        return jnp.sum(self.weight[self.index] @ x)


class _Keyed(eqx.Module):
    weight: jax.Array
    key: jax.Array  # a PRNG key: not a parameter


def test_a_whole_module_where_its_arrays_belong_is_refused_with_the_recipe():
    model = _model()
    params = eqx.filter(model, eqx.is_inexact_array)
    tx = mm.MaskedMultiSteps(OPT, K)
    state = tx.init(params)
    grads = eqx.filter_grad(lambda m: jnp.sum(m(jnp.ones(3))))(model)
    recipe = (
        r"an equinox module.* pass its floating arrays, "
        r"`eqx.filter\(model, eqx.is_inexact_array\)`"
    )
    with pytest.raises(TypeError, match=r"at params.activation\. For " + recipe):
        tx.init(model)
    apart = r"differ where one holds None, at .activation, .final_activation: for "
    with pytest.raises(ValueError, match=r"params' tree structure .*" + apart + recipe):
        tx.update(grads, state, model, count=2)
    with pytest.raises(ValueError, match=r"params' tree structure .*" + apart + recipe):
        tx.apply_gradients(grads, state, model, count=2)
    indexed = _Indexed(jnp.ones((2, 3)), jnp.array([1, 0]))
    # A state holding the integer arrays (`eqx.is_array`, as equinox's examples
    # filter), which `eqx.filter_grad` gives no gradient: the message says so.
    with_ints = eqx.filter(indexed, eqx.is_array)
    grads = eqx.filter_grad(lambda m: m(jnp.ones(3)))(indexed)
    assert grads.index is None
    at_index = r"differ where one holds None, at .index: for " + recipe
    with pytest.raises(ValueError, match=r"gradients' tree structure .*" + at_index):
        tx.update(grads, tx.init(with_ints), with_ints, count=2)
    floats = eqx.filter(indexed, eqx.is_inexact_array)
    updates, _ = tx.update(grads, tx.init(floats), floats, count=2)
    assert updates.index is None
    # A PRNG key among the arrays (`eqx.is_array` keeps it) is named, where the
    # dtype's conversion failed without a path.
    keyed = eqx.filter(_Keyed(jnp.ones(2), jax.random.key(0)), eqx.is_array)
    with pytest.raises(TypeError, match=r"an array of key<fry> at params.key\. For "):
        tx.init(keyed)


def test_the_hint_is_for_another_filter_of_the_same_module_only():
    tx = mm.MaskedMultiSteps(OPT, K)
    state = tx.init(eqx.filter(_model(), eqx.is_inexact_array))
    # Another architecture, filtered alike: the structures say it all.
    other = eqx.filter(eqx.nn.MLP(3, 2, 4, 2, key=jax.random.key(1)), eqx.is_array)
    with pytest.raises(ValueError, match="tree structure") as refused:
        tx.update(other, state, other, count=1)
    assert "equinox" not in str(refused.value)
    # Frozen layers (equinox's `eqx.partition` by a spec): the state of what
    # trains, the gradients of the whole module, apart at the frozen ones.
    model = _model()
    spec = jax.tree.map(lambda _: False, model)
    spec = eqx.tree_at(lambda m: m.layers[-1].weight, spec, replace=True)
    trained, _ = eqx.partition(model, spec)
    grads = eqx.filter_grad(lambda m: jnp.sum(m(jnp.ones(3))))(model)
    with pytest.raises(
        ValueError, match=r"at .layers\[0\].weight, .layers\[0\].bias, .*first part"
    ):
        tx.update(grads, tx.init(trained), trained, count=1)
    # Other trees' messages say nothing of equinox.
    with pytest.raises(TypeError) as refused:
        tx.init({"w": jnp.ones(2), "act": jax.nn.relu})
    assert "equinox" not in str(refused.value)


def test_window_stats_groups_by_a_module_shaped_tree_of_labels():
    # An equinox module is callable: a tree of labels shaped like one is not
    # taken for a function of the params.
    params = eqx.filter(_model(), eqx.is_inexact_array)
    tx = mm.MaskedMultiSteps(OPT, 1, per_leaf_stats=True)
    state = tx.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    _, state = tx.update(grads, state, params, count=2)
    labels = jax.tree.map(lambda _: "all", params)
    labels = eqx.tree_at(lambda m: m.layers[0].weight, labels, replace="first")
    stats = mm.window_stats(state, groups=labels)
    first = params.layers[0].weight.size
    total = sum(x.size for x in jax.tree.leaves(params))
    assert float(stats.grad_sq_norm["first"]) == first
    assert float(stats.grad_sq_norm["all"]) == total - first

    # A function holding strings (a Partial's arguments) is still called.
    def label_fn(prefix, tree):
        return jax.tree.map(lambda _: prefix + "all", tree)

    by_fn = mm.window_stats(state, groups=jax.tree_util.Partial(label_fn, "g_"))
    assert float(by_fn.grad_sq_norm["g_all"]) == total


def _mesh():
    devices = jax.devices()[:4]
    assert len(devices) == 4  # one per row: a device without tokens
    return jax.sharding.Mesh(np.array(devices), ("data",))


@pytest.mark.parametrize("whole", [True, False])
def test_data_parallel_deferred_on_an_equinox_module(whole):
    # Each device's own running mean, combined once per window: as one device.
    # The module whole (its functions static), or partitioned by hand.
    mesh = _mesh()
    params, static = eqx.partition(_model(), eqx.is_inexact_array)
    params = jax.device_put(params, jax.NamedSharding(mesh, jax.P()))

    def loss(params, batch):
        return _loss(params if whole else eqx.combine(params, static), *batch)

    grad_fn = mm.per_device_value_and_grad(loss, mesh, "data")
    tx = mm.MaskedMultiSteps(OPT, K, reduction=mm.deferred(mesh, "data"))
    state = tx.init(params)
    x, y = _data()
    for i in range(K):
        batch = jax.device_put(
            (x[i], y[i], MASK[i]), jax.NamedSharding(mesh, jax.P("data"))
        )
        (_, count), grads = grad_fn(
            eqx.combine(params, static) if whole else params, batch
        )
        params, state = eqx.filter_jit(tx.apply_gradients)(
            grads, state, params, count=count
        )
    assert int(state.gradient_step) == 1
    _assert_close(eqx.combine(params, static), _full_batch(_model())[3])


def test_data_parallel_gradients_of_the_module_whole():
    mesh = _mesh()
    model = _model()
    batch = jax.device_put(_whole_batch(), jax.NamedSharding(mesh, jax.P("data")))
    want_loss, want_count, want_grads, _ = _full_batch(model)
    grad_fn = mm.data_parallel_value_and_grad(
        lambda m, mb: _loss(m, *mb), mesh, "data", num_microbatches=K
    )
    for fn in (grad_fn, eqx.filter_jit(grad_fn)):
        (loss, count), grads = fn(model, batch)
        assert int(count) == int(want_count) and grads.activation is None
        np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
        _assert_close(grads, want_grads)
    # Eagerly, a second call with the same module runs the program compiled
    # for the first (its functions are a static argument, hashed).
    with backend_compiles() as compiled:
        grad_fn(model, batch)
    assert compiled == []

    class Tagged(eqx.Module):  # a leaf neither array nor hashable
        weight: jax.Array
        tags: set

    def loss(m, mb):
        return mm.masked_mean(mb[0] @ m.weight, mb[1])

    tagged = Tagged(jnp.ones(3), {"a"})
    with pytest.raises(
        TypeError, match=r"neither arrays nor hashable.*set at params.tags"
    ):
        mm.per_device_value_and_grad(loss, mesh, "data")(tagged, batch[::2])


def test_a_mid_window_checkpoint_by_equinox_resumes_bit_identically(tmp_path):
    # equinox's own serialisation of the wrapper's state (leaves in order,
    # into a state of the same settings), mid-window.
    params, static = eqx.partition(_model(), eqx.is_inexact_array)
    tx = mm.MaskedMultiSteps(OPT, K, window_stats=True)
    step = jax.jit(tx.apply_gradients)
    x, y = _data()

    def grads_of(params, i):
        model = eqx.combine(params, static)
        (_, count), grads = eqx.filter_value_and_grad(_loss, has_aux=True)(
            model, x[i], y[i], MASK[i]
        )
        return grads, count

    state = tx.init(params)
    grads, count = grads_of(params, 0)
    params, state = step(grads, state, params, count=count)
    path = tmp_path / "state.eqx"
    eqx.tree_serialise_leaves(path, (params, state))
    restored = eqx.tree_deserialise_leaves(path, (params, tx.init(params)))
    runs = []
    for params_i, state_i in [(params, state), restored]:
        for i in range(1, K):
            grads, count = grads_of(params_i, i)
            params_i, state_i = step(grads, state_i, params_i, count=count)
        runs.append((params_i, state_i))
    (a, sa), (b, sb) = runs
    assert int(sb.gradient_step) == 1
    for u, v in zip(jax.tree.leaves((a, sa)), jax.tree.leaves((b, sb)), strict=True):
        np.testing.assert_array_equal(u, v)


def test_counts_as_arrays_compile_the_step_once_under_filter_jit():
    # eqx.filter_jit takes Python ints as static: one compile per new count.
    params = eqx.filter(_model(), eqx.is_inexact_array)
    tx = mm.MaskedMultiSteps(OPT, K)
    grads = jax.tree.map(jnp.ones_like, params)
    traces = []

    @eqx.filter_jit
    def step(params, state, count):
        traces.append(count)
        return tx.apply_gradients(grads, state, params, count=count)

    for counts in ([3, 5, 7, 3], [jnp.asarray(n) for n in (3, 5, 7, 3)]):
        traces.clear()
        state = tx.init(params)
        for n in counts:
            _, state = step(params, state, n)
        assert len(traces) == (3 if isinstance(counts[0], int) else 1)


def test_frozen_layers_train_on_the_partition_alone():
    # equinox's recipe: partition by a spec, differentiate the first part.
    model = _model()
    spec = jax.tree.map(lambda _: False, model)
    spec = eqx.tree_at(lambda m: m.layers[-1].weight, spec, replace=True)
    trained, frozen = eqx.partition(model, spec)
    tx = mm.MaskedMultiSteps(OPT, K)
    state = tx.init(trained)
    x, y = _data()
    for i in range(K):
        (_, count), grads = eqx.filter_value_and_grad(
            lambda t, *data: _loss(eqx.combine(t, frozen), *data), has_aux=True
        )(trained, x[i], y[i], MASK[i])
        trained, state = tx.apply_gradients(grads, state, trained, count=count)
    model_after = eqx.combine(trained, frozen)
    _, _, full_grads, _ = _full_batch(model)
    np.testing.assert_allclose(
        model_after.layers[-1].weight,
        model.layers[-1].weight - full_grads.layers[-1].weight,
        rtol=1e-5,
        atol=1e-7,
    )
    assert model_after.layers[0].weight is model.layers[0].weight


def test_a_dropout_key_goes_in_as_rng():
    model = eqx.nn.Sequential(
        [eqx.nn.Linear(3, 2, key=jax.random.key(0)), eqx.nn.Dropout(0.5)]
    )
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def loss(model, mb, key):
        out = model(mb[0][0], key=key)  # a microbatch of one row
        return mm.masked_mean(out**2, jnp.ones(out.shape, bool))

    with pytest.raises(TypeError, match="rename `key`, or pass `lambda params"):
        mm.microbatched_value_and_grad(loss, 2)

    # A key that defaults to None passes the first check; called with `rng`:
    def loss_or_none(params, mb, key=None):
        return loss(eqx.combine(params, static), mb, key)

    grad_fn = mm.microbatched_value_and_grad(loss_or_none, 2)
    with pytest.raises(TypeError, match="rename `key`, or pass `lambda params"):
        grad_fn(params, (jnp.ones((2, 3)),), rng=jax.random.key(1))
    # A third argument that is no key is not taken for one.
    with pytest.raises(TypeError) as refused:
        mm.microbatched_value_and_grad(lambda params, x, y: 0.0, 2)
    assert "rng" not in str(refused.value)

    def draws(params, mb, rng):
        # Each microbatch's loss is a draw from its key.
        return mm.masked_mean(jax.random.uniform(rng, (1,)), jnp.ones(1, bool))

    grad_fn = eqx.filter_jit(mm.microbatched_value_and_grad(draws, 2))
    (mean, _), _ = grad_fn(params, (jnp.ones((2, 3)),), rng=jax.random.key(1))
    keys = [jax.random.fold_in(jax.random.key(1), j) for j in range(2)]
    want = np.mean([jax.random.uniform(k, (1,))[0] for k in keys])
    np.testing.assert_allclose(mean, want, rtol=1e-6)  # a key each, as documented
    grad_fn = eqx.filter_jit(
        mm.microbatched_value_and_grad(
            lambda params, mb, rng: loss(eqx.combine(params, static), mb, key=rng), 2
        )
    )
    batch = (jnp.ones((2, 3)),)
    (a, _), _ = grad_fn(params, batch, rng=jax.random.key(1))
    (b, _), _ = grad_fn(params, batch, rng=jax.random.key(1))
    (c, _), _ = grad_fn(params, batch, rng=jax.random.key(2))
    assert a == b and a != c
    # The module whole: the same draws.
    whole_fn = eqx.filter_jit(
        mm.microbatched_value_and_grad(lambda m, mb, rng: loss(m, mb, key=rng), 2)
    )
    (whole, _), grads = whole_fn(model, batch, rng=jax.random.key(1))
    assert whole == a and grads.layers[1].p is None  # (the rate: held fixed)


def test_a_tree_holding_a_module_is_filtered_whole_and_wrt_points_to_partition():
    # As eqx.filter_value_and_grad filters its first argument: the module's and
    # the tree's other floating arrays differentiated, the rest held fixed.
    tree = {"model": _model(), "scale": jnp.asarray(2.0), "steps": jnp.asarray(3)}

    def loss(tree, mb):
        return _loss(lambda x: tree["scale"] * tree["model"](x), *mb)

    (_, count), grads = mm.microbatched_value_and_grad(loss, K)(tree, _whole_batch())
    _, want = eqx.filter_value_and_grad(loss, has_aux=True)(tree, _whole_batch())
    assert grads["steps"] is None and int(count) == 7
    _assert_close(grads, want)
    np.testing.assert_allclose(grads["scale"], want["scale"], rtol=1e-5)
    from flax import nnx

    mesh = _mesh()
    for fn in (
        mm.microbatched_value_and_grad(lambda m, mb: _loss(m, *mb), K, wrt=nnx.Param),
        mm.per_device_value_and_grad(lambda m, mb: _loss(m, *mb), mesh, wrt=nnx.Param),
    ):
        with pytest.raises(TypeError, match=r"got MLP: an equinox module whole .*eqx"):
            fn(_model(), _whole_batch())
