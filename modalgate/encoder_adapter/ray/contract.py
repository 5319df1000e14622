"""What the two sides of the Ray Serve encoder pool agree on: names, the reply, the hop.

The gateway side (``ray.client``) and the replicas (``ray.serve``) both depend on this
module and never on each other: the application and deployment names, the batching
choice a request may carry, the reply a replica sends back (``PoolReply``), how an
embedding crosses the hop (numpy out, torch back in), and joining the cluster.

Embeddings travel as numpy arrays in a pickled reply: Ray serialises them with
pickle protocol 5 and out-of-band buffers (big ones through the shared-memory
object store, read without a copy), so no base64 and no JSON cross the hop.
Ray and torch are imported only when used, so importing this module is cheap.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field
from typing import Literal

from modalgate.encoder_adapter.protocol import Encoded
from modalgate.settings import RaySettings

__all__ = [
    "ADDRESS_ENV",
    "DEFAULT_APP",
    "DEPLOYMENT",
    "Batching",
    "PoolReply",
    "check_batching",
    "connect",
    "from_wire",
    "to_wire",
]

ADDRESS_ENV = "MODALGATE_RAY_ADDRESS"  # read through modalgate.settings.RaySettings
DEFAULT_APP = "modalgate-encoder"
DEPLOYMENT = "EncoderReplica"
Batching = Literal["modalgate", "serve"]


@dataclass(frozen=True, slots=True)
class PoolReply:
    """A replica's answer: one result per image (embeddings as numpy arrays), or a refusal."""

    replica: str
    results: list[Encoded] = field(default_factory=list)
    retry_after_s: float | None = None  # set when the replica's own queue was full


def check_batching(batching: str) -> Batching:
    if batching not in ("modalgate", "serve"):
        raise ValueError(f"batching must be 'modalgate' or 'serve', not {batching!r}")
    return batching  # type: ignore[return-value]


def to_wire(result: Encoded) -> Encoded:
    """The replica's side: the embedding as a float32 CPU numpy array (pickled out of band)."""
    if result.embedding is None:
        return result
    array = result.embedding.detach().to("cpu").float().contiguous().numpy()
    return Encoded(embedding=array, grid_thw=result.grid_thw, cached=result.cached)


def from_wire(result: Encoded) -> Encoded:
    """The gateway's side: numpy back to torch without a copy (the array may be a read-only
    view of the object store; the tensor shares it, and nobody in modalgate writes into an
    embedding)."""
    if result.embedding is None:
        return result
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "the given NumPy array is not writable"
        tensor = torch.from_numpy(result.embedding)
    return Encoded(embedding=tensor, grid_thw=result.grid_thw, cached=result.cached)


def connect(address: str | None = None) -> None:
    """Join the Ray cluster as a driver (once per process); replicas' logs stay on the cluster."""
    import ray

    if not ray.is_initialized():
        ray.init(
            address=address or RaySettings().address,
            log_to_driver=False,
            logging_level=logging.WARNING,
        )
