"""The inner optimizer, as :class:`MaskedMultiSteps` runs it once per window.

What the wrapper passes it (the window's mean, its loss as ``value=``, a line
search's ``grad=``, the caller's other keyword arguments), what it asks of it
without running it (whether it needs ``value=``, the shapes of its updates),
and the checks on what comes back (a state of the same structure, in the
dtypes ``init`` gave it).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax import tree as otu

from masked_multistep._branch import EagerMemo, eager_key, staging
from masked_multistep._checks import refuses_keyword, signature

InnerUpdate = Callable[[Any, Any, Any, dict[str, Any]], tuple[Any, Any]]
"""``(mean, inner_state, params, dynamic_args) -> (updates, inner_state)``."""


def check_opt(opt: Any, argument: str = "opt") -> None:
    """``opt`` (the argument so named) is an optax transformation, or a
    ``TypeError`` that says how to build one from a factory passed by mistake
    (``optax.adam``)."""
    if hasattr(opt, "init") and hasattr(opt, "update"):
        return
    hint = ""
    if callable(opt):
        name = getattr(opt, "__name__", type(opt).__name__)
        hint = (
            f" {name!r}: call it to build the optimizer, e.g. "
            "MaskedMultiSteps(optax.adam(1e-3), every_k_schedule=4)"
        )
    elif opt is None:
        hint = ": build one, e.g. " + (
            "optax.adam(1e-3)"
            if argument == "opt"
            else "mm.MaskedMultiSteps(optax.adam(1e-3), every_k_schedule=4)"
        )
    raise TypeError(
        f"`{argument}` must be an optax GradientTransformation, got "
        f"{type(opt).__name__}{hint}"
    )


def describe(opt: Any, depth: int = 4) -> str:
    """``opt`` named by the transformations it is built of, read from the
    closures optax builds it with: ``chain(scale_by_adam, scale)`` for
    ``optax.adam``, ``inject_hyperparams(sgd)``, ``partition(a=..., b=...)``
    (``depth`` levels deep; a transformation of another kind, by its
    function's name).

    Examples:
      >>> import optax
      >>> from masked_multistep._inner import describe
      >>> describe(optax.adamw(1e-3))
      'chain(scale_by_adam, add_decayed_weights, scale)'
      >>> describe(optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1)))
      'chain(clip_by_global_norm, chain(identity, scale))'
    """
    update = getattr(opt, "update", opt)
    name = _function_name(update)
    if name == _WRAPPER_UPDATE:
        # Its closure holds the wrapper itself; name it by its inner optimizer.
        wrapper = _held(update, lambda x: hasattr(x, "_opt"))
        inner = describe(wrapper._opt, depth - 1) if wrapper and depth else "..."
        return f"MaskedMultiSteps({inner})"
    parts: list[str] = []
    for held in _closed_over(update) if depth else ():
        if isinstance(held, optax.GradientTransformation):
            if name == "with_extra_args_support":  # optax's adapter, not a step
                return describe(held, depth)
            parts.append(describe(held, depth - 1))
        elif isinstance(held, tuple) and held and all(map(callable, held)):
            parts += [describe(u, depth - 1) for u in held]  # chain's updates
        elif (
            isinstance(held, dict)
            and held
            and all(isinstance(t, optax.GradientTransformation) for t in held.values())
        ):
            parts += [f"{k}={describe(t, depth - 1)}" for k, t in held.items()]
        elif name == "inject_hyperparams" and callable(held):
            parts.append(_function_name(held))  # the optimizer's factory
    return f"{name}({', '.join(parts)})" if parts else name


_WRAPPER_UPDATE = "MaskedMultiSteps.update"
# Transformations that may sit next to the wrapper in a chain: linear and
# stateless (a scaled mean is the mean of the scaled gradients, zeros stay
# zeros), or a per-microbatch clean-up (NaNs to zeros) that the mean then weighs.
_HARMLESS_BEFORE = frozenset({"identity", "scale", "zero_nans"})
_HARMLESS_AFTER = frozenset({"identity", "scale"})


def _closed_over(fn: Any) -> Iterator[Any]:
    """The values in ``fn``'s closure (none for a function without one)."""
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            yield cell.cell_contents
        except ValueError:  # a cell not yet filled
            continue


def _held(fn: Any, wanted: Callable[[Any], bool]) -> Any:
    """The first value in ``fn``'s closure for which ``wanted`` holds, or None."""
    return next((held for held in _closed_over(fn) if wanted(held)), None)


def _chain_members(opt: Any) -> list[Any]:
    """The update functions ``opt`` runs one after the other: a chain's (nested
    chains flattened, optax's extra-arguments adapter seen through), else
    ``opt``'s own."""
    update = getattr(opt, "update", opt)
    name = _function_name(update)
    if name == "with_extra_args_support":
        held = _held(update, lambda x: isinstance(x, optax.GradientTransformation))
        return [update] if held is None else _chain_members(held)
    if name == "chain":
        fns = _held(update, lambda x: isinstance(x, tuple) and all(map(callable, x)))
        if fns is not None:
            return [m for fn in fns for m in _chain_members(fn)]
    if name == "named_chain":
        named = _held(update, _is_named_transforms)
        if named is not None:
            return [m for _, tx in named for m in _chain_members(tx)]
    return [update]


def _is_named_transforms(x: Any) -> bool:
    # `named_chain`'s `(name, transformation)` pairs.
    return isinstance(x, list) and all(
        isinstance(p, tuple)
        and len(p) == 2
        and isinstance(p[1], optax.GradientTransformation)
        for p in x
    )


def _branches(update: Any) -> list[Any]:
    """The transformations of ``optax.partition``'s (``multi_transform``'s)
    groups, where ``update`` is one's; else none."""
    if _function_name(update) not in ("partition", "multi_transform"):
        return []
    groups = _held(
        update,
        lambda x: (
            isinstance(x, dict)
            and all(isinstance(t, optax.GradientTransformation) for t in x.values())
        ),
    )
    return [] if groups is None else list(groups.values())


def _around(opt: Any) -> list[tuple[list[Any], list[Any]]]:
    """For each ``MaskedMultiSteps`` in ``opt``, the update functions run
    before and after it on the way to it (through chains, and into the
    ``optax.partition`` group that holds it: its params see the chain's
    members around the partition, and the group's own around the wrapper)."""
    members = _chain_members(opt)
    found = []
    for i, fn in enumerate(members):
        if _function_name(fn) == _WRAPPER_UPDATE:
            found.append((members[:i], members[i + 1 :]))
        for branch in _branches(fn):
            for before, after in _around(branch):
                found.append((members[:i] + before, after + members[i + 1 :]))
    return found


def takes_keyword(opt: Any, key: str) -> bool:
    """Whether an update function that ``opt`` runs (through chains and
    ``optax.partition`` groups) names the keyword ``key`` in its signature."""
    for fn in _chain_members(opt):
        try:
            if key in signature(fn).parameters:
                return True
        except (TypeError, ValueError):
            pass
        if any(takes_keyword(branch, key) for branch in _branches(fn)):
            return True
    return False


def chained_around_wrapper(tx: Any) -> tuple[list[str], list[str]]:
    """The transformations a chain ``tx`` runs before and after the one
    ``MaskedMultiSteps`` in it, by name, but those that are harmless there
    (``identity``, ``scale``, and ``zero_nans`` before it); two empty lists
    where ``tx`` is no such chain. Chains are ``optax.chain`` and
    ``optax.named_chain``, nested or not; a wrapper in a group of
    ``optax.partition`` sees the chain around the partition and the group's
    own. (Two wrappers in series are skipped: ``mm.TrainState.create`` refuses
    them, and a plain ``tx.init`` does not call this.)

    Examples:
      >>> import optax
      >>> import masked_multistep as mm
      >>> from masked_multistep._inner import chained_around_wrapper
      >>> tx = mm.MaskedMultiSteps(optax.sgd(1.0), every_k_schedule=2)
      >>> clip = optax.clip_by_global_norm(1.0)
      >>> chained_around_wrapper(optax.chain(clip, tx, optax.add_decayed_weights(0.1)))
      (['clip_by_global_norm'], ['add_decayed_weights'])
      >>> chained_around_wrapper(optax.chain(optax.scale(2.0), tx))
      ([], [])
    """
    before: list[str] = []
    after: list[str] = []
    for fns_before, fns_after in _around(tx):
        names = [describe(fn) for fn in fns_before], [describe(fn) for fn in fns_after]
        if any(n.startswith("MaskedMultiSteps") for n in names[0] + names[1]):
            continue  # two in series: `mm.TrainState.create` refuses them
        before += [
            n for n in names[0] if n not in before and _named(n, _HARMLESS_BEFORE)
        ]
        after += [n for n in names[1] if n not in after and _named(n, _HARMLESS_AFTER)]
    return before, after


def _named(name: str, harmless: frozenset[str]) -> bool:
    # What to name around a wrapper: not a harmless neighbour, nor a
    # transformation of some params only (`optax.partition`'s or `masked`'s,
    # whose groups the wrapper's params may not be in).
    return name not in harmless and not name.startswith(_PARTIAL)


_PARTIAL = ("partition(", "multi_transform(", "masked(")


def _function_name(fn: Any) -> str:
    """The name of the function that built ``fn`` (``chain`` for
    ``chain.<locals>.update_fn``)."""
    return getattr(fn, "__qualname__", type(fn).__name__).split(".<locals>")[0]


def split_extra_args(
    extra_args: dict[str, Any],
) -> tuple[bool, Any, dict[str, Any], dict[str, Any]]:
    """``update``'s extra keyword arguments, sorted: whether a line search's
    ``grad=`` was passed (the gradient at the params: at the window's end, the
    window's mean, as ``value=`` is the window's loss), the microbatch's
    ``value=``, and the rest for the inner optimizer, split into static ones
    and arrays (which go through the window's conditional)."""
    rest = dict(extra_args)
    with_grad = "grad" in rest
    rest.pop("grad", None)
    value = rest.pop("value", None)
    static_args = {k: v for k, v in rest.items() if not isinstance(v, jax.Array)}
    dynamic_args = {k: v for k, v in rest.items() if isinstance(v, jax.Array)}
    return with_grad, value, static_args, dynamic_args


def cast_like(tree: Any, other: Any) -> Any:
    """``optax.tree.cast_like``, but for typed PRNG keys (in
    ``optax.noisy_sgd``'s state), which are kept as they are: a concrete key
    array has no ``astype`` (an eager step failed on it)."""

    def cast(t: Any, o: Any) -> Any:
        dtype = getattr(o, "dtype", None)
        if dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key):
            return t
        return otu.cast_like(t, o)

    return jax.tree.map(cast, tree, other)


def narrowed(mean: Any, grads: Any) -> list[jax.Array]:
    """The leaves of the window's ``mean`` that the inner optimizer gets in a
    dtype of smaller range (the gradients' dtype: a float16 gradient beside a
    float32 accumulator), cast as it gets them: a finite mean can become inf
    there, so these are tested for finiteness too. Empty where no cast
    narrows, as where the gradients' dtype is the accumulator's."""
    out = []
    for m, g in zip(jax.tree.leaves(mean), jax.tree.leaves(grads), strict=True):
        to, of = jnp.result_type(g), jnp.result_type(m)
        if jnp.finfo(to).max < jnp.finfo(of).max:
            out.append(m.astype(to))
    return out


def inner_update(
    opt: optax.GradientTransformationExtraArgs,
    grads: Any,
    static_args: dict[str, Any],
    *,
    with_value: bool,
    with_grad: bool,
) -> InnerUpdate:
    """``opt`` on the window's mean, its state cast back.

    The mean is cast to the dtypes of ``grads``; without ``with_value`` the
    ``value=`` argument is dropped; with ``with_grad``, the mean is also its
    ``grad=`` (a line search's gradient at the params: the window's, not the
    closing microbatch's).
    """

    def update(mean, inner_state, params, dynamic_args):
        mean_grads = otu.cast_like(mean, grads)
        if not with_value:
            dynamic_args = {k: v for k, v in dynamic_args.items() if k != "value"}
        if with_grad:
            dynamic_args = {**dynamic_args, "grad": mean_grads}
        updates, new_inner = opt.update(
            mean_grads, inner_state, params, **static_args, **dynamic_args
        )
        if jax.tree.structure(new_inner) != jax.tree.structure(inner_state):
            # The window's conditional carries one state through both
            # branches (optax.monitor's measurements appear on update).
            before, after = (
                {
                    jax.tree_util.keystr(p)
                    for p, _ in jax.tree_util.tree_flatten_with_path(x)[0]
                }
                for x in (inner_state, new_inner)
            )
            changed = sorted(before ^ after)[:3] or ["its containers"]
            raise ValueError(
                "The inner optimizer's state changes structure on `update` "
                f"(at {', '.join(changed)}): the wrapper holds it between "
                "windows, so `init` must build it as `update` returns it "
                "(optax.monitor's does not; nor does it run under "
                "jax.lax.scan)"
            )
        # The inner state keeps its dtypes (as in optax.MultiSteps).
        return updates, cast_like(new_inner, inner_state)

    return update


class WindowPlan(NamedTuple):
    """What :func:`window_shapes` learns of the inner optimizer at a window's
    end, and the update to run there."""

    needs_value: bool
    """Whether it fails without ``value=`` (where the call passes one: whether
    it reads it and fails without it)."""
    passes_value: bool
    """Whether it gets one."""
    updates_avals: Any
    """The shapes of the updates it returns (as ``jax.ShapeDtypeStruct`` leaves)."""
    update: InnerUpdate
    """Its update as :func:`inner_update` builds it; where a jaxpr is being
    built (:func:`~masked_multistep._branch.staging`), the ``jax.jit`` of it
    whose trace gave ``updates``, which the window's end reuses (called on
    arguments of the same types)."""


def window_shapes(
    opt: optax.GradientTransformationExtraArgs,
    memo: EagerMemo,
    built: EagerMemo,
    mean_of: Callable[[Any], Any],
    window: Any,
    grads: Any,
    static_args: dict[str, Any],
    inner_state: Any,
    params: Any,
    dynamic_args: dict[str, Any],
    *,
    has_value: bool,
    with_grad: bool,
) -> WindowPlan:
    """Whether ``opt`` needs ``value=``, whether it gets one, the shapes of
    the updates it returns at the window's end, on the window's mean
    ``mean_of(window)`` (all by abstract evaluation), and the update to run.

    Statically: an inner optimizer that runs without ``value=`` gets none
    unless this call passes one (a choice between the two at run time would
    compile the inner update twice and triple the step's scratch memory);
    one that needs it (reduce_on_plateau, polyak_sgd) gets the window's
    mean, and a window without one (no microbatch passed a value, or its
    mean is not finite) is held like a non-finite mean: a NaN loss would
    make polyak_sgd's step NaN and every window a plateau. One whose
    update's signature refuses the keyword gets none, whatever this call
    passes.

    Where a jaxpr is being built (under ``jit``, ``shard_map`` inside it
    included, with or without ``vmap`` or a derivative inside them) the
    update is traced once: it is wrapped in ``jax.jit(..., inline=True)``,
    whose trace of the shapes' evaluation the window's end reuses (the mean
    is formed inside that evaluation, so it has the type, sharding included,
    that the window's end gives it). The cached jaxpr is inlined where it is
    called, so the program is the one the plain update gives (a call left to
    XLA to inline compiled the same instructions in another order, slower at
    small sizes). Under an eager ``vmap`` or derivative alone, whose
    operations run one by one, it is not wrapped: a ``jax.jit`` would compile
    on every call. The inner state's structure is
    compared with the one the wrapper's ``init`` built for params of the
    same structure, shapes and dtypes, held in ``built`` (:func:`avals_key`),
    before ``opt.init`` is traced on them (the answer is the same; only the
    trace is saved). An eager step (no part traced) remembers the rest in
    ``memo`` instead of tracing the inner optimizer again on every call (most
    of such a step's time).
    """
    parts = (grads, static_args, window, inner_state, params, dynamic_args)
    key = eager_key(*parts, has_value, with_grad)
    wrap = staging()
    updates: dict[bool, InnerUpdate] = {}

    def update_of(with_value: bool) -> InnerUpdate:
        if with_value not in updates:
            update = inner_update(
                opt, grads, static_args, with_value=with_value, with_grad=with_grad
            )
            updates[with_value] = jax.jit(update, inline=True) if wrap else update
        return updates[with_value]

    known = memo.get(key)
    if known is not None:
        needs_value, passes_value, shapes_ = known
        return WindowPlan(needs_value, passes_value, shapes_, update_of(passes_value))
    # A state of another inner optimizer's structure is refused before its
    # update runs: one whose update ignores the state's surplus (plain sgd
    # given momentum sgd's) would take it silently.
    # It is checked on the params, against the structure the wrapper's `init`
    # built for such params if it did, else against `opt.init` traced on them.
    # Where none are passed, the window's mean stands in for them in the
    # gradients' dtypes (the params', where the mean may be float32; its
    # shapes, where the gradients have a device axis), then as it is.
    got = jax.tree.structure(inner_state)
    if params is not None:
        stand_ins = [params]
    else:
        mean_like = jax.eval_shape(mean_of, window)
        retyped = _in_dtypes_of(mean_like, grads)
        stand_ins = [mean_like] if retyped is None else [retyped, mean_like]

    def built_as(structure: Any) -> bool:
        return structure is not None and structure == got

    # (The first stand-in's `opt.init` is traced last, by the explanation.)
    if not any(built_as(built.get(avals_key(p))) for p in stand_ins) and not any(
        built_as(init_structure(opt, p)) for p in stand_ins[1:]
    ):
        explain_other_state(opt, inner_state, *stand_ins)

    def shapes(with_value: bool) -> tuple[Any, bool]:
        # The updates' shapes, and (with the value) whether the update reads
        # it (`_reads`).
        # (The update gets `dynamic_args` as the window's end passes them,
        # value included, so that its trace is the one reused there.)
        update = update_of(with_value)
        others = {k: v for k, v in dynamic_args.items() if k != "value"}

        def inner_update_on_mean(window, inner_state, params, others, value):
            args = {**others, "value": value}
            return update(mean_of(window), inner_state, params, args)

        try:
            traced = jax.jit(inner_update_on_mean).trace(
                window, inner_state, params, others, dynamic_args["value"]
            )
        except TypeError as err:
            if not with_grad and _MISSING_GRAD in str(err):
                # (Without `value=` too: the try with it raises this again.)
                raise TypeError(f"{_GRAD_HINT}; it said: {err}") from err
            raise
        if not with_value:
            return traced.out_info[0], False
        try:
            jaxpr = traced.jaxpr.jaxpr
            reads = _reads(jaxpr, jaxpr.invars[-1])
        except (AttributeError, IndexError, KeyError, TypeError):
            # A jaxpr of a form this does not know (another jax): the value is
            # taken as read, and the update traced without it too.
            reads = True
        return traced.out_info[0], reads

    # An inner optimizer whose update refuses the keyword by its signature
    # (optax.contrib.sam declares extra arguments and takes none) runs without
    # it, as optax.with_extra_args_support runs one that declares none: the
    # value stays the wrapper's own (the window's loss). Its TypeError without
    # one is its own, not a sign that it needs one.
    refused = refuses_keyword(opt.update, "value")

    def shapes_with_value() -> tuple[Any, bool]:
        try:
            return shapes(with_value=True)
        except TypeError as err:
            if "unexpected keyword argument 'value'" in str(err):
                raise TypeError(
                    "a transformation inside the inner optimizer refuses the "
                    "`value=` that the wrapper hands on (the window's mean "
                    "loss), as optax.contrib.sam does inside optax.chain: wrap "
                    "such a one as optax.GradientTransformation(t.init, t.update), "
                    f"which optax.chain calls without extra arguments; it said: {err}"
                ) from err
            raise

    # Where this call passes a value, the update is traced with it first: one
    # that does not read it (most: adam drops it) needs none, and is traced
    # once. Only one that reads it is traced without it as well, to learn
    # whether it needs it (whether a NaN loss holds the window).
    # "Fails without it": optax's own raise TypeError (a keyword-only
    # `value`); an update of its own may check `value is None` and raise
    # ValueError or assert, as optax.contrib.momo's checks do. (An error that
    # is not about the value comes again where it is passed, and is raised.)
    avals, needs_value = None, False
    passes_value = has_value and not refused
    if passes_value:
        avals, reads = shapes_with_value()
        if reads:
            try:
                shapes(with_value=False)
            except _FAILS_WITHOUT_VALUE:
                needs_value = True
    else:
        try:
            avals, _ = shapes(with_value=False)
        except _FAILS_WITHOUT_VALUE:
            if refused:
                raise
            needs_value = passes_value = True
            avals, _ = shapes_with_value()
    memo.put(key, (needs_value, passes_value, avals))
    return WindowPlan(needs_value, passes_value, avals, update_of(passes_value))


_FAILS_WITHOUT_VALUE = (TypeError, ValueError, AssertionError)


def _reads(jaxpr: Any, var: Any) -> bool:
    """Whether ``jaxpr`` reads its input ``var``: whether ``var`` is one of its
    results, or an operand of one of its operations, but for a ``jax.jit``
    call whose own jaxpr does not read it (jax 0.11 and later keep the call
    of a ``jax.jit(..., inline=True)`` in a jaxpr, inlining it only where it
    is lowered). Jaxprs close over nothing: a use inside a conditional, a
    loop or a custom derivative is that operation's operand, taken as a read.
    """
    if any(x is var for x in jaxpr.outvars):
        return True
    for eqn in jaxpr.eqns:
        at = [i for i, x in enumerate(eqn.invars) if x is var]
        if not at:
            continue
        called = eqn.params.get("jaxpr") if eqn.primitive.name in _JITS else None
        called = getattr(called, "jaxpr", called)  # a ClosedJaxpr's Jaxpr
        if called is None or len(called.invars) != len(eqn.invars):
            return True
        if any(_reads(called, called.invars[i]) for i in at):
            return True
    return False


# The names of a `jax.jit` call's primitive (jax 0.10: `pjit`; later `jit`).
_JITS = ("jit", "pjit")

_MISSING_GRAD = "required keyword-only argument: 'grad'"
_GRAD_HINT = (
    "the inner optimizer is a line search that needs `grad=`: pass one with "
    "each microbatch, e.g. `grad=grads`, and the wrapper hands it the window's "
    "mean gradient in its place"
)


def _in_dtypes_of(avals: Any, like: Any) -> Any:
    """``avals`` (abstract values) in the dtypes of ``like``'s leaves, or None
    where the two trees differ in structure."""
    if jax.tree.structure(avals) != jax.tree.structure(like):
        return None
    return jax.tree.map(lambda a, x: a.update(dtype=jnp.result_type(x)), avals, like)


def init_structure(opt: Any, params_like: Any) -> Any:
    """The tree structure of the state ``opt.init`` builds for params like
    ``params_like`` (by abstract evaluation), or None where ``init`` cannot
    run on them (a check made with it is then skipped: the error at hand, if
    any, stands). (``init`` is called, not given to jax whole: jax reads a
    function's signature, which from Python 3.14 evaluates its annotations.)"""
    try:
        return jax.tree.structure(jax.eval_shape(lambda p: opt.init(p), params_like))
    except Exception:  # noqa: BLE001 -- no structure to compare with
        return None


def avals_key(tree: Any) -> Any:
    """A hashable key of ``tree``'s structure, shapes and dtypes (its leaves
    may be arrays, tracers, numbers or ``jax.ShapeDtypeStruct``), or None
    where a leaf is none of those."""
    leaves, treedef = jax.tree.flatten(tree)
    try:
        return treedef, tuple((np.shape(x), jnp.result_type(x)) for x in leaves)
    except TypeError:
        return None


def explain_other_state(
    opt: optax.GradientTransformation,
    inner_state: Any,
    params_like: Any,
    *more_like: Any,
) -> None:
    """Where ``inner_state`` is not of the structure ``opt.init`` builds (a
    state from a wrapper around another inner optimizer), a ``ValueError``
    that says so, before the inner update runs on it. ``params_like`` stands
    in for the params (their structure, shapes and dtypes; abstract values
    will do); where ``opt.init`` cannot run on it, the first of ``more_like``
    that it runs on."""
    want = None
    for like in (params_like, *more_like):
        want = init_structure(opt, like)
        if want is not None:
            break
    got = jax.tree.structure(inner_state)
    if want is not None and got != want:
        is_, built = apart(
            inner_state, want.unflatten([0] * want.num_leaves), "state.inner_opt_state"
        )
        raise ValueError(
            "`state.inner_opt_state` was not built by this wrapper's inner "
            f"optimizer: it is {is_}, but the inner optimizer's `init` builds "
            f"{built}. Use the state that this wrapper's `init` returned "
            "(restore a checkpoint against it)"
        )


def apart(got: Any, want: Any, name: str) -> tuple[str, str]:
    """``(got, want)`` described where two optimizer states' structures
    differ: their containers (:func:`outline`), and where those are the same
    (other leaves: dict keys, boxed params' values), the first leaf at which
    they part, spelt from ``name``."""
    got_text, want_text = outline(got), outline(want)
    if got_text == want_text:
        paths = [
            [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(t)]
            for t in (got, want)
        ]
        first = next(
            (i for i, (a, b) in enumerate(zip(*paths)) if a != b),
            min(map(len, paths)),
        )
        leaf, wanted = (
            f"`{name}{p[first]}`" if first < len(p) else "no leaf" for p in paths
        )
        got_text += f" (the first leaf apart: {leaf}, where `init` builds {wanted})"
    return got_text, want_text


def outline(state: Any, depth: int = 3) -> str:
    """An optimizer state's containers, by type name (``(ScaleByAdamState,
    EmptyState)``), ``depth`` levels deep."""
    if isinstance(state, (tuple, list)) and not hasattr(state, "_fields"):
        if depth == 0 or not state:
            return f"{type(state).__name__}[{len(state)}]"
        inner = ", ".join(outline(x, depth - 1) for x in state)
        return f"({inner},)" if len(state) == 1 else f"({inner})"
    return type(state).__name__


def warn_without_value() -> None:
    """Warns that the inner optimizer needs ``value=`` and the call passed none."""
    # Without the wrapper, such an optimizer refuses the call; with it, a
    # window in which no call passes a value is held, so a loop that never
    # passes one would never update the params.
    warnings.warn(
        "The inner optimizer needs `value=` (e.g. reduce_on_plateau, "
        "polyak_sgd), and this call passes none: a window in which no "
        "microbatch passes `value=` is held, not applied (counted in "
        "`state.num_nonfinite_windows`); one that other microbatches "
        "pass a value in gets their token-weighted mean. Pass each "
        "microbatch's mean loss, `count=count, value=loss`",
        UserWarning,
        stacklevel=3,
    )
