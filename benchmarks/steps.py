"""The benchmark's workloads and the jitted train steps it compares.

Every competitor is a pair ``init(params) -> carry`` and ``step(carry, batch) ->
carry``. The carry (params and optimizer state, or the floor's accumulator) is
donated to the compiled step, as in a real training loop, so that XLA updates
it in place.

The window workload is dominated by the optimizer: a few square float32 weight
matrices and a tiny batch, so that one gradient costs about as much as a pass
over the parameters. That is where the cost of gradient accumulation itself
(the running mean, the inner optimizer, the conditional) is visible; with a
large batch it would vanish behind the gradient.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import masked_multistep as mm

LEARNING_RATE = 1e-4


@dataclasses.dataclass(frozen=True)
class Workload:
    """A tanh MLP of ``layers`` square ``width x width`` matrices (with
    ``biases``, a bias vector after each), masked MSE loss.

    A batch has ``rows`` rows of ``width`` "tokens"; about 80% of them are real
    (the mask), so microbatches carry different token counts.
    """

    width: int
    layers: int = 4
    rows: int = 8
    biases: bool = False

    @property
    def num_params(self) -> int:
        return self.layers * self.width * (self.width + self.biases)

    @property
    def param_bytes(self) -> int:
        return 4 * self.num_params

    def params(self, seed: int = 0) -> dict[str, jax.Array]:
        keys = jax.random.split(jax.random.PRNGKey(seed), self.layers)
        scale = 1.0 / np.sqrt(self.width)
        params = {
            f"w{i}": scale * jax.random.normal(key, (self.width, self.width))
            for i, key in enumerate(keys)
        }
        if self.biases:
            params.update({f"b{i}": jnp.zeros(self.width) for i in range(self.layers)})
        return params

    def batch(self, seed: int, rows: int | None = None) -> dict[str, jax.Array]:
        rows = self.rows if rows is None else rows
        kx, ky, km = jax.random.split(jax.random.PRNGKey(1000 + seed), 3)
        shape = (rows, self.width)
        return {
            "x": jax.random.normal(kx, shape),
            "y": jax.random.normal(ky, shape),
            "mask": jax.random.bernoulli(km, 0.8, shape),
        }

    def window_batch(self, k: int) -> dict[str, jax.Array]:
        """Microbatches ``batch(0)`` to ``batch(k - 1)`` as one batch, microbatch
        j in rows j, j + k, ...: ``microbatched_value_and_grad(loss_fn, k)``
        splits it into the very microbatches the per-microbatch loops take."""
        parts = [self.batch(j) for j in range(k)]
        return {
            name: jnp.stack([p[name] for p in parts], axis=1).reshape(
                k * self.rows, *parts[0][name].shape[1:]
            )
            for name in parts[0]
        }

    def loss_fn(self, params: Any, batch: Any) -> tuple[jax.Array, jax.Array]:
        """``(mean_loss, count)``: the masked mean squared error and its tokens."""
        h = batch["x"]
        for i in range(self.layers):
            h = h @ params[f"w{i}"]
            h = jnp.tanh(h + params[f"b{i}"][None] if self.biases else h)
        return mm.masked_mean((h - batch["y"]) ** 2, batch["mask"])


@dataclasses.dataclass(frozen=True)
class Competitor:
    """One way to train through a window of ``k`` microbatches.

    ``calls_per_window`` is ``k`` for the loops that take one microbatch per call,
    1 for the in-jit microbatched step (which takes the window's batch at once).
    ``opt_state`` picks the persistent optimizer state out of the carry.
    """

    name: str
    init: Callable[[Any], Any]
    step: Callable[[Any, Any], Any]
    calls_per_window: int
    opt_state: Callable[[Any], Any]
    # The compiled step does not depend on k (only the window length does).
    k_independent: bool = False
    # The competitor this one is the same step as, less the window statistics.
    baseline: str | None = None


def _grads(workload: Workload, params: Any, batch: Any):
    (loss, count), grads = jax.value_and_grad(workload.loss_fn, has_aux=True)(
        params, batch
    )
    del loss
    return grads, count


def floor(workload: Workload, k: int) -> Competitor:
    """The gradient plus a bare running-mean accumulate: no inner optimizer."""

    def init(params):
        acc = jax.tree.map(jnp.zeros_like, params)
        return params, acc, jnp.zeros([], jnp.int32)

    def step(carry, batch):
        params, acc, total = carry
        grads, count = _grads(workload, params, batch)
        acc, total = mm.running_mean_update(acc, total, grads, count)
        return params, acc, total

    return Competitor("floor", init, step, k, lambda c: c[1:], k_independent=True)


def _optax_loop(
    name: str, tx: Any, workload: Workload, k: int, *, with_count: bool, **kw
) -> Competitor:
    """The plain optax loop: ``tx.update`` then ``optax.apply_updates``."""

    def step(carry, batch):
        params, opt_state = carry
        grads, count = _grads(workload, params, batch)
        extra = {"count": count} if with_count else {}
        updates, opt_state = tx.update(grads, opt_state, params, **extra)
        return optax.apply_updates(params, updates), opt_state

    return Competitor(name, lambda p: (p, tx.init(p)), step, k, lambda c: c[1], **kw)


def adam(workload: Workload, k: int) -> Competitor:
    """A plain adam step on every microbatch (no accumulation)."""
    tx = optax.adam(LEARNING_RATE)
    return _optax_loop("adam", tx, workload, k, with_count=False, k_independent=True)


def optax_multisteps(workload: Workload, k: int) -> Competitor:
    """``optax.MultiSteps(adam, k)``: ``tx.update`` then ``optax.apply_updates``."""
    tx = optax.MultiSteps(optax.adam(LEARNING_RATE), every_k_schedule=k)
    return _optax_loop("optax.MultiSteps", tx, workload, k, with_count=False)


def masked_multisteps(workload: Workload, k: int) -> Competitor:
    """``mm.MaskedMultiSteps(adam, k)`` in the plain optax loop."""
    tx = mm.MaskedMultiSteps(optax.adam(LEARNING_RATE), every_k_schedule=k)
    return _optax_loop("MaskedMultiSteps update", tx, workload, k, with_count=True)


def masked_multisteps_stats(workload: Workload, k: int) -> Competitor:
    """The plain optax loop with ``window_stats=True``."""
    return _with_statistics("+stats", workload, k, window_stats=True)


def masked_multisteps_leaf_stats(workload: Workload, k: int) -> Competitor:
    """The plain optax loop with ``per_leaf_stats=True``: the statistics and
    each parameter leaf's share of them."""
    return _with_statistics("+leaf stats", workload, k, per_leaf_stats=True)


def _with_statistics(suffix: str, workload: Workload, k: int, **kw: Any) -> Competitor:
    """``mm.MaskedMultiSteps(adam, k, **kw)`` in the plain optax loop, against
    the same loop without statistics."""
    tx = mm.MaskedMultiSteps(optax.adam(LEARNING_RATE), every_k_schedule=k, **kw)
    return _optax_loop(
        f"MaskedMultiSteps update{suffix}",
        tx,
        workload,
        k,
        with_count=True,
        baseline="MaskedMultiSteps update",
    )


def masked_multisteps_norm_test(workload: Workload, k: int) -> Competitor | None:
    """The plain optax loop with windows closed by the norm test, held at ``k``
    microbatches (the minimum and the maximum both ``k``) so
    that the inner optimizer runs as often as in the other rows: what the
    test's per-microbatch figures cost. None for ``k < 2``: the test decides
    on two microbatches or more, so a window of one never consults it."""
    if k < 2:
        return None
    policy = mm.norm_test(0.5, min_microbatches=k, max_microbatches=k)
    tx = mm.MaskedMultiSteps(optax.adam(LEARNING_RATE), norm_test=policy)
    return _optax_loop(
        "MaskedMultiSteps update+norm test",
        tx,
        workload,
        k,
        with_count=True,
        baseline="MaskedMultiSteps update",
    )


def has_train_state() -> bool:
    try:
        mm.TrainState  # noqa: B018
    except (AttributeError, ImportError):
        return False
    return True


def train_state(
    workload: Workload, k: int, *, window_stats: bool = False
) -> Competitor:
    """``mm.TrainState.apply_gradients`` (``tx.apply_gradients`` without flax)."""
    tx = mm.MaskedMultiSteps(
        optax.adam(LEARNING_RATE), every_k_schedule=k, window_stats=window_stats
    )
    suffix = "+stats" if window_stats else ""

    if has_train_state():

        def init(params):
            return mm.TrainState.create(apply_fn=None, params=params, tx=tx)

        def step(state, batch):
            grads, count = _grads(workload, state.params, batch)
            return state.apply_gradients(grads=grads, count=count)

        name = "TrainState.apply_gradients"
        return Competitor(
            name + suffix,
            init,
            step,
            k,
            lambda s: s.opt_state,
            baseline=name if window_stats else None,
        )

    def step_tx(carry, batch):
        params, opt_state = carry
        grads, count = _grads(workload, params, batch)
        return tx.apply_gradients(grads, opt_state, params, count=count)

    name = "tx.apply_gradients"
    return Competitor(
        name + suffix,
        lambda p: (p, tx.init(p)),
        step_tx,
        k,
        lambda c: c[1],
        baseline=name if window_stats else None,
    )


def train_state_stats(workload: Workload, k: int) -> Competitor:
    """:func:`train_state` with ``window_stats=True``."""
    return train_state(workload, k, window_stats=True)


def train_state_token_windows(workload: Workload, k: int) -> Competitor:
    """``mm.TrainState.apply_gradients`` with windows of ``k`` microbatches'
    expected tokens (``tokens_per_window``) and the window statistics (flax)."""
    expected = round(0.8 * k * workload.rows * workload.width)
    tx = mm.MaskedMultiSteps(
        optax.adam(LEARNING_RATE), tokens_per_window=expected, window_stats=True
    )

    def init(params):
        return mm.TrainState.create(apply_fn=None, params=params, tx=tx)

    def step(state, batch):
        grads, count = _grads(workload, state.params, batch)
        return state.apply_gradients(grads=grads, count=count)

    return Competitor(
        "TrainState token windows+stats", init, step, k, lambda s: s.opt_state
    )


def nnx_optimizer(workload: Workload, k: int) -> Competitor:
    """``nnx.Optimizer.update`` with ``mm.MaskedMultiSteps(adam, k)`` (flax NNX).

    The carry is the model's and the optimizer's ``nnx.State`` (``nnx.split``),
    so that it can be donated like the other carries.
    """
    from flax import nnx

    tx = mm.MaskedMultiSteps(optax.adam(LEARNING_RATE), every_k_schedule=k)

    class Weights(nnx.Module):
        def __init__(self, params: dict[str, jax.Array]):
            self.w = nnx.Dict({name: nnx.Param(w) for name, w in params.items()})

        def params(self) -> dict[str, jax.Array]:
            return {name: p[...] for name, p in self.w.items()}

    graphdef = None

    def init(params):
        nonlocal graphdef
        model = Weights(params)
        graphdef, state = nnx.split((model, nnx.Optimizer(model, tx, wrt=nnx.Param)))
        return state

    def step(state, batch):
        model, optimizer = nnx.merge(graphdef, state)

        def loss_fn(model):
            return workload.loss_fn(model.params(), batch)

        (loss, count), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
        del loss
        optimizer.update(model, grads, count=count)
        return nnx.split((model, optimizer))[1]

    def opt_state(state):
        return nnx.merge(graphdef, state)[1].opt_state

    return Competitor("nnx.Optimizer.update", init, step, k, opt_state)


def in_jit_microbatched(workload: Workload, k: int) -> Competitor:
    """One call per window: ``microbatched_value_and_grad`` over k microbatches,
    then one adam step."""
    tx = optax.adam(LEARNING_RATE)
    grad_fn = mm.microbatched_value_and_grad(workload.loss_fn, k)

    def step(carry, batch):
        params, opt_state = carry
        _, grads = grad_fn(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return Competitor(
        "in-jit microbatched", lambda p: (p, tx.init(p)), step, 1, lambda c: c[1]
    )


WINDOW_COMPETITORS = (
    floor,
    adam,
    optax_multisteps,
    masked_multisteps,
    masked_multisteps_stats,
    masked_multisteps_leaf_stats,
    masked_multisteps_norm_test,
    train_state,
    train_state_stats,
    in_jit_microbatched,
)


def tree_bytes(tree: Any) -> int:
    """Bytes held by the arrays of ``tree``."""
    return sum(
        int(np.prod(jnp.shape(x))) * jnp.result_type(x).itemsize
        for x in jax.tree.leaves(tree)
    )
