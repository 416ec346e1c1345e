"""The accounts config of ``plexrl nats-config``, checked against what must stay forbidden, and
the broker's per-tenant limits and tenant changes on a running server.

The deny list below is written by hand, independently of services/tenants/accounts.py: every
subject a tenant's account imports (as rendered into the config) is checked not to overlap any
of them, so a slice that grew by a wildcard, another tenant's token or a JetStream API of the
services fails here even if the code that writes the slice agrees with itself.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import nats
import pytest
from accounts_support import accounts_broker, write_auth, write_config
from nats.aio.msg import Msg

from schemas import subjects as sj
from services.config.tenants import TenantQuota, load_tenants, save_tenants
from services.tenants.accounts import SERVICES_ACCOUNT, tenant_account
from services.tenants.credentials import SERVICES, ensure_seed, seed_path
from services.tenants.nats_config import render_accounts, users_of

ACME, BETA = "acme", "beta"

FORBIDDEN = [
    # the services' JetStream: streams, consumers, acknowledgements, flow control, the account
    "$JS.API.STREAM.>",
    "$JS.API.CONSUMER.>",
    "$JS.API.ACCOUNT.>",
    "$JS.API.INFO",
    "$JS.API.META.>",
    "$JS.API.SERVER.>",
    "$JS.ACK.>",
    "$JS.FC.>",
    "$JS.EVENT.>",
    "$KV.>",
    "$O.>",
    "$SYS.>",
    "$SRV.>",
    # direct get of anything but acme's own weights store
    "$JS.API.DIRECT.GET.PLEXRL_RUNS.>",
    "$JS.API.DIRECT.GET.PLEXRL_ROLLOUTS.>",
    "$JS.API.DIRECT.GET.PLEXRL_WEIGHTS.>",
    "$JS.API.DIRECT.GET.PLEXRL_ERRORS.>",
    "$JS.API.DIRECT.GET.KV_plexrl-registry.>",
    "$JS.API.DIRECT.GET.KV_plexrl-progress.>",
    "$JS.API.DIRECT.GET.OBJ_plexrl-weights.>",
    "$JS.API.DIRECT.GET.OBJ_plexrl-weights-beta.>",
    # the default tenant's subjects and beta's
    "plexrl.runs.submit",
    "plexrl.runs.evict",
    "plexrl.runs.discovered",
    "plexrl.runs.beta.>",
    "plexrl.rollouts.*",
    "plexrl.rollouts.beta.>",
    "plexrl.weights.*",
    "plexrl.weights.beta.>",
    "plexrl.inference.generate",
    "plexrl.inference.beta.>",
    "plexrl.registry.list",
    "plexrl.registry.beta.>",
    "plexrl.train.*",
    "plexrl.train.beta.>",
    "plexrl.ingest.beta.>",
    "plexrl.errors.>",
    "plexrl.collective.>",
    "_INBOX.>",
    "_INBOX_beta.>",
]
"""What acme's account must never import from the services' account."""

WRITES = ["plexrl.runs.acme.submit", "plexrl.runs.acme.evict", "plexrl.rollouts.acme.*"]
"""acme's own writes: imported as services (answered by the registry), never as streams, which
would hand acme's requests back to it and to the services' streams unchecked."""


def overlap(a: str, b: str) -> bool:
    """Whether some subject matches both NATS patterns ``a`` and ``b``."""
    x, y = a.split("."), b.split(".")
    for s, t in zip(x, y, strict=False):
        if ">" in (s, t):
            return True
        if s != t and "*" not in (s, t):
            return False
    return len(x) == len(y)


def test_overlap_is_nats_subject_matching() -> None:
    assert overlap("a.*.c", "a.b.>") and overlap("a.>", "a.b") and overlap("a.b", "a.b")
    assert not overlap("a.b", "a.c") and not overlap("a.b", "a.b.c") and not overlap("a.*", "b.*")
    assert overlap(">", "x.y") and not overlap("a.b.*", "a.b")


def block_of(config: str, account: str) -> str:
    """The config of ``account`` alone."""
    block = config[config.index(f'"{account}": {{') :]
    return block[: block.index("\n  }")]


def imports_of(config: str, account: str) -> list[tuple[str, str, str]]:
    """(kind, subject in the services' account, subject in ``account``) of each import."""
    block = block_of(config, account)
    found = []
    pattern = (
        r'\{ (service|stream): \{ account: "(\w+)", subject: "([^"]+)" \}(?:, to: "([^"]+)")? \}'
    )
    for kind, source, subject, to in re.findall(pattern, block):
        assert source == SERVICES_ACCOUNT, f"{account} imports from {source}"
        found.append((kind, subject, to or subject))
    return found


def test_a_tenants_account_imports_nothing_on_the_deny_list(tmp_path: Path) -> None:
    write_auth(tmp_path, {ACME: TenantQuota(), BETA: TenantQuota()})
    config = render_accounts(users_of(tmp_path))
    imports = imports_of(config, tenant_account(ACME))
    assert len(imports) >= 10
    for kind, subject, local in imports:
        for bad in FORBIDDEN:
            assert not overlap(subject, bad), f"acme imports {kind} {subject}, overlapping {bad}"
        assert "beta" not in subject and "beta" not in local
        if kind == "stream":
            for write in WRITES:
                assert not overlap(local, write), f"acme hears {local}, its own write {write}"
    # and its account exports only its own JetStream API, to the services alone
    block = block_of(config, tenant_account(ACME))
    exports = re.findall(r"\{ (service|stream): \"([^\"]+)\", accounts: \[([^\]]+)\] \}", block)
    assert exports == [("service", "$JS.API.>", f'"{SERVICES_ACCOUNT}"')]


def test_the_broker_enforces_a_tenants_connection_limit(tmp_path: Path) -> None:
    quota = TenantQuota(max_connections=2)
    with accounts_broker(tmp_path, {ACME: quota}) as broker:

        async def connect() -> nats.aio.client.Client:
            return await nats.connect(
                broker.url, nkeys_seed=str(broker.seed(ACME)), allow_reconnect=False
            )

        async def main() -> str:
            first, second = await connect(), await connect()
            try:
                with pytest.raises(Exception, match="maximum account active connections"):
                    await connect()
            finally:
                await first.close()
                await second.close()
            third = await connect()  # room again once one left
            await third.close()
            return "ok"

        assert asyncio.run(main()) == "ok"


async def test_a_tenant_added_to_a_running_server_works_after_two_reloads_and_leaves_on_removal(
    tmp_path: Path,
) -> None:
    with accounts_broker(tmp_path, {ACME: TenantQuota()}) as broker:
        services = await nats.connect(broker.url, nkeys_seed=str(broker.seed(SERVICES)))
        answered: list[str] = []

        async def ingest(msg: Msg) -> None:
            answered.append(msg.subject)
            await msg.respond(b"{}")

        await services.subscribe("plexrl.ingest.*.submit", cb=ingest)
        await services.flush()
        # plexrl tenants add beta, plexrl nats-config, then two reloads (nats-server wires a new
        # account's service imports on the reload after the one that creates it)
        tenants = load_tenants(broker.tenants_file)
        save_tenants(
            broker.tenants_file,
            tenants.model_copy(update={"tenants": tenants.tenants | {BETA: TenantQuota()}}),
        )
        ensure_seed(seed_path(broker.auth, BETA))
        write_config(broker.auth, broker.server.port, tmp_path / "store")
        broker.server.reload()
        broker.server.reload()
        beta = await nats.connect(broker.url, nkeys_seed=str(broker.seed(BETA)))
        await beta.request(sj.runs_subject("submit", BETA), b"{}", timeout=10)
        assert answered == ["plexrl.ingest.beta.submit"]
        # plexrl tenants remove beta, nats-config, reload: beta's key stops working
        save_tenants(broker.tenants_file, tenants)
        write_config(broker.auth, broker.server.port, tmp_path / "store")
        broker.server.reload()
        with pytest.raises(Exception, match=r"[Aa]uthorization"):
            await nats.connect(broker.url, nkeys_seed=str(broker.seed(BETA)), allow_reconnect=False)
        await beta.close()
        await services.close()
