"""The registry: the one owner of run identity.

- :mod:`services.registry.service` — the ``plexrl registry`` service (discovery, validation,
  the index pool, eviction, lifecycle events);
- :mod:`services.registry.ledger` and :mod:`services.registry.table` — the run table in KV
  ``plexrl-registry``, its write-ahead log (other services read it through
  :mod:`services.runs`).
- :mod:`services.registry.tenancy` and :mod:`services.registry.fair_share` — what a tenant may
  do (quotas, ownership) and which waiting run gets a free index;
- :mod:`services.registry.listing` — the run list service, ``plexrl.registry[.<tenant>].list``.

Nothing is imported here, so ``plexrl --help`` stays instant.
"""
