"""``plexrl schemas export`` / ``plexrl schemas check``: regenerate or verify the contract files.

``check`` exits 1 when the committed ``json/`` or ``asyncapi.yaml`` differ from what the Python
types generate, so a change to an event cannot land without its language-neutral schema.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

SCHEMAS_DIR = Path(__file__).resolve().parent
_DIFF_LINES = 40  # per file: enough to see what changed without flooding a CI log


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "schemas",
        help="regenerate or verify schemas/json/ and schemas/asyncapi.yaml",
        description="The JSON Schemas and the AsyncAPI document generated from schemas/*.py.",
    )
    actions = parser.add_subparsers(dest="schemas_action", metavar="ACTION", required=True)
    for name, func, help_text in (
        ("export", _export, "write the generated files and list what changed"),
        ("check", _check, "exit 1 if the committed files differ from the generated ones"),
    ):
        action = actions.add_parser(name, help=help_text, description=help_text)
        action.add_argument(
            "--dir",
            type=Path,
            default=SCHEMAS_DIR,
            help="the schemas directory holding json/ and asyncapi.yaml (default: %(default)s)",
        )
        action.set_defaults(func=func)


def _export(args: argparse.Namespace) -> int:
    from schemas.export import write

    changes = write(args.dir)
    for change in changes:
        verb = "removed" if change.kind == "stale" else "wrote"
        print(f"{verb} {args.dir / change.path}")
    if not changes:
        print(f"{args.dir}: up to date")
    return 0


def _check(args: argparse.Namespace) -> int:
    from schemas.export import compare

    differences = compare(args.dir)
    if not differences:
        print(f"{args.dir}: schemas match the code")
        return 0
    print(f"{args.dir}: {len(differences)} file(s) out of date:", file=sys.stderr)
    for d in differences:
        print(f"  {d}", file=sys.stderr)
    for d in differences:
        if d.diff:
            lines = d.diff.splitlines()
            print("", file=sys.stderr)
            print("\n".join(lines[:_DIFF_LINES]), file=sys.stderr)
            if len(lines) > _DIFF_LINES:
                print(f"... {len(lines) - _DIFF_LINES} more diff lines", file=sys.stderr)
    print(
        "\nThe event or config types changed without re-exporting their schemas: run "
        "`plexrl schemas export` and commit schemas/json/ and schemas/asyncapi.yaml.",
        file=sys.stderr,
    )
    return 1
