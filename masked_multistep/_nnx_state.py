"""NNX modules in ``microbatched_value_and_grad``: what may be differentiated
whole, and the state of a module passed whole.

A module's ``nnx.Param`` variables are differentiated; its other state (RNG
stream counters, running batch statistics) is carried from microbatch to
microbatch by :class:`ModuleState`, or, where a module cannot be passed whole,
refused with the recipe that splits it. flax is optional: nothing here imports
it, and a program that never imported ``flax.nnx`` holds no NNX module.
"""

from __future__ import annotations

import sys
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from masked_multistep._checks import first_three, holds_equinox_module, holds_instance
from masked_multistep._shards import varying_axes

SPLIT_RECIPE = (
    "pass `params` from `graphdef, params, rest = nnx.split(model, nnx.Param, "
    "...)` and rebuild the module in `loss_fn` with `nnx.merge(graphdef, "
    "params, rest, copy=True)` (then `nnx.reseed(module, default=rng, "
    "dropout=rng)` gives each microbatch its own dropout key when `grad_fn` is "
    "called with `rng=`; dropout draws from the `default` stream of an "
    "`nnx.Rngs(0)`)"
)


def nnx_path(path: tuple[Any, ...]) -> str:
    """An ``nnx`` state path as attribute access: ``.bn.mean``, ``.layers[0]``."""
    return "".join(f".{key}" if isinstance(key, str) else f"[{key!r}]" for key in path)


def non_parameters(module: Any) -> list[tuple[Any, Any]]:
    """``(path, variable)`` of every variable of ``module`` (or of an
    ``nnx.State``) that is not an ``nnx.Param``."""
    nnx = sys.modules["flax.nnx"]
    if isinstance(module, nnx.Module):
        return list(nnx.to_flat_state(nnx.state(module, nnx.Not(nnx.Param))))
    return [
        (path, v)
        for path, v in nnx.to_flat_state(module)
        if not isinstance(v, nnx.Param)
    ]


def located(variables: list[tuple[Any, Any]], where: str = "params") -> list[str]:
    """``BatchStat at params.bn.mean`` for each ``(path, variable)``."""
    return [f"{type(v).__name__} at {where}{nnx_path(p)}" for p, v in variables]


def check_nnx_modules(params: Any, whole_ok: bool = False) -> None:
    """Refuses NNX modules in ``params`` that hold state other than ``nnx.Param``.

    Their other variables (batch statistics, RNG streams) would be
    "differentiated" like parameters, and the state ``loss_fn`` writes to them
    lost. flax is optional: if ``flax.nnx`` was never imported, ``params``
    holds no NNX module.

    >>> from flax import nnx
    >>> check_nnx_modules({"bn": nnx.BatchNorm(2, rngs=nnx.Rngs(0))})
    Traceback (most recent call last):
    TypeError: `params` is an NNX module (BatchNorm) holding state other than
    nnx.Param (BatchStat at params['bn'].mean, params['bn'].var), which cannot
    be differentiated whole: pass `params` from `graphdef, params, rest =
    nnx.split(model, nnx.Param, ...)` and rebuild the module in `loss_fn` ...
    """
    nnx = sys.modules.get("flax.nnx")
    if nnx is None:
        return
    # Variables that are never trained, in a state split off whole
    # (`nnx.split(model)`); other Variable types may be a user's parameters.
    untrainable = (nnx.BatchStat, nnx.Cache, nnx.Intermediate, nnx.RngState)
    leaves = jax.tree_util.tree_flatten_with_path(
        params, is_leaf=lambda x: isinstance(x, (nnx.Module, nnx.Variable))
    )[0]
    found_in_state = [
        f"{type(leaf).__name__} at params{jax.tree_util.keystr(path)}"
        for path, leaf in leaves
        if isinstance(leaf, untrainable)
    ]
    if found_in_state:
        raise TypeError(
            f"`params` holds variables that are not parameters "
            f"({first_three(found_in_state)}): {SPLIT_RECIPE}"
        )
    # A variable reached twice (tied weights) is differentiated as two leaves:
    # its gradient would come back split between them.
    first_seen: dict[int, str] = {}
    for path, variable in jax.tree_util.tree_flatten_with_path(
        params, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )[0]:
        if not isinstance(variable, nnx.Variable):
            continue
        where = f"params{jax.tree_util.keystr(path)}"
        if id(variable) in first_seen:
            raise TypeError(
                f"`params` reaches the same NNX variable at {first_seen[id(variable)]} "
                f"and at {where} (shared, tied weights): differentiated whole, "
                "its gradient would be split between the two. "
                f"{SPLIT_RECIPE[0].upper()}{SPLIT_RECIPE[1:]} "
                "(nnx.split lists a shared variable once)"
            )
        first_seen[id(variable)] = where
    for prefix, module in leaves:
        if not isinstance(module, nnx.Module):
            continue
        where = f"params{jax.tree_util.keystr(prefix)}"
        by_type: dict[str, list[str]] = {}
        for path, variable in non_parameters(module):
            by_type.setdefault(type(variable).__name__, []).append(
                where + nnx_path(path)
            )
        if not by_type:
            continue
        found = "; ".join(
            f"{kind} at {first_three(paths)}" for kind, paths in by_type.items()
        )
        whole = (
            "pass the module itself as `params` (microbatched_value_and_grad "
            "carries its other state from microbatch to microbatch), or "
            if whole_ok
            else ""
        )
        raise TypeError(
            f"`params` is an NNX module ({type(module).__name__}) holding state "
            f"other than nnx.Param ({found}), which cannot be differentiated "
            f"whole: {whole}{SPLIT_RECIPE}. State that `loss_fn` writes (RNG "
            "counters, running batch statistics) is not returned"
        )


def check_wrt(wrt: Any) -> Any:
    """``wrt=``, an ``nnx`` filter of the variables to differentiate (as
    ``nnx.Optimizer``'s ``wrt`` and ``nnx.DiffState`` take it): ``None``, or
    one that ``nnx`` can read (a ``Variable`` type, a tag string, ``nnx.All``,
    ...); a ``TypeError`` naming it otherwise."""
    if wrt is None:
        return None
    if wrt is Ellipsis or wrt is True:
        raise TypeError(
            f"`wrt={filter_text(wrt)}` selects every variable of the module, "
            "RNG streams and batch statistics included: pass the parameters to "
            "differentiate (nnx.Param, the default, or a subset such as "
            "nnx.LoRAParam)"
        )
    nnx = sys.modules.get("flax.nnx")
    if nnx is None:
        raise TypeError(
            f"`wrt` filters the variables of an NNX module, got {wrt!r} with "
            "flax.nnx not imported"
        )
    try:
        nnx.filterlib.to_predicate(wrt)
    except Exception as err:  # flax's own error for an unreadable filter
        raise TypeError(
            f"`wrt` must be an nnx filter of the variables to differentiate "
            f"(e.g. nnx.LoRAParam, as nnx.Optimizer takes it), got {wrt!r} of "
            f"type {type(wrt).__name__}"
        ) from err
    return wrt


def is_module(x: Any) -> bool:
    """Whether ``x`` is an NNX module (``False`` where flax.nnx was never
    imported)."""
    nnx = sys.modules.get("flax.nnx")
    return nnx is not None and isinstance(x, nnx.Module)


def selected_state(module: Any, wrt: Any) -> Any:
    """The ``nnx.State`` of ``module``'s variables that ``wrt`` selects (the
    structure of the gradients taken with respect to them)."""
    return sys.modules["flax.nnx"].state(module, wrt)


def filter_text(wrt: Any) -> str:
    """``wrt`` as code names it, for an error's recipe: ``nnx.LoRAParam`` for
    flax's variable types, a class's own name for others, flax's filter
    objects as their constructors (``nnx.All(nnx.Param, nnx.PathContains('a'))``),
    strings and other values by ``repr``."""
    nnx = sys.modules.get("flax.nnx")
    if wrt is Ellipsis:
        return "..."
    if isinstance(wrt, type):
        if (
            wrt.__module__.startswith("flax.")
            and getattr(nnx, wrt.__name__, None) is wrt
        ):
            return f"nnx.{wrt.__name__}"
        return wrt.__name__
    if isinstance(wrt, (tuple, list)):
        inner = ", ".join(filter_text(f) for f in wrt)
        return (
            f"({inner},)"
            if isinstance(wrt, tuple) and len(wrt) == 1
            else (f"({inner})" if isinstance(wrt, tuple) else f"[{inner}]")
        )
    if nnx is None:
        return repr(wrt)
    fl = nnx.filterlib
    if isinstance(wrt, fl.OfType):
        return filter_text(wrt.type)
    if isinstance(wrt, (fl.Any, fl.All)):
        parts = ", ".join(filter_text(p) for p in wrt.predicates)
        return f"nnx.{type(wrt).__name__}({parts})"
    if isinstance(wrt, fl.Not):
        return f"nnx.Not({filter_text(wrt.predicate)})"
    if isinstance(wrt, fl.PathContains):
        exact = "" if wrt.exact else ", exact=False"
        return f"nnx.PathContains({wrt.key!r}{exact})"
    if isinstance(wrt, fl.WithTag):
        return repr(wrt.tag)
    if isinstance(wrt, fl.Everything):
        return "..."
    if isinstance(wrt, fl.Nothing):
        return "None"
    return repr(wrt)


def refuse_non_module(params: Any, wrt: Any) -> None:
    """Refuses ``wrt`` with ``params`` that is not an NNX module."""
    if not is_module(params):
        fix = (
            "pass the NNX module, or leave `wrt` out and pass the pytree of what "
            "to differentiate"
        )
        if holds_equinox_module(params):
            fix = (
                "an equinox module whole is differentiated in its floating arrays; "
                "for a part of it, leave `wrt` out, pass `params` from `params, "
                "static = eqx.partition(model, spec)` and rebuild the module in "
                "`loss_fn` with `eqx.combine(params, static)`"
            )
        raise TypeError(
            f"`wrt={filter_text(wrt)}` selects variables of an NNX module passed whole "
            f"as `params`, got {type(params).__name__}: {fix}"
        )


def refuse_module_state(params: Any, wrt: Any) -> None:
    """Refuses ``wrt`` with ``params`` that is not an NNX module, or one
    holding state other than parameters (where each device's call cannot
    carry it: :func:`per_device_value_and_grad`)."""
    refuse_non_module(params, wrt)
    others = non_parameters(params)
    if others:
        found = first_three(located(others))
        raise TypeError(
            f"`params` is an NNX module ({type(params).__name__}) holding state "
            f"other than nnx.Param ({found}), which cannot be carried from "
            "microbatch to microbatch on every device apart: leave `wrt` out, "
            "pass `params` from `graphdef, params, rest = nnx.split(model, "
            f"{filter_text(wrt)}, ...)` and rebuild the module in `loss_fn` with "
            "`nnx.merge(graphdef, params, rest, copy=True)`"
        )


def holds_nnx(params: Any) -> bool:
    """Whether ``params`` is or holds an NNX module, variable or state."""
    return holds_instance(params, "flax.nnx", "Module", "Variable", "State")


def layout_text(layout: Any) -> str:
    """``float32[4]`` for a leaf's ``(shape, dtype)``; ``None`` for no value."""
    leaves = jax.tree.leaves(layout, is_leaf=lambda x: isinstance(x, tuple))
    if not leaves:
        return "None"
    return ", ".join(f"{dtype}{list(shape)}" for shape, dtype in leaves)


class ModuleState(NamedTuple):
    """An NNX module passed whole, split for differentiation.

    Its ``nnx.Param`` state is what the gradients are taken with respect to;
    the rest (RNG streams' counters, running batch statistics, any other
    variable) is threaded through the microbatches in order, each
    microbatch's ``loss_fn`` call seeing what the previous one wrote, as ``k``
    calls of the module one after the other would (but for a microbatch
    without tokens: :meth:`held_without_tokens`), and written back into the
    module at the end.
    """

    module: Any
    graphdef: Any
    params: Any
    rest: Any
    # With `wrt=`: the `nnx.Param` variables it leaves out (frozen: the same
    # for every microbatch, neither differentiated nor carried); else None.
    frozen: Any = None
    wrt: Any = None

    @classmethod
    def of(cls, params: Any, wrt: Any = None) -> ModuleState | None:
        """The split of ``params`` if it is an NNX module holding state other
        than ``nnx.Param``, or any NNX module with ``wrt`` (an ``nnx`` filter
        of the variables to differentiate, :func:`check_wrt`'s); ``None``
        otherwise (a pytree of params, or a module of parameters only,
        differentiated as a pytree)."""
        if not is_module(params):
            return None
        nnx = sys.modules["flax.nnx"]
        if wrt is not None:
            graphdef, diff, frozen, rest = nnx.split(params, wrt, nnx.Param, ...)
            if not jax.tree.leaves(diff):
                raise TypeError(
                    f"`wrt={filter_text(wrt)}` selects none of the variables of "
                    f"the module passed as `params` ({type(params).__name__}): "
                    "pass the filter that nnx.Optimizer(..., wrt=...) takes for it"
                )
            chosen = non_parameters(diff)
            if chosen:
                raise TypeError(
                    f"`wrt={filter_text(wrt)}` selects variables that are not "
                    f"parameters ({first_three(located(chosen))}): differentiate "
                    "nnx.Param variables (or a subclass, e.g. nnx.LoRAParam); the "
                    "rest of the module is carried from microbatch to microbatch"
                )
            return cls(params, graphdef, diff, rest, frozen, wrt)
        if not non_parameters(params):
            return None
        graphdef, param_state, rest = nnx.split(params, nnx.Param, ...)
        return cls(params, graphdef, param_state, rest)

    def merge(self, params: Any, rest: Any) -> Any:
        """The module of ``params`` and ``rest``, for one ``loss_fn`` call."""
        nnx = sys.modules["flax.nnx"]
        if self.wrt is not None:
            return nnx.merge(self.graphdef, params, self.frozen, rest, copy=True)
        return nnx.merge(self.graphdef, params, rest, copy=True)

    def rest_of(self, module: Any) -> Any:
        """The rest of ``module``'s state after a ``loss_fn`` call."""
        nnx = sys.modules["flax.nnx"]
        if self.wrt is not None:
            return nnx.split(module, self.wrt, nnx.Param, ...)[3]
        return nnx.split(module, nnx.Param, ...)[2]

    def held_without_tokens(self, weight: Any, after: Any, before: Any) -> Any:
        """The state ``after`` one microbatch's ``loss_fn`` call; where that
        microbatch holds no tokens (its ``weight``, the count as
        :func:`~masked_multistep._checks.count_weight` makes it, is 0: so is a
        negative, NaN or infinite count's), every variable but the RNG
        streams' keeps its value from ``before``.

        Such a microbatch's rows are all padding: what a layer would learn
        from them is noise, or NaN (a masked ``BatchNorm``'s ``0/0`` batch
        statistics, which its running averages would carry from then on), as
        its gradient is for the accumulation, which leaves it out. RNG
        streams advance as usual, so each microbatch's draws stay those of
        its place in the stream.

        Inside ``shard_map``, where each device counts its own tokens, a
        value that is the same on every device (one computed without the
        device's data, such as a call counter) is not held: holding it on
        some devices only would make its copies differ.
        """
        nnx = sys.modules["flax.nnx"]
        has_tokens = weight > 0
        by_device = varying_axes(has_tokens)

        def hold(a: Any, b: Any) -> Any:
            if by_device - varying_axes(a):
                return a
            return jnp.where(has_tokens, a, b)

        def held(new: Any, old: Any) -> Any:
            if isinstance(new, nnx.RngState):
                return new
            return jax.tree.map(hold, new, old)

        return jax.tree.map(
            held, after, before, is_leaf=lambda x: isinstance(x, nnx.Variable)
        )

    def check_kept(self, after: Any) -> None:
        """Refuses a ``loss_fn`` that changes the state's layout (``sow``
        adds ``nnx.Intermediate`` variables; a value may change dtype): each
        microbatch must leave the state as the next one takes it."""
        nnx = sys.modules["flax.nnx"]

        def layout(state: Any) -> dict[Any, Any]:
            return {
                path: jax.tree.map(lambda x: (jnp.shape(x), jnp.result_type(x)), v)
                for path, v in nnx.to_flat_state(state)
            }

        before, now = layout(self.rest), layout(after)
        if before == now:
            return
        added = [nnx_path(p) for p in now if p not in before]
        removed = [nnx_path(p) for p in before if p not in now]
        changed = [
            f"{nnx_path(p)} ({layout_text(before[p])} -> {layout_text(now[p])})"
            for p in before
            if p in now and before[p] != now[p]
        ]
        found = "; ".join(
            f"{what} {first_three(paths)}"
            for what, paths in (
                ("added", added),
                ("removed", removed),
                ("changed", changed),
            )
            if paths
        )
        raise TypeError(
            "`loss_fn` changed the layout of the module's state other than "
            "nnx.Param, which is carried from one microbatch to the next and "
            f"must keep its variables, shapes and dtypes: it {found}. Variables "
            "created during the call (`sow`, nnx.Intermediate) cannot be "
            "carried: return what you need as `aux` (has_aux=True) instead; "
            "keep a variable's dtype (`.astype` the new value)"
        )

    def write_back(self, rest: Any) -> None:
        """The microbatches' last state, into the module passed in."""
        sys.modules["flax.nnx"].update(self.module, rest)
