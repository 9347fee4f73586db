"""Each device's own gradient, for data parallelism that reduces once per window.

Under ``jit`` with a batch sharded over devices, ``jax.value_and_grad`` of a
replicated model returns the *global* gradient: the compiler sums the devices'
contributions with an all-reduce inside the step, on every microbatch. The
functions here keep each device's gradient local instead, so the reduction can
wait for the end of a window:

* :func:`per_device_value_and_grad` returns every device's own mean loss, token
  count and mean gradient, stacked along a leading device axis sharded over the
  mesh axis: no cross-device reduction at all. ``MaskedMultiSteps(...,
  reduction=mm.deferred(mesh, axis))`` accumulates them per device and combines
  them once per window.
* :func:`data_parallel_value_and_grad` runs a whole in-jit microbatch loop on
  every device's rows and combines the devices once at the end: one reduction
  per call, not one per loop iteration.

Both run the loss inside ``jax.shard_map`` over the batch's mesh axes only (other
mesh axes, say a tensor-parallel one, stay under the compiler's automatic
sharding), with the replication check off (``check_vma=False``): the body holds
no collective over those axes, so a gradient taken inside it is the device's
own, never summed over the devices.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Concatenate, Literal, Never, cast, overload

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from masked_multistep import _equinox, _stats
from masked_multistep._checks import (
    check_flag,
    holds_equinox_module,
    refuse_unknown_keywords,
    type_spec,
)
from masked_multistep._microbatch import (
    CALL_HINTS,
    KEYWORD_HINTS,
    MICROBATCH_KEYWORDS,
    GradFn,
    GradFnWithLeafStats,
    GradFnWithStats,
    ParamsT,
    _aux_reductions,
    _batch_size,
    _check_args,
    _check_params,
    _check_rng,
    _grad_fn,
    _sum_dtype,
    check_per_leaf_stats,
)
from masked_multistep._nnx_state import check_wrt, refuse_module_state, selected_state
from masked_multistep._placement import resharded_as, spec_axes, without_axes
from masked_multistep._reduction import (
    any_explicit,
    check_mesh_axes,
    mean_over_devices,
)

__all__ = ["per_device_value_and_grad", "data_parallel_value_and_grad"]


def _check_batch(batch: Any, num_devices: int, num_microbatches: int) -> None:
    # One leading size, checked on the whole batch (the caller's sizes, not a
    # device's share of them).
    size = _batch_size(batch, 1)
    if size % (num_devices * num_microbatches):
        raise ValueError(
            "The batch size (the leading axis of every `batch` leaf) must be "
            f"divisible by the number of devices ({num_devices}) times "
            f"`num_microbatches` ({num_microbatches}), got {size}"
        )


# What `microbatched_value_and_grad` hints; here `k` is per device.
_HINTS = {
    **KEYWORD_HINTS,
    **dict.fromkeys(
        MICROBATCH_KEYWORDS, "the microbatches per device are `num_microbatches=`"
    ),
}


@overload
def per_device_value_and_grad(
    loss_fn: Callable[Concatenate[ParamsT, ...], Any],
    mesh: jax.sharding.Mesh,
    axis_name: Hashable | Sequence[Hashable] = "data",
    *,
    num_microbatches: int | np.integer = 1,
    has_aux: bool | np.bool_ = False,
    aux_reduction: Any = None,
    wrt: None = None,
) -> GradFn[ParamsT, Any]: ...


@overload
def per_device_value_and_grad(  # with `wrt`: the gradients are an nnx.State
    loss_fn: Callable[..., Any],
    mesh: jax.sharding.Mesh,
    axis_name: Hashable | Sequence[Hashable] = "data",
    *,
    num_microbatches: int | np.integer = 1,
    has_aux: bool | np.bool_ = False,
    aux_reduction: Any = None,
    wrt: Any,
) -> GradFn[Any, Any]: ...


def per_device_value_and_grad(
    loss_fn: Callable[Concatenate[ParamsT, ...], Any],
    mesh: jax.sharding.Mesh,
    axis_name: Hashable | Sequence[Hashable] = "data",
    *,
    num_microbatches: int | np.integer = 1,
    has_aux: bool | np.bool_ = False,
    aux_reduction: Any = None,
    wrt: Any = None,
    **unknown: Never,  # a misspelt keyword: flagged by a type checker, hinted
) -> GradFn[ParamsT, Any] | GradFn[Any, Any]:
    """Every device's own ``value_and_grad`` of a masked mean loss, unreduced.

    The batch's leading axis is split over the mesh axes ``axis_name`` (``D``
    devices; device ``d`` holds rows ``d·B/D … (d+1)·B/D − 1``, the layout of
    ``NamedSharding(mesh, P(axis_name))``). Each device computes, on its rows
    only, what :func:`microbatched_value_and_grad` computes on a batch::

        lossᵈ = Σ nᵢᵈ ℓᵢᵈ / nᵈ     countᵈ = nᵈ     gradsᵈ = Σ nᵢᵈ ∇ℓᵢᵈ / nᵈ

    and the results come back stacked along a new leading axis of size ``D``,
    sharded over ``axis_name``: entry ``d`` lives on device ``d``, and no
    cross-device reduction runs (the compiled step contains none for the
    gradients). The global full-batch values are the token-weighted means over
    that axis, ``Σ_d nᵈ gradsᵈ / Σ_d nᵈ``; hand the stacked values to
    ``MaskedMultiSteps(..., reduction=mm.deferred(mesh, axis_name))``, which
    keeps one running mean per device and combines them once per window.

    A device whose rows hold no tokens returns count ``0`` and zeros (not the
    ``0/0`` NaN), as :func:`microbatched_value_and_grad` does. Params are taken
    replicated over ``axis_name``: parameters sharded over it (FSDP) are
    gathered on entry, and every device's gradient is then a full-size buffer.
    Other mesh axes keep the compiler's automatic sharding. ``params`` may be
    an NNX module whose state is only ``nnx.Param`` (its gradients come back
    as a module of the same class; with ``wrt=``, an ``nnx.State`` of the
    variables it selects, the others held fixed, as in
    :func:`microbatched_value_and_grad`); a module that also holds RNG
    streams or batch statistics is refused with the ``nnx.split`` recipe, as
    state carried from one microbatch to the next cannot be split over
    devices. An equinox module goes in whole, as in
    :func:`microbatched_value_and_grad` (its floating arrays differentiated,
    ``None`` in the gradients elsewhere); its leaves that are neither arrays
    nor ``None`` (functions, Python numbers) are a static argument of the
    compiled program, as under ``eqx.filter_jit``: hashable, a compile for
    each new one.

    Args:
      loss_fn: ``loss_fn(params, microbatch) -> (mean_loss, count)``, or
        ``(mean_loss, (count, aux))`` with ``has_aux=True`` (as
        :func:`masked_mean` returns).
      mesh: the ``jax.sharding.Mesh`` the batch is sharded on; its axes may be
        ``AxisType.Auto`` or ``AxisType.Explicit`` (``jax.make_mesh``'s default).
      axis_name: the mesh axis (or tuple of axes, all of one type) the
        batch's leading axis is split over.
      num_microbatches: in-jit microbatches per device and call (``k``): each
        device runs :func:`microbatched_value_and_grad` on its rows.
      has_aux: whether ``loss_fn`` returns ``aux``; it comes back per device,
        combined over the device's microbatches as ``aux_reduction`` says.
      aux_reduction: as in :func:`microbatched_value_and_grad`: ``"sum"``,
        ``"mean"`` or a pytree prefix of ``aux`` with those leaves (required
        for floating ``aux`` leaves).
      wrt: for an NNX module of parameters passed as ``params``, an ``nnx``
        filter of the variables to differentiate (``nnx.LoRAParam``), as in
        :func:`microbatched_value_and_grad`.

    Returns:
      ``grad_fn(params, batch, *, rng=None) -> ((loss, count), grads)``
      (``((loss, (count, aux)), grads)`` with ``has_aux``), every leaf with a
      leading axis of size ``D`` sharded over ``axis_name``: ``loss`` (in
      ``loss_fn``'s dtype) and ``count`` (float32) have shape ``(D,)``, each
      gradient leaf ``(D, *param.shape)``. With ``rng``, device ``d`` uses
      ``jax.random.fold_in(rng, d)`` as its key (and folds in the microbatch
      index as :func:`microbatched_value_and_grad` does), so the devices draw
      different dropout masks.

    Raises:
      TypeError: if ``mesh`` is not a ``jax.sharding.Mesh``; and as
        :func:`microbatched_value_and_grad` does for ``loss_fn``,
        ``num_microbatches`` and ``has_aux``; when called, if an equinox
        module holds a leaf that is neither an array nor hashable.
      ValueError: if ``axis_name`` is not an axis of ``mesh``, names one
        twice, or names axes of both types (``AxisType.Explicit`` and
        ``AxisType.Auto``); when called, if a
        ``batch`` leaf's leading size is not divisible by ``D·num_microbatches``,
        or a 64-bit numpy integer leaf holds values that jax (without x64)
        would wrap into 32 bits.

    Examples:
      Each device's own mean over its rows, and the global mean from them:

      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> import masked_multistep as mm
      >>> n = len(jax.devices())
      >>> mesh = jax.make_mesh((n,), ("data",),
      ...                      axis_types=(jax.sharding.AxisType.Auto,))
      >>> def loss_fn(w, mb):
      ...     return mm.masked_mean(w * mb["x"], mb["mask"])
      >>> batch = jax.device_put(
      ...     {"x": jnp.arange(2.0 * n)[:, None], "mask": jnp.ones((2 * n, 1), bool)},
      ...     NamedSharding(mesh, P("data")))
      >>> grad_fn = jax.jit(mm.per_device_value_and_grad(loss_fn, mesh, "data"))
      >>> (loss, count), grad = grad_fn(jnp.array(1.0), batch)
      >>> print(grad.shape == (n,), count.shape == (n,), float(grad[0]))
      True True 0.5
      >>> float((grad * count).sum() / count.sum()) == (2 * n - 1) / 2  # global
      True
    """
    refuse_unknown_keywords(
        "per_device_value_and_grad",
        unknown,
        per_device_value_and_grad,
        {
            **_HINTS,
            "with_stats": (
                "each device's gradient stays unreduced here; the window's "
                "statistics come from MaskedMultiSteps(..., window_stats=True, "
                "reduction=mm.deferred(...)), one call's from "
                "mm.data_parallel_value_and_grad(..., with_stats=True)"
            ),
        },
    )
    return cast(
        GradFn[ParamsT, Any],
        _per_device(
            loss_fn,
            mesh,
            axis_name,
            num_microbatches,
            has_aux,
            aux_reduction,
            wrt=check_wrt(wrt),
        ),
    )


def _per_device(
    loss_fn: Callable[..., Any],
    mesh: jax.sharding.Mesh,
    axis_name: Hashable | Sequence[Hashable],
    num_microbatches: int | np.integer,
    has_aux: bool | np.bool_,
    aux_reduction: Any,
    stats_sums: bool = False,
    per_leaf: bool = False,
    wrt: Any = None,
) -> Callable[..., Any]:
    """:func:`per_device_value_and_grad`; with ``stats_sums`` each device also
    returns its microbatches' ``(Σ nᵢ‖gᵢ‖², K)`` (shape ``(D,)`` each; with
    ``per_leaf``, each leaf's sums instead of the total, shape ``(D, L)``).
    ``wrt``: a checked ``nnx`` filter (:func:`_nnx_state.check_wrt`)."""
    # (`microbatched_value_and_grad` takes the number positionally.)
    axes, num_devices = check_mesh_axes(
        mesh,
        axis_name,
        int_hint="the number of microbatches is keyword-only here "
        "(`num_microbatches={}`)",
    )
    k, has_aux, stats_sums = _check_args(
        loss_fn, num_microbatches, has_aux, aux_reduction, stats_sums
    )
    grad_fn = _grad_fn(
        loss_fn,
        k,
        has_aux,
        aux_reduction,
        "sums" if stats_sums else None,
        per_leaf=per_leaf,
        # With `wrt`, the module is split inside each device's call; a module
        # holding state besides parameters is refused before (`per_device`).
        module_state=wrt is not None,
        wrt=wrt,
    )
    spec = P(axes[0] if len(axes) == 1 else axes)

    def on_device(params, batch, rng, *, static):
        params = _equinox.rebuild(params, static)
        if rng is None:
            out = grad_fn(params, batch)
        else:
            device = jax.lax.axis_index(axes)
            out = grad_fn(params, batch, rng=jax.random.fold_in(rng, device))
        return jax.tree.map(lambda x: jnp.expand_dims(x, 0), out)

    # Jitted: outside `jit`, jax runs a shard_map over some of a mesh's axes
    # (the data axes of a data × model mesh) only traced. (Under the caller's
    # `jit` the inner one is inlined.)
    # (`static`: an equinox module's leaves that are not arrays, its functions.)
    def on_devices(params, batch, rng, static):
        return jax.shard_map(
            functools.partial(on_device, static=static),
            mesh=mesh,
            in_specs=(P(), spec, P()),
            out_specs=spec,
            axis_names=frozenset(axes),
            # The body runs on local rows only, with no collective over `axes`, so
            # the gradient is the device's own. (With the check on, the gradient of
            # the replicated params would be summed over the devices unless they
            # were pcast to varying, and the in-jit loop's carry, which starts from
            # invariant zeros, would not type-check.)
            check_vma=False,
        )(params, batch, rng)

    mapped = jax.jit(on_devices, static_argnums=3)

    def per_device(
        params: optax.Params,
        batch: Any,
        *,
        rng: jax.typing.ArrayLike | None = None,
        **keywords: Any,
    ) -> tuple[Any, optax.Updates]:
        refuse_unknown_keywords("grad_fn", keywords, per_device, CALL_HINTS)
        _check_batch(batch, num_devices, k)
        if wrt is not None:
            refuse_module_state(params, wrt)
        # An equinox module's arrays cross the shard_map, the rest is static.
        arrays, static = _equinox.arrays_and_static(params)
        if wrt is None and static is None:  # (jax's error names no path)
            _check_params(params)
        key = None if rng is None else _check_rng(rng)
        with jax.named_scope("masked_multistep/per_device"):
            return mapped(
                _gathered_over(arrays, frozenset(axes)),
                _split_over(batch, mesh, axes),
                key,
                static,
            )

    return per_device


def _gathered_over(params: Any, axes: frozenset) -> Any:
    """``params`` with every leaf sharded over an ``AxisType.Explicit`` axis
    of ``axes`` resharded to whole over it (an all-gather: FSDP-style params).

    The loss runs on every device's rows with the params replicated over the
    data axes (``in_specs=P()``); under automatic sharding the compiler
    gathers them itself, under explicit sharding the gather is spelt out.
    """

    def sharded_over(x: Any) -> bool:
        return any(spec_axes(entry) & axes for entry in type_spec(x))

    if not any(sharded_over(x) for x in jax.tree.leaves(params)):
        return params  # as given (an NNX module stays the same object)

    def leaf(x: Any) -> Any:
        if not sharded_over(x):
            return x
        kept = [without_axes(entry, axes) for entry in type_spec(x)]
        return jax.sharding.reshard(x, _on_mesh_of(x, P(*kept)))

    return jax.tree.map(leaf, params)


def _split_over(batch: Any, mesh: jax.sharding.Mesh, axes: tuple) -> Any:
    """``batch`` with every leaf's rows split over ``axes``, where those are
    ``AxisType.Explicit`` axes and a leaf's type lays its rows out otherwise
    (a replicated array, or host data: a reshard, as the compiler moves the
    rows itself on automatic axes). Its other dimensions keep their layout."""
    if not any_explicit(mesh, axes):
        return batch
    lead = axes[0] if len(axes) == 1 else tuple(axes)

    def leaf(x: Any) -> Any:
        spec = tuple(type_spec(x))
        if spec[:1] == (lead,):
            return x
        rest = [without_axes(entry, axes) for entry in spec[1:]]
        return jax.sharding.reshard(x, jax.sharding.NamedSharding(mesh, P(lead, *rest)))

    return jax.tree.map(leaf, batch)


def _placed_like(grads: Any, params: Any) -> Any:
    """The combined ``grads`` laid out as ``params`` are where their types say
    otherwise, on explicit axes (FSDP-style params: a reduce-scatter's result),
    so that they meet an accumulator built from the params
    (:func:`resharded_as`, leaf by leaf)."""
    g_leaves, g_def = jax.tree.flatten(grads)
    p_leaves = jax.tree.leaves(params)
    if len(p_leaves) != len(g_leaves):
        return grads  # an NNX module and its gradient State: left as they are
    return jax.tree.unflatten(g_def, list(map(resharded_as, g_leaves, p_leaves)))


def _on_mesh_of(x: Any, spec: Any) -> Any:
    """``spec`` on the mesh of ``x``'s type: a sharding that needs no
    ``jax.set_mesh`` context."""
    return jax.sharding.NamedSharding(jax.typeof(x).sharding.mesh, spec)


def _combine(out: Any, has_aux: bool, aux_reduction: Any) -> tuple[Any, optax.Updates]:
    """Per-device ``((loss, count[, aux]), grads)`` to the global values.

    Loss, gradients and ``"mean"`` aux leaves are token-weighted means over the
    devices (one reduction); ``"sum"`` aux leaves are summed.
    """
    (loss, rest), grads = out
    count, aux = rest if has_aux else (rest, None)
    aux_leaves, aux_def = jax.tree.flatten(aux)
    per_device_aux = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), aux
    )
    reductions = _aux_reductions(per_device_aux, aux_reduction) if has_aux else ()
    means = [x for x, r in zip(aux_leaves, reductions, strict=True) if r == "mean"]
    (loss, means, grads), total = mean_over_devices((loss, means, grads), count)
    if not has_aux:
        return (loss, total), grads
    means = iter(means)
    aux = jax.tree.unflatten(
        aux_def,
        [
            next(means) if r == "mean" else x.sum(0, dtype=_sum_dtype(x.dtype))
            for x, r in zip(aux_leaves, reductions, strict=True)
        ],
    )
    return (loss, (total, aux)), grads


@overload
def data_parallel_value_and_grad(
    loss_fn: Callable[Concatenate[ParamsT, ...], Any],
    mesh: jax.sharding.Mesh,
    axis_name: Hashable | Sequence[Hashable] = "data",
    *,
    num_microbatches: int | np.integer = 1,
    has_aux: bool | np.bool_ = False,
    aux_reduction: Any = None,
    with_stats: Literal[False] = False,
    per_leaf_stats: Literal[False] = False,
    wrt: None = None,
) -> GradFn[ParamsT, Any]: ...


@overload
def data_parallel_value_and_grad(
    loss_fn: Callable[Concatenate[ParamsT, ...], Any],
    mesh: jax.sharding.Mesh,
    axis_name: Hashable | Sequence[Hashable] = "data",
    *,
    num_microbatches: int | np.integer = 1,
    has_aux: bool | np.bool_ = False,
    aux_reduction: Any = None,
    with_stats: Literal[True],
    per_leaf_stats: Literal[False] = False,
    wrt: None = None,
) -> GradFnWithStats[ParamsT, Any]: ...


@overload
def data_parallel_value_and_grad(
    loss_fn: Callable[Concatenate[ParamsT, ...], Any],
    mesh: jax.sharding.Mesh,
    axis_name: Hashable | Sequence[Hashable] = "data",
    *,
    num_microbatches: int | np.integer = 1,
    has_aux: bool | np.bool_ = False,
    aux_reduction: Any = None,
    with_stats: Literal[True],
    per_leaf_stats: Literal[True],
    wrt: None = None,
) -> GradFnWithLeafStats[ParamsT, Any]: ...


@overload
def data_parallel_value_and_grad(  # flags known at run time only (`cfg.stats`)
    loss_fn: Callable[Concatenate[ParamsT, ...], Any],
    mesh: jax.sharding.Mesh,
    axis_name: Hashable | Sequence[Hashable] = "data",
    *,
    num_microbatches: int | np.integer = 1,
    has_aux: bool | np.bool_ = False,
    aux_reduction: Any = None,
    with_stats: bool | np.bool_,
    per_leaf_stats: bool | np.bool_ = False,
    wrt: None = None,
) -> (
    GradFn[ParamsT, Any]
    | GradFnWithStats[ParamsT, Any]
    | GradFnWithLeafStats[ParamsT, Any]
): ...


@overload
def data_parallel_value_and_grad(  # with `wrt`: the gradients are an nnx.State
    loss_fn: Callable[..., Any],
    mesh: jax.sharding.Mesh,
    axis_name: Hashable | Sequence[Hashable] = "data",
    *,
    num_microbatches: int | np.integer = 1,
    has_aux: bool | np.bool_ = False,
    aux_reduction: Any = None,
    with_stats: Literal[False] = False,
    per_leaf_stats: Literal[False] = False,
    wrt: Any,
) -> GradFn[Any, Any]: ...


@overload
def data_parallel_value_and_grad(
    loss_fn: Callable[..., Any],
    mesh: jax.sharding.Mesh,
    axis_name: Hashable | Sequence[Hashable] = "data",
    *,
    num_microbatches: int | np.integer = 1,
    has_aux: bool | np.bool_ = False,
    aux_reduction: Any = None,
    with_stats: Literal[True],
    per_leaf_stats: Literal[False] = False,
    wrt: Any,
) -> GradFnWithStats[Any, Any]: ...


@overload
def data_parallel_value_and_grad(
    loss_fn: Callable[..., Any],
    mesh: jax.sharding.Mesh,
    axis_name: Hashable | Sequence[Hashable] = "data",
    *,
    num_microbatches: int | np.integer = 1,
    has_aux: bool | np.bool_ = False,
    aux_reduction: Any = None,
    with_stats: Literal[True],
    per_leaf_stats: Literal[True],
    wrt: Any,
) -> GradFnWithLeafStats[Any, Any]: ...


@overload
def data_parallel_value_and_grad(
    loss_fn: Callable[..., Any],
    mesh: jax.sharding.Mesh,
    axis_name: Hashable | Sequence[Hashable] = "data",
    *,
    num_microbatches: int | np.integer = 1,
    has_aux: bool | np.bool_ = False,
    aux_reduction: Any = None,
    with_stats: bool | np.bool_,
    per_leaf_stats: bool | np.bool_ = False,
    wrt: Any,
) -> GradFn[Any, Any] | GradFnWithStats[Any, Any] | GradFnWithLeafStats[Any, Any]: ...


def data_parallel_value_and_grad(
    loss_fn: Callable[Concatenate[ParamsT, ...], Any],
    mesh: jax.sharding.Mesh,
    axis_name: Hashable | Sequence[Hashable] = "data",
    *,
    num_microbatches: int | np.integer = 1,
    has_aux: bool | np.bool_ = False,
    aux_reduction: Any = None,
    with_stats: bool | np.bool_ = False,
    per_leaf_stats: bool | np.bool_ = False,
    wrt: Any = None,
    **unknown: Never,  # a misspelt keyword: flagged by a type checker, hinted
) -> (
    GradFn[ParamsT, Any]
    | GradFnWithStats[ParamsT, Any]
    | GradFnWithLeafStats[ParamsT, Any]
):
    """In-jit microbatching over data-parallel devices, reduced once per call.

    The result is that of :func:`microbatched_value_and_grad` (``jax.value_and_grad``
    of the full batch's masked mean loss), computed so that the devices
    exchange gradients once: each device runs the ``k``-microbatch loop over its
    own rows (:func:`per_device_value_and_grad`), and the per-device means are
    combined at the end, token-weighted::

        grads = Σ_d nᵈ gradsᵈ / Σ_d nᵈ        count = Σ_d nᵈ

    with the arithmetic of :func:`weighted_mean_across` (a device with no tokens
    contributes nothing). :func:`microbatched_value_and_grad` under plain
    ``jit`` on a sharded batch instead lets the compiler all-reduce every
    microbatch's gradient inside the loop: ``k`` reductions per call instead of
    one. The microbatches differ too: device ``d`` splits its own block of rows
    (``d·B/D …``), so the loss is the same up to rounding, whatever the split.
    ``params`` takes what :func:`per_device_value_and_grad` takes (an NNX
    module of parameters, an equinox module whole).

    Args:
      loss_fn: ``loss_fn(params, microbatch) -> (mean_loss, count)``, or
        ``(mean_loss, (count, aux))`` with ``has_aux=True``.
      mesh: the ``jax.sharding.Mesh`` the batch is sharded on; its axes may be
        ``AxisType.Auto`` or ``AxisType.Explicit`` (``jax.make_mesh``'s default).
      axis_name: the mesh axis (or tuple of axes, all of one type) the batch
        is split over.
      num_microbatches: microbatches per device (``k``); the batch size must be
        divisible by ``D·k``.
      has_aux: whether ``loss_fn`` returns ``aux``.
      aux_reduction: as in :func:`microbatched_value_and_grad`: ``"mean"``
        leaves come back as token-weighted means over the whole batch,
        ``"sum"`` leaves summed over every device's microbatches.
      with_stats: also return the call's :class:`WindowStats`, every device's
        microbatch a small batch of its own (``K`` counts the ``D·k``
        device microbatches with tokens). Each device keeps its own
        ``Σ nᵢ‖gᵢ‖²`` and ``K``; their sums (8 bytes) join the one reduction.
      per_leaf_stats: with ``with_stats=True``, each parameter leaf's
        statistics, as in :func:`microbatched_value_and_grad` (each device
        keeps one sum per leaf: 4 bytes per leaf join the reduction).
      wrt: for an NNX module of parameters passed as ``params``, an ``nnx``
        filter of the variables to differentiate, as in
        :func:`per_device_value_and_grad`.

    Returns:
      ``grad_fn(params, batch, *, rng=None) -> ((loss, count), grads)``
      (``((loss, (count, aux)), grads)`` with ``has_aux``), the full batch's
      values, as :func:`microbatched_value_and_grad` returns them (``rng``: as
      in :func:`per_device_value_and_grad`); with ``with_stats=True``, a
      third element: the :class:`WindowStats`.

    Raises:
      TypeError: if ``with_stats`` or ``per_leaf_stats`` is not a bool, or
        ``per_leaf_stats=True`` comes without ``with_stats=True``; and as
        :func:`per_device_value_and_grad`.
      ValueError: as :func:`per_device_value_and_grad`.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> import masked_multistep as mm
      >>> n = len(jax.devices())
      >>> mesh = jax.make_mesh((n,), ("data",),
      ...                      axis_types=(jax.sharding.AxisType.Auto,))
      >>> def loss_fn(w, mb):
      ...     return mm.masked_mean(w * mb["x"], mb["mask"])
      >>> x = jnp.arange(4.0 * n)[:, None]
      >>> mask = x % 3 == 0  # rows with a token: 0, 3, 6, ...
      >>> batch = jax.device_put({"x": x, "mask": mask}, NamedSharding(mesh, P("data")))
      >>> grad_fn = jax.jit(mm.data_parallel_value_and_grad(
      ...     loss_fn, mesh, "data", num_microbatches=2))
      >>> (loss, count), grad = grad_fn(jnp.array(1.0), batch)
      >>> bool(jnp.allclose(grad, x[mask].mean())), int(count) == int(mask.sum())
      (True, True)

      With ``with_stats=True``, the call's statistics too: ``K`` counts every
      device's microbatches that hold a token (device ``d``'s microbatch ``j``
      is its local rows ``j, j + 2``):

      >>> stats_fn = jax.jit(mm.data_parallel_value_and_grad(
      ...     loss_fn, mesh, "data", num_microbatches=2, with_stats=True))
      >>> _, _, stats = stats_fn(jnp.array(1.0), batch)
      >>> k = mask.reshape(n, 2, 2).any(axis=1).sum()  # (device, row, microbatch)
      >>> int(stats.microbatches) == int(k), float(stats.tokens) == int(mask.sum())
      (True, True)

    References:
      D. H. D. West, "Updating mean and variance estimates: an improved method",
      Communications of the ACM 22(9), 1979.
    """
    refuse_unknown_keywords(
        "data_parallel_value_and_grad", unknown, data_parallel_value_and_grad, _HINTS
    )
    has_aux = check_flag(has_aux, "`has_aux`")
    with_stats = check_flag(with_stats, "`with_stats`")
    per_leaf = check_per_leaf_stats(per_leaf_stats, with_stats)
    wrt = check_wrt(wrt)
    per_device = _per_device(
        loss_fn,
        mesh,
        axis_name,
        num_microbatches,
        has_aux,
        aux_reduction,
        with_stats,
        per_leaf,
        wrt=wrt,
    )

    def grad_fn(
        params: ParamsT,
        batch: Any,
        *,
        rng: jax.typing.ArrayLike | None = None,
        **keywords: Any,
    ) -> Any:
        refuse_unknown_keywords("grad_fn", keywords, grad_fn, CALL_HINTS)
        out = per_device(params, batch, rng=rng)
        with jax.named_scope("masked_multistep/combine_devices"):
            (value, grads) = _combine(out[:2], has_aux, aux_reduction)
            # (With `wrt`, laid out as the variables it selects are.)
            # (For an equinox module, its floating arrays.)
            if wrt is not None:
                template = selected_state(params, wrt)
            elif holds_equinox_module(params):
                template = _equinox.split(params)[0]
            else:
                template = params
            combined = value, _placed_like(grads, template)
        if not with_stats:
            return combined
        (loss, rest), grads = combined
        count = rest[0] if has_aux else rest
        sums = _stats.sum_over_devices(*out[2])
        stats = _stats.one_window_stats(sums, tokens=count, mean=grads, loss=loss)
        return (*combined, stats)

    return grad_fn
