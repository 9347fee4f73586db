"""The wrapper's state held by name, as ``nnx.state(optimizer)`` holds it.

An NNX optimizer's state (and so its orbax checkpoints) holds the
:class:`MaskedMultiStepsState` as a mapping of its field names (flax's
``nnx.State``, or a ``dict``), empty fields such as ``()`` left out and each
array inside an NNX variable. These helpers read and build such a state, or a
bare one, field by field.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax

from masked_multistep._state import MaskedMultiStepsState
from masked_multistep._stats_state import LeafSums, WindowStatsState
from masked_multistep._token_total import TokenTotal

# The fields that identify the wrapper's state where it is held by name
# (``nnx.state(optimizer)``, which leaves out empty fields).
NAMED = frozenset(("mini_step", "gradient_step", "acc_count", "acc_grads"))
# The statistics' NamedTuples, rebuilt from a state held by name by their
# field names (a token budget's state is a TokenTotal too).
_STATS_KINDS = (TokenTotal, LeafSums, WindowStatsState)


def is_named(x: Any) -> bool:
    """Whether ``x`` is the wrapper's state held by name."""
    return isinstance(x, Mapping) and NAMED <= set(x.keys())


def get(node: Any, name: str) -> Any:
    """A field of the wrapper's state, bare or as ``nnx.state`` holds it (which
    leaves out an empty field)."""
    if isinstance(node, Mapping):
        return node.get(name, ())
    return getattr(node, name)


def array(field: Any) -> Any:
    """The one array of a scalar field (an NNX variable holds it inside)."""
    (leaf,) = jax.tree.leaves(field)
    return leaf


def like(field: Any, value: Any) -> Any:
    """``value`` in the template ``field``'s container (an NNX variable)."""
    return jax.tree.unflatten(jax.tree.structure(field), [value])


def boxed(x: Any) -> bool:
    """Whether ``x``, in a state held by name, holds one array (an NNX
    variable, or the array itself)."""
    return not isinstance(x, Mapping) and len(jax.tree.leaves(x)) == 1


def plain(node: Any, kinds: tuple[Any, ...] = ()) -> Any:
    """A field held by name as a bare state holds it: arrays out of their NNX
    variables, mappings as ``dict``\\ s, or as the one of the NamedTuples
    ``kinds`` whose fields they hold."""
    if boxed(node):
        return array(node)
    if not isinstance(node, Mapping):
        return node
    items = {key: plain(value, kinds) for key, value in node.items()}
    return next((kind(**items) for kind in kinds if _holds(kind, items)), items)


def _holds(kind: Any, items: Mapping[str, Any]) -> bool:
    """Whether ``items`` are the fields of the NamedTuple ``kind``, but for
    fields with a default (an empty ``()``, which a state by name leaves out)."""
    fields = set(kind._fields)
    return fields - set(kind._field_defaults) <= set(items) <= fields


def bare_stats(stats: Any) -> Any:
    """The statistics' field of the wrapper's state, bare or held by name, as
    a bare :class:`WindowStatsState` (whose properties read its figures by
    name), or ``()`` without statistics."""
    return plain(stats, _STATS_KINDS)


def bare(state: Any) -> MaskedMultiStepsState:
    """The wrapper's state held by name as a bare one (the fields it leaves
    out are the empty ones)."""
    return MaskedMultiStepsState(
        **{
            name: plain(
                get(state, name),
                _STATS_KINDS if name in ("stats", "policy_state") else (),
            )
            for name in MaskedMultiStepsState._fields
        }
    )


def named(state: Any, template: Any) -> Any:
    """The bare ``state`` (or a ``dict`` of its fields) held by name as
    ``template`` holds it: in its mappings and NNX variables."""

    def field_of(path: tuple[Any, ...], field: Any) -> Any:
        value = state
        for key in path:
            value = (
                value[key.key]
                if isinstance(value, Mapping)
                else getattr(value, key.key)
            )
        return like(field, value)

    return jax.tree_util.tree_map_with_path(field_of, template, is_leaf=boxed)
