"""MkDocs hooks of the plexrl site: the reference pages are written from the code at every
build (docs/reference.py), so they cannot drift from it; the home page is ``README.md`` itself
and the deployment guide ``deploy/README.md`` itself, their links pointed into the site."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]


def _reference() -> Any:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))  # the plexrl packages, when the site is built in place
    spec = importlib.util.spec_from_file_location(
        "plexrl_docs_reference", ROOT / "docs" / "reference.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def home_page() -> str:
    """``README.md`` with its links into ``docs/`` made relative to the site."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    text = text.replace("](deploy/README.md", "](deploy.md")
    return text.replace("](docs/", "](")


def deploy_page() -> str:
    """``deploy/README.md`` with its links into ``docs/`` made relative to the site."""
    text = (ROOT / "deploy" / "README.md").read_text(encoding="utf-8")
    return text.replace("](../docs/", "](")


def on_files(files: Files, config: Any) -> Files:
    for path, write in _reference().PAGES.items():
        files.append(File.generated(config, path, content=write()))
    files.append(File.generated(config, "index.md", content=home_page()))
    files.append(File.generated(config, "deploy.md", content=deploy_page()))
    return files
