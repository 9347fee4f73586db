"""One process of the two-process data-parallel run in `test_multiprocess.py`.

Usage: ``python _multiprocess_worker.py PROCESS_ID PORT OUT.npz CKPT_DIR``. Each
process owns 2 CPU devices of a global 4-device mesh and feeds only its local
rows of every microbatch. It trains twice: with the compiler's reduction of
every microbatch (automatic sharding), and with the deferred reduction
(``mm.per_device_value_and_grad``, ``reduction=mm.deferred``), where it also
checkpoints the per-device state mid-window (orbax, into ``CKPT_DIR``),
restores it and checks that training continues bit-identically (and, restored
onto 2 devices, one per process, that the window ends as it did). The final
(replicated) parameters of both runs go to ``OUT.npz``.

The model, the data and the optimizer live here so that the test computes its
single-process reference from the very same definitions.
"""

import os
import sys
import traceback

import numpy as np

NUM_PROCESSES, LOCAL_DEVICES = 2, 2
K, WINDOWS, B, T, D = 3, 2, 8, 4, 3


def microbatches():
    """K * WINDOWS global microbatches with skewed masks; one is all-masked."""
    rng = np.random.default_rng(0)
    out = []
    for i in range(K * WINDOWS):
        lengths = rng.integers(0, T + 1, size=B)
        # Skew: the first process's rows hold far more tokens in some steps.
        lengths[: B // 2] = T if i % 2 else lengths[: B // 2]
        if i == 2:
            lengths[:] = 0
        mask = np.arange(T)[None, :] < lengths[:, None]
        out.append(
            {
                "x": np.where(
                    mask[..., None], rng.normal(size=(B, T, D)), np.nan
                ).astype(np.float32),
                "y": rng.normal(size=(B, T)).astype(np.float32),
                "mask": mask,
            }
        )
    return out


def init_params():
    rng = np.random.default_rng(1)
    return {"w": rng.normal(size=(D,)).astype(np.float32), "b": np.float32(0.5)}


def loss_fn(params, mb):
    import jax

    import masked_multistep as mm

    x = jax.numpy.where(mb["mask"][..., None], mb["x"], 0)
    pred = jax.numpy.tanh(x @ params["w"] + params["b"])
    return mm.masked_mean((pred - mb["y"]) ** 2, mb["mask"])


def make_step():
    """The jitted train step: masked loss, MaskedMultiSteps, apply_updates."""
    import jax
    import optax

    import masked_multistep as mm

    tx = mm.MaskedMultiSteps(optax.adam(1e-1), K)

    def step(params, state, mb):
        (loss, count), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, mb)
        updates, state = tx.update(grads, state, params, count=count, value=loss)
        return optax.apply_updates(params, updates), state

    return tx, jax.jit(step, donate_argnums=(0, 1))


def make_deferred_step(mesh):
    """The same step with per-device gradients and one reduction per window,
    window statistics on (their per-device shares wait for the window's end)."""
    import jax
    import optax

    import masked_multistep as mm

    tx = mm.MaskedMultiSteps(
        optax.adam(1e-1), K, reduction=mm.deferred(mesh, "data"), window_stats=True
    )
    grad_fn = mm.per_device_value_and_grad(loss_fn, mesh, "data")

    def step(params, state, mb):
        (loss, count), grads = grad_fn(params, mb)
        return tx.apply_gradients(grads, state, params, count=count, value=loss)

    return tx, jax.jit(step)


def _deferred_run(mesh, global_batches, ckpt_dir):
    """Train in deferred mode; checkpoint mid-window, restore, continue."""
    import jax
    import orbax.checkpoint as ocp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    tx, step = make_deferred_step(mesh)
    params = jax.device_put(init_params(), NamedSharding(mesh, P()))
    state = tx.init(params)
    stop = K + 1  # one microbatch into the second window
    for mb in global_batches[:stop]:
        params, state = step(params, state, mb)
    assert int(state.mini_step) == 1, state.mini_step
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(ckpt_dir, {"params": params, "opt_state": state})
    checkpointer.wait_until_finished()

    def finish(params, state):
        for mb in global_batches[stop:]:
            params, state = step(params, state, mb)
        assert int(state.gradient_step) == WINDOWS, state.gradient_step
        return params, state

    uninterrupted = finish(params, state)
    # A fresh state as the template. tx.init places its leaves on the global
    # mesh (replicated, like everything jit returns); anything else would be
    # restored onto this process's first device.
    template = {"params": params, "opt_state": tx.init(params)}
    replicated = NamedSharding(mesh, P())

    def on_mesh(x):
        sharding = x.sharding if isinstance(x.sharding, NamedSharding) else replicated
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    abstract = jax.tree.map(on_mesh, template)
    restored = checkpointer.restore(ckpt_dir, abstract)
    checkpointer.close()
    # Every device's own token total and statistics' shares (the global ones
    # are formed when the window closes), restored on the devices this
    # process holds.
    for name in ("counts", "sq_norms", "microbatches"):
        restored_leaf = getattr(restored["opt_state"].reduction_state, name)
        for sa, sb in zip(
            restored_leaf.addressable_shards,
            getattr(state.reduction_state, name).addressable_shards,
            strict=True,
        ):
            assert sa.index == sb.index and np.array_equal(sa.data, sb.data), name
    assert float(state.reduction_state.sq_norms.addressable_shards[0].data[0]) > 0
    acc = restored["opt_state"].acc_grads["w"]
    assert acc.shape == (len(jax.devices()), D), acc.shape
    assert acc.sharding.is_equivalent_to(NamedSharding(mesh, P("data")), 2)
    resumed = finish(restored["params"], restored["opt_state"])
    # Bit-identical on every device this process holds (the per-device
    # accumulators span both processes: compare the local shards).
    for a, b in zip(
        jax.tree.leaves(uninterrupted), jax.tree.leaves(resumed), strict=True
    ):
        assert a.dtype == b.dtype and a.sharding == b.sharding, (a, b)
        for sa, sb in zip(a.addressable_shards, b.addressable_shards, strict=True):
            assert sa.index == sb.index
            assert np.array_equal(sa.data, sb.data, equal_nan=True), (sa, sb)
    _on_fewer_devices(ckpt_dir, len(global_batches) - stop, uninterrupted)
    return uninterrupted[0]


def _on_fewer_devices(ckpt_dir, rest, uninterrupted):
    """The mid-window checkpoint of 4 devices restored onto 2 (one per
    process) with ``mm.device_count_target`` and ``mm.from_device_count``; the
    window ends as the uninterrupted run's did."""
    import jax
    import orbax.checkpoint as ocp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import masked_multistep as mm

    devices = [
        next(d for d in jax.devices() if d.process_index == p)
        for p in range(NUM_PROCESSES)
    ]
    mesh = jax.make_mesh(
        (len(devices),),
        ("data",),
        axis_types=(jax.sharding.AxisType.Auto,),
        devices=devices,
    )
    tx, step = make_deferred_step(mesh)
    params = jax.device_put(init_params(), NamedSharding(mesh, P()))
    template = {"params": params, "opt_state": tx.init(params)}
    target = mm.device_count_target(template, len(jax.devices()))
    # Both processes hold 2 of the saved devices' running means.
    assert target["opt_state"].acc_grads["w"].sharding.spec == P("data")
    checkpointer = ocp.StandardCheckpointer()
    restored = checkpointer.restore(
        ckpt_dir, jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
    )
    checkpointer.close()
    moved = mm.from_device_count(restored, template)
    params, state = moved["params"], moved["opt_state"]
    assert state.acc_grads["w"].shape == (len(devices), D)
    data = NamedSharding(mesh, P("data"))
    ((local, *_),) = data.addressable_devices_indices_map((B,)).values()
    for mb in microbatches()[-rest:]:  # this process's rows, on its one device
        mb = jax.tree.map(
            lambda x: jax.make_array_from_process_local_data(
                data, x[local], global_shape=x.shape
            ),
            mb,
        )
        params, state = step(params, state, mb)
    assert int(state.gradient_step) == WINDOWS, state.gradient_step
    want_params, want_state = uninterrupted
    for got, want in zip(
        jax.tree.leaves(params), jax.tree.leaves(want_params), strict=True
    ):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5)
    got, want = mm.window_stats(state), mm.window_stats(want_state)
    assert int(got.tokens) == int(want.tokens)
    np.testing.assert_allclose(np.asarray(got.loss), np.asarray(want.loss), rtol=1e-5)


def _explicit_run(global_batches):
    """The deferred run on jax.make_mesh's default, an AxisType.Explicit data
    axis over the same devices: the accumulator keeps its device axis sharded
    in its type, and the window's combination crosses the processes."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((NUM_PROCESSES * LOCAL_DEVICES,), ("data",))
    assert mesh.axis_types == (jax.sharding.AxisType.Explicit,), mesh
    data = NamedSharding(mesh, P("data"))
    with jax.set_mesh(mesh):
        tx, step = make_deferred_step(mesh)
        params = jax.device_put(init_params(), NamedSharding(mesh, P()))
        state = tx.init(params)
        for mb in global_batches:
            mb = jax.tree.map(
                lambda x: jax.make_array_from_single_device_arrays(
                    x.shape,
                    data,
                    [jax.device_put(s.data, s.device) for s in x.addressable_shards],
                ),
                mb,
            )
            params, state = step(params, state, mb)
        assert int(state.gradient_step) == WINDOWS, state.gradient_step
        assert jax.typeof(state.acc_grads["w"]).sharding.spec == P("data", None)
    return params


def _eager_counts(mesh, global_batches, process_id: int) -> None:
    """Outside jit, a count array spanning the processes is checked like a
    traced one: a valid step works, and a negative count on the last device is
    dropped on every process alike (it raised on the process holding it only,
    and a process that caught the error and went on had windows a microbatch
    out of step with the other's)."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import masked_multistep as mm

    tx, _ = make_deferred_step(mesh)
    grad_fn = jax.jit(mm.per_device_value_and_grad(loss_fn, mesh, "data"))
    params = jax.device_put(init_params(), NamedSharding(mesh, P()))
    state = tx.init(params)
    (loss, count), grads = grad_fn(params, global_batches[0])
    _, after = tx.apply_gradients(grads, state, params, count=count, value=loss)
    assert int(after.mini_step) == 1, after.mini_step
    devices = NUM_PROCESSES * LOCAL_DEVICES
    local = np.ones(LOCAL_DEVICES, np.float32)
    holder = process_id == NUM_PROCESSES - 1
    if holder:
        local[-1] = -1.0
    bad = jax.make_array_from_process_local_data(
        NamedSharding(mesh, P("data")), local, (devices,)
    )
    _, dropped = tx.apply_gradients(grads, state, params, count=bad)
    assert int(dropped.mini_step) == 1, dropped.mini_step
    # The bad count is tallied on its device (added to num_invalid_counts when
    # the window closes); each process reads the devices it holds.
    for shard in dropped.reduction_state.invalid.addressable_shards:
        start = shard.index[0].start or 0
        got = np.asarray(shard.data).tolist()
        want = [int(start + i == devices - 1) for i in range(len(got))]
        assert got == want, (start, got, holder)


def _different_settings(mesh, process_id: int) -> None:
    """Processes that build different wrappers are told so by ``init``, all of
    them alike (with ``k`` = 2 on one and 3 on the other, the deferred windows
    would pair different microbatches and the parameters drift apart). A mesh
    over one process's devices only is not compared: the other process never
    calls its ``init``."""
    import jax
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import masked_multistep as mm

    params = jax.device_put(init_params(), NamedSharding(mesh, P()))
    for reduction in (None, mm.deferred(mesh, "data")):
        tx = mm.MaskedMultiSteps(optax.sgd(0.1), 2 + process_id, reduction=reduction)
        try:
            tx.init(params)
        except ValueError as e:
            why = f"process(es) [{1 - process_id}] built a different wrapper (its repr)"
            assert why in str(e), e
            assert f"every_k_schedule={2 + process_id}" in str(e), e
            # Every process names the first difference as each holds it.
            first = "process 0: every_k_schedule=2; process 1: every_k_schedule=3."
            assert first in str(e), e
        else:
            raise AssertionError(f"no error with reduction={reduction!r}")
    # The same wrapper over a state whose tree holds a function (its address
    # differs between the processes): no error.
    partial = jax.tree_util.Partial(loss_fn, params)
    state = mm.MaskedMultiSteps(optax.adam(0.1), 2).init(partial)
    assert int(state.mini_step) == 0
    own = jax.make_mesh(
        (LOCAL_DEVICES,),
        ("data",),
        axis_types=(jax.sharding.AxisType.Auto,),
        devices=jax.local_devices(),
    )
    own_params = jax.device_put(init_params(), NamedSharding(own, P()))
    tx = mm.MaskedMultiSteps(
        optax.sgd(0.1), 2 + process_id, reduction=mm.deferred(own, "data")
    )
    state = tx.init(own_params)
    assert int(state.mini_step) == 0


def main(process_id: int, port: int, out_path: str, ckpt_dir: str) -> None:
    import jax

    # Both settings must precede backend initialisation.
    jax.config.update("jax_num_cpu_devices", LOCAL_DEVICES)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_numpy_rank_promotion", "raise")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=NUM_PROCESSES,
        process_id=process_id,
        initialization_timeout=60,
    )
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    assert jax.process_count() == NUM_PROCESSES, jax.process_count()
    assert len(jax.devices()) == NUM_PROCESSES * LOCAL_DEVICES, jax.devices()
    mesh = jax.make_mesh(
        (NUM_PROCESSES * LOCAL_DEVICES,),
        ("data",),
        axis_types=(jax.sharding.AxisType.Auto,),
    )
    replicated = NamedSharding(mesh, P())
    data = NamedSharding(mesh, P("data"))

    tx, step = make_step()
    params = jax.device_put(init_params(), replicated)
    state = tx.init(params)
    # The rows this process's devices hold (contiguous: one block per process).
    blocks = [i[0] for i in data.addressable_devices_indices_map((B,)).values()]
    local = slice(min(b.start for b in blocks), max(b.stop for b in blocks))
    assert local.stop - local.start == B // NUM_PROCESSES, blocks
    # Each process supplies only its own rows of every global microbatch.
    global_batches = [
        jax.tree.map(
            lambda x: jax.make_array_from_process_local_data(
                data, x[local], global_shape=x.shape
            ),
            mb,
        )
        for mb in microbatches()
    ]
    for mb in global_batches:
        params, state = step(params, state, mb)
    assert int(state.gradient_step) == WINDOWS, state.gradient_step
    deferred = _deferred_run(mesh, global_batches, ckpt_dir)
    explicit = _explicit_run(global_batches)
    _eager_counts(mesh, global_batches, process_id)
    _different_settings(mesh, process_id)
    np.savez(
        out_path,
        **{f"auto/{k}": np.asarray(v) for k, v in params.items()},
        **{f"deferred/{k}": np.asarray(v) for k, v in deferred.items()},
        **{f"explicit/{k}": np.asarray(v) for k, v in explicit.items()},
    )
    jax.distributed.shutdown()


if __name__ == "__main__":
    try:
        main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
    except BaseException:
        # A failed worker stops at once, its traceback written: exiting
        # normally would wait in `jax.distributed`'s shutdown barrier for the
        # other process, which waits in a collective for this one, until the
        # test's timeout.
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
