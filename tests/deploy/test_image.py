"""deploy/Dockerfile and its build-context filter, read as text (CI has no Docker engine)."""

from __future__ import annotations

import fnmatch
import json
import re
from pathlib import Path

import pytest
import yaml

from .contract import DEPLOY, K8S, REPO

DOCKERFILE = DEPLOY / "Dockerfile"
DOCKERIGNORE = DEPLOY / "Dockerfile.dockerignore"


def instructions() -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` in order, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):  # a comment inside a continued instruction
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        keyword, _, rest = full.partition(" ")
        out.append((keyword.upper(), rest.strip()))
    assert not pending, "the Dockerfile ends inside a continued line"
    return out


def stages() -> list[list[tuple[str, str]]]:
    out: list[list[tuple[str, str]]] = [[]]
    for ins in instructions():
        if ins[0] == "FROM":
            out.append([])
        out[-1].append(ins)
    return out[1:]


def final_stage() -> list[tuple[str, str]]:
    return stages()[-1]


def args_with_defaults() -> dict[str, str]:
    out = {}
    for keyword, rest in instructions():
        if keyword == "ARG" and "=" in rest:
            name, _, value = rest.partition("=")
            out[name] = value
    return out


def test_build_args_choose_the_variant_and_base_image() -> None:
    args = args_with_defaults()
    assert args["VARIANT"] == "cpu"
    assert args["BASE_IMAGE"] == "python:3.11-slim"
    first_from = next(rest for kw, rest in instructions() if kw == "FROM")
    assert first_from.startswith("${BASE_IMAGE}")
    text = DOCKERFILE.read_text(encoding="utf-8")
    assert 'pip install ".[vllm]"' in text  # the gpu variant
    assert re.search(r'"\$\{VARIANT\}" = "gpu"', text)
    assert re.search(r"case \"\$\{VARIANT\}\" in cpu\|gpu\)", text)  # any other value fails


def test_cpu_variant_installs_the_torch_the_project_is_tested_with() -> None:
    args = args_with_defaults()
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    bootstrap = (REPO / "scripts" / "bootstrap.sh").read_text(encoding="utf-8")
    tested = set(re.findall(r"torch==([0-9.]+)", bootstrap))
    assert tested == {args["TORCH_VERSION"]}


def test_final_stage_runs_as_a_non_root_user() -> None:
    stage = final_stage()
    users = [rest for kw, rest in stage if kw == "USER"]
    assert users == ["10001:10001"]
    user_at = stage.index(("USER", users[0]))
    # nothing runs as root after the switch, and the entrypoint comes after it
    assert all(kw != "RUN" for kw, _ in stage[user_at:])
    assert ("ENTRYPOINT", '["plexrl"]') in stage[user_at:]
    runs = " ".join(rest for kw, rest in stage if kw == "RUN")
    assert "--uid 10001" in runs
    assert "--gid 10001" in runs
    assert "chown -R plexrl:plexrl /var/lib/plexrl" in runs


def test_tiny_model_is_written_at_build_time_where_the_services_look() -> None:
    stage = final_stage()
    runs = [rest for kw, rest in stage if kw == "RUN"]
    assert "plexrl model tiny /opt/plexrl/models/tiny" in runs
    env = " ".join(rest for kw, rest in stage if kw == "ENV")
    assert "PLEXRL_MODEL=/opt/plexrl/models/tiny" in env
    assert "PLEXRL_OUTPUT_DIR=/var/lib/plexrl/outputs" in env
    assert "HF_HUB_OFFLINE=1" in env
    model_env = yaml.safe_load_all((K8S / "env.yaml").read_text(encoding="utf-8"))
    model_dirs = {d["data"]["PLEXRL_MODEL"] for d in model_env if "PLEXRL_MODEL" in d["data"]}
    assert model_dirs == {"/opt/plexrl/models/tiny"}


def test_healthcheck_runs_the_health_script_copied_into_the_image() -> None:
    stage = final_stage()
    checks = [rest for kw, rest in stage if kw == "HEALTHCHECK"]
    assert len(checks) == 1
    options, _, cmd = checks[0].partition("CMD")
    assert "--interval=" in options and "--timeout=" in options
    assert json.loads(cmd) == ["python", "/opt/plexrl/healthcheck.py"]
    assert ("COPY", "deploy/healthcheck.py /opt/plexrl/healthcheck.py") in stage


def test_entrypoint_is_plexrl() -> None:
    entrypoints = [rest for kw, rest in final_stage() if kw == "ENTRYPOINT"]
    assert entrypoints == ['["plexrl"]']


# --- the build context filter ------------------------------------------------------------------


def _ignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule, simplified: the last pattern matching the path or a parent wins."""
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern.lstrip("!").rstrip("/")
        if any(fnmatch.fnmatchcase(c, pat) for c in candidates):
            ignored = not negate
    return ignored


@pytest.fixture(scope="module")
def ignore_patterns() -> list[str]:
    lines = DOCKERIGNORE.read_text(encoding="utf-8").splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def test_context_filter_keeps_every_copied_path(ignore_patterns: list[str]) -> None:
    sources = []
    for kw, rest in instructions():
        if kw == "COPY" and not rest.startswith("--from"):
            sources.extend(rest.split()[:-1])
    assert sources
    for src in sources:
        assert (REPO / src).exists(), src
        assert not _ignored(src, ignore_patterns), f"{src} is copied but left out of the context"
        if (REPO / src).is_dir():
            for child in sorted((REPO / src).rglob("*.py"))[:5]:
                rel = child.relative_to(REPO).as_posix()
                assert not _ignored(rel, ignore_patterns), rel


def test_context_filter_leaves_out_environments_outputs_and_caches(
    ignore_patterns: list[str],
) -> None:
    for path in (
        ".venv/bin/python",
        ".git/HEAD",
        "outputs/run_x/metrics.jsonl",
        "tests/conftest.py",
        "services/__pycache__/cli.cpython-311.pyc",
        "deploy/local.yml",
    ):
        assert _ignored(path, ignore_patterns), path
    assert not _ignored("deploy/runs/reverse.toml", ignore_patterns)


def test_context_filter_parser_follows_the_last_matching_pattern() -> None:
    patterns = ["*", "!services/", "**/__pycache__"]
    assert _ignored("README.md", patterns)
    assert not _ignored("services/cli.py", patterns)
    assert _ignored("services/__pycache__/x.pyc", patterns)


def test_build_command_in_the_readme_matches_the_layout() -> None:
    readme = (DEPLOY / "README.md").read_text(encoding="utf-8")
    assert "docker build -f deploy/Dockerfile" in readme
    assert "docker compose -f deploy/local.yml up --build" in readme
    assert Path(DEPLOY / "Dockerfile").is_file()
