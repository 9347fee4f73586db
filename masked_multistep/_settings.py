"""A running wrapper's state, continued by a wrapper with other settings."""

from __future__ import annotations

from typing import Any, overload

import jax
import jax.numpy as jnp

from masked_multistep import _by_name, _stats, _stats_state
from masked_multistep._checkpoint import (
    _check_template,
    check_counters,
    check_matches,
    check_stats_tallies,
    host_count,
    like_template,
    refuse_swapped,
    same_layout,
)
from masked_multistep._checks import (
    holds_abstract,
    refuse_restore_target,
    traced,
    training_state_kind,
)
from masked_multistep._inspect import (
    find_boxed,
    has_deferred_reduction,
    holds_optimizer_boxes,
    holds_variables,
    unboxed,
    unboxed_all,
)
from masked_multistep._reduction import placed_like
from masked_multistep._state import MaskedMultiStepsState
from masked_multistep._token_total import TokenTotal, token_total, with_tokens_seen

__all__ = ["from_other_settings"]

# What every wrapper around the same inner optimizer, for the same params,
# holds alike, whatever its window rule, statistics or skip function.
_CARRIED = (
    "mini_step",
    "gradient_step",
    "inner_opt_state",
    "acc_grads",
    "acc_value",
    "updated",
    "num_invalid_counts",
    "num_nonfinite_windows",
)


@overload
def from_other_settings(
    state: Any, template: MaskedMultiStepsState, *, tokens_seen: Any = None
) -> MaskedMultiStepsState: ...
@overload
def from_other_settings(
    state: Any, template: Any, *, tokens_seen: Any = None
) -> Any: ...
def from_other_settings(state: Any, template: Any, *, tokens_seen: Any = None) -> Any:
    """``state`` of a running :class:`MaskedMultiSteps`, continued by one with
    other settings: another ``k`` or schedule, a token budget or the norm
    test, the window statistics turned on or off, another ``count_dtype`` (the
    token totals convert by value: a fractional one is refused for an integer
    dtype, and an integer one beyond 2**24 rounds to float32).

    The window in progress carries over (its mean gradient, tokens, mean
    ``value`` and microbatches, which count toward the new rule: a window
    already past its new ``k`` or budget closes on the next microbatch), and
    so do the inner optimizer's state (hyperparameters that
    ``optax.inject_hyperparams`` keeps in it included: an injected constant
    learning rate is the old one, not the template's, and
    ``optax.tree.set(state, learning_rate=...)`` after converting changes it;
    an injected schedule is the template's, at the carried step count) and
    the step counters. The statistics
    carry over where the template keeps the same ones; else they start
    afresh (``windows`` from 0, no last window to read), the pending window's
    mean counting as one microbatch of its tokens (as
    :func:`from_optax_multisteps` counts it). The tokens seen (for a budget
    that is a function of them, and the statistics' ``tokens_seen``) are
    ``state``'s where it kept them, else
    ``tokens_seen``, else 0. A skip function's state, and a custom window
    policy's (:class:`WindowPolicy`), carry over where they have the
    template's layout, else they start afresh.

    Args:
      state: the running wrapper's state, or a tree holding it (an
        ``optax.chain`` state, ``mm.TrainState``, ``optimizer.opt_state``),
        or an NNX optimizer's ``nnx.state(optimizer)["opt_state"]``.
      template: ``tx.init(params)`` of the wrapper that continues (the same
        inner optimizer, for the same params): the ``MaskedMultiStepsState``
        itself, or the state of an optimizer that holds it (an
        ``optax.chain``'s, ``optax.multi_transform``'s; given the same way as
        ``state``, which must hold the running one at the same place); or,
        for an ``nnx.Optimizer`` built with it,
        ``nnx.state(new_optimizer)["opt_state"]``, and the result is an
        ``nnx.State`` like it, to put in place of ``"opt_state"`` in
        ``nnx.state(optimizer)`` (the running optimizer's: its ``step`` carries
        over too) before ``nnx.update(new_optimizer, ...)``.
        Where ``state`` is an ``optimizer.opt_state`` (or holds arrays where
        the params are NNX variables), ``tx.init(nnx.state(model, nnx.Param))``
        or ``new_optimizer.opt_state`` serves; the result, in that template's
        layout, loads with ``nnx.update(new_optimizer.opt_state,
        nnx.state(result))``.
      tokens_seen: the tokens of all completed windows, where ``state`` kept
        no count of them (a whole number in ``[0, 2**48]``); it overrides
        ``state``'s when given.

    Returns:
      A state of ``template``'s layout, placement and dtypes (for a template
      that holds the wrapper's state, ``state``'s tree with the wrapper's
      part converted: its other elements' states as they ran, which must
      have the template's structure, shapes and dtypes).

    Raises:
      TypeError: if ``template`` neither is nor holds one
        ``MaskedMultiStepsState``; if one of ``state`` and ``template`` is an
        NNX optimizer's state by name and the other not (or, holding the
        wrapper's state, one is in an ``nnx.Optimizer``'s variables and the
        other not); if ``template`` holds it and ``state`` is an
        ``mm.TrainState`` (pass its ``opt_state``); if ``state`` holds
        ``jax.ShapeDtypeStruct`` leaves, or
        ``template`` does where ``state`` carries nothing over (a token
        budget's tokens seen, statistics of another kind, a skip function's
        state); if ``tokens_seen`` is not a number; or if the call is traced
        by ``jit`` (the counts are read and checked).
      ValueError: if ``tokens_seen`` is not a whole number in ``[0, 2**48]``;
        if ``state`` holds no wrapper state (or several); if ``template``
        holds it elsewhere than ``state`` does, or differs from ``state``
        outside it in structure, shapes or dtypes; if
        ``template`` holds a run in progress and ``state`` a state that has
        taken no step (the arguments swapped); if either
        has ``reduction=mm.deferred(...)`` (move the window onto one device
        first with :func:`from_device_count`); if the inner optimizer's state
        or the accumulator differ from the template's in structure or shapes,
        or a field's values do not fit the template's dtypes (a token total
        beyond an integer ``count_dtype``, a fractional one for it), or a step
        counter (``mini_step``, ``gradient_step``, ``num_invalid_counts``,
        ``num_nonfinite_windows``) is negative, or, where the statistics carry
        over, one of their tallies is (the open or last window's microbatches,
        the windows closed, a squared norms' sum).

    Examples:
      Halfway through a window of 4, switch to windows of 10 tokens:

      >>> import jax.numpy as jnp, optax
      >>> import masked_multistep as mm
      >>> params = {"w": jnp.zeros(())}
      >>> old = mm.MaskedMultiSteps(optax.sgd(1.0), 4)
      >>> state = old.init(params)
      >>> for g, n in [(1.0, 3), (2.0, 3)]:
      ...     _, state = old.update({"w": jnp.array(g)}, state, params,
      ...                           count=jnp.array(n))
      >>> new = mm.MaskedMultiSteps(optax.sgd(1.0), tokens_per_window=10)
      >>> state = mm.from_other_settings(state, new.init(params))
      >>> updates, state = new.update({"w": jnp.array(6.0)}, state, params,
      ...                             count=jnp.array(4))
      >>> print(updates["w"])  # -(3·1 + 3·2 + 4·6) / 10, the window at 10 tokens
      -3.3
    """
    if _by_name.is_named(template):
        if not _by_name.is_named(state):
            raise TypeError(
                "`template` is an NNX optimizer's state by name "
                "(`nnx.state(new_optimizer)['opt_state']`): pass the running "
                "optimizer's the same way, `nnx.state(optimizer)['opt_state']`, "
                f"got {type(state).__name__}"
            )
        converted = _carried_over(state, _by_name.bare(template), tokens_seen)
        return _by_name.named(converted, template)
    if _by_name.is_named(state) and not isinstance(state, dict):
        # (An `nnx.State`; a plain dict is a checkpoint restored without a
        # target, which `refuse_restore_target` names.)
        raise TypeError(
            "`state` is an NNX optimizer's state by name "
            "(`nnx.state(optimizer)['opt_state']`): pass the new optimizer's the "
            "same way as the template, `nnx.state(new_optimizer)['opt_state']` "
            "(or `optimizer.opt_state` as the state); `template` is a "
            f"{type(template).__name__}"
        )
    if not _is_wrapper_state(template):
        found = _wrapper_states(template)
        if len(found) == 1:
            return _in_holder(state, template, found[0], tokens_seen)
    return _carried_over(state, template, tokens_seen)


def _is_wrapper_state(x: Any) -> bool:
    """Whether ``x`` is the wrapper's state, bare or held by name."""
    return isinstance(x, MaskedMultiStepsState) or _by_name.is_named(x)


def _wrapper_states(tree: Any) -> list[tuple[Any, Any]]:
    """``(path, node)`` of the wrapper's states in ``tree``, bare or by name."""
    found = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_wrapper_state)[0]
    return [(path, x) for path, x in found if _is_wrapper_state(x)]


def _in_holder(
    state: Any, template: Any, found: tuple[Any, Any], tokens_seen: Any
) -> Any:
    """:func:`from_other_settings` onto a ``template`` that holds the new
    wrapper's state (an ``optax.chain``'s or ``optax.inject_hyperparams``'
    state, bare or as ``nnx.state`` holds it; ``found`` its path and node):
    ``state``'s tree with its wrapper's state converted. Every other
    element's state is ``state``'s own (they carry the run: a schedule's
    count, an average), which must have the template's layout."""
    path, inner = found
    if training_state_kind(state) is not None:
        fix = (
            "both `opt_state`s, `mm.from_other_settings(state.opt_state, "
            "new_state.opt_state)`"
            if training_state_kind(template) is not None
            else "its `opt_state`, `mm.from_other_settings(state.opt_state, "
            "new_tx.init(params))`"
        )
        raise TypeError(
            f"`state` is a {type(state).__name__}, which holds the optimizer "
            f"state: pass {fix}"
        )
    held = _wrapper_states(state)
    if len(held) == 1 and _by_name.is_named(held[0][1]) != _by_name.is_named(inner):
        by_name, bare = ("`state`", "`template`")
        if _by_name.is_named(inner):
            by_name, bare = bare, by_name
        raise TypeError(
            f"{by_name} holds the wrapper's state by name (as "
            f"`nnx.state(optimizer)['opt_state']` does) and {bare} bare: pass "
            "both the same way, `nnx.state(optimizer)['opt_state']` and "
            "`nnx.state(new_optimizer)['opt_state']`, or `optimizer.opt_state` "
            "and `new_optimizer.opt_state`"
        )
    if [p for p, _ in held] != [path]:
        at = [jax.tree_util.keystr(p) or "the root" for p, _ in held] or ["nowhere"]
        raise ValueError(
            "`template` holds the wrapper's state at "
            f"{jax.tree_util.keystr(path) or 'the root'}, `state` at "
            f"{', '.join(at)}: pass the running optimizer's state and "
            "`new_tx.init(params)` of one structure (an optimizer that differs "
            "in the wrapper's settings only)"
        )
    if holds_optimizer_boxes(state) != holds_optimizer_boxes(template):
        raise TypeError(
            "one of `state` and `template` holds an nnx.Optimizer's variables "
            "(`optimizer.opt_state`) and the other not: where the wrapper sits "
            "in a chain, pass the new optimizer's the same way, "
            "`new_optimizer.opt_state` (or both by name, "
            "`nnx.state(optimizer)['opt_state']`)"
        )
    converted = from_other_settings(held[0][1], inner, tokens_seen=tokens_seen)
    outside, wanted = _replaced(state, None), _replaced(template, None)
    hint = (
        "the other elements' states carry over as they ran, so the new "
        "optimizer may differ from the running one in the wrapper's settings "
        "only (else convert the wrapper's element alone and build the rest)"
    )
    where = f"`state` outside the wrapper's state at {jax.tree_util.keystr(path)}"
    check_matches(where, outside, wanted, hint)
    for (leaf_path, got), want in zip(
        jax.tree_util.tree_leaves_with_path(outside),
        jax.tree.leaves(wanted),
        strict=True,
    ):
        if jnp.result_type(got) != jnp.result_type(want):
            raise ValueError(
                f"`state{jax.tree_util.keystr(leaf_path)}` has dtype "
                f"{jnp.result_type(got)} where the template has "
                f"{jnp.result_type(want)}: {hint}"
            )
    return _replaced(state, converted)


def _replaced(tree: Any, new: Any) -> Any:
    """``tree`` (new containers) with its wrapper's state replaced by ``new``."""
    return jax.tree.map(
        lambda x: new if _is_wrapper_state(x) else x, tree, is_leaf=_is_wrapper_state
    )


def _carried_over(state: Any, template: Any, tokens_seen: Any) -> Any:
    """:func:`from_other_settings` onto a template not by name (``state`` by
    name only where the template given was)."""
    _check_template(template)
    given = template
    if _by_name.is_named(state):
        old = _by_name.bare(state)
    else:
        old = unboxed(find_boxed(state, "`state`"))
        # `optimizer.opt_state` (or a state restored as arrays) holds the optax
        # state of the params' arrays: so does the template built from its
        # params (`nnx.state(model, nnx.Param)`, whose variables hold them) or
        # taken from the new optimizer's `opt_state`. A plain loop's state of
        # `nnx.split` params keeps their `nnx.Param` nodes, as its template.
        template = (
            unboxed(template)
            if holds_variables(old.acc_grads)
            else unboxed_all(template)
        )
    refuse_restore_target(old, "`state`")
    if traced((old, template)):
        raise TypeError(
            "from_other_settings reads the state's counts to check them, so it "
            "must be called eagerly (outside jit), once, when switching"
        )
    refuse_swapped(
        old,
        template,
        "state",
        "from_other_settings(state, template) carries `state`'s run over to "
        "`template`'s settings: pass the running state first, and "
        "`new_tx.init(params)` (for an nnx.Optimizer, "
        "`nnx.state(new_optimizer)['opt_state']`) as the template",
    )
    for what, s in (("`state`", old), ("`template`", template)):
        if has_deferred_reduction(s):
            raise ValueError(
                f"{what} has reduction=mm.deferred(...) (one running mean per "
                "device): move the window onto one device first, with "
                "mm.from_device_count(state, template_without_reduction), "
                "convert, and back with mm.from_device_count if need be"
            )
    hint = (
        "the template must come from `tx.init(params)` of a wrapper around the "
        "same inner optimizer, for the same params"
    )
    for name in _CARRIED:
        check_matches(
            f"`state.{name}`", getattr(old, name), getattr(template, name), hint
        )
    new = template._replace(
        **{
            name: like_template(
                f"`state.{name}`", getattr(old, name), getattr(template, name)
            )
            for name in _CARRIED
        }
    )
    check_counters(new, "`state.{}`")
    dtype = template.acc_count.dtype
    acc_count = host_count(old.acc_count, dtype, "`state.acc_count`")
    value_count = host_count(old.value_count, dtype, "`state.value_count`")
    new = new._replace(acc_count=acc_count, value_count=value_count)
    if same_layout(old.skip_state, template.skip_state):
        new = new._replace(
            skip_state=like_template(
                "`state.skip_state`", old.skip_state, template.skip_state
            )
        )
    if same_layout(old.policy_state, template.policy_state):
        # A custom window policy's state (a budget's tokens seen are set
        # below, to `state`'s or `tokens_seen`).
        new = new._replace(
            policy_state=like_template(
                "`state.policy_state`", old.policy_state, template.policy_state
            )
        )
    if isinstance(template.stats, _stats_state.WindowStatsState):
        if same_layout(old.stats, template.stats):
            check_stats_tallies(old.stats, "`state.{}`")
            # The last window's token totals, in the count dtype, convert as
            # the window's own do (a fractional total refused for integers;
            # an int32 total beyond 2**24 rounded to float32).
            last = old.stats.last._replace(
                tokens=host_count(
                    old.stats.last.tokens, dtype, "`state.stats.last.tokens`"
                ),
                loss_tokens=host_count(
                    old.stats.last.loss_tokens, dtype, "`state.stats.last.loss_tokens`"
                ),
            )
            stats = like_template(
                "`state.stats`", old.stats.replaced(last=last), template.stats
            )
        else:
            # Not the template's statistics: the pending window's mean counts
            # as one microbatch of its tokens.
            _refuse_abstract(template, ("stats",))
            stats = _stats.accumulate_window_stats(
                template.stats, new.acc_grads, acc_count
            )
        new = new._replace(stats=stats)
    seen = _tokens_seen_of(old)
    if tokens_seen is not None:
        seen = token_total(tokens_seen, "`tokens_seen`")
    if seen is not None:
        new = with_tokens_seen(new, seen)
    _refuse_abstract(new, new._fields)
    # Placed as the template's leaves are, so that the first jitted step sees
    # the shardings of every later one; an abstract template places nothing,
    # and the counts made on the host go where the running state's are.
    new = jax.tree.map(placed_like, new, template)
    new = new._replace(
        acc_count=placed_like(new.acc_count, old.acc_count),
        value_count=placed_like(new.value_count, old.value_count),
    )
    if template is not given:
        # In the layout of the template as given: its NNX variables (an
        # `nnx.Optimizer`'s boxes, or the `nnx.Param` nodes of a state built
        # from `nnx.state(model, nnx.Param)`) hold the converted arrays.
        leaves = jax.tree.leaves(new)
        if len(leaves) == len(jax.tree.leaves(given)):
            new = jax.tree.unflatten(jax.tree.structure(given), leaves)
    return new


def _refuse_abstract(state: Any, fields: tuple[str, ...]) -> None:
    """A ``TypeError`` naming the fields of ``state`` (the template's, or the
    result taken from it) that hold ``jax.ShapeDtypeStruct`` leaves: values
    the running state does not carry over, which an abstract template
    (``jax.eval_shape(tx.init, params)``) cannot give."""
    abstract = [name for name in fields if holds_abstract(getattr(state, name))]
    if abstract:
        raise TypeError(
            "`template` holds jax.ShapeDtypeStruct leaves in "
            f"{', '.join(f'`{name}`' for name in abstract)}, which `state` does "
            "not carry over: pass the concrete state `new_tx.init(params)` (or "
            "an NNX optimizer's, by name). An abstract template serves where "
            "`state` carries every field"
        )


def _tokens_seen_of(state: Any) -> TokenTotal | None:
    """The tokens seen that ``state`` kept (its statistics', or its token
    budget's), or ``None``."""
    if isinstance(state.stats, _stats_state.WindowStatsState):
        return state.stats.last.tokens_seen
    found = []
    jax.tree.map(
        lambda x: found.append(x) if isinstance(x, TokenTotal) else None,
        state.policy_state,
        is_leaf=lambda x: isinstance(x, TokenTotal),
    )
    return found[0] if found else None
