#!/usr/bin/env bash
# The figures only a GPU gives, in one prepared run on a machine whose python3
# already has jax with CUDA, optax and flax (nothing is installed or fetched):
#
#   bash benchmarks/gpu_session.sh            # a few minutes (never yet run on a GPU)
#   QUICK=1 bash benchmarks/gpu_session.sh    # a dry run, on any backend
#
# 1. The window workload (4 x 2048² float32, adam, k = 8), every competitor
#    of bench.py side by side: the statistics' cost ("+stats" rows against
#    the same step without them, goal <= 1.05x) and the TrainState step
#    against the accumulation floor, timed.
# 2. The same at 1024² and k = 1, 4, 16, for the README's table.
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
else
  reference=(--widths 2048 --ks 8 --repeats 15)
  table=(--widths 1024 --ks 1,4,16 --repeats 7)
fi
command -v nvidia-smi >/dev/null && nvidia-smi -L || true
"$python" -c 'import jax, optax, masked_multistep as mm; print("jax", jax.__version__, jax.devices(), "optax", optax.__version__, "masked_multistep", mm.__version__)'
# Each run may fail or time out on its own: the other still runs, and the
# script's status says whether both succeeded.
status=0
timeout 300 "$python" benchmarks/bench.py "${reference[@]}" --out "$out/gpu_reference.json" 2>&1 | tee "$out/gpu_reference.log" || status=$?
timeout 240 "$python" benchmarks/bench.py "${table[@]}" --out "$out/gpu_table.json" 2>&1 | tee "$out/gpu_table.log" || status=$?
exit "$status"
