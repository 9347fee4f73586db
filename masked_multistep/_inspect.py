"""Reading the wrapper's state wherever it sits in an optimizer state."""

from __future__ import annotations

import sys
from typing import Any, Literal, TypeVar, overload

import jax
import optax

from masked_multistep._checks import (
    check_flag,
    check_takes_one,
    instances_in,
    refuse_restore_target,
    training_state_kind,
)
from masked_multistep._state import (
    MaskedMultiStepsState,
    has_field_named,
    states_in,
)
from masked_multistep._stats import read_leaf_stats, read_window_stats
from masked_multistep._stats_state import (
    LeafSums,
    WindowStats,
    WindowStatsState,
    each_leaf,
    with_groups,
)

__all__ = ["find_state", "window_stats", "has_updated"]


_T = TypeVar("_T")


def _is_variable(x: Any) -> bool:
    # flax NNX variables hold their array behind ``get_value``; flax is
    # optional, so no isinstance check.
    return not isinstance(x, jax.Array) and callable(getattr(x, "get_value", None))


def _is_optimizer_box(x: Any) -> bool:
    # The variables an `nnx.Optimizer` wraps each leaf of its optax state in
    # (``optimizer.opt_state``): flax's `nnx.OptState` and its subclasses. Other
    # variables, such as the `nnx.Param` nodes of a state that a plain loop
    # built from `nnx.split` params, are part of the state's tree and stay.
    nnx = sys.modules.get("flax.nnx")  # (no flax imported: no such variable)
    box = getattr(nnx, "OptState", None)
    return box is not None and isinstance(x, box)


def unboxed(tree: _T) -> _T:
    """``tree`` with each of an NNX optimizer's variables (``nnx.OptState``)
    replaced by the array it holds; other NNX variables stay. ``tree`` itself
    where it holds none (a state found is the state, not a copy of it)."""
    if not holds_optimizer_boxes(tree):
        return tree
    return jax.tree.map(
        lambda x: x.get_value() if _is_optimizer_box(x) else x,
        tree,
        is_leaf=_is_optimizer_box,
    )


def holds_optimizer_boxes(tree: Any) -> bool:
    """Whether ``tree`` holds an NNX optimizer's variables (``nnx.OptState``)."""
    return "flax.nnx" in sys.modules and any(
        map(_is_optimizer_box, jax.tree.leaves(tree, is_leaf=_is_optimizer_box))
    )


def holds_variables(tree: Any) -> bool:
    """Whether ``tree`` holds NNX variables of any kind."""
    return any(_is_variable(x) for x in jax.tree.leaves(tree, is_leaf=_is_variable))


def unboxed_all(tree: _T) -> _T:
    """``tree`` with each NNX variable of any kind replaced by its array."""
    return jax.tree.map(
        lambda x: x.get_value() if _is_variable(x) else x, tree, is_leaf=_is_variable
    )


def find_state(opt_state: Any) -> MaskedMultiStepsState:
    """The one :class:`MaskedMultiStepsState` inside ``opt_state``: the node
    itself (what is changed in it, such as an injected hyperparameter's
    entry in ``inner_opt_state.hyperparams``, is changed in ``opt_state``),
    but for an NNX optimizer's ``opt_state``, whose variables it unwraps into
    a new tree (change those through the optimizer, or with
    ``optax.tree.set``).

    Looks through any pytree: a bare state, ``optax.chain``,
    ``optax.inject_hyperparams``, ``optax.multi_transform`` and ``optax.masked``
    states, a ``mm.TrainState`` (its ``opt_state``), a flax NNX optimizer's
    ``opt_state`` (its ``nnx.OptState`` variables are unwrapped to arrays;
    other variables, as in a plain loop's state of ``nnx.split`` params, stay).

    Raises:
      ValueError: if ``opt_state`` holds no such state, or more than one (pass
        the part of the state that holds the one you mean).
      TypeError: if the state holds ``jax.ShapeDtypeStruct`` leaves (a restore
        target, ``jax.eval_shape(tx.init, params)``), not arrays.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import masked_multistep as mm
      >>> tx = optax.chain(mm.MaskedMultiSteps(optax.sgd(0.1), 2),
      ...                  optax.scale(0.5))
      >>> state = tx.init(jnp.zeros(3))
      >>> int(mm.find_state(state).mini_step)
      0
    """
    return unboxed(find_boxed(opt_state))


def find_boxed(opt_state: Any, what: str = "`opt_state`") -> MaskedMultiStepsState:
    """:func:`find_state` without unwrapping NNX variables: a reader of a
    field or two unwraps those (unwrapping the whole state maps over every
    parameter leaf, milliseconds per call for thousands of leaves). ``what``
    names ``opt_state`` in the error of an abstract state."""
    holder = opt_state
    if training_state_kind(opt_state) is not None:
        # A TrainState or an NNX optimizer: the optax state is its `opt_state`
        # (its params need not be searched).
        opt_state = opt_state.opt_state
    found = states_in(opt_state, MaskedMultiStepsState)
    if not found and hasattr(opt_state, "opt_state"):
        # Other holders with an `opt_state` field are searched whole first
        # (optax.contrib.sam's state keeps one beside its `adv_state`); one
        # that is no pytree (a trainer object of the user's) by its field.
        opt_state = opt_state.opt_state
        found = states_in(opt_state, MaskedMultiStepsState)
    if len(found) != 1:
        hint = ""
        if found:
            where = "state" if holder is opt_state else "state.opt_state"
            paths = [f"`{path}`" for path in state_paths(opt_state, where)]
            hint = f" (at {', '.join(paths)}): pass the one you mean."
            if not states_in(opt_state, optax.PartitionState):
                # (One wrapper per optax.multi_transform branch is right.)
                hint += (
                    " (Two wrappers one after the other in an optax.chain "
                    "would be a mistake: the second would average the first's "
                    "in-window zeros as microbatches; chain the transformations "
                    "inside one wrapper.)"
                )
        elif states_in(opt_state, optax.MultiStepsState):
            hint = (
                ": it holds an optax.MultiStepsState; convert it with "
                "`mm.from_optax_multisteps(state, tx, params, acc_count=...)`"
            )
        elif isinstance(opt_state, optax.GradientTransformation):
            hint = (
                ": that is the optimizer, not its state; pass the state its "
                "`init` and `update` return (`opt_state`)"
            )
        elif has_field_named(opt_state, "acc_grads"):
            hint = (
                ": it holds the state's fields by name only, as a checkpoint "
                "restored without a template, or `nnx.state(optimizer)`, gives "
                "them. Restore against `tx.init(params)` (the target), or pass "
                "`optimizer.opt_state`"
            )
        raise ValueError(
            "`opt_state` must hold exactly one MaskedMultiStepsState, found "
            f"{len(found)} in a {type(holder).__name__}{hint}"
        )
    # (Its scalars tell an abstract state, `jax.eval_shape(tx.init, params)`,
    # without a pass over every parameter leaf.)
    refuse_restore_target((found[0].mini_step, found[0].updated), what)
    return found[0]


def state_paths(tree: Any, where: str) -> list[str]:
    """Where each :class:`MaskedMultiStepsState` in ``tree`` is, spelt from
    ``where`` (``"state.opt_state"`` gives ``state.opt_state[0]``...)."""
    return [
        where + jax.tree_util.keystr(path)
        for path, _ in instances_in(tree, MaskedMultiStepsState)
    ]


def has_updated(opt_state: Any) -> jax.Array:
    """Whether the last update of the :class:`MaskedMultiSteps` inside
    ``opt_state`` applied an inner update (ended a window with tokens and a
    finite mean gradient, and, for an inner optimizer that needs ``value=``, a
    finite mean value; a window without them closes without one).

    It describes the wrapper's last call that was kept: a transformation around
    the wrapper that keeps the old state on a step (``optax.apply_if_finite``
    withholding a non-finite gradient) leaves it as it was, so there log when
    ``gradient_step`` changes instead.

    Raises:
      ValueError: as :func:`find_state`, if ``opt_state`` holds no wrapper's
        state, or more than one.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import masked_multistep as mm
      >>> tx = optax.chain(mm.MaskedMultiSteps(optax.sgd(0.1), 2), optax.scale(0.5))
      >>> state = tx.init(jnp.zeros(2))
      >>> for _ in range(2):
      ...     _, state = tx.update(jnp.ones(2), state, count=jnp.array(4))
      ...     print(bool(mm.has_updated(state)))
      False
      True
    """
    return jax.numpy.asarray(unboxed(find_boxed(opt_state).updated))


@overload
def window_stats(
    opt_state: Any, *, per_leaf: Literal[False] = False, groups: None = None
) -> WindowStats[jax.Array]: ...


@overload
def window_stats(
    opt_state: Any, *, per_leaf: Literal[True], groups: None = None
) -> WindowStats[Any]: ...


@overload
def window_stats(
    opt_state: Any, *, per_leaf: Literal[False] = False, groups: Any
) -> WindowStats[dict[str, jax.Array]]: ...


@overload
def window_stats(
    opt_state: Any, *, per_leaf: bool, groups: None = None
) -> WindowStats[Any]: ...


def window_stats(
    opt_state: Any, *, per_leaf: bool = False, groups: Any = None
) -> WindowStats[Any]:
    """The :class:`WindowStats` of the last completed window.

    They describe the last window that ended (loss, tokens, gradient norm,
    noise scale) and stay the same until the next one ends, so they can be
    logged after any step, e.g. when ``mm.has_updated(opt_state)``.

    With a wrapper built with ``per_leaf_stats=True``, the same statistics of
    each parameter leaf, or of each group of leaves: ``grad_sq_norm``,
    ``grad_var_trace``, ``true_grad_sq_norm``, ``noise_scale`` and
    ``smoothed_noise_scale`` are then a pytree shaped like the params
    (``per_leaf=True``) or a ``dict`` by group label (``groups=``), and the
    other fields the window's. A group's ``S`` and ``‖ḡ‖²`` are the sums of
    its leaves', so the groups' ``grad_sq_norm``, ``grad_var_trace`` and
    ``true_grad_sq_norm`` add up to the window's (up to rounding); a noise
    scale does not add up: each group has its own.

    Args:
      opt_state: an optimizer state holding the wrapper's (see
        :func:`find_state`).
      per_leaf: each parameter leaf's statistics.
      groups: each group's statistics, by label: a pytree of ``str`` labels
        with the params' structure or a prefix of it (as
        ``optax.multi_transform``'s ``param_labels``: ``{"encoder": "enc",
        "decoder": "dec"}``; matched by path where the containers differ, so
        a ``dict`` serves an NNX ``State``), or a function returning one,
        called (under ``jax.eval_shape``) on abstract arrays with the params'
        structure and shapes, in the accumulator's dtype (float32 for
        bfloat16 params by default), for a batch of states or a deferred
        reduction's per-device state too.

    Raises:
      ValueError: if ``opt_state`` holds no single :class:`MaskedMultiSteps`
        state, or its wrapper was built without ``window_stats=True`` (or,
        for ``per_leaf`` and ``groups``, without ``per_leaf_stats=True``), or
        ``groups`` does not match the params' structure.
      TypeError: if ``per_leaf`` is not a bool, or both ``per_leaf`` and
        ``groups`` are given, or a label is not a ``str``, or ``groups`` is a
        function that cannot be called with the params alone.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import masked_multistep as mm
      >>> tx = mm.MaskedMultiSteps(optax.sgd(0.1), 2, window_stats=True)
      >>> params = jnp.zeros(2)
      >>> state = tx.init(params)
      >>> for g, n, loss in [(1.0, 2, 0.5), (3.0, 2, 1.5)]:
      ...     _, state = tx.update(jnp.full(2, g), state, params,
      ...                          count=jnp.array(n), value=jnp.array(loss))
      >>> stats = mm.window_stats(state)
      >>> print(int(stats.tokens), stats.loss, stats.grad_sq_norm)
      4 1.0 8.0

      ``S = 2·‖(1, 1) − (2, 2)‖² + 2·‖(3, 3) − (2, 2)‖² = 2·2 + 2·2 = 8`` over
      ``K = 2`` microbatches:
      ``tr Σ̂ = 8``, ``|G|²̂ = 8 − 8 / 4 = 6``, ``B_simple = 8 / 6`` tokens.

      >>> print(stats.grad_var_trace, stats.true_grad_sq_norm, stats.noise_scale)
      8.0 6.0 1.3333334

      Each leaf's, or each group's, with ``per_leaf_stats=True``:

      >>> tx = mm.MaskedMultiSteps(optax.sgd(0.1), 2, per_leaf_stats=True)
      >>> params = {"w": jnp.zeros(2), "b": jnp.zeros(1)}
      >>> state = tx.init(params)
      >>> for g, n in [(1.0, 2), (3.0, 2)]:
      ...     grads = {"w": jnp.full(2, g), "b": jnp.full(1, 2 * g)}
      ...     _, state = tx.update(grads, state, params, count=jnp.array(n))
      >>> stats = mm.window_stats(state, per_leaf=True)
      >>> var = stats.grad_var_trace  # S: 2·2 + 2·2 for "w", 2·4 + 2·4 for "b"
      >>> print(var["w"], var["b"])
      8.0 16.0
      >>> print(mm.window_stats(state, groups="all").grad_var_trace["all"])
      24.0
    """
    boxed = find_boxed(opt_state)
    stats = unboxed(boxed.stats)
    if not isinstance(stats, WindowStatsState):
        raise ValueError(
            "This MaskedMultiSteps keeps no window statistics: construct it with "
            "`window_stats=True`."
        )
    per_leaf = check_flag(per_leaf, "`per_leaf`")
    if not per_leaf and groups is None:
        return read_window_stats(stats)
    if per_leaf and groups is not None:
        raise TypeError("mm.window_stats takes `per_leaf=True` or `groups=`, not both")
    if not isinstance(stats.leaves, LeafSums):
        what = "`per_leaf=True`" if per_leaf else "`groups=`"
        raise ValueError(
            f"{what} reads each parameter leaf's share of the window statistics, "
            "which this MaskedMultiSteps does not keep: construct it with "
            "`per_leaf_stats=True`."
        )
    # The accumulator's layout (its leaves, without a deferred reduction's
    # device axis), not the inner optimizer's state; figures to read, as
    # arrays (also where a plain loop's state keeps `nnx.Param` nodes).
    state = boxed._replace(
        **{
            name: unboxed_all(getattr(boxed, name))
            for name in ("acc_grads", "acc_count", "reduction_state")
        }
    )
    if per_leaf:
        return each_leaf(state.acc_grads, lambda groups: read_leaf_stats(stats, groups))
    labels = leaf_labels(groups, params_like(state))
    names = sorted(set(labels))
    read = read_leaf_stats(stats, tuple(names.index(label) for label in labels))
    return with_groups(read, lambda x: dict(zip(names, x, strict=True)))


def has_deferred_reduction(state: MaskedMultiStepsState) -> bool:
    """Whether ``state`` is of a wrapper with ``reduction=mm.deferred(...)``:
    its reduction state holds arrays (each device's counts). Without one it
    is empty, ``()`` or, restored without a target, ``None``."""
    return bool(jax.tree.leaves(state.reduction_state))


def params_like(state: MaskedMultiStepsState) -> Any:
    """Abstract arrays shaped like the params: the state's ``acc_grads``
    without the axes the params lack (a batch of states' leading axes, as
    ``vmap`` stacks them; a deferred reduction's device axis), in the
    accumulator's dtype."""
    lead = jax.numpy.ndim(state.acc_count)
    if has_deferred_reduction(state):
        lead += 1  # one running mean per device
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape[lead:], x.dtype), state.acc_grads
    )


def _labels_for(groups: Any, tree: Any) -> bool:
    """Whether ``groups``, callable, is a tree of labels for ``tree`` all the
    same (an equinox module's, which is callable): its leaves labels
    (``str``), one at least, in ``tree``'s structure or a prefix of it."""
    leaves = jax.tree.leaves(unboxed_all(groups))
    if not leaves or not all(isinstance(x, str) for x in leaves):
        return False
    try:
        jax.tree.map(lambda label, subtree: None, groups, tree)
    except (ValueError, TypeError):
        return False  # a function holding strings (a `Partial`'s arguments)
    return True


def leaf_labels(groups: Any, tree: Any) -> list[str]:
    """The label of each leaf of ``tree`` (in ``jax.tree.leaves`` order) that
    ``groups`` gives: a pytree of ``str`` labels shaped like ``tree`` or a
    prefix of it (callable or not: an equinox module of labels), or a
    function of ``tree`` returning one.

    ``tree``'s leaves may be abstract (``jax.ShapeDtypeStruct``): a function is
    called on them under ``jax.eval_shape``, so it sees arrays with their
    shapes and dtypes, as ``optax.multi_transform``'s ``param_labels`` may
    see the params traced. Labels are matched to the leaves by structure, or
    failing that by path (dict keys, attribute names and sequence indices
    alike), so a plain ``dict`` of labels matches an NNX ``State``, and NNX
    variables holding labels count as the labels they hold.
    """
    if callable(groups) and not _labels_for(groups, tree):
        check_takes_one(groups, "`groups`", "the params")
        called = []
        try:
            jax.eval_shape(lambda t: called.append(groups(t)) or (), tree)
        except jax.errors.JAXTypeError as error:
            raise TypeError(
                "`groups`, a function, is called on abstract arrays (shapes and "
                "dtypes, as under jit, whatever the state holds): label the "
                "params by `.shape`, `.ndim`, `.dtype` or path, not by their "
                f"values; it raised {type(error).__name__}"
            ) from error
        labels = called[0]
    else:
        labels = groups
    labels = unboxed_all(labels)
    for label in jax.tree.leaves(labels):
        if not isinstance(label, str):
            raise TypeError(
                f"`groups`' labels must be str, got {label!r} of type "
                f"{type(label).__name__}"
            )
    try:
        per_subtree = jax.tree.map(
            lambda label, sub: [label] * len(jax.tree.leaves(sub)), labels, tree
        )
    except (ValueError, TypeError):
        return _labels_by_path(labels, tree)
    return jax.tree.leaves(per_subtree)


def _key_names(path: tuple[Any, ...]) -> tuple[Any, ...]:
    """A key path's entries as plain names: a dict key, an attribute name or
    a sequence index alike."""
    names = []
    for key in path:
        for field in ("key", "name", "idx"):
            if hasattr(key, field):
                names.append(getattr(key, field))
                break
        else:
            names.append(str(key))
    return tuple(names)


def _is_placeholder(x: Any) -> bool:
    # Where a params leaf has no accumulator (`optax.multi_transform`'s other
    # branches, `optax.masked`): a place for a label, with nothing to label.
    return x is None or isinstance(x, optax.MaskedNode)


def _labels_by_path(labels: Any, tree: Any) -> list[str]:
    """Each leaf's label, the one whose path (in :func:`_key_names`) leads to
    it."""
    given = {
        _key_names(path): label
        for path, label in jax.tree_util.tree_flatten_with_path(labels)[0]
    }
    places: set[tuple[Any, ...]] = set()  # every prefix of every path
    holes: list[tuple[Any, ...]] = []  # placeholders: a whole subtree may be one
    found, unmatched = [], []
    for path, leaf in jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=_is_placeholder
    )[0]:
        names = _key_names(path)
        prefixes = [names[:i] for i in range(len(names) + 1)]
        places.update(prefixes)
        if _is_placeholder(leaf):
            holes.append(names)
            continue
        label = next((given[p] for p in prefixes if p in given), None)
        if label is None:
            unmatched.append(names)
        found.append(label)
    problem = ""
    unused = [
        q for q in given if q not in places and not any(q[: len(h)] == h for h in holes)
    ]
    deeper = [q for q in given if unmatched and q[: len(unmatched[0])] == unmatched[0]]
    if deeper:
        # `{"w": ["a"]}` for a leaf `w`: a container where one label belongs.
        problem = (
            f"the labels for the params' leaf at {_spelt(unmatched[0])} are "
            f"nested ({_spelt(deeper[0])}): give that leaf one str label"
        )
    elif unmatched:
        problem = (
            f"no label for the params' leaf at {_spelt(unmatched[0])} (a None "
            "label is no label)"
        )
        if unused:
            problem += (
                f", and a label at {_spelt(unused[0])}, where the params have no leaf"
            )
            if isinstance(labels, (list, tuple)) != isinstance(tree, (list, tuple)):
                problem += (
                    f" (the labels are a {type(labels).__name__}, the params a "
                    f"{type(tree).__name__})"
                )
    elif unused:
        problem = f"a label at {_spelt(unused[0])}, where the params have no leaf"
    if problem:
        raise ValueError(
            "`groups` must be a pytree of str labels with the params' structure "
            f"or a prefix of it (or a function of the params returning one): "
            f"{problem}"
        )
    return found


def _spelt(names: tuple[Any, ...]) -> str:
    return "".join(f"[{name!r}]" for name in names) or "the root"
