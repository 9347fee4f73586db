"""Reading checkpoints written with an older state layout.

The fields of :class:`MaskedMultiStepsState` are part of the checkpoint format:
restoring a checkpoint of another layout against ``tx.init(params)`` fails in
orbax (or ``flax.serialization``) with an error that lists the fields it found
missing. A checkpoint of version 0.1 can still be read: restore its wrapper
state against :func:`state_0_1_target` and convert it with
:func:`from_state_0_1`; training then continues where it stopped.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, overload

import jax
import jax.numpy as jnp
import numpy as np

from masked_multistep import _by_name, _stats, _stats_state, _token_total
from masked_multistep._checks import (
    check_count_dtype,
    holds_abstract,
    nested_hint,
    refuse_restore_target,
    to_count,
    traced,
)
from masked_multistep._reduction import placed_like
from masked_multistep._state import MaskedMultiStepsState

__all__ = ["STATE_0_1_FIELDS", "from_state_0_1", "state_0_1_target"]

#: The fields of a version 0.1 ``MaskedMultiStepsState``, in order.
STATE_0_1_FIELDS = (
    "mini_step",
    "gradient_step",
    "inner_opt_state",
    "acc_grads",
    "acc_count",
    "acc_value",
    "updated",
    "num_invalid_counts",
    "skip_state",
)


def _check_template(template: Any) -> None:
    if not isinstance(template, MaskedMultiStepsState):
        hint = nested_hint(
            template, MaskedMultiStepsState, "that element (the wrapper's own state)"
        )
        raise TypeError(
            "`template` must be a MaskedMultiStepsState (from `tx.init(params)`, "
            "or an NNX optimizer's `nnx.state(optimizer)['opt_state']`), "
            f"got {type(template).__name__}{hint}"
        )


def same_layout(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` have one tree structure and shapes."""
    return jax.tree.structure(a) == jax.tree.structure(b) and all(
        np.shape(x) == np.shape(y)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def _container_types(tree: Any) -> set[type]:
    """The types of the pytree nodes in ``tree`` (``dict``, ``tuple``, an
    optax state's NamedTuple, ...)."""
    found: set[type] = set()

    def walk(treedef: Any) -> None:
        data = treedef.node_data()
        if data is not None:
            found.add(data[0])
        for child in treedef.children():
            walk(child)

    walk(jax.tree.structure(tree))
    return found


# What a checkpoint restored without a target is built of.
_PLAIN = {dict, list, type(None)}


def check_matches(what: str, got: Any, want: Any, hint: str) -> None:
    """Refuses a restored field ``got`` whose tree structure or shapes are not
    the template's ``want`` (``what`` names it; ``hint`` says what to do).

    Where ``got`` is built of plain dicts and lists alone and the template is
    not, the hint is to restore against a target first: that is what a
    checkpoint restored without one gives."""
    if not same_layout(got, want):
        got_types = _container_types(got)
        if got_types <= _PLAIN and not _container_types(want) <= _PLAIN:
            hint = (
                "it is built of plain dicts and lists where the template has "
                "tuples and optimizer states, as a checkpoint restored without "
                "a target gives it: restore against the target (orbax: "
                "`checkpointer.restore(path, target)`), then convert. Else, " + hint
            )
        raise ValueError(
            f"{what} does not match the template's (structure or shapes: got "
            f"{jax.tree.map(np.shape, got)}, template "
            f"{jax.tree.map(np.shape, want)}): {hint}"
        )


STEP_COUNTERS = (
    "mini_step",
    "gradient_step",
    "num_invalid_counts",
    "num_nonfinite_windows",
)


def check_counters(state: Any, where: str) -> None:
    """An error naming the first of ``state``'s step counters that is negative
    (``where.format(name)`` names it): one would stretch the next window
    (``mini_step`` -2 with k = 3 closes it after 5 microbatches). ``state``
    may be bare or as ``nnx.state`` holds it."""
    for name in STEP_COUNTERS:
        held = _by_name.array(_by_name.get(state, name))
        if np.ndim(held):
            raise ValueError(
                f"{where.format(name)} has shape {np.shape(held)}, not (): a "
                "batch of states (an ensemble built with jax.vmap) is converted "
                "one member at a time, each against its own template, e.g. "
                "`jax.tree.map(lambda x: x[i], state)` for each i, the results "
                "stacked with `jax.tree.map(lambda *xs: jnp.stack(xs), *members)`"
            )
        counter = int(held)
        if counter < 0:
            raise ValueError(
                f"{where.format(name)} must be an integer in [0, 2**31 - 1], got "
                f"{counter}"
            )


def check_stats_tallies(stats: Any, where: str) -> None:
    """An error naming the first of the window statistics' tallies that is
    negative (``where.format(name)`` names it): the open and the last window's
    microbatches, the windows closed, the squared norms' sums (a NaN or inf
    sum passes: a step makes one from a gradient not finite). A negative
    microbatch count flips the sign of the noise scale's estimates.
    ``stats`` may be bare or as ``nnx.state`` holds it."""
    bare = _by_name.bare_stats(stats)
    for path in (
        ("microbatches",),
        ("last", "microbatches"),
        ("last", "windows"),
        ("weighted_sq_norms",),
        ("leaves", "weighted_sq_norms"),
    ):
        field = bare
        for name in path:
            # An empty field (no per-leaf sums) holds nothing further down.
            field = () if field == () else getattr(field, name)
        for leaf in jax.tree.leaves(field):
            lowest = np.min(np.asarray(leaf), initial=0)
            if lowest < 0:
                name = ".".join(("stats", *path))
                raise ValueError(
                    f"{where.format(name)} must not be negative, got {lowest}"
                )


def _progress(node: Any) -> dict[str, int] | None:
    """A state's step counters, where they are concrete scalars (None for an
    abstract template, or a batch of states)."""
    counters = {}
    for name in ("gradient_step", "mini_step"):
        x = _by_name.array(_by_name.get(node, name))
        if isinstance(x, jax.Array):
            # (A replicated scalar: every process holds it whole.)
            x = x.addressable_data(0)
        elif not isinstance(x, (np.ndarray, np.generic, int)):
            return None
        if np.ndim(x):  # a batch of states: refused by its own check
            return None
        counters[name] = int(np.asarray(x))
    return counters


def refuse_swapped(state: Any, template: Any, name: str, usage: str) -> None:
    """An error where ``template`` holds a run in progress and ``state`` (the
    argument called ``name``) none: the two swapped, which would keep the
    fresh state's values (the running window and the inner optimizer's state
    lost without a word). ``usage`` says what the call does with which."""
    got, want = _progress(state), _progress(template)
    if got is None or want is None or any(got.values()) or not any(want.values()):
        return
    raise ValueError(
        "`template` holds a run in progress ("
        + ", ".join(f"{k}={v}" for k, v in want.items())
        + f") and `{name}` a state that has taken no step: are the arguments "
        f"swapped? {usage}"
    )


def like_template(where: str, got: Any, want: Any, hint: str = "") -> Any:
    """The restored field ``got`` in the dtypes of the template's ``want``
    (``where``: how the error names ``got``; ``hint`` ends it).

    As orbax does on restore (``flax.serialization`` keeps the saved dtypes, e.g.
    a 0.1 bfloat16 accumulator): floating leaves are cast, integer ones only
    when their values fit; a leaf of another kind is refused.
    """

    def leaf(g: Any, w: Any) -> Any:
        # A jax array keeps its placement (orbax restores onto the target's
        # sharding); anything else goes through numpy, as jnp.asarray would
        # narrow int64 to int32 before any check.
        if not isinstance(g, jax.Array):
            g = np.asarray(g)
        w_dtype = jnp.result_type(w)
        if g.dtype != w_dtype:
            kinds = (jnp.inexact, jnp.integer, jnp.bool_)
            same_kind = any(
                jnp.issubdtype(g.dtype, k) and jnp.issubdtype(w_dtype, k) for k in kinds
            )
            # By value: a cast there and back keeps the bits of another
            # signedness (3e9 as int32 is -1294967296).
            outside = None
            if same_kind and jnp.issubdtype(w_dtype, jnp.integer) and g.size:
                info = jnp.iinfo(w_dtype)
                lo, hi = int(g.min()), int(g.max())
                outside = lo if lo < info.min else hi if hi > info.max else None
            if not same_kind or outside is not None:
                raise ValueError(
                    f"{where} holds dtype {g.dtype} where the template "
                    f"has {w_dtype}"
                    + (
                        ""
                        if not same_kind
                        else f", and values that do not fit it: {outside}"
                    )
                    + hint
                )
            g = g.astype(w_dtype)
        return jnp.asarray(g)

    return jax.tree.map(leaf, got, want)


def host_count(count: Any, count_dtype: Any, what: str) -> jax.Array:
    """A token total read from a state (``what`` names it), in
    ``count_dtype``, by the count contract.

    As a Python number: a whole float total (0.1 could count in float) then
    converts into integer counts, a fractional one is refused."""
    converted, _ = to_count(np.asarray(count).item(), count_dtype, what)
    return converted


@overload
def state_0_1_target(
    template: MaskedMultiStepsState, *, count_dtype: jax.typing.DTypeLike | None = None
) -> dict[str, Any]: ...
@overload
def state_0_1_target(
    template: Any, *, count_dtype: jax.typing.DTypeLike | None = None
) -> Any: ...
def state_0_1_target(
    template: Any, *, count_dtype: jax.typing.DTypeLike | None = None
) -> Any:
    """The tree to restore a version 0.1 wrapper state into.

    Args:
      template: a state of the current layout, ``tx.init(params)`` (or its
        abstract form), for the same inner optimizer and parameters; or, for
        an ``nnx.Optimizer``, ``nnx.state(optimizer)["opt_state"]`` (or its
        abstract form): the result is then an ``nnx.State`` of the 0.1 fields
        it holds (its empty ones left out, as in a 0.1 checkpoint of it), to
        put in place of ``"opt_state"`` in the restore target.
      count_dtype: the ``count_dtype`` the 0.1 run counted tokens in (0.1's
        default was ``int32``), where it differs from the template's. Orbax
        casts each restored leaf to the target's dtype: a fractional float
        total restored as an integer would be truncated (0.5 to 0, dropping
        the pending gradient) before :func:`from_state_0_1` could refuse it.
        ``None``: the template's count dtype.

    Returns:
      A ``dict`` keyed by the 0.1 field names, with the template's values (the
      token total in ``count_dtype``): pass it (through
      ``ocp.utils.to_shape_dtype_struct`` for orbax) where the state sits in
      the restore target. :func:`from_state_0_1` then converts the total to
      the template's count dtype by the count contract.

    Raises:
      TypeError: if ``template`` is not a wrapper's state, or ``count_dtype``
        not a dtype.
      ValueError: if ``count_dtype`` cannot count tokens (as the wrapper's
        ``count_dtype``: float32, float64, int32 or int64).

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import masked_multistep as mm
      >>> tx = mm.MaskedMultiSteps(optax.sgd(1.0), 2)
      >>> target = mm.state_0_1_target(tx.init(jnp.zeros(3)))
      >>> tuple(target) == mm.STATE_0_1_FIELDS
      True
    """
    if _by_name.is_named(template):
        fields = {k: v for k, v in template.items() if k in STATE_0_1_FIELDS}
        target = state_0_1_target(_by_name.bare(template), count_dtype=count_dtype)
        return _by_name.named(target, type(template)(fields))
    _check_template(template)
    target = {name: getattr(template, name) for name in STATE_0_1_FIELDS}
    if count_dtype is not None:
        dtype = jax.dtypes.canonicalize_dtype(check_count_dtype(count_dtype))
        like = template.acc_count
        if isinstance(like, jax.ShapeDtypeStruct):
            target["acc_count"] = jax.ShapeDtypeStruct(
                like.shape, dtype, sharding=like.sharding
            )
        else:
            target["acc_count"] = placed_like(np.zeros(jnp.shape(like), dtype), like)
    return target


@overload
def from_state_0_1(
    restored: Mapping[str, Any],
    template: MaskedMultiStepsState,
    *,
    tokens_seen: jax.typing.ArrayLike | None = None,
) -> MaskedMultiStepsState: ...
@overload
def from_state_0_1(
    restored: Mapping[str, Any],
    template: Any,
    *,
    tokens_seen: jax.typing.ArrayLike | None = None,
) -> Any: ...
def from_state_0_1(
    restored: Mapping[str, Any],
    template: Any,
    *,
    tokens_seen: jax.typing.ArrayLike | None = None,
) -> Any:
    """A version 0.1 wrapper state, restored as a ``dict``, in the current layout.

    The fields 0.1 had keep their restored values (the pending window included),
    in the template's dtypes (as orbax restores them; ``flax.serialization``
    keeps the saved ones); the fields added since take the template's initial
    values. In 0.1 the window's ``value`` mean was weighted by the window's whole
    token total (a microbatch that passed none left the mean as it was, its
    tokens counted all the same), so its weight total ``value_count`` is the
    window's token total where the restored ``acc_value`` is not zero, and zero
    (no value passed) where it is. With window statistics, the pending window's
    mean counts as one microbatch of its tokens (0.1 kept no statistics).

    Args:
      restored: the restored 0.1 state: a mapping with exactly the keys of
        :data:`STATE_0_1_FIELDS`, e.g. restored against
        :func:`state_0_1_target` (or a NamedTuple of those fields).
      template: ``tx.init(params)`` for the same inner optimizer and parameters;
        or, for an ``nnx.Optimizer``, ``nnx.state(optimizer)["opt_state"]``,
        with ``restored`` the ``"opt_state"`` restored against
        :func:`state_0_1_target` of it: the result is then an ``nnx.State``
        like it, to put in place of ``"opt_state"`` in the restored optimizer
        state before ``nnx.update(optimizer, ...)``.
      tokens_seen: the tokens of all windows the 0.1 run completed (0.1 kept
        no such count), for a token budget that is a function of the tokens
        seen and the statistics' ``tokens_seen``; ``None``: 0.

    Returns:
      A :class:`MaskedMultiStepsState` that continues the 0.1 run (held by
      name as ``template`` is, for an NNX one).

    Raises:
      TypeError: if ``template`` is not a concrete state (``tx.init(params)``,
        not its abstract form), ``restored`` not a mapping or one of
        ``jax.ShapeDtypeStruct`` leaves (the restore target, not what the
        restore returns), ``tokens_seen`` not a number, or the call is traced
        by ``jit``.
      ValueError: if ``tokens_seen`` is not a whole number in ``[0, 2**48]``;
        if ``restored`` does not have the 0.1 fields, or their
        structure or shapes differ from ``template``'s; if a field holds
        integers where the template has floats (or the reverse), or integers
        its dtype cannot hold; if a step counter (``mini_step``,
        ``gradient_step``, ``num_invalid_counts``) is negative; if the token
        total is negative, not finite,
        beyond the count dtype or fractional for an integer ``count_dtype``.

    Examples:
      >>> import jax, jax.numpy as jnp, optax
      >>> import masked_multistep as mm
      >>> tx = mm.MaskedMultiSteps(optax.sgd(1.0), every_k_schedule=2)
      >>> params = {"w": jnp.zeros(())}
      >>> template = tx.init(params)
      >>> old = mm.state_0_1_target(template)   # stands for a restored checkpoint
      >>> old = {**old, "mini_step": jnp.int32(1), "acc_count": jnp.float32(3),
      ...        "acc_grads": {"w": jnp.float32(2.0)}}
      >>> state = mm.from_state_0_1(old, template)
      >>> updates, state = tx.update({"w": jnp.float32(6.0)}, state, params,
      ...                            count=jnp.float32(1))
      >>> print(updates["w"])  # (3·2 + 1·6) / 4
      -3.0
    """
    if _by_name.is_named(template):
        if "value_count" not in template:  # which this version's state always has
            raise TypeError(
                "`template` must be this version's state (`tx.init(params)`, or an "
                "NNX optimizer's `nnx.state(optimizer)['opt_state']`), got a "
                f"mapping of the fields {sorted(template)}: a 0.1 state's? That "
                "one is `restored`"
            )
        if isinstance(restored, Mapping):
            # The 0.1 fields the template leaves out are empty, as they were
            # in the 0.1 checkpoint of it.
            empty = {name: () for name in STATE_0_1_FIELDS if name not in template}
            restored = {**empty, **{k: _by_name.plain(v) for k, v in restored.items()}}
        state = from_state_0_1(
            restored, _by_name.bare(template), tokens_seen=tokens_seen
        )
        return _by_name.named(state, template)
    _check_template(template)
    if holds_abstract(template):
        raise TypeError(
            "`template` must be the concrete state `tx.init(params)`, got one with "
            "ShapeDtypeStruct leaves (the abstract form is for `state_0_1_target`)"
        )
    if isinstance(restored, MaskedMultiStepsState):
        raise TypeError(
            "`restored` is already a MaskedMultiStepsState of this version: use "
            "it as it is (no conversion needed)"
        )
    if not isinstance(restored, Mapping) and hasattr(restored, "_asdict"):
        # The 0.1 state as a NamedTuple of its fields (flax.serialization
        # restores into the target's type).
        restored = restored._asdict()
    if not isinstance(restored, Mapping):
        raise TypeError(
            "`restored` must be the 0.1 state as a mapping of its fields (restore "
            f"it against `state_0_1_target(template)`), got {type(restored).__name__}"
        )
    refuse_restore_target(dict(restored), "`restored`")
    if traced((dict(restored), template)):
        raise TypeError(
            "from_state_0_1 reads the restored values to check them (token "
            "total, step counters), so it must be called eagerly (outside jit), "
            "once, after restoring"
        )
    if set(restored) != set(STATE_0_1_FIELDS):
        raise ValueError(
            "`restored` is not a masked_multistep 0.1 state: expected the fields "
            f"{sorted(STATE_0_1_FIELDS)}, got {sorted(map(str, restored))}"
        )
    for name in STATE_0_1_FIELDS:
        check_matches(
            f"`restored[{name!r}]`",
            restored[name],
            getattr(template, name),
            "the template must come from `tx.init(params)` of a wrapper like the "
            "0.1 one, on the same params (0.1 had no reduction=mm.deferred(...))",
        )
    state = template._replace(
        **{
            name: like_template(
                f"`restored[{name!r}]`", restored[name], getattr(template, name)
            )
            for name in STATE_0_1_FIELDS
            if name != "acc_count"
        }
    )
    check_counters(state, "`restored[{!r}]`")
    acc_count = host_count(
        restored["acc_count"], template.acc_count.dtype, "`restored['acc_count']`"
    )
    value_count = jnp.where(state.acc_value != 0, acc_count, jnp.zeros_like(acc_count))
    stats = state.stats
    if isinstance(stats, _stats_state.WindowStatsState):
        # 0.1 kept no statistics: the pending window's mean counts as one
        # microbatch of its tokens.
        stats = _stats.accumulate_window_stats(stats, state.acc_grads, acc_count)
    state = state._replace(acc_count=acc_count, value_count=value_count, stats=stats)
    if tokens_seen is not None:
        state = _token_total.with_tokens_seen(
            state, _token_total.token_total(tokens_seen, "`tokens_seen`")
        )
    # Where the template's leaves are (`init` places its scalars as a step
    # returns them): the counts built here would otherwise sit uncommitted on
    # one device, and the first step compile twice.
    return jax.tree.map(placed_like, state, template)
