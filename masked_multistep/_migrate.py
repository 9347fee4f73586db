"""Switching a run from ``optax.MultiSteps`` to :class:`MaskedMultiSteps`."""

from __future__ import annotations

import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from masked_multistep._checks import (
    check_flag,
    host_int_to_float,
    nested_hint,
    refuse_narrow_float,
    refuse_restore_target,
    to_count,
)
from masked_multistep._deferred import Deferred
from masked_multistep._inspect import holds_variables, unboxed, unboxed_all
from masked_multistep._multisteps import MaskedMultiSteps
from masked_multistep._reduction import placed_like
from masked_multistep._running_mean import compute_dtype
from masked_multistep._state import MaskedMultiStepsState, has_field_named
from masked_multistep._token_total import token_total, with_tokens_seen

__all__ = ["from_optax_multisteps"]


def _concrete_scalar(x: Any, name: str) -> np.ndarray:
    try:
        value = np.asarray(x)
    except jax.errors.TracerArrayConversionError as err:
        raise TypeError(
            f"from_optax_multisteps reads `{name}`, so it must be called eagerly "
            "(outside jit), once, when switching"
        ) from err
    if value.shape != ():
        raise ValueError(f"`{name}` must be a scalar, got shape {value.shape}")
    return value


def _step_counter(x: Any, name: str) -> int:
    """A concrete step counter, an integer in [0, 2**31 - 1] (the state's int32)."""
    value = _concrete_scalar(x, name)
    if not np.issubdtype(value.dtype, np.integer) or not (
        0 <= value.item() <= np.iinfo(np.int32).max
    ):
        raise ValueError(
            f"`{name}` must be an integer in [0, 2**31 - 1], got {value.item()!r} "
            f"of dtype {value.dtype}"
        )
    return int(value.item())


def _check_acc_count(acc_count: Any, mini_step: int) -> np.ndarray | None:
    """``acc_count`` as a concrete non-negative scalar; checked against mini_step."""
    if acc_count is None:
        if mini_step > 0:
            raise ValueError(
                f"The optax.MultiSteps state is in the middle of a window "
                f"(mini_step={mini_step}): pass `acc_count=`, the number of tokens "
                f"behind the {mini_step} microbatch gradients it has accumulated "
                f"(e.g. {mini_step} * tokens per microbatch)"
            )
        return None
    if isinstance(acc_count, bool) or not (
        isinstance(acc_count, numbers.Real) or hasattr(acc_count, "dtype")
    ):
        raise TypeError(
            "`acc_count` must be a real number, got "
            f"{acc_count!r} of type {type(acc_count).__name__}"
        )
    if isinstance(acc_count, numbers.Integral) and not 0 <= int(acc_count) < 2**64:
        # A Python int numpy holds in no integer dtype (an object array): by
        # value, as a float, as `tx.update(count=...)` reads it (the count
        # dtype's range is checked below).
        if int(acc_count) < 0:
            raise ValueError(f"`acc_count` must be finite and >= 0, got {acc_count}")
        acc_count = float(host_int_to_float(int(acc_count)))
    value = _concrete_scalar(acc_count, "acc_count")
    refuse_narrow_float(value.dtype, "`acc_count`")
    if value.dtype == np.bool_ or not (
        np.issubdtype(value.dtype, np.integer)
        or np.issubdtype(value.dtype, np.floating)
    ):
        raise TypeError(
            "`acc_count` must be an integer or floating scalar, got dtype "
            f"{value.dtype}"
        )
    if not np.isfinite(value) or value < 0:
        raise ValueError(f"`acc_count` must be finite and >= 0, got {value}")
    if mini_step == 0 and value != 0:
        raise ValueError(
            f"The optax.MultiSteps state is at a window boundary (mini_step=0), so "
            f"its window holds no tokens, but `acc_count` is {value}"
        )
    if mini_step > 0 and value == 0:
        raise ValueError(
            f"`acc_count` is 0, but the optax.MultiSteps state holds {mini_step} "
            "accumulated microbatch(es): their gradients would be dropped. Pass the "
            "number of tokens behind them."
        )
    return value


def _same_tree(name: str, got: Any, expected: Any, hint: str) -> None:
    got_def, expected_def = jax.tree.structure(got), jax.tree.structure(expected)
    if got_def != expected_def:
        raise ValueError(
            f"The optax.MultiSteps state's `{name}` has tree structure {got_def}, "
            f"but `tx.init(params)` gives {expected_def}: {hint}"
        )
    for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        if jnp.shape(g) != jnp.shape(e):
            raise ValueError(
                f"The optax.MultiSteps state's `{name}` holds a leaf of shape "
                f"{jnp.shape(g)} where `tx.init(params)` has {jnp.shape(e)}: {hint}"
            )


def from_optax_multisteps(
    state: optax.MultiStepsState | optax.OptState,
    tx: MaskedMultiSteps,
    params: optax.Params,
    *,
    acc_count: jax.typing.ArrayLike | None = None,
    use_grad_mean: bool | np.bool_ = True,
    tokens_seen: jax.typing.ArrayLike | None = None,
) -> MaskedMultiStepsState:
    """Converts an ``optax.MultiSteps`` state, so that a run can switch mid-run.

    The inner optimizer's state, ``gradient_step``, ``mini_step`` and
    ``skip_state`` carry over unchanged, so schedules, moments and the position
    in the current window continue where ``optax.MultiSteps`` left them. Build
    ``tx`` with the same inner optimizer (and ``should_skip_update_fn``) as the
    ``optax.MultiSteps`` the state came from.

    At a window boundary (``state.mini_step == 0``) nothing else is needed. In
    the middle of a window, ``optax.MultiSteps`` holds the plain mean
    ``(g₁ + … + gₘ) / m`` of the ``m = mini_step`` microbatch gradients seen so
    far (their sum with ``use_grad_mean=False``); ``acc_count`` says how many
    tokens stand behind them, and that mean becomes the window's running mean
    with weight ``acc_count``. When those ``m`` microbatches held equal counts
    ``n`` (``acc_count = m·n``), the window then ends exactly as if
    :class:`MaskedMultiSteps` had been used all along. With unequal counts
    their tokens cannot be told apart any more: they keep the equal weights
    ``optax.MultiSteps`` gave them, with ``acc_count`` as their total.

    The window's ``value`` mean (``acc_value``) starts empty: ``optax.MultiSteps``
    keeps no loss, nor tokens seen: pass ``tokens_seen=`` (the tokens of the
    windows completed so far) for a token budget that is a function of the
    tokens seen (a warmup) to continue where it was, and for the statistics'
    ``tokens_seen``; without it both count from the switch. With
    ``window_stats=True`` the window's statistics count the accumulated mean
    as one microbatch of ``acc_count`` tokens (its spread within is lost), so
    the first window's noise-scale estimates stay unbiased; no earlier window
    is recorded.
    ``has_updated`` of the result agrees with ``optax.MultiSteps.has_updated``
    of ``state``.

    Call it eagerly, once; it allocates one fresh state with ``tx.init(params)``.
    For a state inside ``optax.chain``, convert the chain's element that is the
    ``optax.MultiStepsState`` (and put ``tx`` in the chain in its place).

    Args:
      state: an ``optax.MultiStepsState``, with arrays as leaves (or NNX
        variables holding them: an ``nnx.Optimizer``'s ``opt_state``).
      tx: the :class:`MaskedMultiSteps` to continue with.
      params: the current params (for ``tx.init``: structure, dtypes, shardings).
      acc_count: the number of tokens (or total weight) behind the gradients
        accumulated in the current window. Required when ``state.mini_step > 0``;
        must be omitted or 0 at a window boundary.
      use_grad_mean: the ``use_grad_mean`` the ``optax.MultiSteps`` was built
        with (optax's default, ``True``: ``acc_grads`` is a mean; ``False``: a
        sum).
      tokens_seen: the tokens of all windows completed before the switch (a
        whole number up to ``2**48``), where the new wrapper's rules or
        statistics count tokens seen; ``None``: 0.

    Returns:
      A :class:`MaskedMultiStepsState` for ``tx``.

    Raises:
      TypeError: if ``state`` is not an ``optax.MultiStepsState``, ``tx`` not a
        :class:`MaskedMultiSteps`, ``acc_count`` not a real scalar, ``state``
        or ``acc_count`` holds ``jax.ShapeDtypeStruct`` leaves (a restore
        target),
        ``use_grad_mean`` not a bool, ``tokens_seen`` not a number, or the
        call is traced by ``jit``.
      ValueError: if ``tokens_seen`` is not a whole number in ``[0, 2**48]``;
        if ``acc_count`` is missing mid-window, nonzero at a window
        boundary, zero mid-window, negative, not finite, beyond the count
        dtype or fractional for an integer ``count_dtype``; if
        ``state.mini_step`` or ``state.gradient_step`` is not an integer in
        ``[0, 2**31 - 1]``; if the state's
        gradients, inner state or skip state do not match ``tx.init(params)``;
        or mid-window into a ``tx`` with ``reduction=mm.deferred(...)`` (its
        per-device accumulators start at a window's start).

    Examples:
      Two microbatches of 5 tokens each went to ``optax.MultiSteps``; the third
      goes to ``MaskedMultiSteps``, and the window ends as if it had been used
      from the start:

      >>> import jax.numpy as jnp
      >>> import optax
      >>> import masked_multistep as mm
      >>> params = {"w": jnp.zeros(2)}
      >>> old = optax.MultiSteps(optax.sgd(1.0), every_k_schedule=3)
      >>> old_state = old.init(params)
      >>> for g in (1.0, 2.0):
      ...     _, old_state = old.update({"w": jnp.full(2, g)}, old_state, params)
      >>> tx = mm.MaskedMultiSteps(optax.sgd(1.0), every_k_schedule=3)
      >>> state = mm.from_optax_multisteps(old_state, tx, params, acc_count=2 * 5)
      >>> params, state = tx.apply_gradients({"w": jnp.full(2, 6.0)}, state,
      ...                                    params, count=jnp.array(10))
      >>> print(params["w"])  # -(5·1 + 5·2 + 10·6) / 20
      [-3.75 -3.75]
    """
    if not isinstance(state, optax.MultiStepsState):
        hint = nested_hint(state, optax.MultiStepsState, "that element")
        if isinstance(state, MaskedMultiStepsState):
            hint = (
                ": it is already this library's state, no conversion needed "
                "(to change its settings, mm.from_other_settings)"
            )
        elif not hint and has_field_named(state, "acc_grads"):
            hint = (
                ": it holds the state's fields by name only, as a checkpoint "
                "restored without a target gives them; restore it against the "
                "old optimizer's state (`optax.MultiSteps(...).init(params)` as "
                "the target), then convert"
            )
        raise TypeError(
            "`state` must be an optax.MultiStepsState (the state of "
            f"optax.MultiSteps), got {type(state).__name__}{hint}"
        )
    if not isinstance(tx, MaskedMultiSteps):
        raise TypeError(
            f"`tx` must be a masked_multistep.MaskedMultiSteps, got {type(tx).__name__}"
        )
    refuse_restore_target(state, "`state`")
    refuse_restore_target(acc_count, "`acc_count`")
    use_grad_mean = check_flag(use_grad_mean, "`use_grad_mean`")
    # An NNX optimizer keeps its state in variables (`optimizer.opt_state`)
    # around the optax state of its params' arrays, and `nnx.state(model,
    # nnx.Param)` holds the params in variables of another type: where the
    # state holds arrays, theirs are what converts. (A plain loop's state of
    # `nnx.split` params holds their `nnx.Param` nodes, as `tx.init(params)`
    # does: those stay.)
    state = unboxed(state)
    if not holds_variables(state.acc_grads):
        params = unboxed_all(params)
    mini_step = _step_counter(state.mini_step, "state.mini_step")
    gradient_step = _step_counter(state.gradient_step, "state.gradient_step")
    count = _check_acc_count(acc_count, mini_step)
    seen = None if tokens_seen is None else token_total(tokens_seen, "`tokens_seen`")

    fresh = tx.init(params)
    params_hint = "`params` must be the params the optax.MultiSteps state was built for"
    if isinstance(tx._reduction, Deferred):
        # One running mean per device: optax.MultiSteps' single mean has no
        # per-device split, so only a window's start converts.
        if mini_step != 0:
            raise ValueError(
                "`tx` was built with reduction=mm.deferred(...), whose accumulator "
                "holds one running mean per device: convert at a window's start "
                f"(`state.mini_step` == 0), got mini_step {mini_step}"
            )
        _same_tree("acc_grads", state.acc_grads, params, params_hint)
    else:
        _same_tree("acc_grads", state.acc_grads, fresh.acc_grads, params_hint)
    _same_tree(
        "inner_opt_state",
        state.inner_opt_state,
        fresh.inner_opt_state,
        "build `tx` with the inner optimizer that optax.MultiSteps wrapped",
    )
    _same_tree(
        "skip_state",
        state.skip_state,
        fresh.skip_state,
        "build `tx` with the should_skip_update_fn that optax.MultiSteps used",
    )

    if mini_step == 0:
        # optax.MultiSteps zeroes its accumulator when a window ends; so is ours.
        acc_grads = fresh.acc_grads
        new_count = fresh.acc_count
    else:
        assert count is not None  # _check_acc_count requires it mid-window
        divisor = 1 if use_grad_mean else mini_step
        acc_grads = jax.tree.map(
            lambda a, f: (jnp.asarray(a, compute_dtype(a.dtype)) / divisor).astype(
                f.dtype
            ),
            state.acc_grads,
            fresh.acc_grads,
        )
        # The count contract of `tx.update(..., count=)`: refused, not wrapped
        # or rounded to inf, when the count dtype cannot hold it.
        new_count, _ = to_count(count.item(), fresh.acc_count.dtype, "`acc_count`")

    gradient_step = jnp.asarray(gradient_step, fresh.gradient_step.dtype)
    replacements = dict(
        mini_step=jnp.asarray(mini_step, fresh.mini_step.dtype),
        gradient_step=gradient_step,
        inner_opt_state=state.inner_opt_state,
        acc_grads=acc_grads,
        acc_count=new_count,
        skip_state=state.skip_state,
        # The statistics see the accumulated mean as one microbatch.
        stats=tx._recorder.accumulate(fresh.stats, acc_grads, new_count),
    )
    if "updated" in fresh._fields:
        # What optax.MultiSteps.has_updated would say of `state`.
        replacements["updated"] = jnp.asarray((mini_step == 0) & (gradient_step > 0))
    # Placed as `tx.init`'s state is (a sharded accumulator sharded, not whole
    # on every device; host arrays of a state read with flax.serialization on
    # the devices; new scalars on the params' mesh), so that the first jitted
    # step sees the shardings of every later one.
    state = fresh._replace(**replacements)
    if seen is not None:
        state = with_tokens_seen(state, seen)
    state = jax.tree.map(placed_like, state, fresh)
    return tx._reduction.place(state, params)
