#!/usr/bin/env bash
# The whole test suite: set-up, lint, format check, type check, then every test.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
.venv/bin/ruff check schemas services tests bench deploy
.venv/bin/ruff format --check schemas services tests bench deploy
.venv/bin/mypy
.venv/bin/plexrl schemas check
.venv/bin/python -m pytest "$@"
