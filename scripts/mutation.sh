#!/usr/bin/env bash
# Mutation testing (mutmut) of the modules where a silent error costs most: each is broken on
# purpose, one small change at a time, and the tests named below must fail on every change. Not
# part of check.sh (it takes long; see "Mutation score" in docs/contributing.md for the figures and the time).
#
#   bash scripts/mutation.sh                 # every group below, one after the other
#   bash scripts/mutation.sh loss commit     # some groups
#   MUTATION_ONLY='*ǁforward__mutmut_*' bash scripts/mutation.sh lora   # some mutants (fnmatch)
#
# Each group is mutated in a fresh copy of the tree, .mutation/<group>/ (left there to look at:
# `mutmut show NAME` in it), with only its own tests, under `nice`. The score of
# a module is killed / (killed + survived), where a mutant the tests time out on counts as killed
# and one no test reaches as survived; the mutants named in docs/mutation-survivors.md are
# equivalent (no test can tell them from the original) and left out. Prints each module's score
# and every survivor not listed there; exits 1 when a module scores under MUTATION_MIN (90).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
bash scripts/bootstrap.sh >/dev/null
.venv/bin/python -c "import mutmut" 2>/dev/null || .venv/bin/python -m pip install --quiet "mutmut==3.8.1"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

# group | modules to mutate | the tests each mutant must fail
GROUPS_TABLE=(
  "loss|services/trainer/loss.py services/trainer/policy_losses.py|tests/trainer/test_loss.py tests/trainer/test_loss_kl.py tests/trainer/test_policy_losses.py tests/trainer/test_loss_bounds.py"
  "packer|services/trainer/packer.py|tests/trainer/test_packer.py"
  "commit|services/trainer/commit.py|tests/trainer/test_commit.py"
  "lora|services/model/lora.py|tests/model/test_model_lora_parts.py tests/model/test_model_lora.py tests/model/test_model_peft_io.py"
  "digest|services/weights/digest.py|tests/weights/test_weights_digest.py"
  "tenants|services/tenants/accounts.py services/tenants/credentials.py services/tenants/nats_config.py services/tenants/views.py services/tenants/migrate.py services/tenants/cli.py|tests/bus/test_auth_cli.py tests/bus/test_tenants_cli_parser.py tests/bus/test_tenants_cli_commands.py tests/security/test_nats_config_render.py tests/security/test_tenant_credentials_views.py tests/security/test_accounts_config.py tests/security/test_upgrade.py tests/bus/test_follower_tenant.py"
  "advantages|services/orchestrator/advantages.py|tests/orchestrator/test_advantages.py"
  "codec|schemas/codec.py|tests/contract/test_codec.py tests/contract/test_examples.py tests/contract/test_compatibility.py tests/contract/test_properties.py"
)
JOBS=${MUTATION_JOBS:-2}
ONLY=()
read -r -a ONLY <<<"${MUTATION_ONLY:-}"  # patterns, not globbed here
MIN=${MUTATION_MIN:-90}

toml_list() {  # toml_list A B ...: ["A", "B", ...]
  local out="" x
  for x in "$@"; do out+="\"$x\", "; done
  echo "[${out%, }]"
}

selected=("$@")
started=$SECONDS
for row in "${GROUPS_TABLE[@]}"; do
  IFS="|" read -r group modules tests <<<"$row"
  if [ ${#selected[@]} -gt 0 ] && [[ ! " ${selected[*]} " =~ " $group " ]]; then
    continue
  fi
  work=.mutation/$group
  # mutmut would reuse the verdicts of unchanged functions even when their tests changed
  rm -rf "$work"
  mkdir -p "$work"
  # The tree as it is now, tracked and new files alike.
  git ls-files -co --exclude-standard -- schemas services tests deploy pyproject.toml \
    | tar -cf - -T - | tar -xf - -C "$work"
  # shellcheck disable=SC2086
  {
    cat pyproject.toml
    echo
    echo "[tool.mutmut]"
    # every package is copied into mutants/ (the tests import them from there), the group's
    # modules alone are mutated
    echo 'source_paths = ["schemas", "services"]'
    # files the tests read beside the code (deploy/nats.conf is the base of a generated config)
    echo 'also_copy = ["deploy"]'
    echo "only_mutate = $(toml_list $modules)"
    echo "pytest_add_cli_args_test_selection = $(toml_list $tests)"
    echo 'pytest_add_cli_args = ["-p", "no:cacheprovider", "-o", "addopts=", "-q"]'
    echo 'process_isolation = "forkserver"'
    # prose is not mutated: --help texts and log lines (messages the user acts on, errors
    # included, are)
    echo 'do_not_mutate_patterns = ["^\\s*(help|description)=", "^\\s*log\\.\\w+\\("]'
    # a loaded machine must not pass a slow test off as a mutant that hangs (a kill)
    echo 'timeout_constant = 10.0'
  } >"$work/pyproject.toml"
  echo "== $group: $modules"
  t0=$SECONDS
  (cd "$work" && nice -n 15 "$ROOT/.venv/bin/mutmut" run --max-children "$JOBS" "${ONLY[@]}" >mutmut.log 2>&1) \
    || { echo "mutmut failed; see $work/mutmut.log" >&2; tail -20 "$work/mutmut.log" >&2; exit 1; }
  (cd "$work" && "$ROOT/.venv/bin/mutmut" results --all true >results.txt 2>/dev/null)
  echo "   $((SECONDS - t0)) s"
done
echo "== mutation testing took $((SECONDS - started)) s"

.venv/bin/python - "$MIN" "${selected[@]}" <<'SCORE'
import re, sys
from collections import Counter, defaultdict
from pathlib import Path

minimum, wanted = float(sys.argv[1]), set(sys.argv[2:])
listed = set(re.findall(r"`([\w.]+__mutmut_\d+)`", Path("docs/mutation-survivors.md").read_text()))
KILLED = {"killed", "timeout", "segfault"}
SURVIVED = {"survived", "no tests", "suspicious"}
counts: dict[str, Counter[str]] = defaultdict(Counter)
unlisted: list[str] = []
for results in sorted(Path(".mutation").glob("*/results.txt")):
    if wanted and results.parent.name not in wanted:
        continue
    for line in results.read_text().splitlines():
        if ": " not in line:
            continue
        name, status = (s.strip() for s in line.rsplit(": ", 1))
        module = name.split(".x_")[0].split(".xǁ")[0]
        if status == "not checked":  # left out by MUTATION_ONLY, or the run was stopped
            counts[module]["not run"] += 1
        elif status in KILLED:
            counts[module]["killed"] += 1
        elif name in listed:
            counts[module]["equivalent"] += 1
        elif status in SURVIVED:
            counts[module]["survived"] += 1
            unlisted.append(f"{name}: {status}")
        else:
            counts[module]["unfinished"] += 1
            unlisted.append(f"{name}: {status}")
failed = False
print(f"{'module':42} {'killed':>6} {'surv.':>6} {'equiv.':>6} {'score':>7} {'not run':>7}")
for module, c in sorted(counts.items()):
    judged = c["killed"] + c["survived"] + c["unfinished"]
    score = 100.0 * c["killed"] / judged if judged else 100.0
    failed |= score < minimum
    print(
        f"{module:42} {c['killed']:6} {c['survived']:6} {c['equivalent']:6} {score:6.1f}%"
        f" {c['not run']:7}"
    )
if unlisted:
    print("\nsurvivors not listed in docs/mutation-survivors.md (mutmut show NAME in .mutation/<group>):")
    print("\n".join(f"  {u}" for u in unlisted))
sys.exit(1 if failed else 0)
SCORE
