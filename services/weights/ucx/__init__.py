"""The ``ucx`` weight transport: weights straight from the trainer's memory to each replica.

Location: a WeightsReady with ``transport = "ucx"`` has ``location`` =
``ucx://<host>:<port>/<run_id>/step_<n>``: the address of the trainer's UCX listener and the tag
under which it holds that version's safetensors stream (an adapter, or a whole model's state
dict). The trainer keeps the last ``keep_last`` versions of each run in memory (no disk, no
object store; of a full-weight run the publisher keeps only the newest); a replica connects and
pulls, into fresh tensors or in place into a ``destination``. TCP on
one host, RDMA across hosts when ``UCX_TLS`` allows it: this module sets ``UCX_TLS=tcp`` and
``UCX_WARN_UNUSED_ENV_VARS=n`` only where they are unset, so set ``UCX_TLS`` (for instance
``rc,tcp``) to use other transports.

Protocol, on one UCX endpoint per replica and trainer, in tagged messages; every message has a
tag of its own, so nothing depends on their order and requests on one endpoint run at once:

1. replica -> trainer, tag 1: a request frame of :data:`REQUEST_BYTES` bytes: magic
   ``PLXWREQ1``, u64 request id ``r``, u16 length of the tag, the tag in UTF-8, zero padding.
2. trainer -> replica, tag ``r << 24``: a reply frame (:data:`REPLY`): magic ``PLXWREP1``, u32
   status (0 ok, 1 unknown tag, 2 bad request), u32 reserved (0), u64 header length (with its
   8-byte prefix), u64 stream size, u64 chunk size. A status other than 0 ends the reply.
3. trainer -> replica, tag ``r << 24 | 1``: the safetensors header.
4. trainer -> replica, tag ``r << 24 | 2 + k``: bucket ``k`` of the tensor data, as
   :func:`services.weights.buckets.bucket_plan` cuts it with that chunk size: large tensors in
   pieces of their own, received in place, and the pieces of small tensors put together,
   copied through a buffer on both ends. The replica cuts its :meth:`StreamDecoder.targets`
   the same way.

Both ends keep a few pieces in flight (``window``). A replica checks size and digest when the
last piece is in (:meth:`StreamDecoder.finish`). Every wait is bounded: connecting by
``connect_timeout`` (ucxx usually reports a refused connection at once, but now and then only
as that timeout), each message by ``stall_timeout`` (a peer that stops sending for that long
is given up on). A trainer that dies mid-transfer resets the connection, which fails the
transfer at once; either way the replica aborts the endpoint (so nothing more is written into
its buffers), drops it from its cache and raises :class:`WeightsError`, with ``touched`` set
when pieces were already being received into a destination; the next fetch reconnects.

asyncio: ucxx's asyncio API runs here in its ``thread`` progress mode with Python futures: a UCX
progress thread drives the worker, and a notifier thread completes each request's asyncio future
on the event loop, so an idle endpoint costs nothing and nats-py shares the loop undisturbed.
(Without Python futures every awaited request polls with ``asyncio.sleep(0)``, which keeps a core
busy for as long as a replica waits.) There is one ucxx context per event loop, made on first use:
ucxx keeps its progress tasks in a global dictionary keyed by loop, so a second context on the
same loop would never progress. The notifier thread is not a daemon; it is stopped when its loop
closes and before interpreter shutdown joins threads, or the process would hang on exit.

Modules: :mod:`.wire` (frames, tags, the per-loop context, the send and receive pipeline),
:mod:`.server` (:class:`UcxWeightServer`, the trainer's end), :mod:`.client`
(:class:`UcxWeightClient`, a replica's end).
"""

from __future__ import annotations

from pathlib import Path

from services.bus import Bus
from services.weights.transport import SenderOptions
from services.weights.ucx.client import UcxWeightClient, default_client
from services.weights.ucx.server import UcxWeightServer
from services.weights.ucx.wire import _tag, import_ucxx

__all__ = ["UcxWeightClient", "UcxWeightServer", "_tag", "import_ucxx"]


def sender(bus: Bus, output_dir: Path, keep_last: int, options: SenderOptions) -> UcxWeightServer:
    return UcxWeightServer(options.ucx_host, options.ucx_port, keep_last)


def fetcher(bus: Bus, output_dir: Path | None) -> UcxWeightClient:
    return default_client()


def unavailable(ucx_module: str = "ucxx") -> str | None:
    """Why ucx cannot run here: ``ucx_module`` (ucxx) cannot be imported; None when it can."""
    try:
        import_ucxx(ucx_module)
    except ImportError as exc:
        return (
            f"weight transport 'ucx' needs the {ucx_module!r} package, which cannot be "
            f"imported here ({exc}); install it with pip install -e '.[ucx]' or choose "
            "another transport"
        )
    return None
