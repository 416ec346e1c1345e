"""What ``plexrl nats-config`` writes, read back as a nats-server config: every account, user,
limit, export and import, the TLS block, the base config copied verbatim, and the file itself
(its mode, its directory, its bytes in UTF-8 whatever the locale), each accepted by a real
``nats-server -t``.

The rendered text is parsed by a small reader of nats-server's config syntax written here, and
compared with the slices written out by hand below, independently of
services/tenants/accounts.py: a share that names another subject, loses its mapping, gains one it
does not need, or changes its kind fails here.
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pki import make_pki

from services.tenants.credentials import SERVICES, ensure_seed, public_key, seed_path
from services.tenants.nats_config import User, render_nats_config
from tests.bus.test_auth_cli import nats_server_accepts, plexrl

REPO = Path(__file__).resolve().parents[2]

ACME_FLAGS = [
    *("--max-connections", "5", "--max-subscriptions", "100", "--max-payload", "1048576"),
    *("--max-store-bytes", "100000000", "--max-memory-bytes", "1000000"),
    *("--max-streams", "4", "--max-consumers", "16"),
]


# --- a reader of the nats-server config syntax, as much of it as the renderer writes ---------

_TOKEN = re.compile(r'[ \t\r]*(?:(#[^\n]*)|("(?:[^"\\]|\\.)*"|[{}\[\],:\n]|[^\s{}\[\],:#"]+))')
_PUNCTUATION = ("{", "}", "[", "]", ",", ":", "\n")


def _tokens(text: str) -> list[str]:
    out, pos, text = [], 0, text.rstrip(" \t\r")
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise ValueError(f"cannot read the config at {text[pos : pos + 20]!r}")
        pos = m.end()
        if m.group(2) is not None:  # not a comment
            out.append(m.group(2))
    return out


class _Reader:
    def __init__(self, text: str) -> None:
        self.toks, self.i = _tokens(text), 0

    def peek(self) -> str | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def take(self) -> str:
        tok = self.peek()
        if tok is None:
            raise ValueError("the config ends early")
        self.i += 1
        return tok

    def skip_separators(self) -> None:
        while self.peek() in (",", "\n"):
            self.i += 1

    def value(self) -> Any:
        tok = self.take()
        if tok == "{":
            return self.mapping("}")
        if tok == "[":
            items = []
            while True:
                self.skip_separators()
                if self.peek() == "]":
                    self.i += 1
                    return items
                items.append(self.value())
        if tok.startswith('"'):
            return json.loads(tok)
        if tok in _PUNCTUATION:
            raise ValueError(f"a value expected, not {tok!r}")
        return int(tok) if tok.isdigit() else tok

    def mapping(self, end: str | None) -> dict[str, Any]:
        found: dict[str, Any] = {}
        while True:
            self.skip_separators()
            if self.peek() == end:
                if end is not None:
                    self.i += 1
                return found
            key = self.take()
            key = json.loads(key) if key.startswith('"') else key
            if self.peek() == ":":
                self.i += 1
            elif self.peek() != "{":  # `name { ... }` needs no colon
                raise ValueError(f"':' expected after {key!r}")
            if key in found:
                raise ValueError(f"{key!r} given twice")
            found[key] = self.value()


def parse(text: str) -> dict[str, Any]:
    """The config ``text`` as nested dicts and lists (keys as written; bare numbers as ints)."""
    return _Reader(text).mapping(None)


# --- what each tenant's account must get, written out by hand ---------------------------------


def _import(kind: str, subject: str, to: str | None = None) -> dict[str, Any]:
    entry: dict[str, Any] = {kind: {"account": "PLEXRL", "subject": subject}}
    return entry if to is None else entry | {"to": to}


def slice_of(t: str) -> list[dict[str, Any]]:
    """Every import of tenant ``t``'s account; ``to`` only where the subject is renamed."""
    store = f"OBJ_plexrl-weights-{t}"
    return [
        _import("service", f"plexrl.ingest.{t}.submit", f"plexrl.runs.{t}.submit"),
        _import("service", f"plexrl.ingest.{t}.evict", f"plexrl.runs.{t}.evict"),
        _import("service", f"plexrl.ingest.{t}.rollouts.*", f"plexrl.rollouts.{t}.*"),
        _import("service", f"plexrl.inference.{t}.generate"),
        _import("service", f"plexrl.inference.{t}.cancel"),
        _import("service", f"plexrl.registry.{t}.list"),
        _import("service", f"plexrl.train.{t}.*"),
        _import("service", f"$JS.API.DIRECT.GET.{store}", f"$JS.plexrl.API.DIRECT.GET.{store}"),
        _import("service", f"$JS.API.DIRECT.GET.{store}.>", f"$JS.plexrl.API.DIRECT.GET.{store}.>"),
        _import("stream", f"plexrl.runs.{t}.discovered"),
        _import("stream", f"plexrl.runs.{t}.invalid"),
        _import("stream", f"plexrl.runs.{t}.evicted"),
        _import("stream", f"plexrl.runs.{t}.forgotten"),
        _import("stream", f"plexrl.weights.{t}.>"),
        _import("stream", f"_INBOX_{t}.>"),
    ]


def exports_to(t: str) -> list[dict[str, Any]]:
    """What the services' account exports to ``t`` alone: the other side of its imports."""
    out = []
    for entry in slice_of(t):
        ((kind, source),) = ((k, v) for k, v in entry.items() if k != "to")
        out.append({kind: source["subject"], "accounts": [f"TENANT_{t}"]})
    return out


def same(a: list[Any], b: list[Any]) -> bool:
    """Equal as multisets: the order of entries is not what a server acts on."""
    return sorted(map(json.dumps, a)) == sorted(map(json.dumps, b))


def _auth(tmp_path: Path) -> Path:
    d = tmp_path / "auth"
    assert plexrl("tenants", "add", "acme", *ACME_FLAGS, "--dir", d) == 0
    assert plexrl("tenants", "add", "beta", "--dir", d) == 0
    return d


# --- the tests --------------------------------------------------------------------------------


def test_every_account_gets_exactly_its_users_limits_exports_and_imports(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = _auth(tmp_path)
    store = tmp_path / "js"
    assert plexrl("nats-config", "--dir", d, "--store-dir", store) == 0
    conf = d / "nats.conf"
    assert f"wrote {conf}" in capsys.readouterr().out
    config = parse(conf.read_text())
    key = {n: public_key(d / f"{n}.nk") for n in ("services", "gateway", "acme", "beta")}

    assert config["listen"] == "0.0.0.0:4222"
    assert config["max_payload"] == 8 * 1024 * 1024
    assert config["jetstream"] == {"store_dir": str(store), "sync_interval": "always"}
    accounts = config["accounts"]
    assert set(accounts) == {"PLEXRL", "GATEWAY", "TENANT_acme", "TENANT_beta"}

    services = accounts["PLEXRL"]
    assert set(services) == {"jetstream", "users", "exports", "imports"}
    assert services["jetstream"] == "enabled"
    assert services["users"] == [{"nkey": key["services"]}]
    assert same(services["exports"], exports_to("acme") + exports_to("beta"))
    assert same(
        services["imports"],
        [
            {
                "service": {"account": f"TENANT_{t}", "subject": "$JS.API.>"},
                "to": f"$JS.tenant_{t}.API.>",
            }
            for t in ("acme", "beta")
        ],
    )

    # the gateway's connection answers health checks: no JetStream, nothing shared
    assert accounts["GATEWAY"] == {
        "limits": {"max_connections": 64},
        "users": [{"nkey": key["gateway"]}],
    }

    acme = accounts["TENANT_acme"]
    assert acme["users"] == [{"nkey": key["acme"]}]
    assert acme["limits"] == {
        "max_connections": 5,
        "max_subscriptions": 100,
        "max_payload": 1048576,
    }
    assert acme["jetstream"] == {
        "max_file": 100000000,
        "max_mem": 1000000,
        "max_streams": 4,
        "max_consumers": 16,
    }
    assert acme["exports"] == [{"service": "$JS.API.>", "accounts": ["PLEXRL"]}]
    assert same(acme["imports"], slice_of("acme"))

    beta = accounts["TENANT_beta"]
    assert beta["users"] == [{"nkey": key["beta"]}]
    assert "max_payload" not in beta["limits"]  # the server's limit applies
    assert same(beta["imports"], slice_of("beta"))

    result = nats_server_accepts(conf)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ([], {}),
        (["--tls-ca", "{ca}", "--tls-verify"], {"ca_file": "{ca}", "verify": "true"}),
    ],
    ids=["server-tls", "mutual-tls"],
)
def test_the_tls_block_names_the_certificate_key_and_ca_given(
    tmp_path: Path, flags: list[str], expected: dict[str, str]
) -> None:
    d = _auth(tmp_path)
    pki = make_pki(tmp_path)
    out = tmp_path / "nats.conf"
    tls = ["--tls-cert", pki.server_cert, "--tls-key", pki.server_key]
    given = [f.format(ca=pki.ca) for f in flags]
    assert plexrl("nats-config", "--dir", d, "--out", out, *tls, *given) == 0
    config = parse(out.read_text())
    assert config["tls"] == {
        "cert_file": str(pki.server_cert),
        "key_file": str(pki.server_key),
        **{k: v.format(ca=pki.ca) for k, v in expected.items()},
    }
    result = nats_server_accepts(out)  # it reads the certificate, key and CA
    assert result.returncode == 0, result.stderr


def test_a_base_config_is_copied_verbatim_between_the_header_and_the_accounts(
    tmp_path: Path,
) -> None:
    d = _auth(tmp_path)
    # as an editor may save it: no newline after the last line
    base = f'listen: "127.0.0.1:4333"\njetstream {{\n  store_dir: "{tmp_path / "js"}"\n}}'
    (tmp_path / "base.conf").write_text(base)
    out = tmp_path / "nats.conf"
    assert plexrl("nats-config", "--dir", d, "--base", tmp_path / "base.conf", "--out", out) == 0
    text = out.read_text()
    header, rest = text.split("\n\n", 1)
    lines = header.splitlines()
    assert all(line.startswith("# ") for line in lines)
    # the header says what to run after a change of tenants
    for command in ("`plexrl nats-config`", "`plexrl tenants add/remove`", "--signal reload"):
        assert command in header
    assert rest.startswith(base + "\n\naccounts {\n")
    assert rest.endswith("\n}\n") and not rest.endswith("\n\n")
    config = parse(text)
    assert config["listen"] == "127.0.0.1:4333" and "max_payload" not in config
    result = nats_server_accepts(out)
    assert result.returncode == 0, result.stderr


def test_the_config_goes_into_new_directories_readable_by_all_and_writable_by_its_owner(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = _auth(tmp_path)
    out = tmp_path / "etc" / "nats" / "plexrl" / "nats.conf"
    assert plexrl("nats-config", "--dir", d, "--out", out) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    assert stat.S_IMODE(out.stat().st_mode) == 0o644
    assert sorted(p.name for p in out.parent.iterdir()) == ["nats.conf"]  # no temporary left
    assert "TENANT_acme" in parse(out.read_text())["accounts"]


def test_a_non_ascii_base_is_read_and_written_as_utf8_under_an_ascii_locale(
    tmp_path: Path,
) -> None:
    d = _auth(tmp_path)
    base = '# cluster Zürich — étage 3\nlisten: "127.0.0.1:4333"\n'
    (tmp_path / "base.conf").write_text(base, encoding="utf-8")
    out = tmp_path / "nats.conf"
    # a shell whose locale encodes nothing but ASCII (LC_ALL=C, Python's UTF-8 mode off): the
    # base is read, and the config written, in UTF-8 all the same
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LC_", "LANG", "PYTHONUTF8"))}
    env |= {"LC_ALL": "C", "PYTHONCOERCECLOCALE": "0"}
    command = [sys.executable, "-X", "utf8=0", "-m", "services", "nats-config", "--dir", str(d)]
    result = subprocess.run(
        [*command, "--base", str(tmp_path / "base.conf"), "--out", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert base.encode("utf-8") in out.read_bytes()
    assert parse(out.read_text(encoding="utf-8"))["listen"] == "127.0.0.1:4333"
    accepted = nats_server_accepts(out)
    assert accepted.returncode == 0, accepted.stderr


def test_a_config_rendered_without_the_gateways_user_has_no_gateway_account(
    tmp_path: Path,
) -> None:
    services, _ = ensure_seed(seed_path(tmp_path, SERVICES))
    acme, _ = ensure_seed(seed_path(tmp_path, "acme"))
    text = render_nats_config([User(SERVICES, services), User("acme", acme)])
    config = parse(text)
    assert config["listen"] == "0.0.0.0:4222"  # all interfaces unless told otherwise
    assert set(config["accounts"]) == {"PLEXRL", "TENANT_acme"}
    assert same(config["accounts"]["TENANT_acme"]["imports"], slice_of("acme"))
    conf = tmp_path / "nats.conf"
    conf.write_text(text)
    result = nats_server_accepts(conf)
    assert result.returncode == 0, result.stderr
