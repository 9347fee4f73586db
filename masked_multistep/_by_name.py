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

# The fields that identify the wrapper's state where it is held by name
# (``nnx.state(optimizer)``, which leaves out empty fields).
NAMED = frozenset(("mini_step", "gradient_step", "acc_count", "acc_grads"))


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
