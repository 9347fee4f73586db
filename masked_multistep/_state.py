"""The wrapper's state, :class:`MaskedMultiStepsState`, and the checks that a
state handed to a step is one this wrapper's ``init`` built."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from masked_multistep import _checks
from masked_multistep._running_mean import accumulator_fits

__all__ = [
    "MaskedMultiStepsState",
    "check_state",
    "has_field_named",
    "layout",
    "scalars_as_arrays",
    "states_in",
]


class MaskedMultiStepsState(NamedTuple):
    """State of :class:`MaskedMultiSteps`.

    Field names follow ``optax.MultiStepsState``; the token weighting adds the
    counts, and ``updated``, ``num_invalid_counts`` and ``num_nonfinite_windows``
    make what happened observable. The layout is part of the checkpoint format.

    Attributes:
      mini_step: microbatches counted in the current window (skipped ones
        excluded).
      gradient_step: inner optimizer updates applied so far.
      inner_opt_state: the state of the wrapped optimizer.
      acc_grads: running token-weighted mean of the window's gradients (with
        ``reduction=mm.deferred(...)``, one per device along a leading axis).
        Meaningful where the window holds tokens (``acc_count > 0``, or with a
        deferred reduction agreeing only at the window's end, a device's
        ``reduction_state.counts``); the next counted microbatch after a
        window ends overwrites it. It is scratch once a window closes: after
        ``MaskedMultiSteps.update`` applied an inner update it may hold that
        update's values (the update reuses its buffer).
      acc_count: the window's token total (``count_dtype``, float32 by default).
        With ``reduction=mm.deferred(...)`` agreeing only at the window's end
        (see :func:`masked_multistep.deferred`), 0: the global total is formed
        when the window closes, and every device's own is in
        ``reduction_state.counts``.
      acc_value: running token-weighted mean of the window's ``value`` arguments
        (float32), over the microbatches that passed one (0 where
        ``acc_count`` is).
      updated: whether the last ``update`` applied an inner update.
      num_invalid_counts: microbatches skipped because their count was
        negative or non-finite under ``jit`` (concrete ones raise), or would
        overflow the window's total (eagerly too; the full window then closes
        on that microbatch) (with a deferred reduction
        agreeing only at the window's end, devices' shares, added when the
        window closes, and 1 for a window dropped whole because its combined
        total does not fit ``count_dtype``).
      value_count: the token total behind ``acc_value``.
      num_nonfinite_windows: windows whose mean gradient was not finite (or,
        for an inner optimizer that needs ``value=``, whose mean value was
        missing or not finite), and which were therefore not handed to the
        inner optimizer.
      skip_state: what ``should_skip_update_fn`` returned last (``()`` without
        one).
      stats: with ``window_stats=True``, the window statistics'
        ``WindowStatsState`` (the current window's running sums and the last
        completed window's totals, from which
        :func:`masked_multistep.window_stats` reads its :class:`WindowStats`;
        no NaN of its own; fourteen scalars packed into three arrays, read
        by name through its properties); ``()`` otherwise.
      policy_state: the window policy's state (``()`` for a fixed ``k``).
      reduction_state: the cross-device reduction's state: ``()`` by default;
        with ``reduction=mm.deferred(...)``, each device's token total behind
        its running mean (``counts``, shape ``(D,)``; a ``DeferredState``, or
        where the devices agree only at the window's end a
        ``DeferredWindowState``, which also keeps every device's invalid counts,
        ``value`` running mean and statistics' shares).

    Examples:
      Halfway through a window of 2: 3 tokens with mean gradient 1, then the
      window closes on 1 token with mean gradient 5:

      >>> import jax.numpy as jnp, optax
      >>> import masked_multistep as mm
      >>> tx = mm.MaskedMultiSteps(optax.sgd(1.0), every_k_schedule=2)
      >>> params = jnp.zeros(())
      >>> state = tx.init(params)
      >>> _, state = tx.update(jnp.array(1.0), state, params, count=jnp.array(3))
      >>> int(state.mini_step), float(state.acc_count), float(state.acc_grads)
      (1, 3.0, 1.0)
      >>> _, state = tx.update(jnp.array(5.0), state, params, count=jnp.array(1))
      >>> int(state.mini_step), int(state.gradient_step), bool(state.updated)
      (0, 1, True)
    """

    mini_step: jax.Array
    gradient_step: jax.Array
    inner_opt_state: Any
    acc_grads: Any
    acc_count: jax.Array
    acc_value: jax.Array
    updated: jax.Array
    num_invalid_counts: jax.Array
    value_count: jax.Array
    num_nonfinite_windows: jax.Array
    skip_state: Any = ()
    stats: Any = ()
    policy_state: Any = ()
    reduction_state: Any = ()


# Pickles name the class by its module: the one it was defined in before this
# module held it, which still exports it, so that a state pickled here loads
# with earlier versions too.
MaskedMultiStepsState.__module__ = "masked_multistep._multisteps"


def states_in(tree: Any, types: type | tuple[type, ...]) -> list[Any]:
    """The nodes of ``tree`` that are instances of ``types`` (outermost ones:
    a match is not searched further), in leaf order."""
    return [x for _, x in _checks.instances_in(tree, types)]


def has_field_named(tree: Any, name: str) -> bool:
    """Whether a key on some path of ``tree`` is ``name`` (a dict key or an
    attribute)."""
    for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
        for key in path:
            if getattr(key, "key", getattr(key, "name", None)) == name:
                return True
    return False


def layout(x: Any) -> Any:
    """The nesting of tuples (named or not) and dicts in ``x``; leaves as
    ``None``, whatever wraps them (an NNX variable, a shape struct)."""
    if isinstance(x, tuple):
        return (type(x), tuple(layout(c) for c in x))
    if isinstance(x, dict):
        return (dict, tuple((k, layout(v)) for k, v in sorted(x.items())))
    return None


def scalar_dtypes(count_dtype: Any) -> dict[str, Any]:
    """The dtypes in which ``init`` builds the state's scalar fields."""
    return {
        "mini_step": jnp.int32,
        "gradient_step": jnp.int32,
        "num_invalid_counts": jnp.int32,
        "num_nonfinite_windows": jnp.int32,
        "acc_count": count_dtype,
        "value_count": count_dtype,
        "acc_value": jnp.float32,
        "updated": jnp.bool_,
    }


def scalars_as_arrays(state: Any, count_dtype: Any) -> Any:
    """``state`` with the scalars given as Python numbers (a window reset by
    hand, ``state._replace(acc_count=0.0)``; under ``jit``, weakly typed
    arrays) in the dtypes ``init`` builds (the running mean reads them),
    where the number's kind fits its field's: an integer count, say, for a
    float ``count_dtype`` (one its dtype cannot hold is a ``ValueError``).
    Others are left to the checks."""
    if not isinstance(state, MaskedMultiStepsState):
        return state
    given = {}
    for field, dtype in scalar_dtypes(count_dtype).items():
        # The kinds of number the field takes as it is: an int for an
        # integer field, an int or a float for a floating one.
        kinds = {"b": "b", "i": "i", "f": "if"}[jnp.dtype(dtype).kind]
        x = getattr(state, field)
        if isinstance(x, (bool, int, float)):
            kind = {bool: "b", int: "i", float: "f"}[type(x)]
        elif isinstance(x, jax.Array) and jax.typeof(x).weak_type:
            kind = jnp.dtype(x.dtype).kind
        else:
            continue
        if kind in kinds:
            try:
                given[field] = jnp.asarray(x, dtype)
            except OverflowError as err:  # a Python int its dtype cannot hold
                raise ValueError(
                    f"`state.{field}` does not fit {jnp.dtype(dtype)}, got {x}"
                ) from err
    return state._replace(**given) if given else state


def check_state(
    state: Any,
    params: Any,
    grads: Any,
    *,
    owner: Any,
    settings_layout: Any,
    stats_dtypes: list[Any],
    count_dtype: Any,
    accumulator_dtype: Any,
) -> None:
    """Refuses a state that this wrapper's ``init`` did not build.

    The fields that the settings shape (window statistics, the window rule's
    state, the reduction's) are compared by layout, leaves aside, so a state
    whose statistics another configuration would drop is an error, not lost.
    """
    if isinstance(getattr(state, "mini_step", None), jax.ShapeDtypeStruct):
        # (Its counters suffice: an abstract state is abstract throughout.)
        raise TypeError(
            "`state` holds jax.ShapeDtypeStructs, an abstract state (as "
            "`jax.eval_shape(tx.init, params)` or a checkpoint's restore "
            "target gives it): pass the state `tx.init(params)` returns, or "
            "restore the checkpoint against the abstract one and pass what "
            "the restore returns"
        )
    if isinstance(state, optax.MultiStepsState):
        raise TypeError(
            "`state` is an optax.MultiStepsState: convert it once with "
            "`mm.from_optax_multisteps(state, tx, params, acc_count=...)`, or "
            "start from `tx.init(params)`"
        )
    if not isinstance(state, MaskedMultiStepsState):
        hint = ""
        if isinstance(params, MaskedMultiStepsState):
            hint = (
                ": `params` is the wrapper's state, so the two are swapped; "
                "the order is (grads, state, params)"
            )
        elif isinstance(grads, MaskedMultiStepsState):
            hint = (
                ": `grads` is the wrapper's state, so the two are swapped; "
                "the order is (grads, state, params)"
            )
        elif _checks.training_state_kind(state) == "train_state":
            hint = (
                ": a TrainState holds it in `.opt_state`; or call "
                "`train_state.apply_gradients(grads=grads, count=n)`"
            )
        elif _checks.training_state_kind(state) == "nnx_optimizer":
            hint = (
                ": an nnx.Optimizer runs the wrapper itself: call "
                "`optimizer.update(model, grads, count=n)`"
            )
        elif states_in(state, MaskedMultiStepsState):
            hint = (
                ": it holds this wrapper's state among others (an "
                "optax.chain's, say): call the update of the transformation "
                "that built it"
            )
        elif has_field_named(state, "acc_grads"):
            hint = (
                ": it holds the state's fields by name only, as a checkpoint "
                "restored without a template gives them; restore against "
                "`tx.init(params)` (the target)"
            )
        raise TypeError(
            "`state` must be the MaskedMultiStepsState that this wrapper's "
            f"`init` returned, got {type(state).__name__}{hint}"
        )
    got = layout((state.stats, state.policy_state, state.reduction_state))
    if got != settings_layout:
        raise ValueError(
            "`state` was built by a MaskedMultiSteps with other settings "
            "(window_stats, the window rule or the reduction differ from "
            f"{owner!r}): use the state that this wrapper's `init` returned; "
            "to carry a running state over to new settings, "
            "`mm.from_other_settings(state, tx.init(params))` (a new `init` "
            "alone would drop the inner optimizer's state and the pending "
            "window)"
        )
    shape = jnp.shape(state.acc_count)
    if shape:
        raise ValueError(
            f"`state` is a batch of states (its acc_count has shape {shape}, "
            "not ()), as `jax.vmap(tx.init)` builds one per ensemble member: "
            "call the step under `jax.vmap` too, over the states, gradients "
            "and params (and counts) of the members"
        )
    # A restore against another wrapper's state keeps that state's dtypes
    # (flax.serialization does): its tokens would be counted, or its mean
    # kept, in the other precision.
    counts = jnp.result_type(state.acc_count)
    if counts != count_dtype:
        raise ValueError(
            f"`state` counts tokens in {counts}, but this wrapper's "
            f"count_dtype is {count_dtype} ({owner!r}): use the state "
            "that this wrapper's `init` returned (restore against it), or "
            "carry it over with `mm.from_other_settings(state, "
            "tx.init(params))`"
        )
    _check_counter_dtypes(state, stats_dtypes, count_dtype, owner)
    for path, acc in jax.tree_util.tree_flatten_with_path(state.acc_grads)[0]:
        dtype = jnp.result_type(acc)
        if not accumulator_fits(dtype, accumulator_dtype):
            want = accumulator_dtype or "at least float32"
            raise ValueError(
                f"`state` accumulates {jax.tree_util.keystr(path) or '<root>'} "
                f"in {dtype}, but this wrapper's accumulator is {want} "
                f"({owner!r}): use the state that this wrapper's `init` "
                "returned (restore against it)"
            )


def _check_counter_dtypes(
    state: MaskedMultiStepsState, stats_dtypes: list[Any], count_dtype: Any, owner: Any
) -> None:
    """Refuses counters and statistics of other dtypes than ``init`` builds:
    a state cast whole (``jax.tree.map(lambda x: x.astype(jnp.float32),
    state)``) failed in jax's ``cond`` under ``jit``, naming an internal
    path, and came back with counters of mixed dtypes outside it."""
    # (`acc_count`, checked above with its own hint, passes here.)
    scalars = [
        (f".{name}", getattr(state, name), want)
        for name, want in scalar_dtypes(count_dtype).items()
    ]
    stats = [
        (".stats" + jax.tree_util.keystr(path), x, want)
        for (path, x), want in zip(
            jax.tree_util.tree_flatten_with_path(state.stats)[0],
            stats_dtypes,
            strict=True,
        )
    ]
    for where, x, want in scalars + stats:
        dtype = jnp.result_type(x)
        if dtype != jnp.dtype(want):
            raise ValueError(
                f"`state{where}` is {dtype}, but this wrapper's `init` builds "
                f"{jnp.dtype(want)} ({owner!r}): use the state that `init` "
                "returned (restore against it); a cast of the whole state "
                "(`jax.tree.map(lambda x: x.astype(...), state)`) casts its "
                "counters too"
            )
