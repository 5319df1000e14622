"""Stage three of the flow: encoding the accepted image parts.

Importing this package does not import torch: the local encoder loads it when
an encoder is created.
"""

from modalgate.encoder_adapter.batching import BatchSettings, MicroBatcher, Overloaded
from modalgate.encoder_adapter.cache import EmbeddingCache
from modalgate.encoder_adapter.protocol import Encoded, EncoderAdapter
from modalgate.encoder_adapter.registry import available, create_encoder, register

__all__ = [
    "BatchSettings",
    "EmbeddingCache",
    "Encoded",
    "EncoderAdapter",
    "MicroBatcher",
    "Overloaded",
    "available",
    "create_encoder",
    "register",
]
