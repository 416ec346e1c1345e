#!/usr/bin/env bash
# The whole test suite: set-up, lint, format check, type check, then every test.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
.venv/bin/ruff check schemas services tests bench deploy docs/*.py
.venv/bin/ruff format --check schemas services tests bench deploy docs/*.py
.venv/bin/mypy
.venv/bin/plexrl schemas check
# The documentation site: a broken link, a missing page or a setting without a description fails.
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet
# Two workers, each test file on one of them (module fixtures such as a trained deployment are
# built once): most tests wait on processes and the broker, so the second core is otherwise idle.
.venv/bin/python -m pytest -n 2 --dist loadfile "$@"
