"""Stage three of the flow: encoding accepted image parts (see ``protocol``)."""

from modalgate.encoder_adapter.protocol import Encoded, EncoderAdapter

__all__ = ["Encoded", "EncoderAdapter"]
