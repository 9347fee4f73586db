"""Where arrays lie on a mesh: the explicit axes in their types.

On a mesh with ``AxisType.Explicit`` axes an array's sharding is part of its
type, and jax's operations compare types: two operands of a ``select`` (and the
two branches of a conditional) must lie alike. These helpers read specs and
lay an array out as another one is. Fresh arrays made under ``jit`` without
``jax.set_mesh`` need them with jax 0.12: there ``jnp.zeros_like`` of an array
split over an explicit axis is not split (:func:`zeros_placed_as`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.core
import jax.numpy as jnp
from jax.sharding import PartitionSpec

__all__ = [
    "names_an_axis",
    "resharded_as",
    "spec_axes",
    "tree_resharded_as",
    "trimmed",
    "without_axes",
    "zeros_placed_as",
]


def resharded_as(x: Any, like: Any) -> Any:
    """``x`` with the sharding in ``like``'s type, where the two types differ
    and ``like``'s is on a mesh (outside ``jit``, on ``like``'s devices)."""
    want, have = jax.typeof(like).sharding, jax.typeof(x).sharding
    if want is None or want.mesh.empty or have is None:
        return x
    # Only explicit axes appear in a type's spec (under AxisType.Auto both
    # specs are empty, and the compiler decides).
    if trimmed(want.spec) == trimmed(have.spec):
        return x
    if not (names_an_axis(want.spec) or names_an_axis(have.spec)):
        return x
    if not isinstance(like, jax.core.Tracer):
        # Its placement's mesh, with the type's spec: `reshard` takes explicit
        # axes only (an automatic one in the placement's spec is refused).
        want = jax.sharding.NamedSharding(like.sharding.mesh, want.spec)
    return jax.sharding.reshard(x, want)


def tree_resharded_as(tree: Any, like: Any) -> Any:
    """``tree`` with the shardings, on explicit mesh axes, of ``like``'s
    leaves where their types differ (:func:`resharded_as` leaf by leaf;
    ``tree`` as it is where the two trees' structures differ)."""
    if jax.tree.structure(tree) != jax.tree.structure(like):
        return tree
    return jax.tree.map(resharded_as, tree, like)


def trimmed(spec: Any) -> tuple:
    """A spec's entries without trailing ``None``s (``P("data", None)`` is
    ``P("data")``)."""
    entries = list(spec)
    while entries and entries[-1] is None:
        entries.pop()
    return tuple(entries)


def spec_axes(entry: Any) -> frozenset:
    """The mesh axes one entry of a ``PartitionSpec`` names (none for ``None``
    and ``P.UNCONSTRAINED``)."""
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
        return frozenset()
    return frozenset(entry) if isinstance(entry, tuple) else frozenset({entry})


def without_axes(entry: Any, axes: Any) -> Any:
    """One ``PartitionSpec`` entry with the mesh axes ``axes`` left out
    (``("data", "model")`` without ``"data"`` is ``"model"``); one that
    names none of them as it is."""
    if not spec_axes(entry) & set(axes):
        return entry
    names = tuple(a for a in spec_axes(entry) if a not in axes)
    if isinstance(entry, tuple):  # the entry's own order, major to minor
        names = tuple(a for a in entry if a in names)
    return names[0] if len(names) == 1 else (names or None)


def names_an_axis(spec: Any) -> bool:
    """Whether a ``PartitionSpec`` names a mesh axis (in a type's sharding:
    an explicit one)."""
    return any(spec_axes(entry) for entry in spec)


def zeros_placed_as(x: Any, dtype: Any = None) -> jax.Array:
    """Zeros of ``x``'s shape (and dtype, or ``dtype``) lying where ``x`` does
    on explicit mesh axes: ``jnp.zeros_like``, resharded as ``x`` where its
    type lacks them (jax 0.12 under ``jit`` without ``jax.set_mesh``; a
    ``select`` between ``x``'s kind and such zeros fails there, or, between
    the branches of a conditional, takes the type of the branch taken when false).

    Example:
      >>> import jax.numpy as jnp
      >>> zeros_placed_as(jnp.ones(2), jnp.int32)
      Array([0, 0], dtype=int32)
    """
    return resharded_as(jnp.zeros_like(x, dtype=dtype), x)
