"""How a window's mean is agreed across devices: locally, or deferred over an axis.

Data parallelism splits every microbatch over the devices of a mesh axis. Device
``d`` sees ``nᵈ`` of the microbatch's tokens and computes its own mean gradient
``gᵈ``. The full batch's token-mean gradient is ``Σ nᵈ gᵈ / Σ nᵈ``; since the
token-weighted mean is associative, it does not matter whether the devices are
combined on every microbatch and the results then accumulated over the window,
or each device accumulates its own running mean over the window and the devices
are combined once at its end::

    m_window = Σ_d (Nᵈ / N) · mᵈ        mᵈ = Σᵢ nᵢᵈ gᵢᵈ / Nᵈ,  Nᵈ = Σᵢ nᵢᵈ,  N = Σ_d Nᵈ

The second order costs one gradient-sized cross-device reduction per window
instead of one per microbatch. This module holds the combination over a leading
device axis (:func:`mean_over_devices`) and the two reductions
:class:`MaskedMultiSteps` can use: :func:`local` (the gradients it receives are
already the microbatch's global mean; the default) and :func:`deferred` (each
device's gradients stay local, stacked along a leading axis of size ``D``
sharded over the mesh axis, and are combined once per window).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import Any

import jax

from masked_multistep._collectives import weighted_mean_across

__all__ = ["mean_over_devices", "check_mesh_axes"]

# The name of the leading (device) axis inside `mean_over_devices`' vmap.
_DEVICES = "masked_multistep/devices"


def check_mesh_axes(
    mesh: Any, axis_name: Hashable | Sequence[Hashable]
) -> tuple[tuple[Hashable, ...], int]:
    """``axis_name`` as a tuple of mesh axis names, and their total size ``D``.

    Raises ``TypeError`` if ``mesh`` is not a ``jax.sharding.Mesh`` and
    ``ValueError`` if an axis is not one of its axes.
    """
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(
            f"`mesh` must be a jax.sharding.Mesh, got {type(mesh).__name__}"
        )
    axes = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    if not axes:
        raise ValueError("`axis_name` must name at least one mesh axis, got ()")
    for axis in axes:
        if axis not in mesh.axis_names:
            raise ValueError(
                f"`axis_name` must name axes of the mesh {tuple(mesh.axis_names)}, "
                f"got {axis!r}"
            )
    if len(set(axes)) != len(axes):
        raise ValueError(f"`axis_name` names an axis twice: {axes}")
    return axes, math.prod(mesh.shape[a] for a in axes)


def mean_over_devices(tree: Any, counts: jax.Array) -> tuple[Any, jax.Array]:
    """Token-weighted mean over a leading device axis: ``Σ_d (nᵈ/N)·xᵈ``, ``N``.

    ``tree``'s leaves and ``counts`` carry a leading axis of size ``D`` (one
    entry per device). This is :func:`weighted_mean_across` over that axis (the
    same float32 arithmetic, zero-safe: a device with ``nᵈ = 0`` contributes
    nothing even if its entries are NaN). Under ``jit`` with the leading axis
    sharded over a mesh axis, the compiler turns the sum into one cross-device
    reduction of the combined leaves.
    """
    return jax.vmap(
        lambda x, n: weighted_mean_across(x, n, _DEVICES),
        axis_name=_DEVICES,
        out_axes=None,
    )(tree, counts)
