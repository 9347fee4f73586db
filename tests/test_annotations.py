"""Users' functions annotated with names imported only for type checkers.

From Python 3.14 annotations are evaluated lazily (PEP 649): a function
annotated with a name imported under ``if TYPE_CHECKING:`` runs, and
``inspect.signature`` (which evaluates annotations by default) raises
``NameError`` on it. The library reads the signatures of ``loss_fn``, inner
optimizers' updates, skip functions, schedules and window policies, for their
parameters only: those reads must not evaluate annotations.

The functions below come from one source text: on Python 3.14 and newer its
annotations are lazy, so an evaluation raises (asserted); on older Pythons,
which evaluate annotations where a function is defined, it starts with
``from __future__ import annotations`` (strings, the way such code is written
there), and the same calls must work.
"""

import inspect
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import masked_multistep as mm

SOURCE = """
from typing import TYPE_CHECKING

import jax
import optax

import masked_multistep as mm

if TYPE_CHECKING:
    from somewhere_else import Array, Batch, Key, Params, State, Updates


def loss_fn(params: Params, batch: Batch) -> Array:
    return mm.masked_mean((batch["x"] @ params["w"] - 1.0) ** 2, batch["mask"])


def loss_with_rng(params: Params, batch: Batch, *, rng: Key = None) -> Array:
    return loss_fn(params, batch)


def loss_with_key(params: Params, batch: Batch, key: Key) -> Array:
    return loss_fn(params, batch)


def negate_init(params: Params) -> State:
    return optax.EmptyState()


def negate(updates: Updates, state: State, params: Params = None, *,
           value: Array = None) -> tuple[Updates, State]:
    return jax.tree.map(lambda u: -u, updates), state


def skip(updates: Updates, gradient_step: Array, params: Params) -> Array:
    return optax.skip_not_finite(updates, gradient_step, params)


def every_two(step: Array) -> Array:
    return 2


def budget(seen: Array) -> Array:
    return 4.0


def policy_init() -> State:
    return jax.numpy.zeros([], jax.numpy.int32)


def policy_closes(state: State, scalars: Array) -> Array:
    return scalars.microbatches >= 2


def policy_update(state: State, scalars: Array, closed: Array) -> State:
    return state + 1


def at_most_two(step: Array) -> Array:
    return 2


def one_group(params: Params) -> dict[str, Array]:
    return jax.tree.map(lambda _: "all", params)


def loss_with_batch_dict(params: Params, batch: dict[str, Array]) -> Array:
    return loss_fn(params, batch)
"""
if sys.version_info < (3, 14):
    SOURCE = "from __future__ import annotations\n" + SOURCE
USER: dict = {}
exec(compile(SOURCE, "users_code.py", "exec"), USER)  # noqa: S102

PARAMS = {"w": jnp.array([0.5, -1.0, 2.0])}
BATCH = {
    "x": jnp.arange(24.0).reshape(8, 3) / 10,
    "mask": jnp.array([1, 1, 0, 1, 1, 1, 0, 0], bool),
}


def _plain_loss(params, batch):
    return mm.masked_mean((batch["x"] @ params["w"] - 1.0) ** 2, batch["mask"])


def test_the_functions_annotations_cannot_be_evaluated_from_python_3_14():
    if sys.version_info >= (3, 14):
        with pytest.raises(NameError, match="Params"):
            inspect.signature(USER["loss_fn"])
    else:  # strings, not evaluated
        assert inspect.signature(USER["loss_fn"]).parameters["params"].annotation


def test_in_jit_microbatching_reads_loss_fns_parameters_only():
    want = mm.microbatched_value_and_grad(_plain_loss, 2)(PARAMS, BATCH)
    got = mm.microbatched_value_and_grad(USER["loss_fn"], 2)(PARAMS, BATCH)
    chex.assert_trees_all_equal(got, want)
    with_rng = mm.microbatched_value_and_grad(USER["loss_with_rng"], 2)
    chex.assert_trees_all_equal(with_rng(PARAMS, BATCH, rng=jax.random.key(0)), want)
    # A loss without `rng` is refused, and a key by another name than `rng`
    # with its hint: both show the parameters, without their annotations.
    with pytest.raises(TypeError, match=r"signature \(params, batch\) does not"):
        mm.microbatched_value_and_grad(USER["loss_with_batch_dict"], 2)(
            PARAMS, BATCH, rng=jax.random.key(0)
        )
    with pytest.raises(TypeError, match=r"loss_with_key\(params, batch, key\)"):
        mm.microbatched_value_and_grad(USER["loss_with_key"], 2)(
            PARAMS, BATCH, rng=jax.random.key(0)
        )


def test_per_device_and_data_parallel_gradients_read_loss_fns_parameters_only():
    mesh = jax.make_mesh(
        (2,),
        ("data",),
        devices=jax.devices()[:2],
        axis_types=(jax.sharding.AxisType.Explicit,),
    )
    with jax.set_mesh(mesh):
        for gradients in [
            mm.data_parallel_value_and_grad,
            mm.per_device_value_and_grad,
        ]:
            got = gradients(USER["loss_fn"], mesh, "data")(PARAMS, BATCH)
            want = gradients(_plain_loss, mesh, "data")(PARAMS, BATCH)
            chex.assert_trees_all_equal(got, want)


def test_the_wrapper_reads_its_functions_parameters_only():
    inner = optax.GradientTransformationExtraArgs(USER["negate_init"], USER["negate"])
    grads = {"w": jnp.array([1.0, 2.0, 3.0])}
    for tx in [
        mm.MaskedMultiSteps(inner, 2),
        mm.MaskedMultiSteps(
            optax.sgd(1.0),
            USER["every_two"],
            should_skip_update_fn=USER["skip"],
        ),
        mm.MaskedMultiSteps(optax.sgd(1.0), tokens_per_window=USER["budget"]),
        mm.MaskedMultiSteps(
            optax.sgd(1.0),
            tokens_per_window=mm.WindowPolicy(
                USER["policy_init"], USER["policy_closes"], USER["policy_update"]
            ),
        ),
        mm.MaskedMultiSteps(
            optax.sgd(1.0),
            tokens_per_window=mm.token_budget(
                100, max_microbatches=USER["at_most_two"]
            ),
        ),
    ]:
        state = tx.init(PARAMS)
        # `value=` reaches an inner update that names it, a window of two
        # microbatches of 2 tokens each closes on the second.
        for _ in range(2):
            updates, state = tx.update(grads, state, PARAMS, count=2, value=1.0)
        assert bool(state.updated), tx
        np.testing.assert_allclose(updates["w"], -grads["w"])
    # A keyword the inner update does not take is still told apart by name.
    tx = mm.MaskedMultiSteps(inner, 2)
    with pytest.raises(TypeError, match="'metric'.*`value=`"):
        tx.update(grads, tx.init(PARAMS), PARAMS, count=2, metric=1.0)


def test_another_optimizers_state_is_refused_whatever_inits_annotations():
    # The check that a state is the inner optimizer's own traces its `init`.
    inner = optax.GradientTransformationExtraArgs(USER["negate_init"], USER["negate"])
    foreign = mm.MaskedMultiSteps(optax.adam(1.0), 2).init(PARAMS)
    with pytest.raises(ValueError, match="inner"):
        mm.MaskedMultiSteps(inner, 2).update(PARAMS, foreign, PARAMS, count=2)


def test_window_statistics_group_by_a_function_of_the_params():
    tx = mm.MaskedMultiSteps(optax.sgd(1.0), 2, per_leaf_stats=True)
    state = tx.init(PARAMS)
    for count in (2, 3):
        grads = {"w": jnp.arange(3.0) * count}
        _, state = tx.update(grads, state, PARAMS, count=count)
    chex.assert_trees_all_equal(
        mm.window_stats(state, groups=USER["one_group"]),
        mm.window_stats(state, groups="all"),
    )
