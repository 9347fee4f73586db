#!/usr/bin/env bash
# The figures only a GPU gives, in one prepared run on a machine whose python3
# already has jax with CUDA, optax and flax (nothing is installed or fetched):
#
#   bash benchmarks/gpu_session.sh            # a few minutes (runs 1-3: ~50 s on an H100)
#   QUICK=1 bash benchmarks/gpu_session.sh    # a dry run, on any backend
#
# 1. The window workload (4 x 2048² float32, adam, k = 8), every competitor
#    of bench.py side by side: the statistics' cost ("+stats" rows against
#    the same step without them, goal <= 1.05x) and the TrainState step
#    against the accumulation floor, timed.
# 2. The same at 1024² and k = 1, 4, 16, for the README's table.
# 3. (1) with XLA:GPU's command buffers for loops and conditionals
#    (XLA_FLAGS=--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL).
# 4. Many small leaves (100 layers of 256² with biases, 200 leaves, k = 8):
#    a step of many kernels, as a real model's.
# 5. The host's cost per call of a carry's scalar leaves (bench_dispatch.py).
# 6. Where a window's time goes: device busy and idle per microbatch, from a
#    profile of each step (profile_window.py; the profile kept beside it).
# Each result is a JSON file and its log under $OUT, or benchmarks/results;
# `python benchmarks/report.py FILE.json` prints a JSON's tables as markdown.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out="${OUT:-benchmarks/results}"
mkdir -p "$out"
python="${PYTHON:-python3}"
if [[ -n "${QUICK:-}" ]]; then
  reference=(--widths 128 --ks 4 --repeats 2)
  table=(--widths 64 --ks 1,2 --repeats 2)
  leaves=(--widths 32 --layers 10 --biases --ks 4 --repeats 2)
  dispatch=(--width 64 --repeats 2)
  profile=(--width 32 --windows 1)
else
  reference=(--widths 2048 --ks 8 --repeats 50)
  table=(--widths 1024 --ks 1,4,16 --repeats 20)
  leaves=(--widths 256 --layers 100 --biases --ks 8 --repeats 20)
  dispatch=(--scalars 14,32,64)
  profile=(--windows 3)
fi
command -v nvidia-smi >/dev/null && nvidia-smi -L || true
"$python" -c 'import jax, optax, masked_multistep as mm; print("jax", jax.__version__, jax.devices(), "optax", optax.__version__, "masked_multistep", mm.__version__)'
# Each run may fail or time out on its own: the others still run, and the
# script's status says whether all succeeded.
status=0
bench() {  # NAME SECONDS ARGS...
  local name=$1 seconds=$2
  shift 2
  timeout "$seconds" "$python" benchmarks/bench.py "$@" --out "$out/$name.json" 2>&1 | tee "$out/$name.log" || status=$?
}
bench gpu_reference 180 "${reference[@]}"
bench gpu_table 120 "${table[@]}"
XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL" \
  bench gpu_command_buffers 120 "${reference[@]}"
bench gpu_leaves 120 "${leaves[@]}"
timeout 60 "$python" benchmarks/bench_dispatch.py "${dispatch[@]}" 2>&1 | tee "$out/gpu_dispatch.log" || status=$?
timeout 120 "$python" benchmarks/profile_window.py "${profile[@]}" --xplane "$out/gpu_profile.xplane.pb" 2>&1 | tee "$out/gpu_profile.log" || status=$?
exit "$status"
