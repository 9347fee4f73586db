"""Moving a deferred window onto another number of devices.

With ``reduction=mm.deferred(mesh, axis)`` the wrapper's state holds one
running mean per device of ``axis`` (``acc_grads``' leading axis) and each
device's share of the window's figures (``reduction_state``): a checkpoint of
it restores only onto as many devices. :func:`device_count_target` gives the
tree to restore such a checkpoint into on the new mesh, and
:func:`from_device_count` regroups the old devices' shares into the new
devices', token-weighted, so the window in progress continues with the same
mean, token total, loss and statistics.

Old device ``d`` of ``D`` joins new device ``⌊d·D′/D⌋`` of ``D′``: when the
count shrinks each new device takes a contiguous group of old ones (their
running means combined as the window's end combines all of them, by
:func:`mean_over_devices`, the one weighted mean); when it grows some new
devices start empty. Token totals, invalid counts, the statistics' sums and
microbatch counts add up; the window's global figures are unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.core
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from masked_multistep._checkpoint import _like_template
from masked_multistep._checks import check_microbatches
from masked_multistep._deferred import _exact_sums
from masked_multistep._multisteps import MaskedMultiStepsState
from masked_multistep._reduction import _from_host, mean_over_devices, placed_like

__all__ = ["device_count_target", "from_device_count"]

# The fields that carry the device axis, and those that identify the wrapper's
# state where it is held by name (``nnx.state(optimizer)``, which leaves out
# empty fields).
_DEVICE_FIELDS = ("acc_grads", "reduction_state")
_NAMED = frozenset(("mini_step", "gradient_step", "acc_count", *_DEVICE_FIELDS))
# Per-device fields of the reduction state and the weights their entries are
# means over; every other field is a sum.
_MEANS = {"value": "value_counts"}
_TOTALS = ("counts", "value_counts")


def _key(entry: Any) -> Any:
    for attr in ("name", "key", "idx"):
        if hasattr(entry, attr):
            return getattr(entry, attr)
    return entry


def _is_state(x: Any) -> bool:
    if isinstance(x, MaskedMultiStepsState):
        return True
    return isinstance(x, Mapping) and _NAMED <= set(x.keys())


def _state_path(tree: Any, what: str) -> tuple[Any, ...]:
    """The path of the one wrapper state in ``tree`` (a bare state, one inside
    a ``TrainState``, a ``dict`` of checkpoint items or ``nnx.state``)."""
    found = [
        path
        for path, x in jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_state)[0]
        if _is_state(x)
    ]
    if len(found) != 1:
        raise ValueError(
            f"`{what}` must hold exactly one MaskedMultiStepsState (bare, in an "
            "optax state, a TrainState, or `nnx.state(optimizer)`), found "
            f"{len(found)}"
        )
    return found[0]


def _device_field(path: tuple[Any, ...], at: tuple[Any, ...]) -> str | None:
    """For a leaf at ``path`` with the wrapper state at ``at``: ``"acc_grads"``
    for the accumulator, the reduction state's field name for its leaves, else
    ``None``."""
    if path[: len(at)] != at or len(path) == len(at):
        return None
    field = _key(path[len(at)])
    if field == "acc_grads":
        return field
    if field == "reduction_state" and len(path) > len(at) + 1:
        return str(_key(path[len(at) + 1]))
    return None


def _devices_of(leaves: list[tuple[Any, Any]], at: tuple[Any, ...], what: str) -> int:
    """The number of devices behind the per-device counts in ``leaves``."""
    for path, x in leaves:
        if _device_field(path, at) == "counts":
            return int(np.shape(x)[0])
    raise ValueError(
        f"`{what}` holds no per-device state: only a wrapper with "
        "reduction=mm.deferred(mesh, axis) keeps one (any other state restores "
        "onto any number of devices as it is)"
    )


def _where(path: tuple[Any, ...]) -> str:
    return jax.tree_util.keystr(path) or "<root>"


def device_count_target(template: Any, num_devices: int) -> Any:
    """The tree to restore a deferred state saved on ``num_devices`` devices into.

    ``template`` as it is, but for the leaves with a device axis (the
    accumulator and the reduction's per-device state), which become
    ``jax.ShapeDtypeStruct``\\ s of ``num_devices`` entries on the template's
    mesh: sharded over its axis where ``num_devices`` is a multiple of the
    axis' size (each device then restores ``num_devices / D′`` running means),
    replicated otherwise (every device holds all ``num_devices`` while
    converting). Restore against it (through ``ocp.utils.to_shape_dtype_struct``
    for orbax, which leaves these as they are), then convert with
    :func:`from_device_count`.

    Args:
      template: what the checkpoint's item is restored against on the new
        mesh: ``tx.init(params)`` of ``MaskedMultiSteps(...,
        reduction=mm.deferred(new_mesh, axis))`` (or its abstract form), or a
        tree holding it: a ``TrainState``, a ``dict`` of items,
        ``nnx.state(optimizer)``.
      num_devices: the number of devices of the saved state's axis.

    Returns:
      ``template``'s tree with the device-axis leaves resized.

    Raises:
      TypeError: if ``num_devices`` is not an integer.
      ValueError: if ``num_devices`` is below 1, or ``template`` holds no
        wrapper state, several, or one without a deferred reduction.

    Examples:
      >>> import jax, jax.numpy as jnp, optax
      >>> import masked_multistep as mm
      >>> mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1],
      ...                      axis_types=(jax.sharding.AxisType.Auto,))
      >>> tx = mm.MaskedMultiSteps(optax.sgd(1.0), 2,
      ...                          reduction=mm.deferred(mesh, "data"))
      >>> target = mm.device_count_target(tx.init({"w": jnp.zeros(3)}), 4)
      >>> target.acc_grads["w"].shape, target.reduction_state.counts.shape
      ((4, 3), (4,))
    """
    num = check_microbatches(num_devices, "`num_devices`")
    at = _state_path(template, "template")
    leaves = jax.tree_util.tree_flatten_with_path(template)[0]
    _devices_of(leaves, at, "template")

    def resize(path: tuple[Any, ...], x: Any) -> Any:
        if _device_field(path, at) is None:
            return x
        return jax.ShapeDtypeStruct(
            (num, *np.shape(x)[1:]),
            jnp.result_type(x),
            sharding=_resized(getattr(x, "sharding", None), num),
        )

    return jax.tree_util.tree_map_with_path(resize, template)


def _resized(sharding: Any, num: int) -> Any:
    """A template leaf's ``sharding`` for ``num`` entries along the device
    axis: as it is where ``num`` divides evenly over the axis, else with that
    axis replicated."""
    if not isinstance(sharding, NamedSharding):
        return sharding
    spec = tuple(sharding.spec) or (None,)
    axes = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
    if num % math.prod(sharding.mesh.shape[a] for a in axes if a is not None):
        spec = (None, *spec[1:])
    return NamedSharding(sharding.mesh, P(*spec))


def _placed(got: Any, want: Any) -> Any:
    """``got`` where the template's ``want`` is: a host or uncommitted value
    as :func:`placed_like` puts it, an array on other devices (a state
    converted in memory, not restored) moved there."""
    got = placed_like(got, want)
    sharding = getattr(want, "sharding", None)
    if (
        isinstance(got, jax.Array)
        and isinstance(sharding, jax.sharding.Sharding)
        and got.sharding.device_set != sharding.device_set
    ):
        return jax.device_put(got, sharding)
    return got


def _groups(old: int, new: int) -> tuple[np.ndarray, np.ndarray]:
    """``(index, member)``, shape ``(new, G)``: the old devices in each new
    device's group (``⌊d·new/old⌋``), padded with index 0 where ``member`` is
    False."""
    target = np.arange(old) * new // old
    size = max(1, int(np.bincount(target, minlength=new).max()))
    index = np.zeros((new, size), np.int32)
    member = np.zeros((new, size), bool)
    for j in range(new):
        (mine,) = np.nonzero(target == j)
        index[j, : len(mine)] = mine
        member[j, : len(mine)] = True
    return index, member


def _regroup(device: dict[str, Any], old: int, new: int) -> tuple[Any, jax.Array]:
    """The per-device leaves regrouped from ``old`` devices into ``new``, and
    whether the restored counts are valid and their groups' totals fit."""
    index, member = _groups(old, new)
    contiguous = old % new == 0
    size = index.shape[1]

    def group(x: jax.Array) -> jax.Array:
        if contiguous:  # each new device's group is a block of the old axis
            return x.reshape(new, size, *x.shape[1:])
        return x[index]

    def masked(x: jax.Array) -> jax.Array:
        x = group(x)
        where = member.reshape(member.shape + (1,) * (x.ndim - 2))
        return jnp.where(where, x, jnp.zeros_like(x))

    rs = device["reduction_state"]
    ok = jnp.ones([], jnp.bool_)
    totals = {}
    for name in _TOTALS:
        if name in rs:
            counts = rs[name]
            ok &= jnp.all(counts >= 0)
            if jnp.issubdtype(counts.dtype, jnp.floating):
                ok &= jnp.all(jnp.isfinite(counts))
            sums, fits = _exact_sums(masked(counts))
            totals[name] = sums
            ok &= jnp.all(fits)

    def mean(tree: Any, weights: str) -> Any:
        counts = masked(rs[weights])
        return jax.vmap(lambda x, n, t: mean_over_devices(x, n, t)[0])(
            jax.tree.map(group, tree), counts, totals[weights]
        )

    out = {"acc_grads": mean(device["acc_grads"], "counts"), "reduction_state": {}}
    for name, x in rs.items():
        if name in totals:
            out["reduction_state"][name] = totals[name]
        elif name in _MEANS:
            out["reduction_state"][name] = mean(x, _MEANS[name])
        else:  # the window's sums: invalid counts, Σ nᵈ‖gᵈ‖², microbatches
            out["reduction_state"][name] = jnp.sum(masked(x), axis=1).astype(x.dtype)
    return out, ok


def from_device_count(restored: Any, template: Any) -> Any:
    """A deferred state from another number of devices, for the template's.

    ``restored`` is a checkpoint restored against
    ``device_count_target(template, D)``: its wrapper state holds ``D``
    devices' running means and shares of the window in progress. The result
    has ``template``'s structure, placement and dtypes, with those shares
    regrouped onto the template's ``D′`` devices (old device ``d`` joins new
    device ``⌊d·D′/D⌋``; see the module docstring) and every other leaf as
    restored. The window continues where it stopped: its mean gradient, token
    total, loss and window statistics are those of the saved state (the means
    of a group are combined in float32, as the window's end combines devices;
    for ``D′ = D`` the state is returned bit for bit). Every field the window
    does not spread over devices (``mini_step``, the inner optimizer's state,
    ...) is kept as restored.

    A state without a window in progress (saved right after a window closed)
    holds nothing per device; converting it costs only the restore of its
    ``D`` empty accumulators.

    Args:
      restored: the restored tree: the template's structure, with ``D``
        entries along the device axis.
      template: the tree :func:`device_count_target` was given (concrete or
        abstract): it says where each converted leaf goes.

    Returns:
      ``restored`` converted, in ``template``'s structure, on its devices.

    Raises:
      TypeError: if called under ``jit`` (the restored counts are read).
      ValueError: if either tree holds no deferred wrapper state, their
        structures differ (the template is of another configuration: another
        inner optimizer, ``window_stats``, skip function or window policy), a
        leaf's shape is not the template's (with ``D`` entries along the
        device axis), a leaf's dtype is of another kind, or the restored counts
        are negative, not finite, or (for an integer ``count_dtype``) add up
        beyond it within a group.

    Examples:
      Two devices' halves of a window (2 tokens of mean 1, 6 tokens of mean 3)
      moved onto one device keep the window's mean, 2.5:

      >>> import jax, jax.numpy as jnp, optax
      >>> import masked_multistep as mm
      >>> mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1],
      ...                      axis_types=(jax.sharding.AxisType.Auto,))
      >>> tx = mm.MaskedMultiSteps(optax.sgd(1.0), 2,
      ...                          reduction=mm.deferred(mesh, "data"))
      >>> params = {"w": jnp.zeros(())}
      >>> template = tx.init(params)
      >>> saved = jax.tree.map(jnp.zeros_like, mm.device_count_target(template, 2))
      >>> saved = saved._replace(  # stands for a checkpoint of two devices
      ...     mini_step=jnp.int32(1),
      ...     acc_grads={"w": jnp.array([1.0, 3.0])},
      ...     reduction_state=saved.reduction_state._replace(
      ...         counts=jnp.array([2.0, 6.0])))
      >>> state = mm.from_device_count(saved, template)
      >>> print(state.acc_grads["w"], state.reduction_state.counts)
      [2.5] [8.]
      >>> updates, state = tx.update({"w": jnp.ones((1,))}, state, params,
      ...                            count=jnp.ones(1))
      >>> print(updates["w"])  # -(8 · 2.5 + 1 · 1) / 9
      -2.3333333
    """
    if any(
        isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((restored, template))
    ):
        raise TypeError(
            "from_device_count reads the restored token counts to check them, so "
            "it must be called eagerly (outside jit), once, after restoring"
        )
    at = _state_path(template, "template")
    t_leaves, treedef = jax.tree_util.tree_flatten_with_path(template)
    new = _devices_of(t_leaves, at, "template")
    if jax.tree.structure(restored) != treedef:
        raise ValueError(
            "`restored` does not have the template's structure: restore against "
            "`mm.device_count_target(template, num_devices)`, with a template "
            "from a wrapper configured as the one that saved the state (the "
            "same inner optimizer, window_stats, skip function and window "
            f"policy); got {jax.tree.structure(restored)}, template {treedef}"
        )
    paired = list(zip(t_leaves, jax.tree.leaves(restored), strict=True))
    old = _devices_of([(p, r) for (p, _), r in paired], at, "restored")
    # The device-axis leaves, keyed as `_regroup` takes them, and where each
    # converted one goes (the template's sharding).
    device: dict[str, dict[str, Any]] = {"acc_grads": {}, "reduction_state": {}}
    shardings: dict[str, dict[str, Any]] = {"acc_grads": {}, "reduction_state": {}}
    keys: list[tuple[str, str] | None] = []
    out: list[Any] = []
    for (path, want), got in paired:
        field = _device_field(path, at)
        shape = np.shape(want)
        expected = shape if field is None else (old, *shape[1:])
        if np.shape(got) != expected:
            raise ValueError(
                f"`restored` holds shape {np.shape(got)} at {_where(path)} where "
                f"{expected} was expected (the template's, with {old} devices "
                "along the device axis)"
            )
        got = _like_template(f"`restored` at {_where(path)}", got, want)
        if field is None:
            keys.append(None)
            out.append(_placed(got, want))
            continue
        key = (
            ("acc_grads", _where(path))
            if field == "acc_grads"
            else (
                "reduction_state",
                field,
            )
        )
        sharding = _resized(want.sharding, old)
        if not getattr(got, "_committed", True):  # read from the host
            got = _from_host(np.asarray(got), sharding)
        elif got.sharding.device_set != sharding.device_set:  # not restored here
            got = jax.device_put(got, sharding)
        device[key[0]][key[1]] = got
        shardings[key[0]][key[1]] = want.sharding
        keys.append(key)
        out.append(None)
    replicated = NamedSharding(shardings["reduction_state"]["counts"].mesh, P())
    converted, ok = jax.jit(
        _regroup, static_argnums=(1, 2), out_shardings=(shardings, replicated)
    )(device, old, new)
    if not bool(ok):
        raise ValueError(
            "`restored` holds per-device token counts that are negative or not "
            "finite, or that add up beyond the count dtype on one of the "
            f"{new} devices: it cannot continue its window on {new} devices"
        )
    out = [x if key is None else converted[key[0]][key[1]] for x, key in zip(out, keys)]
    return jax.tree.unflatten(treedef, out)
