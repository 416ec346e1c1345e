"""The registry: the one owner of run identity, and the run mirror other services follow.

- :mod:`services.registry.service` — the ``plexrl registry`` service (discovery, validation,
  the index pool, eviction, the KV run table, lifecycle events);
- :mod:`services.registry.mirror` — :class:`RunMirror`, the registry's state as the trainer and
  inference apply it, with creation/deletion hooks synchronised across ranks;
- :mod:`services.registry.progress` — per-run progress in KV ``plexrl-progress``.

Nothing is imported here, so ``plexrl --help`` stays instant.
"""
