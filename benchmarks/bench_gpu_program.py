"""The train steps' compiled GPU programs, side by side, without a GPU.

Compiles the benchmark's steps (``steps.py``: the tanh MLP of 4 square float32
matrices, adam, parameters and optimizer state donated) ahead of time for an
NVIDIA H100 (a deviceless compile: jax's CUDA plugin, no GPU needed) and reads
the compiled programs. For each step, a microbatch between window ends and one
that closes a window: the kernels it runs and the bytes they read and write
(operands plus results, kernel by kernel), the parameter-sized copies among
them, and the compiled temporaries (``memory_analysis``). On this
optimizer-bound workload a step is memory-bound, so the bytes model its time;
they are figures of the program, not a timing.

``MaskedMultiSteps`` runs each window's conditional as a ``while_loop`` that
runs at most once on GPUs (``masked_multistep/_branch.py``);
``--form cond`` compiles it as ``lax.cond`` instead, to show what XLA:GPU's
copy insertion does with that.

Needs the CUDA plugin of the installed jax's version, e.g. for jax 0.10.2
``pip install "jax-cuda12-plugin[with-cuda]==0.10.2"`` (about 5 GB; a separate
virtual environment keeps it out of the project's).

Usage::

    python benchmarks/bench_gpu_program.py                 # width 2048, k = 8
    python benchmarks/bench_gpu_program.py --form cond --width 1024
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

# The CUDA plugin checks the local GPU's driver unless told not to; the CPU
# stays the default backend, the GPU is only compiled for.
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import steps  # noqa: E402
from _helpers import traffic  # noqa: E402
from bench_cli import positive_int  # noqa: E402

from masked_multistep import _branch, _sq_norms  # noqa: E402

# What the H100 SXM reports (XLA's target config); the programs depend on the
# compute capability and the memory sizes, not on the exact figures.
H100 = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 84929347584
  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 7 }
runtime_version { major: 12 minor: 8 patch: 0 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""

COMPETITORS = (
    steps.floor,
    steps.adam,
    steps.optax_multisteps,
    steps.masked_multisteps,
    steps.masked_multisteps_stats,
    steps.masked_multisteps_norm_test,
    steps.train_state,
    steps.train_state_stats,
)
# The flax steps beyond TrainState: NNX's optimizer, and windows closed on tokens.
FLAX_COMPETITORS = (steps.train_state_token_windows, steps.nnx_optimizer)


def gpu_sharding() -> jax.sharding.NamedSharding:
    from jax.experimental import topologies

    try:
        topology = topologies.get_topology_desc(
            platform="cuda", target_config=H100, topology="1x1x1"
        )
    except (NotImplementedError, RuntimeError) as e:
        sys.exit(
            f"cannot compile for a GPU here ({e}); install jax's CUDA plugin of "
            f"jax {jax.__version__}: see this script's docstring"
        )
    mesh = topologies.make_mesh(topology, (1,), ("d",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def program(make: Any, workload: steps.Workload, k: int, sharding: Any) -> dict | None:
    """The program's figures, or None for a step with no window of ``k``
    microbatches (the norm test at k = 1, as in ``bench.py``)."""
    comp = make(workload, k)
    if comp is None:
        return None
    spec = lambda tree: jax.tree.map(  # noqa: E731
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree
    )
    params = jax.eval_shape(workload.params)
    carry = jax.eval_shape(comp.init, params)
    batch = jax.eval_shape(lambda: workload.batch(0))
    compiled = (
        jax.jit(comp.step, donate_argnums=0).lower(spec(carry), spec(batch)).compile()
    )
    text = compiled.as_text()
    leaf = 4 * workload.width * workload.width
    between, closing = traffic(text, taken=False), traffic(text, taken=True)
    return {
        "name": comp.name,
        "kernels": between.kernels,
        "between": between.bytes,
        "closing": closing.bytes,
        "per_microbatch": ((k - 1) * between.bytes + closing.bytes) / k,
        "copies": sum(b >= leaf for b in between.copies),
        "temp": compiled.memory_analysis().temp_size_in_bytes,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--width",
        type=positive_int,
        default=2048,
        help="width of the MLP's 4 square matrices (default: 2048)",
    )
    parser.add_argument(
        "--k",
        type=positive_int,
        default=8,
        help="microbatches per window (default: 8)",
    )
    parser.add_argument(
        "--form",
        choices=("loop", "cond"),
        default="loop",
        help="MaskedMultiSteps' window conditional on the GPU (default: loop, "
        "what the package compiles; cond: lax.cond, for comparison)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    # The default backend here is the CPU: the forms GPUs get are chosen
    # explicitly (the window's conditional, the squared norms' one reduction).
    _branch.FORM = args.form
    _sq_norms.ONE_REDUCTION = True
    sharding = gpu_sharding()
    workload = steps.Workload(args.width)
    competitors = COMPETITORS + (FLAX_COMPETITORS if steps.has_train_state() else ())
    made = (program(make, workload, args.k, sharding) for make in competitors)
    rows = [row for row in made if row is not None]
    mib = 2.0**20
    print(
        f"Compiled for {sharding.mesh.devices.flat[0].device_kind} (deviceless), "
        f"jax {jax.__version__}; 4 x {args.width}², adam, k = {args.k}; "
        f"MaskedMultiSteps' window conditional: {args.form}"
    )
    print(
        f"\n{'step':34} {'kernels':>7} {'MiB moved':>10} {'closing':>8} "
        f"{'per mb':>8} {'x floor':>7} {'copies':>6} {'temp MiB':>8}"
    )
    floor = rows[0]["per_microbatch"]
    for r in rows:
        print(
            f"{r['name']:34} {r['kernels']:7d} {r['between'] / mib:10.1f} "
            f"{r['closing'] / mib:8.1f} {r['per_microbatch'] / mib:8.1f} "
            f"{r['per_microbatch'] / floor:7.2f} {r['copies']:6d} "
            f"{r['temp'] / mib:8.1f}"
        )
    print(
        "\nkernels, MiB moved, copies: a microbatch between window ends (copies: "
        "of a parameter leaf's size or more); closing: the one that closes a "
        f"window; per mb: their mean over a window of {args.k}."
    )
    return rows


if __name__ == "__main__":
    main()
