"""Two processes, one global mesh: data-parallel MaskedMultiSteps across hosts.

Two worker processes on 127.0.0.1 (gloo CPU collectives, 2 devices each) train
on a global 4-device mesh, each feeding only its own rows of every masked
microbatch: once with the compiler reducing every microbatch's gradient, once
with the deferred reduction (one per window), checkpointing its per-device
state mid-window and checking that a restore continues bit-identically. The
final parameters of both runs must equal a single-process run on the full
microbatches.
"""

import importlib.util
import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import chex
import jax
import numpy as np
import pytest

WORKER = pathlib.Path(__file__).with_name("_multiprocess_worker.py")
TIMEOUT_S = 120


def _worker_module():
    spec = importlib.util.spec_from_file_location("_multiprocess_worker", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _single_process_reference(worker):
    tx, step = worker.make_step()
    device = jax.devices()[0]
    params = jax.device_put(worker.init_params(), device)
    state = tx.init(params)
    for mb in worker.microbatches():
        params, state = step(params, state, jax.device_put(mb, device))
    assert int(state.gradient_step) == worker.WINDOWS
    return params


def _tails(logs) -> str:
    return "\n".join(
        f"--- {log.name} ---\n"
        + log.read_text(
            encoding="locale", errors="replace"
        )  # as the worker wrote[-4000:]
        for log in logs
        if log.exists()
    )


@pytest.mark.slow
def test_two_processes_match_single_process(tmp_path):
    worker = _worker_module()
    port = _free_port()
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        # The workers choose their own device count; drop inherited XLA flags.
        "XLA_FLAGS": "",
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(WORKER.parents[1]), os.environ.get("PYTHONPATH")])
        ),
    }
    outs = [tmp_path / f"params_{i}.npz" for i in range(worker.NUM_PROCESSES)]
    ckpt = tmp_path / "ckpt"
    logs = [tmp_path / f"worker_{i}.log" for i in range(worker.NUM_PROCESSES)]
    procs = []
    try:
        for i in range(worker.NUM_PROCESSES):
            with open(logs[i], "wb") as log:
                procs.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            str(WORKER),
                            str(i),
                            str(port),
                            str(outs[i]),
                            str(ckpt),
                        ],
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                )
        # Meanwhile, the reference in this process.
        reference = _single_process_reference(worker)
        # Until both exit, or one fails (the other then waits for it in a
        # collective: it is stopped below).
        deadline = time.monotonic() + TIMEOUT_S
        codes = [p.poll() for p in procs]
        while None in codes and not any(c not in (None, 0) for c in codes):
            if time.monotonic() > deadline:
                why = f"workers still running after {TIMEOUT_S} s"
                pytest.fail(f"{why}\n{_tails(logs)}")
            time.sleep(0.2)
            codes = [p.poll() for p in procs]
        assert codes == [0] * len(procs), f"exit codes {codes}\n{_tails(logs)}"
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)

    reference = jax.tree.map(np.asarray, reference)
    assert not np.allclose(reference["w"], worker.init_params()["w"])
    for out in outs:
        with np.load(out) as f:
            for mode in ("auto", "deferred", "explicit"):
                got = {name: f[f"{mode}/{name}"] for name in reference}
                chex.assert_trees_all_close(
                    got, reference, rtol=1e-5, atol=1e-6, strict=True
                )


@pytest.mark.slow
def test_bench_dp_smoke(tmp_path):
    """`make bench-dp` in miniature: two gloo processes, every competitor, and
    the reductions per window read from the compiled HLO."""
    script = WORKER.parents[1] / "benchmarks" / "bench_dp.py"
    out = tmp_path / "dp.json"
    args = ["--widths", "64", "--ks", "4", "--repeats", "1", "--out", str(out)]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(WORKER.parents[1]), os.environ.get("PYTHONPATH")])
        ),
    }
    done = subprocess.run(
        [sys.executable, str(script), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    result = json.loads(out.read_text(encoding="utf-8"))
    cell = {(r["k"], r["competitor"]): r for r in result["windows"]}
    # One k: the per-microbatch reduction runs k of them per window, the
    # deferred modes one.
    k = 4
    param_bytes = cell[(k, "deferred")]["param_bytes"]
    per_mb = cell[(k, "per-microbatch reduction")]
    assert per_mb["reductions_per_window"] == k
    assert per_mb["bytes_per_window"] >= k * param_bytes
    deferred = cell[(k, "deferred")]
    assert deferred["reductions_per_window"] == 1
    assert param_bytes <= deferred["bytes_per_window"] < param_bytes + 1024
    assert deferred["scalar_reductions_per_call"] == 0
    # Statistics add no collective between window ends either.
    stats = cell[(k, "deferred + statistics")]
    assert stats["reductions_per_window"] == 1
    assert stats["scalar_reductions_per_call"] == 0
    assert param_bytes <= stats["bytes_per_window"] < param_bytes + 1024
    by_hand = cell[(k, "one reduction, by hand")]
    assert by_hand["reductions_per_window"] == 1
    assert param_bytes <= by_hand["bytes_per_window"] < param_bytes + 1024
    assert cell[(k, "floor")]["reductions_per_window"] == 0
