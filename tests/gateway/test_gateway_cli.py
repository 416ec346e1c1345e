"""``plexrl gateway``: its help is instant, unusable settings exit 2 with a clear message."""

from __future__ import annotations

import os
import subprocess
import sys

from gateway_support import REPO, free_port


def test_help_imports_neither_torch_nor_the_http_stack() -> None:
    code = (
        "import sys; from services.gateway import cli; import argparse; "
        "p = argparse.ArgumentParser(); cli.register(p.add_subparsers()); "
        "print(sorted(m for m in ('torch', 'fastapi', 'uvicorn') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert out.stdout.strip() == "[]", out.stderr


def _gateway(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PLEXRL_")}
    return subprocess.run(
        [sys.executable, "-m", "services", "gateway", *args],
        cwd=REPO,
        env=env | {"PLEXRL_CONNECT_WAIT_S": "0"},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_directory_without_a_tokenizer_is_refused(tmp_path) -> None:
    done = _gateway("--model", str(tmp_path))
    assert done.returncode == 2
    assert f"{tmp_path} holds no tokenizer" in done.stderr


def test_bad_settings_exit_2() -> None:
    done = _gateway("--model", "m", "--port", "70000")
    assert done.returncode == 2
    assert "port" in done.stderr


def test_no_nats_exits_1(tmp_path) -> None:
    from services.model.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "model", seed=0)
    url = f"nats://127.0.0.1:{free_port()}"
    done = _gateway("--model", str(model), "--nats-url", url, "--port", str(free_port()))
    assert done.returncode == 1, done.stderr
    assert "plexrl gateway:" in done.stderr


def test_a_taken_port_exits_2(stack) -> None:
    port = stack.url.rsplit(":", 1)[1]  # the running gateway's
    env = {k: v for k, v in os.environ.items() if not k.startswith("PLEXRL_")}
    done = subprocess.run(
        [sys.executable, "-m", "services", "gateway", "--model", str(stack.model), "--port", port],
        cwd=REPO,
        env=env | {"PLEXRL_NATS_URL": stack.nats_url},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr


def test_without_keys_it_refuses_to_listen_beyond_loopback_and_says_so_on_loopback(
    stack,
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PLEXRL_")}
    env |= {"PLEXRL_NATS_URL": stack.nats_url}
    argv = [sys.executable, "-m", "services", "gateway", "--model", str(stack.model)]
    done = subprocess.run(
        [*argv, "--host", "0.0.0.0", "--port", str(free_port())],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "no tenants file" in done.stderr and "--allow-no-keys" in done.stderr
    # the stack's own gateway, keyless on 127.0.0.1, said what it serves when it started
    assert "serving tenant default without API keys on 127.0.0.1" in stack.log("gateway")
