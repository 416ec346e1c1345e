"""How weights travel from the trainer to inference (a run's adapter, or under full-weight mode
the whole model): store, announce, fetch, verify.

- :mod:`services.weights.object_store`: blobs in the JetStream object store ``plexrl-weights``,
  read and written at stream speed.
- :mod:`services.weights.publisher`: the trainer side; stores a run's adapter after a step,
  publishes WeightsReady and removes old versions.
- :mod:`services.weights.loader`: the inference side; fetches what a WeightsReady announces and
  checks its size and digest before parsing it.
- :mod:`services.weights.stream`: a state dict as a safetensors byte stream, encoded and decoded
  in place, for the direct transports.
- :mod:`services.weights.transport`: the sender and fetcher interfaces of a direct transport.
- :mod:`services.weights.ucx`: the ``ucx`` transport (imports ucxx only when used).
- :mod:`services.weights.collective`: the ``collective`` transport, a torch.distributed broadcast
  group of the trainer and the replicas that re-forms as members come and go.
"""

from services.weights.loader import WeightsError, load_weights
from services.weights.object_store import (
    BlobError,
    BlobNotFoundError,
    delete_blob,
    get_blob,
    put_blob,
)
from services.weights.publisher import WeightPublisher
from services.weights.stream import CHUNK_BYTES, EncodedStream, StreamDecoder
from services.weights.transport import WeightFetcher, WeightSender, unavailable_reason

__all__ = [
    "CHUNK_BYTES",
    "BlobError",
    "BlobNotFoundError",
    "EncodedStream",
    "StreamDecoder",
    "WeightFetcher",
    "WeightPublisher",
    "WeightSender",
    "WeightsError",
    "delete_blob",
    "get_blob",
    "load_weights",
    "put_blob",
    "unavailable_reason",
]
