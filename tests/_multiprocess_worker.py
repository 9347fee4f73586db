"""One process of the two-process data-parallel run in `test_multiprocess.py`.

Usage: ``python _multiprocess_worker.py PROCESS_ID PORT OUT.npz``. Each process
owns 2 CPU devices of a global 4-device mesh and feeds only its local rows of
every microbatch; the final (replicated) parameters go to ``OUT.npz``.

The model, the data and the optimizer live here so that the test computes its
single-process reference from the very same definitions.
"""

import sys

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


def make_step():
    """The jitted train step: masked loss, MaskedMultiSteps, apply_updates."""
    import jax
    import optax

    import masked_multistep as mm

    tx = mm.MaskedMultiSteps(optax.adam(1e-1), K)

    def loss_fn(params, mb):
        x = jax.numpy.where(mb["mask"][..., None], mb["x"], 0)
        pred = jax.numpy.tanh(x @ params["w"] + params["b"])
        return mm.masked_mean((pred - mb["y"]) ** 2, mb["mask"])

    def step(params, state, mb):
        (loss, count), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, mb)
        updates, state = tx.update(grads, state, params, count=count, value=loss)
        return optax.apply_updates(params, updates), state

    return tx, jax.jit(step, donate_argnums=(0, 1))


def main(process_id: int, port: int, out_path: str) -> None:
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
    for mb in microbatches():
        # Each process supplies only its own rows of the global microbatch.
        global_mb = jax.tree.map(
            lambda x: jax.make_array_from_process_local_data(
                data, x[local], global_shape=x.shape
            ),
            mb,
        )
        params, state = step(params, state, global_mb)
    assert int(state.gradient_step) == WINDOWS, state.gradient_step
    np.savez(out_path, **jax.tree.map(np.asarray, params))
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
