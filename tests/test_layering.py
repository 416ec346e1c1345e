"""The package layering DESIGN.md promises, read from the import statements of the tree.

    schemas  <-  bus, config, telemetry  <-  envs, model, weights, runs, launch, tenants
             <-  registry, trainer, inference, orchestrator  <-  up, the CLI

A package may import its own layer's packages only along the edges listed in
``SAME_LAYER``; the four services never import each other: they meet in ``schemas/`` and on the
bus. Every ``import`` counts, at module level or inside a function.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LAYERS: dict[str, int] = {
    "schemas": 0,
    "bus": 1,
    "config": 1,
    "telemetry": 1,
    "envs": 2,
    "model": 2,
    "weights": 2,
    "runs": 2,
    "launch": 2,
    "tenants": 2,  # credentials and the nats-server config of tenants
    "registry": 3,
    "trainer": 3,
    "inference": 3,
    "orchestrator": 3,
    "gateway": 3,
    "up": 4,
    "cli": 4,  # services/cli.py and services/__main__.py
}

SAME_LAYER: frozenset[tuple[str, str]] = frozenset(
    {
        ("bus", "telemetry"),  # the bus counts what it rejects
        ("bus", "config"),
        ("telemetry", "config"),
        ("model", "envs"),  # the warm start trains on the environments' demonstrations
        ("weights", "model"),  # adapters are written in the model's PEFT layout
    }
)

MAX_LINES = 500


def package_of(path: Path) -> str:
    """The layering unit a file under schemas/ or services/ belongs to."""
    rel = path.relative_to(ROOT)
    if rel.parts[0] == "schemas":
        return "schemas"
    if len(rel.parts) == 2:  # services/cli.py, services/__main__.py, services/__init__.py
        return "cli"
    return rel.parts[1]


def imported_packages(tree: ast.AST) -> set[str]:
    """The layering units named by every import in ``tree`` (absolute imports)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    units: set[str] = set()
    for name in names:
        parts = name.split(".")
        if parts[0] == "schemas":
            units.add("schemas")
        elif parts[0] == "services" and len(parts) > 1:
            units.add(parts[1] if parts[1] in LAYERS else "cli")
    return units


def violations(edges: dict[str, set[str]]) -> list[str]:
    """Each import edge ``importer -> imported`` that crosses the layering, in words."""
    found = []
    for importer, imported in sorted(edges.items()):
        for target in sorted(imported - {importer}):
            if target not in LAYERS:
                found.append(f"{importer} imports {target}, which has no layer")
            elif LAYERS[target] > LAYERS[importer]:
                found.append(f"{importer} (layer {LAYERS[importer]}) imports {target} (higher)")
            elif LAYERS[target] == LAYERS[importer] and (importer, target) not in SAME_LAYER:
                found.append(f"{importer} imports {target} in its own layer")
    return found


def source_files() -> list[Path]:
    return sorted([*ROOT.glob("schemas/**/*.py"), *ROOT.glob("services/**/*.py")])


def test_every_package_has_a_layer() -> None:
    packages = {package_of(path) for path in source_files()}
    assert packages <= set(LAYERS), sorted(packages - set(LAYERS))


def test_no_import_crosses_the_layers() -> None:
    by_file: list[str] = []
    for path in source_files():
        importer = package_of(path)
        tree = ast.parse(path.read_text(), filename=str(path))
        found = violations({importer: imported_packages(tree)})
        by_file.extend(f"{path.relative_to(ROOT)}: {line}" for line in found)
    assert not by_file, "\n".join(by_file)


def test_the_check_catches_a_service_importing_another() -> None:
    tree = ast.parse(
        "from services.registry.mirror import RunMirror\n"
        "def f():\n    import services.up.app\n"
        "from schemas.events import WeightsReady\n"
    )
    assert imported_packages(tree) == {"registry", "up", "schemas"}
    found = violations({"trainer": imported_packages(tree)})
    assert found == [
        "trainer imports registry in its own layer",
        "trainer (layer 3) imports up (higher)",
    ]
    assert violations({"model": {"orchestrator"}}) == [
        "model (layer 2) imports orchestrator (higher)"
    ]
    assert violations({"schemas": {"bus"}}) == ["schemas (layer 0) imports bus (higher)"]
    assert violations({"weights": {"model", "bus", "schemas"}}) == []
    assert violations({"model": {"weights"}}) == ["model imports weights in its own layer"]


def test_no_source_file_is_over_500_lines() -> None:
    long = {
        str(path.relative_to(ROOT)): n
        for path in source_files()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"split these along a seam (over {MAX_LINES} lines): {long}"


def test_imports_are_absolute() -> None:
    # The layering reads absolute module names; a relative import could hide a crossing.
    relative = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for path in source_files()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and node.level > 0
    ]
    assert not relative, relative
