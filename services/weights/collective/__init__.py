"""The ``collective`` weight transport: the trainer broadcasts each adapter to every replica.

Roles. The trainer runs a :class:`CollectiveSender`, rank 0 of every group: it hosts a
``TCPStore`` on ``host:port`` and answers membership over NATS. Each inference replica runs a
:class:`CollectiveReceiver`: it joins over NATS, takes part in the group from a background
thread (collectives block) and keeps what arrives, the newest per run, until :meth:`fetch` asks.

Generations. A process group's members are fixed, so each change of membership forms a new
group, generation ``g``: ``ProcessGroupGloo(PrefixStore(f"gen{g}", store), rank, size)`` built
directly, never the default group (``init_process_group`` happens once per process, and a
trainer under torchrun owns it already). Gloo, also on GPU machines: streams are CPU memory
(:mod:`services.weights.stream`), and NCCL would need them on a device. The gloo device binds to
127.0.0.1 when the store's host is a loopback address, else to ``GLOO_SOCKET_IFNAME`` or the
address of the host name. Each member marks ``ready/gen<g>/<member>`` in the store before it
builds its side, so a generation that cannot be built drops the members that never came; after
:data:`MAX_FORM_ATTEMPTS` failures in a row the sender waits for replicas to join again.

Membership goes over core NATS on ``plexrl.collective.<group>.*``, in the messages of
:mod:`schemas.collective` (join, leave, formed, alive): a join forms the next generation of every
live member plus the joiner; after a failed collective the sender keeps the members that answer
a ping and drops the others.

Every new generation is brought up to date first: the sender re-sends the newest stream of
every run, so a replica that joins late has the current weights of all runs.

Frames. Every collective comes from the sender's one broadcasting thread, in order, so all ranks
call the same broadcasts with the same sizes. A frame starts with ``int64[2]`` ``[MAGIC, n]``:
``n == 0`` is a heartbeat (sent after :data:`HEARTBEAT` idle seconds), otherwise ``uint8[n]``
follows, a JSON frame: a stream (run, step, size, digest, header and segment lengths, bucket
size), then the stream's header (with its 8-byte length prefix), then its data in buckets (see
:func:`bucket_plan`); a ``forget``; or ``end`` (this generation is over: a new one follows, or
the sender is closing). Receivers need no other channel to know what comes next.

Timeouts, so that nothing waits forever:

- ``timeout`` (:data:`TIMEOUT`, both ends): building a generation and each broadcast. A sender
  whose broadcast fails or times out forms a new generation of the members that still answer a
  ping within ``ping_timeout`` (:data:`PING_TIMEOUT`); a SIGKILLed replica fails the next
  broadcast at once (the connection closes). A receiver that hears nothing, not even a
  heartbeat, for ``timeout`` gives the generation up.
- ``join_timeout`` (:data:`JOIN_TIMEOUT`): each join or leave request, and how long a receiver
  whose generation failed waits for the sender to announce the next one before it asks to join
  again; with no sender answering, it asks every ``rejoin_interval`` (:data:`REJOIN_INTERVAL`)
  until closed, so replicas find a restarted trainer by themselves.
- ``fetch_timeout`` (:data:`FETCH_TIMEOUT`): how long :meth:`CollectiveReceiver.fetch` waits for
  the announced transfer; a run whose newer step has arrived instead fails at once.

Modules: :mod:`.protocol` (constants, frames, buckets, gloo groups),
:mod:`.sender` (:class:`CollectiveSender`), :mod:`.member` (a replica's membership: joining,
taking part in each generation) and :mod:`.receiver` (:class:`CollectiveReceiver`, what it
receives).
"""

from pathlib import Path

from services.bus import Bus
from services.weights.collective.receiver import CollectiveReceiver
from services.weights.collective.sender import CollectiveSender
from services.weights.transport import SenderOptions

__all__ = ["CollectiveReceiver", "CollectiveSender"]


def sender(bus: Bus, output_dir: Path, keep_last: int, options: SenderOptions) -> CollectiveSender:
    return CollectiveSender(
        bus, options.collective_host, options.collective_port, options.collective_bucket_bytes
    )


def fetcher(bus: Bus, output_dir: Path | None) -> None:
    """None: a replica joins its group at start-up (a CollectiveReceiver) and passes it in."""
    return None


def unavailable() -> str | None:
    import torch.distributed

    if not torch.distributed.is_available():
        return (
            "weight transport 'collective' needs torch.distributed, which this torch "
            "build does not have; choose another transport"
        )
    return None
