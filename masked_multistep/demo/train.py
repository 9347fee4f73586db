"""The demo's three training runs, and how their gradients are measured.

All three runs start from the same parameters and see the same batches:

* ``full_batch``: ``adam`` on the gradient of the whole batch's token-mean loss
  (the reference);
* ``optax_multisteps``: ``optax.MultiSteps(adam, k)`` over ``k`` microbatches,
  each contributing its mean gradient with equal weight;
* ``masked_multisteps``: ``mm.MaskedMultiSteps(adam, k)`` over the same ``k``
  microbatches, each contributing its mean gradient with its token count.

How the gradient error is measured: the inner ``adam`` is wrapped as
``optax.chain(record(), adam)``, where ``record`` passes the gradient through
unchanged and keeps a copy in its state. After a window closes, that copy is
exactly the gradient the accumulator handed to the inner optimizer, whatever
the accumulator computed internally: nothing is reconstructed from the
microbatch gradients, and both accumulators are read the same way
(``optax.MultiSteps`` clears its own accumulator when a window closes, so its
state could not be read afterwards). Before each window the full-batch gradient
is computed at that run's current params, and the error is
``‖g_handed − g_full‖ / ‖g_full‖`` (in float64, on the host). The
``full_batch`` run measures its own gradient the same way, as a check of the
measurement: its error is 0.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import masked_multistep as mm
from masked_multistep.demo.data import Batches, make_batches, make_corpus
from masked_multistep.demo.model import CausalLM, token_mean_loss

__all__ = ["Config", "RunResult", "record", "train_all", "RUNS"]

RUNS = ("full_batch", "optax_multisteps", "masked_multisteps")


class Config(NamedTuple):
    """Settings of the demo (the command line's flags and a few fixed sizes)."""

    steps: int = 100
    microbatches: int = 4
    batch_size: int = 32
    skew: float = 1.0
    seed: int = 0
    learning_rate: float = 3e-3
    heldout_size: int = 512


class RunResult(NamedTuple):
    """Per-step measurements of one run, and its held-out loss at the end.

    ``noise_scale`` (``masked_multisteps`` only, else None): per step, the
    smoothed gradient noise scale ``B_simple`` in tokens from the wrapper's
    window statistics (:func:`mm.window_stats`).
    """

    train_loss: np.ndarray
    grad_rel_error: np.ndarray
    heldout_loss: float
    noise_scale: np.ndarray | None = None


class RecordState(NamedTuple):
    last: Any


def record() -> optax.GradientTransformation:
    """Passes updates through unchanged and keeps the last ones in its state."""

    def init(params):
        return RecordState(jax.tree.map(jnp.zeros_like, params))

    def update(updates, state, params=None):
        del state, params
        return updates, RecordState(updates)

    return optax.GradientTransformation(init, update)


def relative_error(g, g_ref) -> float:
    """``‖g − g_ref‖ / ‖g_ref‖`` over whole pytrees, on the host in float64."""
    g, g_ref = jax.device_get((g, g_ref))
    diff = sum(
        np.sum(np.square(np.float64(a) - np.float64(b)))
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref), strict=True)
    )
    ref = sum(np.sum(np.square(np.float64(b))) for b in jax.tree.leaves(g_ref))
    return float(np.sqrt(diff / ref))


def _recorded(state) -> Any:
    """The ``record()`` state inside any of the three runs' optimizer states."""
    inner = getattr(state, "inner_opt_state", state)
    return inner[0].last


def _optimizers(config: Config) -> dict[str, tuple[Any, int, Callable]]:
    """Per run: the optimizer, its microbatches per step, and its jitted update.

    The update is ``(grads, state, params, count) -> (params, state)``; only
    ``MaskedMultiSteps`` takes ``count=``.
    """
    inner = optax.chain(record(), optax.adam(config.learning_rate))
    k = config.microbatches
    multisteps = optax.MultiSteps(inner, every_k_schedule=k)
    masked = mm.MaskedMultiSteps(inner, every_k_schedule=k, window_stats=True)

    def plain(tx):
        @jax.jit
        def update(grads, state, params, count):
            del count
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        return update

    @jax.jit
    def counted(grads, state, params, count):
        return masked.apply_gradients(grads, state, params, count=count)

    return {
        "full_batch": (inner, 1, plain(inner)),
        "optax_multisteps": (multisteps, k, plain(multisteps)),
        "masked_multisteps": (masked, k, counted),
    }


def make_data(config: Config) -> tuple[Batches, Batches]:
    """The training batches ``(steps, batch, seq_len)`` and a held-out set."""
    # Separate streams, so that the data do not depend on the number of steps.
    corpus = make_corpus(np.random.default_rng([config.seed, 0]))
    train = make_batches(
        np.random.default_rng([config.seed, 1]),
        corpus,
        num_batches=config.steps,
        batch_size=config.batch_size,
        skew=config.skew,
    )
    heldout = make_batches(
        np.random.default_rng([config.seed, 2]),
        corpus,
        num_batches=1,
        batch_size=config.heldout_size,
        skew=0.0,
    )
    return train, Batches(*(x[0] for x in heldout))


def train_all(
    config: Config, progress: Callable[[int], Any] = range
) -> dict[str, RunResult]:
    """Runs the three trainings of ``config``; ``progress`` wraps the step range.

    Returns the per-run results, keyed by the names in ``RUNS``.
    """
    train, heldout = make_data(config)
    model = CausalLM(vocab_size=64, max_len=train.inputs.shape[-1])
    optimizers = _optimizers(config)

    # Jitted, because op-by-op initialisation compiles every op on its own.
    @jax.jit
    def initialise(key, inputs):
        params = model.init(key, inputs)["params"]
        return params, {name: optimizers[name][0].init(params) for name in RUNS}

    init_params, states = initialise(jax.random.key(config.seed), train.inputs[0])
    eval_loss = jax.jit(lambda p, b: token_mean_loss(model, p, *b)[0])

    # One jitted gradient function, compiled once per batch shape, serves all runs.
    loss_and_grad = jax.jit(
        jax.value_and_grad(functools.partial(token_mean_loss, model), has_aux=True)
    )
    params = {name: init_params for name in RUNS}
    losses = {name: [] for name in RUNS}
    errors = {name: [] for name in RUNS}
    noise_scale = []

    # Compile every step function before `progress` starts (its clock would
    # count compilation as the first step): one step of each run on the first
    # batch, whose results are dropped, and one read of the statistics. The
    # functions are pure, so this changes no result.
    first = Batches(*(x[0] for x in train))
    for name, (_, k, update) in optimizers.items():
        loss_and_grad(init_params, *first)
        (_, count), grads = loss_and_grad(
            init_params, *(np.split(x, k)[0] for x in first)
        )
        _, warm = update(grads, states[name], init_params, count)
        if name == "masked_multisteps":
            jax.block_until_ready(mm.window_stats(warm))
        jax.block_until_ready(warm)

    for t in progress(config.steps):
        batch = Batches(*(x[t] for x in train))
        for name, (_, k, update) in optimizers.items():
            # The reference: the full-batch gradient at this run's current params.
            (loss, _), g_full = loss_and_grad(params[name], *batch)
            # Consecutive slices of the (length-arranged) batch.
            for mb in zip(*(np.split(x, k) for x in batch), strict=True):
                (_, count), grads = loss_and_grad(params[name], *mb)
                params[name], states[name] = update(
                    grads, states[name], params[name], count
                )
            # The window has closed: `record` holds what the inner adam received.
            losses[name].append(loss)
            errors[name].append(relative_error(_recorded(states[name]), g_full))
        stats = mm.window_stats(states["masked_multisteps"])
        noise_scale.append(stats.smoothed_noise_scale)

    return {
        name: RunResult(
            train_loss=np.asarray(jax.device_get(losses[name]), np.float64),
            grad_rel_error=np.asarray(errors[name]),
            heldout_loss=float(eval_loss(params[name], heldout)),
            noise_scale=(
                np.asarray(jax.device_get(noise_scale), np.float64)
                if name == "masked_multisteps"
                else None
            ),
        )
        for name in RUNS
    }


def token_counts(config: Config) -> np.ndarray:
    """Real tokens per microbatch of the first batch (shows the length skew)."""
    train, _ = make_data(config._replace(steps=1))
    return train.mask[0].reshape(config.microbatches, -1).sum(axis=-1)


def mean_batch_tokens(config: Config) -> float:
    """Real tokens per batch, averaged over the run's batches."""
    train, _ = make_data(config)
    return float(train.mask.reshape(config.steps, -1).sum(axis=-1).mean())
