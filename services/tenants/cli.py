"""``plexrl tenants add|list|remove`` and ``plexrl nats-config``.

``tenants add NAME`` writes NAME's quotas into ``DIR/tenants.toml`` (default DIR:
``./plexrl-auth``), creates ``DIR/NAME.nk``, the tenant's nkey seed, unless it exists, and gives
a new tenant its gateway API key: ``DIR/NAME.key`` (mode 0600, printed once; the tenants file
keeps only its SHA-256). Hand both files to the tenant. ``nats-config`` writes the nats-server
config that lets exactly these users in: the services (``DIR/services.nk``, created on first use)
in the services' account and each tenant in an account of its own
(:mod:`services.tenants.accounts`). Regenerate it after adding or removing a tenant and reload
the server twice, or restart it. Bad input changes nothing and exits with status 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from schemas.config import format_validation_error
from services.config.tenants import TenantQuota, TenantsFile, load_tenants, save_tenants
from services.tenants.credentials import (
    DEFAULT_DIR,
    GATEWAY,
    SERVICES,
    TENANTS_FILE,
    CredentialsError,
    api_key_digest,
    check_tenant_name,
    ensure_seed,
    key_path,
    new_api_key,
    public_key,
    seed_path,
    write_api_key,
)
from services.tenants.nats_config import Tls, render_nats_config, users_of, write_atomically

QUOTA_FLAGS = (
    "max_runs",
    "max_waiting",
    "max_lora_rank",
    "max_samples_per_step",
    "max_run_dirs",
    "max_connections",
    "max_subscriptions",
    "max_payload",
    "max_store_bytes",
    "max_memory_bytes",
    "max_streams",
    "max_consumers",
)


ADD_DESCRIPTION = (
    "Write NAME's quotas into DIR/tenants.toml (flags not given keep their value), "
    "create DIR/NAME.nk, its nkey seed (mode 0600), unless it exists, and give a new "
    "tenant its gateway API key, DIR/NAME.key (mode 0600, printed once). Then run "
    "`plexrl nats-config` and reload the server twice (or restart it)."
)
ROTATE_KEY_HELP = (
    "give the tenant a new API key (the old one stops working once the gateway "
    "reloads the tenants file)"
)
REMOVE_DESCRIPTION = (
    "Remove NAME from DIR/tenants.toml and delete DIR/NAME.nk and DIR/NAME.key. "
    "Then run `plexrl nats-config` and reload the server: its credentials stop working then."
)
NATS_CONFIG_DESCRIPTION = (
    "Write a complete nats-server config: listen address, JetStream and payload limit "
    "(or a base config copied verbatim), the services' account with the services' "
    "nkey user, one account per tenant (its user, its limits, the imports of its own "
    "slice) and TLS."
)
NATS_MIGRATE_DESCRIPTION = (
    "Upgrade a deployment made before tenants had NATS accounts: with the nats-server "
    "stopped, move its JetStream data from the global account ($G) to the services' "
    "account, keeping every message, sequence number, consumer, KV revision and "
    "object. Then start the server on the config of `plexrl nats-config`."
)


def register(subparsers: Any) -> None:
    tenants = subparsers.add_parser(
        "tenants",
        help="add, list or remove tenants and their NATS credentials",
        description="Tenants: their quotas (DIR/tenants.toml) and nkey seeds (DIR/<name>.nk).",
    )
    sub = tenants.add_subparsers(dest="tenants_command", metavar="SUBCOMMAND")

    add = sub.add_parser(
        "add",
        help="add a tenant or change its quotas; create its seed file",
        description=ADD_DESCRIPTION,
    )
    add.add_argument("name", metavar="NAME", help="1-64 letters, digits, '_' or '-'")
    for flag in QUOTA_FLAGS:
        add.add_argument(
            "--" + flag.replace("_", "-"),
            dest=flag,
            type=int,
            default=None,
            metavar="N",
            help=TenantQuota.model_fields[flag].description or flag.replace("_", " "),
        )
    add.add_argument(
        "--rotate-key",
        action="store_true",
        help=ROTATE_KEY_HELP,
    )
    _dir_arg(add)
    add.set_defaults(func=_add)

    listing = sub.add_parser("list", help="the tenants, their quotas and public keys")
    _dir_arg(listing)
    listing.set_defaults(func=_list)

    remove = sub.add_parser(
        "remove",
        help="remove a tenant and delete its seed and key files",
        description=REMOVE_DESCRIPTION,
    )
    remove.add_argument("name", metavar="NAME")
    _dir_arg(remove)
    remove.set_defaults(func=_remove)
    tenants.set_defaults(func=lambda args: _print_help(tenants))

    conf = subparsers.add_parser(
        "nats-config",
        help="write the nats-server config with the services' and tenants' users",
        description=NATS_CONFIG_DESCRIPTION,
    )
    _dir_arg(conf)
    conf.add_argument(
        "--out",
        type=Path,
        default=None,
        help="where to write it (default DIR/nats.conf; - for stdout)",
    )
    conf.add_argument(
        "--base",
        type=Path,
        default=None,
        metavar="FILE",
        help="start from this config (port, JetStream, cluster...) instead of the defaults",
    )
    conf.add_argument(
        "--listen", default="0.0.0.0:4222", help="client address (default %(default)s)"
    )
    conf.add_argument(
        "--store-dir",
        type=Path,
        default=Path("plexrl-jetstream"),
        help="JetStream's directory (default %(default)s)",
    )
    conf.add_argument("--tls-cert", type=Path, default=None, help="the server's certificate (PEM)")
    conf.add_argument("--tls-key", type=Path, default=None, help="its private key (PEM)")
    conf.add_argument("--tls-ca", type=Path, default=None, help="CA for client certificates")
    conf.add_argument(
        "--tls-verify",
        action="store_true",
        help="require a client certificate signed by --tls-ca (mutual TLS)",
    )
    conf.set_defaults(func=_nats_config)

    migrate = subparsers.add_parser(
        "nats-migrate",
        help="move a single-account deployment's streams into the services' account",
        description=NATS_MIGRATE_DESCRIPTION,
    )
    migrate.add_argument(
        "--store-dir",
        type=Path,
        required=True,
        help="the server's JetStream store_dir (it holds jetstream/)",
    )
    migrate.add_argument(
        "--dry-run", action="store_true", help="say what would move, and move nothing"
    )
    migrate.set_defaults(func=_nats_migrate)


def _dir_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dir",
        type=Path,
        default=DEFAULT_DIR,
        help="directory of tenants.toml and the seed files (default ./%(default)s)",
    )


def _print_help(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 0


def _fail(command: str, message: object) -> int:
    print(f"plexrl {command}: {message}", file=sys.stderr)
    return 2


def _add(args: argparse.Namespace) -> int:
    path = args.dir / TENANTS_FILE
    try:
        name = check_tenant_name(args.name)
        tenants = load_tenants(path)
        given = {f: getattr(args, f) for f in QUOTA_FLAGS if getattr(args, f) is not None}
        current = tenants.tenants.get(name, TenantQuota()).model_dump()
        quota = TenantQuota.model_validate(current | given)
    except ValidationError as exc:
        return _fail("tenants add", format_validation_error(exc))
    except ValueError as exc:  # an illegal name, an unreadable tenants file
        return _fail("tenants add", exc)
    key = None
    if quota.api_key_sha256 is None or args.rotate_key:
        key = new_api_key()
        quota = quota.model_copy(update={"api_key_sha256": api_key_digest(key)})
    try:
        nkey, created = ensure_seed(seed_path(args.dir, name))
        ensure_seed(seed_path(args.dir, SERVICES))
        if key is not None:
            write_api_key(key_path(args.dir, name), key)
    except (CredentialsError, OSError) as exc:
        return _fail("tenants add", exc)
    save_tenants(path, TenantsFile(tenants=tenants.tenants | {name: quota}))
    seed = seed_path(args.dir, name)
    print(f"tenant {name}: {_limits(quota)}; written to {path}")
    print(f"  seed {seed} ({'created' if created else 'kept'}), public key {nkey}")
    if key is not None:
        print(f"  gateway API key (shown once; also in {key_path(args.dir, name)}): {key}")
    print(
        f"  next: plexrl nats-config --dir {args.dir}, reload the server twice (or restart it), "
        f"hand {seed} and the API key to {name}"
    )
    return 0


def _limits(quota: TenantQuota) -> str:
    set_ = quota.model_dump(exclude_defaults=True, exclude={"api_key_sha256"})
    return ", ".join(f"{k} {v}" for k, v in set_.items()) or "default quotas"


def _list(args: argparse.Namespace) -> int:
    try:
        tenants = load_tenants(args.dir / TENANTS_FILE)
    except ValueError as exc:
        return _fail("tenants list", exc)
    if not tenants.tenants:
        print(f"no tenants in {args.dir / TENANTS_FILE}")
        return 0
    for name in sorted(tenants.tenants):
        try:
            key = public_key(seed_path(args.dir, name))
        except CredentialsError as exc:
            key = f"(no usable seed: {exc})"
        has_key = "API key set" if tenants.tenants[name].api_key_sha256 else "no API key"
        print(f"{name}\t{_limits(tenants.tenants[name])}\t{key}\t{has_key}")
    return 0


def _remove(args: argparse.Namespace) -> int:
    path = args.dir / TENANTS_FILE
    try:
        tenants = load_tenants(path)
    except ValueError as exc:
        return _fail("tenants remove", exc)
    if args.name not in tenants.tenants:
        known = ", ".join(sorted(tenants.tenants)) or "none"
        return _fail("tenants remove", f"no tenant {args.name!r} in {path} (tenants: {known})")
    rest = {k: v for k, v in tenants.tenants.items() if k != args.name}
    save_tenants(path, TenantsFile(tenants=rest))
    seed_path(args.dir, args.name).unlink(missing_ok=True)
    key_path(args.dir, args.name).unlink(missing_ok=True)
    print(f"removed tenant {args.name} from {path} and deleted its seed and key files")
    print(
        f"  next: plexrl nats-config --dir {args.dir} and reload the server to revoke its "
        "credentials"
    )
    return 0


def _nats_config(args: argparse.Namespace) -> int:
    if (args.tls_cert is None) != (args.tls_key is None):
        return _fail("nats-config", "give --tls-cert and --tls-key together")
    if args.tls_cert is None and (args.tls_ca is not None or args.tls_verify):
        return _fail("nats-config", "--tls-ca and --tls-verify need --tls-cert and --tls-key")
    if args.tls_verify and args.tls_ca is None:
        return _fail("nats-config", "--tls-verify needs --tls-ca to check client certificates")
    tls = (
        Tls(args.tls_cert, args.tls_key, args.tls_ca, args.tls_verify)
        if args.tls_cert is not None
        else None
    )
    try:
        base = args.base.read_text(encoding="utf-8") if args.base is not None else None
        users = users_of(args.dir)
    except CredentialsError as exc:
        return _fail("nats-config", f"{exc} (run `plexrl tenants add` for that tenant)")
    except (OSError, ValueError) as exc:
        return _fail("nats-config", exc)
    text = render_nats_config(
        users, base=base, listen=args.listen, store_dir=args.store_dir, tls=tls
    )
    out = args.out if args.out is not None else args.dir / "nats.conf"
    if str(out) == "-":
        sys.stdout.write(text)
        return 0
    write_atomically(out, text)
    tenants = [u.name for u in users if u.name not in (SERVICES, GATEWAY)]
    print(
        f"wrote {out}: the services' account and {len(tenants)} tenant account(s) "
        f"{', '.join(tenants)}; reload the server twice (nats-server --signal reload) or restart it"
    )
    return 0


def _nats_migrate(args: argparse.Namespace) -> int:
    from services.tenants.migrate import MigrationError, migrate, plan

    try:
        moved = plan(args.store_dir) if args.dry_run else migrate(args.store_dir)
    except (MigrationError, OSError) as exc:
        return _fail("nats-migrate", exc)
    verb = "would move" if args.dry_run else "moved"
    print(f"{verb} {moved.source} to {moved.target}: {len(moved.streams)} streams")
    for name in moved.streams:
        print(f"  {name}")
    if not args.dry_run:
        print("  next: start the server on the config of `plexrl nats-config`")
    return 0
