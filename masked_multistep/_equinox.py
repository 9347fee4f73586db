"""Equinox modules passed whole to the gradient functions.

An equinox module holds its functions (activations), Python numbers, integer
arrays and PRNG keys among its leaves. Passed whole as ``params`` to
:func:`microbatched_value_and_grad` or the data-parallel gradient functions, its
floating (and complex) arrays are differentiated and the rest held fixed, as
``eqx.filter_value_and_grad`` does: the gradients have the module's structure,
``None`` where it holds no floating array, the structure of
``eqx.filter(model, eqx.is_inexact_array)`` that the wrapper's state is built
from. equinox is optional: nothing here imports it, and a program that never
imported it holds no equinox module.
"""

from __future__ import annotations

import sys
from typing import Any

import jax

from masked_multistep._checks import holds_equinox_module

# The part of a module passed as a static argument of `jax.jit`: its tree
# structure and its leaves that are not arrays (hashable, as for
# `eqx.filter_jit`), or None for a tree holding no equinox module.
Static = tuple[Any, tuple[Any, ...]] | None


def split(tree: Any) -> tuple[Any, Any]:
    """``(differentiated, held)``: ``tree``'s floating arrays (``None``
    elsewhere) and the rest (``None`` where those are), which
    :func:`combine` puts back together (``eqx.partition`` by
    ``eqx.is_inexact_array``)."""
    eqx = sys.modules["equinox"]
    return eqx.partition(tree, eqx.is_inexact_array)


def combine(differentiated: Any, held: Any) -> Any:
    """The module again, from :func:`split`'s two parts (``eqx.combine``)."""
    return sys.modules["equinox"].combine(differentiated, held)


def arrays_and_static(tree: Any) -> tuple[Any, Static]:
    """``tree``'s arrays (``None`` elsewhere) and, for a tree holding an
    equinox module, the rest as a hashable static argument (``None``
    otherwise), which :func:`rebuild` puts back: the arrays cross
    ``jax.shard_map``, the functions among the leaves stay static.

    Raises:
      TypeError: if a leaf that is not an array is not hashable either.
    """
    if not holds_equinox_module(tree):
        return tree, None
    eqx = sys.modules["equinox"]
    arrays, rest = eqx.partition(tree, eqx.is_array)
    flat, treedef = jax.tree_util.tree_flatten_with_path(rest)
    for path, leaf in flat:
        try:
            hash(leaf)
        except TypeError:
            raise TypeError(
                "An equinox module passed as `params` holds leaves that are "
                "neither arrays nor hashable, which the data-parallel gradient "
                "functions take as static (as `eqx.filter_jit` does), got "
                f"{type(leaf).__name__} at params{jax.tree_util.keystr(path)}: "
                "make it hashable (a frozenset for a set) or an array"
            ) from None
    return arrays, (treedef, tuple(leaf for _, leaf in flat))


def rebuild(arrays: Any, static: Static) -> Any:
    """The tree that :func:`arrays_and_static` split."""
    if static is None:
        return arrays
    treedef, leaves = static
    return combine(arrays, jax.tree.unflatten(treedef, leaves))
