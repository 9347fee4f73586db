"""`microbatched_value_and_grad` with an NNX module.

A module whose state is only `nnx.Param` goes in place of `params` (NNX
modules are pytrees; the gradients come back as a module). A module that also
holds RNG streams or batch statistics goes in whole too: its parameters are
differentiated and the rest of its state is carried from one microbatch to the
next and written back, as k calls one after the other would leave it (a
microbatch without tokens leaving all but the RNG streams as they were). Any
module also goes through `nnx.split(model, nnx.Param, ...)`, whose parameters
(an `nnx.State`) are differentiated while `loss_fn` rebuilds the module with
`nnx.merge`. All match `nnx.value_and_grad`, and an `nnx.Optimizer` takes the
gradients as they come.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _flax_data import D_IN, D_OUT, K, make_windows
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import masked_multistep as mm


class _MLP(nnx.Module):
    def __init__(self, rngs):
        self.hidden = nnx.Linear(D_IN, 8, rngs=rngs)
        self.dropout = nnx.Dropout(0.5)
        self.out = nnx.Linear(8, D_OUT, rngs=rngs)

    def __call__(self, x, rng=None):
        h = nnx.relu(self.hidden(x))
        h = self.dropout(h, deterministic=rng is None, rngs=rng)
        return self.out(h)


def _token_loss(model, batch, rng=None):
    x = jnp.where(batch["mask"][..., None], batch["x"], 0.0)
    per_token = jnp.sum((model(x, rng) - batch["y"]) ** 2, axis=-1)
    return mm.masked_mean(per_token, batch["mask"])


def _batch():
    x, y, mask = make_windows()[1]  # 8 rows; microbatch 1 (rows 1, 5) is empty
    return {"x": x, "y": jnp.where(mask[..., None], y, 0.0), "mask": mask}


def _split_loss(graphdef, rest):
    def loss_fn(params, batch, rng=None):
        model = nnx.merge(graphdef, params, rest, copy=True)
        return _token_loss(model, batch, rng)

    return loss_fn


def _assert_same_step(model, grads, f_grads):
    """One optimizer step with `grads` lands where the full batch's lands."""
    ref = nnx.clone(model)
    nnx.Optimizer(model, optax.adam(0.1), wrt=nnx.Param).update(model, grads)
    nnx.Optimizer(ref, optax.adam(0.1), wrt=nnx.Param).update(ref, f_grads)
    chex.assert_trees_all_close(
        nnx.to_pure_dict(nnx.state(model, nnx.Param)),
        nnx.to_pure_dict(nnx.state(ref, nnx.Param)),
        rtol=1e-5,
        atol=1e-6,
    )


def _per_microbatch_mean(loss_fn, batch, key):
    """The token mean of microbatch j = rows j::K with key fold_in(key, j)."""
    parts = [
        loss_fn(jax.tree.map(lambda a, j=j: a[j::K], batch), jax.random.fold_in(key, j))
        for j in range(K)
    ]
    counts = np.array([float(n) for _, n in parts])
    losses = np.array([float(v) for v, _ in parts])
    ok = counts > 0
    return np.sum(counts[ok] * losses[ok]) / counts.sum(), counts.sum()


def test_split_merge_recipe_matches_nnx_value_and_grad():
    model = _MLP(nnx.Rngs(0))
    batch = _batch()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    grad_fn = jax.jit(mm.microbatched_value_and_grad(_split_loss(graphdef, rest), K))
    (loss, count), grads = grad_fn(params, batch)
    (f_loss, f_count), f_grads = nnx.value_and_grad(_token_loss, has_aux=True)(
        model, batch
    )
    assert int(count) == int(f_count) == int(np.sum(batch["mask"]))
    np.testing.assert_allclose(float(loss), float(f_loss), rtol=1e-6)
    chex.assert_trees_all_close(
        nnx.to_pure_dict(grads), nnx.to_pure_dict(f_grads), rtol=1e-5, atol=1e-6
    )
    # An nnx.Optimizer takes the gradients as they come: the same step as the
    # full batch's.
    _assert_same_step(model, grads, f_grads)


def test_split_merge_recipe_with_dropout_per_microbatch():
    model = _MLP(nnx.Rngs(1))
    batch = _batch()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    grad_fn = jax.jit(mm.microbatched_value_and_grad(_split_loss(graphdef, rest), K))
    key = jax.random.key(5)
    first = grad_fn(params, batch, rng=key)
    chex.assert_trees_all_equal(first, grad_fn(params, batch, rng=key))
    deterministic = grad_fn(params, batch)
    assert float(first[0][0]) != float(deterministic[0][0])
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(first))
    # Microbatch j's loss is the module's with dropout key fold_in(key, j).
    want, _ = _per_microbatch_mean(
        lambda mb, key_j: _token_loss(model, mb, key_j), batch, key
    )
    np.testing.assert_allclose(float(first[0][0]), want, rtol=1e-5)


def test_module_in_place_of_params_matches_nnx_value_and_grad():
    model = _MLP(nnx.Rngs(2))
    batch = _batch()
    grad_fn = jax.jit(mm.microbatched_value_and_grad(_token_loss, K))
    (loss, count), grads = grad_fn(model, batch)
    (f_loss, f_count), f_grads = nnx.value_and_grad(_token_loss, has_aux=True)(
        model, batch
    )
    assert type(grads) is _MLP  # the gradients are a module, like `model`
    assert int(count) == int(f_count) == int(np.sum(batch["mask"]))
    np.testing.assert_allclose(float(loss), float(f_loss), rtol=1e-6)
    chex.assert_trees_all_close(
        nnx.to_pure_dict(nnx.state(grads, nnx.Param)),
        nnx.to_pure_dict(f_grads),
        rtol=1e-5,
        atol=1e-6,
    )
    _assert_same_step(model, grads, f_grads)


def test_module_in_place_of_params_with_dropout_per_microbatch():
    model = _MLP(nnx.Rngs(3))
    batch = _batch()
    grad_fn = jax.jit(mm.microbatched_value_and_grad(_token_loss, K))
    key = jax.random.key(11)
    first = grad_fn(model, batch, rng=key)
    chex.assert_trees_all_equal(first, grad_fn(model, batch, rng=key))
    assert float(first[0][0]) != float(grad_fn(model, batch)[0][0])
    # The same numbers as the split/merge recipe with the same key.
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    split_fn = jax.jit(mm.microbatched_value_and_grad(_split_loss(graphdef, rest), K))
    (loss, count), grads = split_fn(params, batch, rng=key)
    assert (float(first[0][0]), float(first[0][1])) == (float(loss), float(count))
    chex.assert_trees_all_equal(
        nnx.to_pure_dict(nnx.state(first[1], nnx.Param)), nnx.to_pure_dict(grads)
    )


def _looped(loss_fn, model, batch, k=K, wrt=nnx.Param, compiled=False):
    """k calls of ``nnx.value_and_grad`` one after the other on the
    microbatches (rows j, j + k, ...), the module's state carried between
    them, except that a microbatch without tokens leaves every variable but
    the RNG streams' as it was: ``((loss, count), grads)`` token-weighted in
    float64. With ``compiled``, each call is an ``nnx.jit`` program, as the
    in-jit loop's body is (where eager and compiled evaluation round apart
    by more than the comparison's tolerance)."""
    losses, counts, grads = [], [], []
    value_and_grad = nnx.value_and_grad(
        loss_fn, argnums=nnx.DiffState(0, wrt), has_aux=True
    )
    if compiled:
        value_and_grad = nnx.jit(value_and_grad)
    for j in range(k):
        microbatch = jax.tree.map(lambda x, j=j: x[j::k], batch)
        before = jax.tree.map(jnp.copy, nnx.state(model, nnx.Not(nnx.RngState)))
        (loss, count), g = value_and_grad(model, microbatch)
        if not count:
            nnx.update(model, before)
        losses.append(float(loss))
        counts.append(float(count))
        grads.append(nnx.to_pure_dict(g))
    total = sum(counts)
    mean = jax.tree.map(
        lambda *g: (
            sum(n * np.asarray(x, np.float64) for n, x in zip(counts, g) if n) / total
        ),
        *grads,
    )
    loss = sum(n * x for n, x in zip(counts, losses) if n) / total
    return (loss, total), mean


def _assert_same_as_looped(got, want):
    (loss, count), grads = got
    (want_loss, want_count), want_grads = want
    assert float(count) == want_count
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5)
    chex.assert_trees_all_close(
        nnx.to_pure_dict(grads), want_grads, rtol=1e-5, atol=1e-6
    )


class _WithRngs(nnx.Module):
    """A module that keeps its dropout RNG stream: not only parameters."""

    def __init__(self, rngs):
        self.hidden = nnx.Linear(D_IN, D_OUT, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.dropout(self.hidden(x))


# Dropout draws from its `dropout` stream, or from `default` where the model's
# Rngs has no `dropout` stream (`nnx.Rngs(0)`): the recipe must reseed both.
@pytest.mark.parametrize(
    "rngs",
    [lambda: nnx.Rngs(0, dropout=1), lambda: nnx.Rngs(0)],
    ids=["dropout stream", "default stream"],
)
def test_module_with_rng_streams_passed_whole_draws_new_masks_per_microbatch(rngs):
    model = _WithRngs(rngs())

    def loss_fn(model, batch):
        x = jnp.where(batch["mask"][..., None], batch["x"], 0.0)
        per_token = jnp.sum((model(x) - batch["y"]) ** 2, axis=-1)
        return mm.masked_mean(per_token, batch["mask"])

    # Passed whole, the module's stream advances microbatch by microbatch, as
    # k calls one after the other do: the same masks, loss and gradients as
    # such a loop, and the stream left where the loop leaves it. (Before, the
    # module was refused; split by hand without `rng=`, every microbatch and
    # every call drew the same mask.)
    looped = nnx.clone(model)
    want = _looped(loss_fn, looped, _batch())
    grad_fn = mm.microbatched_value_and_grad(loss_fn, K)
    got = nnx.jit(grad_fn)(model, _batch())
    _assert_same_as_looped(got, want)
    chex.assert_trees_all_equal(
        nnx.to_pure_dict(nnx.state(model, nnx.RngState)),
        nnx.to_pure_dict(nnx.state(looped, nnx.RngState)),
    )
    again = grad_fn(model, _batch())  # eager; the stream has moved on
    assert float(again[0][0]) != float(got[0][0])
    _assert_same_as_looped(again, _looped(loss_fn, looped, _batch()))
    # Split by hand, a dropout key per microbatch comes from `rng=`.
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def merged_loss(params, batch, rng):
        module = nnx.merge(graphdef, params, rest, copy=True)
        nnx.reseed(module, default=rng, dropout=rng)
        return loss_fn(module, batch)

    grad_fn = jax.jit(mm.microbatched_value_and_grad(merged_loss, K))
    batch, key = _batch(), jax.random.key(4)
    (loss, count), grads = grad_fn(params, batch, rng=key)
    chex.assert_trees_all_equal(((loss, count), grads), grad_fn(params, batch, rng=key))
    assert float(loss) != float(grad_fn(params, batch, rng=jax.random.key(5))[0][0])
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
    want, total = _per_microbatch_mean(
        lambda mb, key_j: merged_loss(params, mb, key_j), batch, key
    )
    assert int(count) == total == int(np.sum(batch["mask"]))
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)


class _WithBatchNorm(nnx.Module):
    """A module with float batch statistics beside its parameters."""

    def __init__(self, rngs):
        self.hidden = nnx.Linear(D_IN, D_OUT, rngs=rngs)
        self.bn = nnx.BatchNorm(D_OUT, rngs=rngs)

    def __call__(self, x):
        return self.bn(self.hidden(x))


def _bn_loss(model, batch):
    x = jnp.where(batch["mask"][..., None], batch["x"], 0.0)
    per_token = jnp.sum((model(x) - batch["y"]) ** 2, axis=-1)
    return mm.masked_mean(per_token, batch["mask"])


def test_module_with_batch_stats_passed_whole_updates_them_microbatch_by_microbatch():
    # The split recipe's `nnx.merge(..., copy=True)` dropped what each
    # microbatch wrote: the running statistics never moved. Passed whole, each
    # microbatch normalises with and updates the statistics the previous one
    # left, as k calls one after the other do.
    model = _WithBatchNorm(nnx.Rngs(0))
    batch = _batch()
    looped = nnx.clone(model)
    want = _looped(_bn_loss, looped, batch)
    grad_fn = mm.microbatched_value_and_grad(_bn_loss, K)

    @jax.jit
    def step(model, batch):  # jax.jit: the updated module is returned
        return grad_fn(model, batch), model

    got, model = step(model, batch)
    _assert_same_as_looped(got, want)
    chex.assert_trees_all_close(
        nnx.to_pure_dict(nnx.state(model, nnx.BatchStat)),
        nnx.to_pure_dict(nnx.state(looped, nnx.BatchStat)),
        rtol=1e-6,
    )
    assert float(jnp.max(jnp.abs(model.bn.mean[...]))) > 0  # they moved
    # The gradients are the parameters' (an nnx.State), as nnx.grad's, and an
    # nnx.Optimizer takes them.
    assert not nnx.to_flat_state(nnx.state(got[1], nnx.Not(nnx.Param)))
    nnx.Optimizer(model, optax.adam(0.1), wrt=nnx.Param).update(model, got[1])


class _WithMaskedBatchNorm(nnx.Module):
    """Batch statistics of the real tokens only, and a dropout stream."""

    def __init__(self, rngs):
        # No bias before the normalisation: its gradient is 0 up to rounding.
        self.hidden = nnx.Linear(D_IN, D_OUT, use_bias=False, rngs=rngs)
        self.bn = nnx.BatchNorm(D_OUT, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x, mask):
        return self.dropout(self.bn(self.hidden(x), mask=mask[..., None]))


def _masked_bn_loss(model, batch):
    x = jnp.where(batch["mask"][..., None], batch["x"], 0.0)
    per_token = jnp.sum((model(x, batch["mask"]) - batch["y"]) ** 2, axis=-1)
    return mm.masked_mean(per_token, batch["mask"])


@pytest.mark.parametrize("jit", [True, False], ids=["nnx.jit", "eager"])
def test_a_microbatch_without_tokens_leaves_the_batch_statistics_as_they_were(jit):
    # A masked BatchNorm's statistics of a microbatch without tokens are 0/0:
    # carried on, they made the running mean and variance NaN for good (every
    # later evaluation NaN). Such a microbatch now leaves the module's state
    # as it found it, as it leaves the accumulated means; its RNG streams
    # still advance, so the dropout draws stay those of k calls in a row.
    # (Normalised by the variance of a microbatch's few tokens, the gradients
    # of eager and compiled evaluation differ by 2e-4 relative with jax
    # 0.12.1's XLA: the reference's calls are compiled.)
    model = _WithMaskedBatchNorm(nnx.Rngs(0, dropout=1))
    batch = _batch()  # microbatch 1 holds no tokens
    looped = nnx.clone(model)
    want = _looped(_masked_bn_loss, looped, batch, compiled=True)
    grad_fn = mm.microbatched_value_and_grad(_masked_bn_loss, K)
    got = (nnx.jit(grad_fn) if jit else grad_fn)(model, batch)
    _assert_same_as_looped(got, want)
    stats = nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(stats))
    assert float(jnp.max(jnp.abs(model.bn.mean[...]))) > 0  # they moved
    chex.assert_trees_all_close(
        stats, nnx.to_pure_dict(nnx.state(looped, nnx.BatchStat)), rtol=1e-6
    )
    chex.assert_trees_all_equal(
        nnx.to_pure_dict(nnx.state(model, nnx.RngState)),
        nnx.to_pure_dict(nnx.state(looped, nnx.RngState)),
    )
    # A batch without any tokens changes nothing but the RNG streams.
    before = nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.RngState)))
    empty = {**batch, "mask": jnp.zeros_like(batch["mask"])}
    (loss, count), _ = grad_fn(model, empty)
    assert int(count) == 0
    chex.assert_trees_all_equal(
        nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.RngState))), before
    )


class _Calls(nnx.Variable):
    """A count of the module's calls: the same on every device."""


class _CountingBatchNorm(_WithMaskedBatchNorm):
    def __init__(self, rngs):
        super().__init__(rngs)
        self.calls = _Calls(jnp.int32(0))

    def __call__(self, x, mask):
        self.calls[...] += 1
        return super().__call__(x, mask)


def test_under_shard_map_only_what_differs_by_device_is_held_by_device():
    # Each device counts its own tokens. Its batch statistics differ by device
    # anyway and are held where its microbatch is empty; a value that is the
    # same on every device (a call counter) is not, or its copies would
    # differ (and `out_specs=P()` for it fails).
    mesh = Mesh(np.array(jax.devices()[:2]), ("d",))
    grad_fn = mm.microbatched_value_and_grad(_masked_bn_loss, 2)

    def on_device(model, batch, cast=True):
        # The device's own gradients: its parameters cast to varying (without
        # the cast each microbatch's gradient would be the devices' sum).
        if cast:
            graphdef, params, rest = nnx.split(model, nnx.Param, ...)
            params = jax.lax.pcast(params, "d", to="varying")
            model = nnx.merge(graphdef, params, rest)
        (loss, count), _ = grad_fn(model, batch)
        stats = nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))
        return model.calls[...], jax.tree.map(lambda x: x[None], stats), count[None]

    def mapped(cast):
        return jax.jit(
            jax.shard_map(
                functools.partial(on_device, cast=cast),
                mesh=mesh,
                in_specs=(P(), P("d")),
                out_specs=(P(), P("d"), P("d")),
            )
        )

    step = mapped(cast=True)
    batch = _batch()
    with pytest.raises(ValueError, match=r"is the same on every shard.*nnx\.split"):
        mapped(cast=False)(_CountingBatchNorm(nnx.Rngs(0, dropout=1)), batch)
    batch["mask"] = batch["mask"].at[7].set(False)  # device 1's rows 5, 7: none
    calls, stats, counts = step(_CountingBatchNorm(nnx.Rngs(0, dropout=1)), batch)
    assert int(calls) == 2  # every microbatch's call, on both devices
    for device in range(2):
        # Device d's microbatches, one after the other: its rows d*4 + (j, j+2).
        looped = _CountingBatchNorm(nnx.Rngs(0, dropout=1))
        rows = jax.tree.map(lambda x, d=device: x[4 * d : 4 * d + 4], batch)
        (_, count), _ = _looped(_masked_bn_loss, looped, rows, k=2)
        assert int(counts[device]) == count
        want = nnx.to_pure_dict(nnx.state(looped, nnx.BatchStat))
        got = jax.tree.map(lambda x, d=device: x[d], stats)
        assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(got))
        chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-8)


def _merged_loss(graphdef):
    """``_bn_loss`` of the module merged from ``graphdef`` and a whole state."""

    def loss(state, batch):
        return _bn_loss(nnx.merge(graphdef, state, copy=True), batch)

    return loss


def test_module_with_batch_stats_is_refused_where_its_state_cannot_be_carried():
    # BatchStat is float: without the check its mean and var would come back
    # as "gradients", which nnx.Optimizer(wrt=nnx.Param) takes silently, and
    # the running statistics would never be updated.
    model = _WithBatchNorm(nnx.Rngs(0))
    batch = _batch()
    # A module inside `params` is checked; the path says where.
    with pytest.raises(
        TypeError,
        match=r"NNX module \(_WithBatchNorm\) holding state other than "
        r"nnx\.Param \(BatchStat at params\['model'\]\.bn\.mean, "
        r"params\['model'\]\.bn\.var\)",
    ):
        mm.microbatched_value_and_grad(lambda p, mb: _bn_loss(p["model"], mb), K)(
            {"model": model}, batch
        )
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    with pytest.raises(TypeError, match=r"NNX module \(_WithBatchNorm\) "):
        mm.data_parallel_value_and_grad(_bn_loss, mesh)(model, batch)
    # So is a state split off whole, with the batch statistics in it.
    graphdef, everything = nnx.split(model)
    whole_state_loss = _merged_loss(graphdef)

    with pytest.raises(
        TypeError,
        match=r"^`params` holds variables that are not parameters \(BatchStat at "
        r"params\['bn'\]\['mean'\], BatchStat at params\['bn'\]\['var'\]\): pass "
        r"`params` from `graphdef, params, rest = nnx.split\(model, nnx.Param",
    ):
        mm.microbatched_value_and_grad(whole_state_loss, K)(everything, batch)
    # The recipe the error names works: with one microbatch it is the full
    # batch's nnx.value_and_grad (batch statistics over the same rows).
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def merged_loss(params, batch):
        return _bn_loss(nnx.merge(graphdef, params, rest, copy=True), batch)

    (loss, count), grads = jax.jit(mm.microbatched_value_and_grad(merged_loss, 1))(
        params, batch
    )
    (f_loss, f_count), f_grads = nnx.value_and_grad(_bn_loss, has_aux=True)(
        nnx.clone(model), batch
    )
    assert int(count) == int(f_count)
    np.testing.assert_allclose(float(loss), float(f_loss), rtol=1e-6)
    chex.assert_trees_all_close(
        nnx.to_pure_dict(grads), nnx.to_pure_dict(f_grads), rtol=1e-5, atol=1e-6
    )
    # Only parameters are differentiated (the BatchNorm'd bias gradient is
    # rounding noise, hence the atol above).
    assert not nnx.to_flat_state(nnx.state(grads, nnx.Not(nnx.Param)))


class _Sows(nnx.Module):
    def __init__(self, rngs):
        self.inner = _WithBatchNorm(rngs)

    def __call__(self, x):
        y = self.inner(x)
        self.sow(nnx.Intermediate, "out", y)
        return y


@pytest.mark.filterwarnings("ignore:Using 'Module.sow\\(\\)' outside")
def test_a_loss_fn_that_adds_module_state_is_a_clear_error():
    # Each microbatch's state is the next one's: a variable created during the
    # call cannot be carried (jax's fori_loop would name carry types only).
    with pytest.raises(TypeError, match=r"changed the layout .* added \.out\. .*aux"):
        mm.microbatched_value_and_grad(_bn_loss, K)(_Sows(nnx.Rngs(0)), _batch())
    # A carried value that changes dtype is named with both layouts.
    with pytest.raises(TypeError, match=r"changed \.total \(bfloat16\[2\] -> float32"):
        mm.microbatched_value_and_grad(_bn_loss, K)(_Promotes(), _batch())


class _Promotes(nnx.Module):
    def __init__(self):
        self.hidden = nnx.Linear(D_IN, D_OUT, rngs=nnx.Rngs(0))
        self.total = nnx.BatchStat(jnp.zeros(D_OUT, jnp.bfloat16))

    def __call__(self, x):
        y = self.hidden(x)
        self.total.set_value(self.total[...] + jnp.mean(y, axis=(0, 1)))  # float32
        return y


class _HoldsNothing(nnx.Module):
    def __init__(self):
        self.hidden = nnx.Linear(D_IN, D_OUT, rngs=nnx.Rngs(0))
        self.cache = nnx.Cache(None)  # a variable without a value yet

    def __call__(self, x):
        return self.hidden(x)


def test_a_module_with_an_empty_variable_goes_in_whole():
    # Its state beside the parameters has no array: it was taken for a module
    # of parameters, then refused for holding a Cache.
    model = _HoldsNothing()
    got = mm.microbatched_value_and_grad(_bn_loss, K)(model, _batch())
    _assert_same_as_looped(got, _looped(_bn_loss, nnx.clone(model), _batch()))


class _Tied(nnx.Module):
    def __init__(self):
        self.a = nnx.Linear(3, 3, rngs=nnx.Rngs(0))
        self.b = self.a  # tied: the same variables twice

    def __call__(self, x):
        return self.b(jnp.tanh(self.a(x)))


def test_tied_weights_are_refused_and_the_split_recipe_gives_their_whole_gradient():
    def loss_fn(model, batch):
        per_token = jnp.sum((model(batch["x"]) - 1.0) ** 2, axis=-1)
        return mm.masked_mean(per_token, batch["mask"])

    rng = np.random.default_rng(0)
    batch = {
        "x": jnp.asarray(rng.normal(size=(8, 3)), jnp.float32),
        "mask": jnp.asarray(rng.random(8) < 0.7),
    }
    model = _Tied()
    # As a pytree the module lists its shared variables twice: the gradient
    # came back split between `a` and `b`.
    with pytest.raises(
        TypeError,
        match=r"same NNX variable at params\.a\.bias and "
        r"at params\.b\.bias \(shared, tied weights\).*nnx\.split",
    ):
        mm.microbatched_value_and_grad(loss_fn, 2)(model, batch)
    # Per device too (it ran, and split the gradient the same way).
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
    with pytest.raises(TypeError, match=r"same NNX variable at params\.a\.bias"):
        mm.per_device_value_and_grad(loss_fn, mesh)(model, batch)
    graphdef, params = nnx.split(model)

    def merged_loss(params, batch):
        return loss_fn(nnx.merge(graphdef, params), batch)

    (_, count), grads = mm.microbatched_value_and_grad(merged_loss, 2)(params, batch)
    (_, want_count), want = nnx.value_and_grad(loss_fn, has_aux=True)(model, batch)
    assert int(count) == int(want_count)
    chex.assert_trees_all_close(
        grads["a"]["kernel"][...], want.a.kernel[...], rtol=1e-5, atol=1e-6
    )


def test_a_module_inside_params_is_told_it_may_go_in_whole():
    # microbatched_value_and_grad carries a module's other state when the
    # module itself is `params`: the error says so. data_parallel_value_and_grad
    # does not carry it, and offers only the split recipe.
    model = _WithBatchNorm(nnx.Rngs(0))
    with pytest.raises(TypeError, match=r"pass the module itself as `params`"):
        mm.microbatched_value_and_grad(lambda p, mb: _bn_loss(p["model"], mb), K)(
            {"model": model}, _batch()
        )
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    with pytest.raises(TypeError, match=r"whole: pass `params` from `graphdef") as err:
        mm.data_parallel_value_and_grad(_bn_loss, mesh)(model, _batch())
    assert "module itself" not in str(err.value)


def test_a_state_split_off_whole_with_rng_streams_is_refused_by_variable():
    # `nnx.split(model)` keeps the RNG streams beside the parameters: each is
    # named as a variable that is not a parameter, with the recipe.
    model = _WithRngs(nnx.Rngs(0, dropout=1))
    graphdef, everything = nnx.split(model)
    whole_state_loss = _merged_loss(graphdef)

    with pytest.raises(
        TypeError,
        match=r"^`params` holds variables that are not parameters \(RngCount at "
        r"params\['dropout'\]\['rngs'\]\['count'\], RngKey at "
        r"params\['dropout'\]\['rngs'\]\['key'\]\): pass `params` from `graphdef, "
        r"params, rest = nnx.split\(model, nnx.Param",
    ):
        mm.microbatched_value_and_grad(whole_state_loss, K)(everything, _batch())


class _FillsCache(nnx.Module):
    def __init__(self):
        self.hidden = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
        self.cache = nnx.Cache(None)  # no value until the first call

    def __call__(self, x):
        y = self.hidden(x)
        self.cache.set_value(jnp.mean(y, axis=(0, 1)))
        return y


def test_a_variable_that_gets_its_first_value_in_loss_fn_is_named_with_both_layouts():
    with pytest.raises(TypeError, match=r"changed \.cache \(None -> float32\[2\]\)"):
        mm.microbatched_value_and_grad(_bn_loss, K)(_FillsCache(), _batch())


def test_an_rngs_closed_over_by_loss_fn_gets_a_note_saying_where_it_goes():
    # flax refuses a closed-over nnx.Rngs advanced inside the loop's trace
    # (TraceContextError); the note said how the batch was split instead.
    rngs = nnx.Rngs(dropout=1)
    dropout = nnx.Dropout(0.5)
    model = nnx.Linear(4, 1, rngs=nnx.Rngs(0))

    def loss_fn(model, batch):
        h = dropout(model(batch["x"]), rngs=rngs)[..., 0]
        return mm.masked_mean(h**2, batch["mask"])

    batch = {"x": jnp.ones((8, 3, 4)), "mask": jnp.ones((8, 3), bool)}
    grad_fn = mm.microbatched_value_and_grad(loss_fn, 4)
    with pytest.raises(Exception, match="different trace level") as info:
        grad_fn(model, batch)
    assert type(info.value).__name__ == "TraceContextError"
    assert any("keep it in the module" in note for note in info.value.__notes__)


class _LoRAWithBatchNorm(nnx.Module):
    """A frozen base layer with LoRA adapters, batch statistics and dropout."""

    def __init__(self, rngs, width=D_OUT):
        base = nnx.Linear(D_IN, width, rngs=rngs)
        self.lin = nnx.LoRA(D_IN, 2, width, base_module=base, rngs=rngs)
        self.bn = nnx.BatchNorm(width, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x, rng=None):
        del rng
        return self.drop(self.bn(self.lin(x)))


@pytest.mark.parametrize("jit", ["eager", "jax.jit", "nnx.jit"])
def test_wrt_differentiates_the_filtered_variables_only(jit):
    """wrt=nnx.LoRAParam: gradients of the adapters alone, equal to nnx's own
    with respect to them over the k microbatches in order (dropout streams and
    batch statistics carried from one to the next), the base weights held
    fixed; an nnx.Optimizer(..., wrt=nnx.LoRAParam) takes them."""
    model = _LoRAWithBatchNorm(nnx.Rngs(0))
    reference = nnx.clone(model)
    batch = _batch()
    grad_fn = mm.microbatched_value_and_grad(_token_loss, K, wrt=nnx.LoRAParam)
    if jit == "jax.jit":
        got, model = jax.jit(lambda m, b: (grad_fn(m, b), m))(model, batch)
    else:
        got = (nnx.jit(grad_fn) if jit == "nnx.jit" else grad_fn)(model, batch)
    want = _looped(_token_loss, reference, batch, wrt=nnx.LoRAParam)
    _assert_same_as_looped(got, want)
    (_, count), grads = got
    assert jax.tree.structure(grads) == jax.tree.structure(
        nnx.state(reference, nnx.LoRAParam)
    )
    # The batch statistics end where k calls leave them; dropout advanced.
    chex.assert_trees_all_close(
        nnx.state(model, nnx.BatchStat), nnx.state(reference, nnx.BatchStat)
    )
    chex.assert_trees_all_equal(
        nnx.state(model, nnx.RngState), nnx.state(reference, nnx.RngState)
    )

    optimizer = nnx.Optimizer(
        model, mm.MaskedMultiSteps(optax.sgd(0.1), 1), wrt=nnx.LoRAParam
    )
    base = np.asarray(model.lin.base_module.kernel[...])
    adapter = np.asarray(model.lin.lora_b[...])  # (lora_a's gradient is 0 at first)
    optimizer.update(model, grads, count=count)
    np.testing.assert_array_equal(model.lin.base_module.kernel[...], base)
    assert not np.allclose(model.lin.lora_b[...], adapter)


class _WideLoRA(nnx.Module):
    """A wide frozen base (1 MiB) under small adapters."""

    def __init__(self, rngs, width=512):
        self.embed = nnx.Linear(D_IN, width, rngs=rngs)
        base = nnx.Linear(width, width, rngs=rngs)
        self.lin = nnx.LoRA(width, 2, width, base_module=base, rngs=rngs)
        self.out = nnx.Linear(width, D_OUT, rngs=rngs)

    def __call__(self, x, rng=None):
        del rng
        return self.out(jnp.tanh(self.lin(self.embed(x))))


@pytest.mark.default_emitters
def test_wrt_keeps_no_gradient_of_the_frozen_weights():
    """The frozen weights' gradients are neither computed, accumulated nor
    returned (compiled scratch and output bytes), and the statistics count
    the adapters alone."""
    model = _WideLoRA(nnx.Rngs(0))
    batch = _batch()

    def footprint(**kwargs):
        grad_fn = mm.microbatched_value_and_grad(_token_loss, K, **kwargs)
        memory = nnx.jit(grad_fn).lower(model, batch).compile().memory_analysis()
        return memory.temp_size_in_bytes, memory.output_size_in_bytes

    base_bytes = 4 * 512 * 512
    (temp, out), (temp_wrt, out_wrt) = footprint(), footprint(wrt=nnx.LoRAParam)
    # Without wrt, a microbatch's gradient of the base in scratch and the
    # window's in the output; with it, no buffer of the base's size.
    assert temp >= base_bytes and out - out_wrt >= base_bytes
    assert temp_wrt < base_bytes / 4

    grad_fn = mm.microbatched_value_and_grad(
        _token_loss, K, wrt=nnx.LoRAParam, with_stats=True, per_leaf_stats=True
    )
    _, grads, stats = grad_fn(model, batch)
    assert jax.tree.structure(stats.grad_sq_norm) == jax.tree.structure(grads)
    np.testing.assert_allclose(
        sum(jax.tree.leaves(stats.grad_sq_norm)),
        sum(jnp.sum(g**2) for g in jax.tree.leaves(grads)),
        rtol=1e-5,
    )


@pytest.mark.parametrize(
    ("params", "wrt", "match"),
    [
        ("pytree", nnx.LoRAParam, "selects variables of an NNX module passed whole"),
        ("linear", nnx.LoRAParam, "selects none of the variables"),
        ("lora", nnx.BatchStat, "selects variables that are not parameters"),
        ("lora", 3, "`wrt` must be an nnx filter"),
    ],
)
def test_wrt_errors_name_the_filter(params, wrt, match):
    given = {
        "pytree": {"w": jnp.ones(2)},
        "linear": nnx.Linear(D_IN, D_OUT, rngs=nnx.Rngs(0)),
        "lora": _LoRAWithBatchNorm(nnx.Rngs(0)),
    }[params]
    with pytest.raises(TypeError, match=match):
        mm.microbatched_value_and_grad(_token_loss, K, wrt=wrt)(given, _batch())


class _Counter(nnx.Variable):
    pass


def test_wrt_refuses_variables_that_are_not_parameters_and_every_variable():
    model = _LoRAWithBatchNorm(nnx.Rngs(0))
    model.calls = _Counter(jnp.zeros(()))
    with pytest.raises(TypeError, match="not parameters .*_Counter at params.calls"):
        mm.microbatched_value_and_grad(
            _token_loss, K, wrt=nnx.Any(nnx.LoRAParam, _Counter)
        )(model, _batch())
    for every in (..., True):
        with pytest.raises(TypeError, match="selects every variable"):
            mm.microbatched_value_and_grad(_token_loss, K, wrt=every)


def test_errors_name_the_filter_as_code():
    from masked_multistep._nnx_state import filter_text

    class Adapter(nnx.Param):
        pass

    assert filter_text(nnx.LoRAParam) == "nnx.LoRAParam"
    assert filter_text(Adapter) == "Adapter"
    assert filter_text("lora") == "'lora'"
    assert (
        filter_text(nnx.All(nnx.Param, nnx.PathContains("lora_a")))
        == "nnx.All(nnx.Param, nnx.PathContains('lora_a'))"
    )
    assert filter_text(nnx.Any(nnx.LoRAParam, "x")) == "nnx.Any(nnx.LoRAParam, 'x')"
    assert filter_text((nnx.LoRAParam, ...)) == "(nnx.LoRAParam, ...)"
    with pytest.raises(TypeError, match=r"`wrt=nnx\.LoRAParam` selects none"):
        mm.microbatched_value_and_grad(_token_loss, K, wrt=nnx.LoRAParam)(
            nnx.Linear(D_IN, D_OUT, rngs=nnx.Rngs(0)), _batch()
        )
