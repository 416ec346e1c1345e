"""Run state every service shares: the run mirror, the run table's read side and progress.

- :mod:`services.runs.mirror` — :class:`RunMirror`, the registry's runs as the trainer and
  inference apply them (buffered lifecycle events, creation/deletion hooks, the same on every
  rank when handed a broadcast);
- :mod:`services.runs.table` — typed reads of KV ``plexrl-registry``
  (:class:`schemas.records.RunRecord`);
- :mod:`services.runs.progress` — per-run :class:`schemas.records.Progress` in KV
  ``plexrl-progress``.

The record types themselves are contract data and live in :mod:`schemas.records`.
"""

from services.runs.mirror import RunInfo, RunMirror
from services.runs.progress import read_progress, write_progress
from services.runs.table import TableUnreadable, read_record, read_table

__all__ = [
    "RunInfo",
    "RunMirror",
    "TableUnreadable",
    "read_progress",
    "read_record",
    "read_table",
    "write_progress",
]
