#!/usr/bin/env bash
# Create .venv and install plexrl with its dev tools, the ucx extra (ucxx, for the ucx weight
# transport) and the docs extra (mkdocs, for the documentation site). Idempotent: a second run
# is quick.
# torch==2.13.0 goes first so the CPU wheel is used; the project's torch range accepts it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.plexrl-installed
# This script is hashed too, so a change of what it installs (an extra) reinstalls.
want=$(cat pyproject.toml tests/js/package.json scripts/bootstrap.sh 2>/dev/null | sha256sum | cut -c1-16)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet "torch==2.13.0" numpy
  .venv/bin/python -m pip install --quiet -e ".[dev,ucx,docs]"
  if [ -f tests/js/package.json ] && command -v npm >/dev/null 2>&1; then
    (cd tests/js && npm install --silent --no-audit --no-fund)
  fi
  echo "$want" > "$stamp"
fi
