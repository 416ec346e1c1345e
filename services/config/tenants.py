"""The tenants file: who may run what, read by the registry, the gateway and ``plexrl nats-config``.

A TOML file (``PLEXRL_TENANTS_FILE``; ``plexrl tenants add`` creates it)::

    [tenants.team-a]
    max_runs = 4                # runs holding an index at once
    max_waiting = 16            # runs waiting for an index
    max_lora_rank = 16
    max_samples_per_step = 4096 # batch_size * group_size of one step
    max_run_dirs = 64           # run directories held (every status but forgotten)
    max_store_bytes = 1073741824  # the broker's limits of the tenant's NATS account...
    api_key_sha256 = "9f2c..."  # the SHA-256 of the tenant's gateway API key, never the key

Without a file, or for the ``default`` tenant, there are no quotas beyond the pool itself. The
registry enforces the run quotas, ``plexrl nats-config`` writes the account limits into the
server's config (the broker enforces them), and the gateway checks API keys against the digests.
Credentials are not in this file: each tenant's nkey seed and API key are files of their own
(see :mod:`services.tenants`), so the file can be shared with operators who must not hold them.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from schemas.config import format_validation_error
from schemas.tenant import DEFAULT_TENANT, validate_tenant


class TenantsFileError(ValueError):
    """A tenants file that cannot be read or does not validate; the message says where."""


class TenantQuota(BaseModel):
    """The limits of one tenant and the digest of its gateway key. A run quota of ``None`` means
    no limit of the tenant's own; the account limits always have a value (their defaults)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_runs: int | None = Field(None, ge=0, le=4096, description="active runs at once")
    max_waiting: int | None = Field(None, ge=0, le=1_000_000, description="waiting runs")
    max_lora_rank: int | None = Field(
        None, ge=1, le=1024, description="largest LoRA rank a run may ask for"
    )
    max_samples_per_step: int | None = Field(
        None, ge=1, le=10_000_000, description="batch_size * group_size of one step"
    )
    max_run_dirs: int | None = Field(
        None,
        ge=1,
        le=1_000_000,
        description="run directories held at once (every status but forgotten); a submit past it "
        "is refused until the tenant deletes evicted runs (plexrl evict RUN --delete)",
    )
    # The broker's limits of the tenant's NATS account: `plexrl nats-config` writes them.
    max_connections: int = Field(
        64, ge=1, le=1_000_000, description="NATS connections of the tenant at once"
    )
    max_subscriptions: int = Field(
        10_000, ge=16, le=10_000_000, description="NATS subscriptions of the tenant at once"
    )
    max_payload: int | None = Field(
        None,
        ge=1024,
        le=64 * 1024 * 1024,
        description="largest message the tenant may publish, in bytes (default: the server's)",
    )
    max_store_bytes: int = Field(
        1 << 30,
        ge=64 << 20,
        le=1 << 50,
        description="JetStream file storage of the tenant's account, its views of its own runs' "
        "events included",
    )
    max_memory_bytes: int = Field(
        64 << 20, ge=0, le=1 << 40, description="JetStream memory storage of the tenant's account"
    )
    max_streams: int = Field(
        32, ge=2, le=100_000, description="JetStream streams of the tenant's account"
    )
    max_consumers: int = Field(
        1024, ge=16, le=1_000_000, description="JetStream consumers of the tenant's account"
    )
    api_key_sha256: str | None = Field(
        None,
        pattern=r"^[0-9a-f]{64}$",
        description="SHA-256 (hex) of the tenant's gateway API key; the key itself is never "
        "stored here",
    )


UNLIMITED = TenantQuota()


class TenantsFile(BaseModel):
    """Every configured tenant by name."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tenants: dict[str, TenantQuota] = Field(default_factory=dict)

    @field_validator("tenants")
    @classmethod
    def _names(cls, v: dict[str, TenantQuota]) -> dict[str, TenantQuota]:
        for name in v:
            validate_tenant(name)
            if name == DEFAULT_TENANT:
                raise ValueError(
                    f"'{DEFAULT_TENANT}' is the services' own tenant and takes no quotas here"
                )
        return v

    def quota(self, tenant: str) -> TenantQuota:
        """The quota of ``tenant`` (no limits for the default tenant)."""
        return self.tenants.get(tenant, UNLIMITED)

    def knows(self, tenant: str) -> bool:
        return tenant == DEFAULT_TENANT or tenant in self.tenants

    def to_toml(self) -> str:
        lines = [
            "# plexrl tenants: quotas per tenant (plexrl tenants add NAME writes this file).",
            "",
        ]
        for name in sorted(self.tenants):
            lines.append(f"[tenants.{name}]")
            for key, value in self.tenants[name].model_dump(exclude_defaults=True).items():
                lines.append(f"{key} = {json.dumps(value)}")
            lines.append("")
        return "\n".join(lines)


def load_tenants(path: Path | None) -> TenantsFile:
    """Read ``path``; no path (or no file there) is no tenants beyond the default one."""
    if path is None or not Path(path).exists():
        return TenantsFile()
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise TenantsFileError(f"{path}: {exc}") from None
    try:
        return TenantsFile.model_validate(data)
    except ValidationError as exc:
        raise TenantsFileError(f"{path}: {format_validation_error(exc)}") from None


def save_tenants(path: Path, tenants: TenantsFile) -> None:
    """Write ``tenants`` to ``path`` atomically (a reader never sees half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(tenants.to_toml())
    tmp.replace(path)
