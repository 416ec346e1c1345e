"""``plexrl nats-migrate``: move a single-account deployment's JetStream data into the services'
account, so that runs survive the move to accounts.

A deployment configured before tenants had accounts kept every user, and so every stream, KV
bucket and object store, in nats-server's global account ``$G``; its store directory holds them
under ``<store>/jetstream/$G``. With the accounts of ``plexrl nats-config`` the services'
account is ``PLEXRL`` (:data:`~services.tenants.accounts.SERVICES_ACCOUNT`), whose data lives
under ``<store>/jetstream/PLEXRL``. With the server stopped, moving that one directory keeps
everything exactly: messages, sequence numbers (which run incarnations and the registry's
records refer to), consumers' positions, KV revisions and objects.

A clustered store (one with the meta group's ``$SYS/_js_``) records which account each stream
belongs to in the cluster's own log; it is refused here, and deploy/README.md gives the steps
(back up each stream as the services' user, restore it in the new account).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from services.tenants.accounts import SERVICES_ACCOUNT

GLOBAL_ACCOUNT = "$G"


class MigrationError(RuntimeError):
    """A store that cannot be moved here; the message says why and what to do."""


@dataclass(frozen=True)
class Moved:
    source: Path
    target: Path
    streams: tuple[str, ...]


def plan(store_dir: Path) -> Moved:
    """What :func:`migrate` would move; :class:`MigrationError` when it would not."""
    root = Path(store_dir) / "jetstream"
    source, target = root / GLOBAL_ACCOUNT, root / SERVICES_ACCOUNT
    if not root.is_dir():
        raise MigrationError(
            f"{root} does not exist: give --store-dir the server's JetStream store_dir (the "
            "directory that holds jetstream/)"
        )
    if (root / "$SYS" / "_js_").exists():
        raise MigrationError(
            f"{store_dir} belongs to a JetStream cluster, whose log records each stream's "
            "account: move the streams with a backup and restore instead (deploy/README.md, "
            "'Upgrading to accounts')"
        )
    if not source.is_dir():
        if target.is_dir():
            raise MigrationError(f"nothing to move: {target} is there and {source} is not")
        raise MigrationError(f"{source} does not exist: no single-account data in {store_dir}")
    if target.exists() and any(target.iterdir()):
        raise MigrationError(
            f"{target} already holds data; both {source} and it exist, so a merge would be "
            "needed: move one of them aside first"
        )
    streams = source / "streams"
    names = tuple(sorted(p.name for p in streams.iterdir())) if streams.is_dir() else ()
    return Moved(source, target, names)


def migrate(store_dir: Path) -> Moved:
    """Move the global account's data to the services' account (the server must be stopped)."""
    moved = plan(store_dir)
    if moved.target.exists():
        moved.target.rmdir()  # empty: checked by plan()
    moved.source.rename(moved.target)
    return moved
