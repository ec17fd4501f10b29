#!/usr/bin/env bash
# Issue 17, item 6: the benchmark tables on a lent GPU, in one prepared run
# of the device tool (whose README asks for one short script per lease):
#
#   run(command="bash benchmarks/device_check.sh", timeout_s=560)
#
# There, python3 already holds jax with CUDA (0.11 as last seen; this repo is
# tested on 0.10), so jaxsession is installed over it without dependencies,
# and the first line of the log says which jax and which devices ran. Each
# script's table goes to $OUT/<script>.md, everything else to $OUT/log.txt;
# each script has its own time limit, so one that hangs or fails leaves the
# others' tables. Here (no $OUT): ./device_out. QUICK=1 runs every script
# with few calls (a check of this script on the CPU, not a measurement);
# INSTALL=0 skips the install (a venv that has jaxsession already).
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-device_out}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
log="$OUT/log.txt"
: >"$log"
export PYTHONUNBUFFERED=1

if [ "${INSTALL:-1}" = 1 ]; then
  $PY -m pip install -q --no-deps --no-build-isolation . >>"$log" 2>&1 ||
    { echo "install failed:"; tail -n 20 "$log"; exit 1; }
fi
$PY -c "import jax, jaxsession; print('jax', jax.__version__, jax.devices())" 2>&1 | tee -a "$log"

if [ "${QUICK:-0}" = 1 ]; then
  dispatch=(--repeats 3 --calls 200)
  decode=(--decode_calls 3 --decode_repeats 3)
  state=(--state_repeats 3 --state_calls 20 --leaf_bytes 256,16384)
  kernels=(--rows 64 --width 256 --adam_elements 16384 --calls 3 --repeats 3)
else
  dispatch=(--repeats 5 --calls 2000)
  decode=(--decode_calls 10 --decode_repeats 5)
  state=(--state_repeats 5 --state_calls 100)
  kernels=(--repeats 5 --calls 50)
fi

status=0
bench() {  # bench NAME SECONDS FLAGS...
  local name=$1 limit=$2
  shift 2
  timeout "$limit" $PY "benchmarks/$name.py" "$@" >"$OUT/$name.md" 2>>"$log"
  local rc=$?
  echo "$name: exit $rc" | tee -a "$log"
  [ $rc = 0 ] || status=1
  grep -E '^(machine|###|\|)' "$OUT/$name.md"
}
bench dispatch 90 "${dispatch[@]}"
bench decode 90 "${decode[@]}"
bench state 180 "${state[@]}"
bench kernels 120 "${kernels[@]}"
exit $status
