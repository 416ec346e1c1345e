"""Tenants on the broker: nkey credentials and the nats-server config that isolates them.

``credentials`` creates and reads the seed files, ``permissions`` states what each user may
do, ``nats_config`` renders the server's ``authorization`` and ``tls`` blocks, and ``cli`` is
``plexrl tenants`` and ``plexrl nats-config``. Quotas live in :mod:`services.config.tenants`.
"""
