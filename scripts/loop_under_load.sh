#!/usr/bin/env bash
# Run pytest on the given tests N times in a row while as many busy processes as there are cores
# keep every core loaded, the way a loaded CI machine is; stop at the first failure and keep
# every run's log and temporary directories (services' logs) under LOGS (default
# $TMPDIR/plexrl-loop, else /tmp/plexrl-loop). What found the fault suite's and the
# evictions' rare failures:
#
#   scripts/loop_under_load.sh 10 tests/faults
#   PLEXRL_EVICTION_ROUNDS=50 scripts/loop_under_load.sh 1 tests/orchestrator/test_eviction_load.py
set -uo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 2 ] || ! [[ $1 =~ ^[0-9]+$ ]]; then
  echo "usage: $0 N TESTS... (pytest arguments)" >&2
  exit 2
fi
runs=$1
shift
logs=${LOGS:-${TMPDIR:-/tmp}/plexrl-loop}
mkdir -p "$logs"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
busy=()
for _ in $(seq "$(nproc)"); do
  python3 -c "while True: pass" &
  busy+=($!)
done
trap 'kill "${busy[@]}" 2>/dev/null' EXIT
for i in $(seq "$runs"); do
  started=$(date +%s)
  .venv/bin/python -m pytest -p no:cacheprovider -q -s --basetemp "$logs/run$i" "$@" \
    > "$logs/run$i.log" 2>&1
  code=$?
  echo "run $i/$runs: exit $code in $(( $(date +%s) - started ))s: $(tail -n 1 "$logs/run$i.log")"
  if [ $code -ne 0 ]; then
    echo "failed; log in $logs/run$i.log, services' logs under $logs/run$i"
    exit $code
  fi
done
echo "$runs runs passed"
