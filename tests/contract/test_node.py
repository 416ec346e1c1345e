"""The contract read from Node.js (tests/js): Ajv validates the examples against the JSON
Schemas and the AsyncAPI parser validates asyncapi.yaml. Needs ``npm install`` in tests/js."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from .vectors import REPO_ROOT

JS_DIR = REPO_ROOT / "tests" / "js"
NODE = shutil.which("node")


@pytest.mark.skipif(
    NODE is None or not (JS_DIR / "node_modules").is_dir(),
    reason="needs node and `npm install --prefix tests/js`",
)
def test_node_validates_examples_and_asyncapi() -> None:
    assert NODE is not None
    proc = subprocess.run([NODE, "--test"], cwd=JS_DIR, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "# fail 0" in proc.stdout
    passed = int(proc.stdout.split("# pass ")[1].split()[0])
    assert passed >= 27
