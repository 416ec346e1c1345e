"""A whole plexrl on loopback for the gateway tests: a real nats-server, and the registry, the
trainer, an inference replica and the gateway as processes, over the tiny model.

The stack is started once per session (the processes take seconds to import torch) and shared:
each test uses runs of its own.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from gateway_support import REPO, Stack, otlp_receiver_module, running_stack

from services.model.tiny import build_tiny_model


@pytest.fixture(scope="session")
def receiver() -> Iterator[Any]:
    """Every process of the stack exports its spans here."""
    with otlp_receiver_module().Receiver() as r:
        yield r


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory, receiver: Any) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("gateway")
    model = build_tiny_model(root / "model", seed=0)
    # a second tenant, so that a test can show the gateway serves its own tenant's runs only
    auth = root / "auth"
    subprocess.run(
        [sys.executable, "-m", "services", "tenants", "add", "team-a", "--dir", str(auth)],
        cwd=REPO,
        check=True,
        capture_output=True,
    )
    tenants = ("--tenants-file", str(auth / "tenants.toml"))
    with running_stack(root, model, otlp=receiver.endpoint, registry_args=tenants) as s:
        yield s
