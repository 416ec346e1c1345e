"""The tenants file: who may run what, read by the registry and written by ``plexrl tenants``.

A TOML file (``PLEXRL_TENANTS_FILE``; ``plexrl tenants add`` creates it)::

    [tenants.team-a]
    max_runs = 4                # runs holding an index at once
    max_waiting = 16            # runs waiting for an index
    max_lora_rank = 16
    max_samples_per_step = 4096 # batch_size * group_size of one step

Without a file, or for the ``default`` tenant, there are no quotas beyond the pool itself.
Credentials are not in this file: each tenant's nkey seed is a file of its own (see
:mod:`services.tenants`), so the file can be shared with operators who must not hold them.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from schemas.config import format_validation_error
from schemas.tenant import DEFAULT_TENANT, validate_tenant


class TenantsFileError(ValueError):
    """A tenants file that cannot be read or does not validate; the message says where."""


class TenantQuota(BaseModel):
    """The limits of one tenant. ``None`` means no limit of the tenant's own."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_runs: int | None = Field(None, ge=0, le=4096, description="active runs at once")
    max_waiting: int | None = Field(None, ge=0, le=1_000_000, description="waiting runs")
    max_lora_rank: int | None = Field(None, ge=1, le=1024)
    max_samples_per_step: int | None = Field(
        None, ge=1, le=10_000_000, description="batch_size * group_size of one step"
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
            for key, value in self.tenants[name].model_dump().items():
                if value is not None:
                    lines.append(f"{key} = {value}")
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
