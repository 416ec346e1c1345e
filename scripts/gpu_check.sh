#!/usr/bin/env bash
# The engine's GPU checks in one call, for a machine with a GPU, Python 3.12, torch (CUDA),
# transformers, peft, triton, accelerate and pyarrow, and no network:
#
#   1. installs the wheels of .whl/ (filled beforehand by scripts/gpu_wheels.sh) into .gpu-site/;
#   2. pytest -m gpu on the decode path, the LoRA layer and full-weight installs;
#   3. bench/inference.py at the Llama-1B shape in bfloat16 (1 x 64 and 8 x 64 sequences of 128
#      tokens: paged engine, the static path it replaced, HF+PEFT, the decode roofline);
#   4. bench/trainer.py --shape llama-1b and --shape llama-8b in bfloat16;
#   5. a profile of one engine decode step (kernel launches, host synchronisations).
#
# Everything lands in $OUT (default gpu-check-out/): one log per step, summary.md with the
# tables. Each step has its own time limit, so the whole run stays under about 8 minutes and a
# step that hangs costs only its own slot. Exit status: the number of failed steps.
#
#   bash scripts/gpu_wheels.sh              # here, once: fills .whl/
#   bash scripts/gpu_check.sh               # on the GPU machine (run tool, carry [".whl"])
#   PYTHON=.venv/bin/python bash scripts/gpu_check.sh --cpu-smoke   # a rehearsal on a CPU:
#                                           # tiny shapes, seconds ($PYTHON: python3 if unset)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-check-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
SMOKE=0
[ "${1:-}" = "--cpu-smoke" ] && SMOKE=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

WHEELS=${GPU_WHEELS_DIR:-.whl}
if [ -d "$WHEELS" ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  if ! "$PY" -m pip install --quiet --no-index --no-deps --target .gpu-site "$WHEELS"/*.whl \
      >"$OUT/wheels.log" 2>&1; then
    # No pip: a wheel is a zip of what lands in site-packages (scripts under *.data/scripts).
    echo "pip install failed (see $OUT/wheels.log); unpacking the wheels instead" >&2
    "$PY" - "$WHEELS" <<'UNPACK' >>"$OUT/wheels.log" 2>&1
import pathlib, stat, sys, zipfile
site = pathlib.Path(".gpu-site")
(site / "bin").mkdir(parents=True, exist_ok=True)
for wheel in sorted(pathlib.Path(sys.argv[1]).glob("*.whl")):
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
for script in site.glob("*.data/scripts/*"):
    target = site / "bin" / script.name
    script.replace(target)
    target.chmod(target.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
UNPACK
  fi
fi
export PYTHONPATH="$PWD:$PWD/.gpu-site${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$PWD/.gpu-site/bin:$PATH"

failed=0
summary="$OUT/summary.md"
: >"$summary"

step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to $OUT/NAME.log
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  timeout --signal=TERM --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  local took=$((SECONDS - start))
  echo "== $name: exit $rc in ${took}s" | tee -a "$summary"
  if [ "$rc" -ne 0 ]; then
    failed=$((failed + 1))
    tail -n 30 "$OUT/$name.log" | sed 's/^/    /' >>"$summary"
  else
    grep -E '^\||^(torch|NVIDIA|CPU|H1|H2|A1|peak|kernel|host|decode)' "$OUT/$name.log" \
      >>"$summary" || true
  fi
  echo >>"$summary"
}

step environment 60 "$PY" -c "
import torch, transformers, peft, msgspec, pydantic
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, 'peft', peft.__version__)
if torch.cuda.is_available():
    print(torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0).total_memory // 2**30, 'GiB')
try:
    import triton; print('triton', triton.__version__)
except ImportError:
    print('triton missing: the decode path falls back to torch')
"
nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1 || true

if [ "$SMOKE" = 1 ]; then
  SHAPE=tiny BIG=tiny DEVICE=cpu DTYPE=float32 RUNS=1,2 PROMPTS=2 N=2 TOKENS=8
else
  SHAPE=llama-1b BIG=llama-8b DEVICE=cuda DTYPE=bfloat16 RUNS=1,8 PROMPTS=8 N=8 TOKENS=128
fi

step pytest_gpu 200 "$PY" -m pytest -m gpu -q -p no:cacheprovider -o addopts="" \
  tests/model/test_decode_gpu.py tests/model/test_model_lora.py tests/weights/test_weights_full.py

step "bench_inference_$SHAPE" 240 "$PY" bench/inference.py --shape "$SHAPE" --dtype "$DTYPE" \
  --device "$DEVICE" --runs "$RUNS" --prompts "$PROMPTS" --n "$N" --max-tokens "$TOKENS" \
  --repeats 1 --skip-swap

step "bench_trainer_$SHAPE" 150 "$PY" bench/trainer.py --shape "$SHAPE" --device "$DEVICE" \
  --dtype "$DTYPE" --repeats 3 --threads 4

# 8B: two rows per run need ~110 GiB with activations; a smaller GPU takes one.
rows=$("$PY" -c "
import torch
big = torch.cuda.is_available() and torch.cuda.get_device_properties(0).total_memory > 100 * 2**30
print(2 if big else 1)" 2>/dev/null || echo 1)
step "bench_trainer_$BIG" 200 "$PY" bench/trainer.py --shape "$BIG" --device "$DEVICE" \
  --dtype "$DTYPE" --repeats 3 --threads 4 --rows-per-run "$rows"

step decode_profile 120 "$PY" bench/decode_profile.py --shape "$SHAPE" --dtype "$DTYPE" \
  --device "$DEVICE"

echo "failed steps: $failed" | tee -a "$summary"
exit "$failed"
