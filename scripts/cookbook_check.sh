#!/usr/bin/env bash
# tinker-cookbook's own supervised and RL recipes, their code unchanged, against plexrl up --gateway
# on the tiny model. Not part of CI: it needs PyPI (the cookbook goes in a second virtual
# environment, .venv-cookbook, with the transformers it pins) and a few minutes.
#
# What is given on the command line instead of the recipes' defaults, and why:
# - the model: the tiny model, named Qwen/Qwen3-8B-Base. The cookbook looks every model name up
#   in its registry for a renderer; this one renders chats as plain "User: ... Assistant: ..."
#   text (role_colon), which the tiny model's character tokenizer can write. Its tokenizer is
#   put in a private Hugging Face cache under that name, so the cookbook and the SDK load it by
#   name, offline.
# - the data: the recipes' defaults (no_robots, GSM8K) live on the Hugging Face hub; sl_basic
#   trains on the cookbook's own example_data/conversations.jsonl, rl_basic on its arithmetic
#   environment. sl_loop and rl_loop take no such option (their dataset is written in the code):
#   they are run too, and stop at load_dataset when the hub cannot be reached.
# - sizes: the tiny model's context is 256 tokens, so max_length 256 and max_tokens 8.
#
# Usage: bash scripts/cookbook_check.sh [WORK_DIR]     (exit 0 when both basic recipes finish)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
VENV=.venv-cookbook
COOKBOOK=${COOKBOOK:-tinker-cookbook[math-rl]}
if [ ! -x "$VENV/bin/python" ]; then
  "${PYTHON:-python3.11}" -m venv "$VENV"
fi
"$VENV/bin/pip" install --quiet "torch==2.13.0" "$COOKBOOK"
"$VENV/bin/pip" show tinker-cookbook transformers tinker | grep -E "^(Name|Version)"

WORK=${1:-$(mktemp -d -t plexrl-cookbook.XXXXXX)}
mkdir -p "$WORK"
NAME=Qwen/Qwen3-8B-Base
.venv/bin/plexrl model tiny "$WORK/model" >/dev/null
repo="$WORK/hf/hub/models--${NAME//\//--}"
mkdir -p "$repo/snapshots/plexrl" "$repo/refs"
cp "$WORK"/model/* "$repo/snapshots/plexrl/"
printf plexrl >"$repo/refs/main"

PORT=$(.venv/bin/python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
URL="http://127.0.0.1:$PORT"
.venv/bin/plexrl up --gateway --gateway-port "$PORT" --model "$WORK/model" --model-name "$NAME" \
  --output-dir "$WORK/out" --no-live >"$WORK/up.log" 2>&1 &
UP=$!
trap 'kill -INT $UP 2>/dev/null; wait $UP 2>/dev/null || true' EXIT
for _ in $(seq 300); do
  if curl -fsS "$URL/healthz" >/dev/null 2>&1; then break; fi
  kill -0 $UP 2>/dev/null || { tail -50 "$WORK/up.log"; exit 1; }
  sleep 1
done
echo "plexrl up --gateway: $URL, logs in $WORK"

export HF_HOME="$WORK/hf" HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export TINKER_API_KEY=tml-plexrl TINKER_BASE_URL="$URL"
PY="$VENV/bin/python"
DATA=$("$PY" -c 'import os, tinker_cookbook as t; print(os.path.join(os.path.dirname(t.__file__), "example_data", "conversations.jsonl"))')
status=0

echo "--- sl_basic (supervised): example_data/conversations.jsonl"
"$PY" -m tinker_cookbook.recipes.sl_basic model_name="$NAME" base_url="$URL" \
  log_path="$WORK/sl_basic" lora_rank=8 learning_rate=1e-3 eval_every=0 save_every=2 \
  dataset_builder=tinker_cookbook.supervised.data:FromConversationFileBuilder \
  dataset_builder.file_path="$DATA" \
  dataset_builder.common_config.model_name_for_tokenizer="$NAME" \
  dataset_builder.common_config.renderer_name=role_colon \
  dataset_builder.common_config.max_length=256 \
  dataset_builder.common_config.batch_size=4 || status=1

echo "--- rl_basic (reinforcement learning): the arithmetic environment"
"$PY" -m tinker_cookbook.recipes.rl_basic model_name="$NAME" base_url="$URL" \
  log_path="$WORK/rl_basic" lora_rank=8 max_tokens=8 max_steps=3 save_every=2 \
  dataset_builder=tinker_cookbook.recipes.math_rl.arithmetic_env:ArithmeticDatasetBuilder \
  dataset_builder.batch_size=4 dataset_builder.group_size=4 dataset_builder.n_batches=3 \
  dataset_builder.model_name_for_tokenizer="$NAME" \
  dataset_builder.renderer_name=role_colon || status=1

for recipe in sl_loop rl_loop; do
  echo "--- $recipe (its dataset is fixed in its code)"
  "$PY" -m "tinker_cookbook.recipes.$recipe" model_name="$NAME" base_url="$URL" \
    log_path="$WORK/$recipe" lora_rank=8 max_steps=2 2>&1 | tail -5 || true
done
exit $status
