"""How adapters travel from the trainer to inference: store, announce, fetch, verify.

- :mod:`services.weights.object_store`: blobs in the JetStream object store ``plexrl-weights``,
  read and written at stream speed.
- :mod:`services.weights.publisher`: the trainer side; stores a run's adapter after a step,
  publishes WeightsReady and removes old versions.
- :mod:`services.weights.loader`: the inference side; fetches what a WeightsReady announces and
  checks its size and digest before parsing it.
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

__all__ = [
    "BlobError",
    "BlobNotFoundError",
    "WeightPublisher",
    "WeightsError",
    "delete_blob",
    "get_blob",
    "load_weights",
    "put_blob",
]
