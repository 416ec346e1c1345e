"""How weights travel from the trainer to inference (a run's adapter, or under full-weight mode
the whole model): encode, store or offer, announce, fetch, verify.

- :mod:`services.weights.transport`: the one interface of a transport (a sender in the trainer,
  a fetcher on each replica) and the table that names them.
- One module per transport: :mod:`~services.weights.object_store` (the JetStream object store
  ``plexrl-weights``, over :mod:`~services.weights.blobs`), :mod:`~services.weights.filesystem`
  (a directory per version), :mod:`~services.weights.ucx` (straight from the trainer's memory;
  imports ucxx only when used), :mod:`~services.weights.collective` (a torch.distributed
  broadcast group that re-forms as replicas come and go).
- :mod:`services.weights.publisher`: the trainer side; publishes WeightsReady and removes old
  versions, whatever the transport.
- :mod:`services.weights.loader`: the inference side; the transport's fetcher receives what a
  WeightsReady announces.
- :mod:`services.weights.stream`: a state dict as a safetensors byte stream, encoded and decoded
  in place; :mod:`services.weights.header` parses and checks its header;
  :mod:`services.weights.buckets` cuts it into messages.
- :mod:`services.weights.digest`: ``blake3:`` (or older ``sha256:``) digests, checked in one place.
"""

from services.weights.loader import WeightsError, load_weights
from services.weights.publisher import WeightPublisher
from services.weights.stream import EncodedStream, StreamDecoder
from services.weights.transport import SenderOptions, unavailable_reason

__all__ = [
    "EncodedStream",
    "SenderOptions",
    "StreamDecoder",
    "WeightPublisher",
    "WeightsError",
    "load_weights",
    "unavailable_reason",
]
