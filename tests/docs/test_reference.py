"""The documentation's reference pages are generated from the code (docs/reference.py): change a
setting's description and its page changes; a setting without one fails the build."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any

import pytest

from services.gateway.settings import GatewaySettings
from services.registry.settings import RegistrySettings

REPO = Path(__file__).resolve().parents[2]


def _reference() -> Any:
    spec = importlib.util.spec_from_file_location("docs_reference", REPO / "docs" / "reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_setting_appears_with_its_variable_flag_and_description() -> None:
    page = _reference().configuration_page()
    for model in (RegistrySettings, GatewaySettings):
        for name, field in model.model_fields.items():
            row = f"| `{name}` | `PLEXRL_{name.upper()}` | `--{name.replace('_', '-')}` |"
            assert row in page, name
            assert str(field.description).replace("|", "\\|") in page
    assert "| `optim.lr` |" in page and "| `max_run_dirs` |" in page


def test_a_changed_description_changes_the_page_and_a_missing_one_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reference = _reference()
    field = RegistrySettings.model_fields["scan_interval"]
    monkeypatch.setattr(field, "description", "a description written by this test")
    assert "| a description written by this test |" in reference.configuration_page()
    monkeypatch.setattr(field, "description", None)
    with pytest.raises(reference.MissingDescription, match=r"RegistrySettings\.scan_interval"):
        reference.configuration_page()


def test_the_events_and_cli_pages_cover_every_subject_event_and_command() -> None:
    from schemas.events import ALL_EVENTS, event_tag
    from schemas.subjects import CHANNELS
    from services.cli import COMMAND_MODULES

    reference = _reference()
    events = reference.events_page()
    for ch in CHANNELS:
        assert f"| `{ch.address}` |" in events
    for cls in ALL_EVENTS:
        assert f"### `{event_tag(cls)}`" in events
    cli = reference.cli_page()
    for command in ("up", "registry", "trainer", "gateway", "submit", "tenants", "nats-migrate"):
        assert f"## `plexrl {command}`" in cli
    assert "### `plexrl tenants add`" in cli and "--rotate-key" in cli
    assert len(COMMAND_MODULES) >= 10


def test_the_readme_is_a_front_page_that_keeps_the_two_commands() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) < 300
    assert "bash scripts/bootstrap.sh && .venv/bin/plexrl up\n" in readme
    assert "\nbash scripts/check.sh\n" in readme
    # every page it links to is a page of the site
    for page in re.findall(r"\]\(docs/([\w./-]+\.md)", readme):
        generated = page.startswith("reference/")
        assert generated or (REPO / "docs" / page).is_file(), page
