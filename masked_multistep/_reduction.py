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
:class:`MaskedMultiSteps` can use: :class:`Local` (the default, ``reduction=None``:
the gradients it receives are already the microbatch's global mean) and
:func:`deferred` (each device's gradients stay local, stacked along a leading
axis of size ``D`` sharded over the mesh axis, and are combined once per window).
Both have the same small interface, so the wrapper's state machine does not
branch on the mode.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from optax import tree as otu

from masked_multistep._collectives import weighted_mean_across
from masked_multistep._running_mean import running_mean_update

__all__ = [
    "Deferred",
    "DeferredState",
    "Local",
    "check_mesh_axes",
    "deferred",
    "mean_over_devices",
]

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


class DeferredState(NamedTuple):
    """The per-device part of a deferred window (``state.reduction_state``).

    Attributes:
      counts: shape ``(D,)``, sharded over the mesh axis: each device's token
        total ``Nᵈ`` behind its running mean in ``acc_grads[d]``.
    """

    counts: jax.Array


def _sharding_of(leaf: Any) -> Any:
    sharding = getattr(leaf, "sharding", None)
    return sharding if isinstance(sharding, NamedSharding) else None


class Local:
    """The gradients handed over are already the microbatch's global mean.

    The default reduction: whatever reduced the devices' gradients (the
    compiler, under ``jit`` with sharded arrays) did so before
    :class:`MaskedMultiSteps` saw them.
    """

    def __repr__(self) -> str:
        return "mm.local()"

    def init_accumulator(self, params: Any, dtype: Any) -> Any:
        return otu.zeros_like(params, dtype=dtype)

    def init(self, count_dtype: Any) -> tuple:
        del count_dtype
        return ()

    def check_grads(self, grads: Any) -> None:
        del grads

    def split_count(self, count: Any) -> tuple[Any, None, jax.Array]:
        return count, None, jnp.ones([], jnp.bool_)

    def accumulate(self, acc, acc_count, reduction_state, grads, n, per_device):
        del per_device
        acc, acc_count = running_mean_update(acc, acc_count, grads, n)
        return acc, acc_count, reduction_state

    def global_value(self, value: Any, per_device: Any) -> Any:
        del per_device
        return value

    def mean(self, acc: Any, reduction_state: Any) -> Any:
        del reduction_state
        return acc

    def reset(self, reduction_state: Any, window_done: jax.Array) -> Any:
        del window_done
        return reduction_state


class Deferred:
    """Each device accumulates its own running mean; combined once per window.

    Build it with :func:`deferred`.
    """

    def __init__(self, mesh: jax.sharding.Mesh, axis_name: Any = "data"):
        self.mesh = mesh
        self.axes, self.size = check_mesh_axes(mesh, axis_name)
        self._spec_axes = self.axes if len(self.axes) > 1 else self.axes[0]

    def __repr__(self) -> str:
        axes = self._spec_axes
        return f"mm.deferred(mesh of {dict(self.mesh.shape)}, {axes!r})"

    # ------------------------------------------------------------------ state

    def _leading_sharding(self, leaf: Any) -> NamedSharding:
        """``P(axes, *rest)``: the device axis over ``axes``; the other dims keep
        the parameter's sharding over the other mesh axes (a dim sharded over
        ``axes`` itself, FSDP-style, is held whole by each device)."""
        rest = [None] * jnp.ndim(leaf)
        sharding = _sharding_of(leaf)
        if sharding is not None and sharding.mesh.shape == self.mesh.shape:
            spec = tuple(sharding.spec) + (None,) * (
                jnp.ndim(leaf) - len(sharding.spec)
            )
            for i, entry in enumerate(spec):
                names = entry if isinstance(entry, tuple) else (entry,)
                if entry is not None and not set(names) & set(self.axes):
                    rest[i] = entry
        return NamedSharding(self.mesh, P(self._spec_axes, *rest))

    def init_accumulator(self, params: Any, dtype: Any) -> Any:
        def leaf(p):
            dt = dtype if dtype is not None else jnp.result_type(p)
            return jnp.zeros(
                (self.size, *jnp.shape(p)), dt, device=self._leading_sharding(p)
            )

        return jax.tree.map(leaf, params)

    def init(self, count_dtype: Any) -> DeferredState:
        return DeferredState(
            counts=jnp.zeros(
                (self.size,),
                count_dtype,
                device=NamedSharding(self.mesh, P(self._spec_axes)),
            )
        )

    # ------------------------------------------------------------- per call

    def check_grads(self, grads: Any) -> None:
        for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
            if jnp.ndim(g) < 1 or jnp.shape(g)[0] != self.size:
                raise ValueError(
                    f"With reduction={self!r}, gradients carry a leading device "
                    f"axis of size {self.size} (as mm.per_device_value_and_grad "
                    f"returns them), got shape {jnp.shape(g)} at "
                    f"{jax.tree_util.keystr(path) or '<root>'}"
                )

    def split_count(self, count: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``(total, per_device, ok)`` from the ``(D,)`` per-device counts.

        ``total`` is the microbatch's global count (the one scalar all-reduce
        per microbatch); ``ok`` whether every device's count is valid.
        """
        if count is None:
            return count, None, jnp.ones([], jnp.bool_)
        arr = jnp.asarray(count)
        kind_ok = jnp.issubdtype(arr.dtype, jnp.integer) or jnp.issubdtype(
            arr.dtype, jnp.floating
        )
        if arr.shape != (self.size,) or not kind_ok:
            raise ValueError(
                f"With reduction={self!r}, `count` holds every device's token count: "
                f"an integer or floating array of shape ({self.size},) (as "
                f"mm.per_device_value_and_grad returns it), got shape {arr.shape} "
                f"and dtype {arr.dtype}"
            )
        if jnp.issubdtype(arr.dtype, jnp.integer):
            ok = arr >= 0
        else:
            ok = jnp.isfinite(arr) & (arr >= 0)
        if not isinstance(arr, jax.core.Tracer) and not bool(np.all(ok)):
            raise ValueError(
                "`count` must be finite and non-negative on every device, got "
                f"{np.asarray(arr).tolist()}"
            )
        per_device = jnp.where(ok, arr, jnp.zeros_like(arr))
        # One scalar all-reduce for both the total and the validity check.
        total, num_bad = jnp.sum(
            jnp.stack([per_device, (~ok).astype(arr.dtype)]), axis=1
        )
        return total, per_device, num_bad == 0

    def accumulate(self, acc, acc_count, reduction_state, grads, n, per_device):
        """Every device's running mean (one :func:`running_mean_update`, mapped
        over the device axis); the global total advances by the global count."""
        take = n > 0
        per_device = jnp.where(take, per_device, jnp.zeros_like(per_device)).astype(
            reduction_state.counts.dtype
        )
        acc, counts = jax.vmap(running_mean_update)(
            acc, reduction_state.counts, grads, per_device
        )
        acc_count = jnp.where(take, acc_count + n, acc_count).astype(acc_count.dtype)
        return acc, acc_count, DeferredState(counts)

    def global_value(self, value: Any, per_device: Any) -> Any:
        """The microbatch's global token-weighted mean of per-device ``value``s."""
        value = jnp.asarray(value)
        if value.shape == ():
            return value
        if value.shape != (self.size,):
            raise ValueError(
                f"With reduction={self!r}, `value` is a scalar or one value per "
                f"device, shape ({self.size},), got shape {value.shape}"
            )
        mean, _ = mean_over_devices(value, per_device)
        return mean

    def mean(self, acc: Any, reduction_state: DeferredState) -> Any:
        """The window's global mean: ``Σ_d (Nᵈ/N)·mᵈ``, one reduction."""
        mean, _ = mean_over_devices(acc, reduction_state.counts)
        return mean

    def reset(self, reduction_state: DeferredState, window_done: jax.Array):
        counts = reduction_state.counts
        return DeferredState(jnp.where(window_done, jnp.zeros_like(counts), counts))


def deferred(mesh: jax.sharding.Mesh, axis_name: Any = "data") -> Deferred:
    """Defer the cross-device gradient reduction to the end of each window.

    For ``MaskedMultiSteps(..., reduction=mm.deferred(mesh, axis_name))``. The
    gradients and counts handed to ``update`` are every device's own, stacked
    along a leading axis of size ``D`` (the devices of ``axis_name``), as
    :func:`per_device_value_and_grad` returns them. Each device keeps its own
    token-weighted running mean of its gradients (the accumulator gets the
    leading axis, sharded over ``axis_name``: no cross-device traffic), and the
    window's end combines them, token-weighted::

        mean = Σ_d (Nᵈ / N) · mᵈ        N = Σ_d Nᵈ

    one gradient-sized all-reduce per window instead of one per microbatch. A
    device with no tokens in the window contributes nothing, even if its
    gradients were NaN. The window's token total (the global count) costs a
    scalar all-reduce per microbatch, so every device agrees on it. The inner
    optimizer sees the global full-batch token-mean gradient, as without the
    mode.

    Memory: the accumulator holds ``D`` copies of the gradients, one per device;
    each device stores its own, a full-size buffer. With parameters sharded
    over ``axis_name`` (FSDP), that is ``D`` times the ``1/D`` share that
    reducing (reduce-scattering) every microbatch needs; see the README.

    Args:
      mesh: the ``jax.sharding.Mesh`` the batch is sharded on.
      axis_name: the mesh axis (or tuple of axes) the batch is split over.

    Returns:
      The reduction, for ``MaskedMultiSteps``' ``reduction=`` argument.

    Raises:
      TypeError: if ``mesh`` is not a ``jax.sharding.Mesh``.
      ValueError: if ``axis_name`` does not name axes of ``mesh``.

    Examples:
      >>> import jax, jax.numpy as jnp, optax
      >>> import masked_multistep as mm
      >>> n = len(jax.devices())
      >>> mesh = jax.make_mesh((n,), ("data",),
      ...                      axis_types=(jax.sharding.AxisType.Auto,))
      >>> tx = mm.MaskedMultiSteps(optax.sgd(1.0), 2,
      ...                          reduction=mm.deferred(mesh, "data"))
      >>> state = tx.init({"w": jnp.zeros(3)})
      >>> state.acc_grads["w"].shape == (n, 3)  # one running mean per device
      True
    """
    return Deferred(mesh, axis_name)
