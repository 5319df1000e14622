"""Video and audio facts from FFmpeg's own demuxers (PyAV): container, streams, length.

A server loads a video by asking its container how many frames and seconds it holds,
then seeks to the frames it samples; a file that declares more than it holds, or
whose index points past its end, fails there (a 500, or a decode error deep in the
model's preprocessing). So the probe reads what the container declares, then demuxes
every packet of the stream it judges (no decoding: packets are read, not decoded)
and counts what is really there, and decodes the stream's first frame only, so codec
data that is not what the container says is caught too.

The demuxer is the one the sniffed format names (``DEMUXERS``), not FFmpeg's own
guess: the bytes were judged to be that format, and are read as that format. It
reads through a callback that holds it to a time and a read budget
(``PROBE_SECONDS``, ``READ_BUDGET``), so a hostile container cannot make it loop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from fractions import Fraction

import av

from modalgate.media.container_walk import end_problem

# The sniffed format (``media.sniff``) -> FFmpeg's demuxer for it.
DEMUXERS = {
    "mp4": "mov",
    "mov": "mov",
    "m4a": "mov",
    "webm": "matroska",
    "mkv": "matroska",
    "avi": "avi",
    "ts": "mpegts",
    "ogv": "ogg",
    "ogg": "ogg",
    "wav": "wav",
    "flac": "flac",
    "mp3": "mp3",
    "aac": "aac",
}
# Wall time and bytes read (as a multiple of the file, plus a constant) one probe may take.
PROBE_SECONDS = 2.0
READ_BUDGET = 4
READ_ALLOWANCE = 1 << 20
# Stream analysis bounded to the first packets: FFmpeg reads up to 5 MB of them by
# default to find what the headers already say (~3.7 ms for a 10 s WAV, 0.35 at 4 KiB);
# every packet is read below anyway. PCM's header says everything.
_OPEN = {"analyzeduration": "0", "probesize": "32768"}
_OPEN_PCM = {"analyzeduration": "0", "probesize": "4096"}
# Packets fed to the decoder to get the first frame out (codecs with delay need a few).
FIRST_FRAME_PACKETS = 32


class MediaProbeError(ValueError):
    """The file cannot be read as what it claims to be; the text is safe to show a client."""


class _OverBudget(Exception):
    """Raised inside the read callback; FFmpeg hands it back from the call it was in."""


@dataclass(frozen=True, slots=True)
class MediaFacts:
    container: str  # the sniffed format: mp4, webm, wav, ...
    codec: str  # FFmpeg's codec name of the stream judged: h264, vp9, pcm_s16le, ...
    seconds: float  # counted: the packets' span
    declared_seconds: float | None
    packets: int  # counted: frames for video, packets for audio
    declared_frames: int | None
    width: int | None = None
    height: int | None = None
    frame_rate: float | None = None
    sample_rate: int | None = None
    channels: int | None = None


class _BudgetedReader:
    """A file object over ``data`` that FFmpeg reads through, within the probe's budget."""

    def __init__(self, data: bytes) -> None:
        self._view = memoryview(data)
        self._at = 0
        self._read_left = READ_BUDGET * len(data) + READ_ALLOWANCE
        self._deadline = time.monotonic() + PROBE_SECONDS

    def read(self, size: int = -1) -> bytes:
        end = len(self._view) if size < 0 else min(len(self._view), self._at + size)
        chunk = self._view[self._at : end]
        self._at = end
        self._read_left -= len(chunk)
        if self._read_left < 0:
            raise _OverBudget
        self.check_time()
        return bytes(chunk)

    def seek(self, offset: int, whence: int = 0) -> int:
        base = (0, self._at, len(self._view))[whence]
        self._at = max(0, min(len(self._view), base + offset))
        self.check_time()
        return self._at

    def tell(self) -> int:
        return self._at

    def check_time(self) -> None:
        if time.monotonic() > self._deadline:
            raise _OverBudget


def probe_media(data: bytes, fmt: str, modality: str, max_pixels: int = 0) -> MediaFacts:
    """The facts of the first ``modality`` stream ("video" or "audio") of ``data``, read
    as ``fmt``; raise MediaProbeError where it is not a whole file of that kind. A video
    whose frames are over ``max_pixels`` is not decoded (its facts say why it is refused)."""
    problem = end_problem(data, fmt)
    if problem is not None:
        raise MediaProbeError(f"the {fmt.upper()} {modality} is not whole: {problem}")
    reader = _BudgetedReader(data)
    try:
        with av.open(
            reader, format=DEMUXERS[fmt], mode="r", options=_OPEN_PCM if fmt == "wav" else _OPEN
        ) as container:
            return _facts(container, reader, data, fmt, modality, max_pixels)
    except _OverBudget:
        raise MediaProbeError(
            f"the {modality} takes too long to read (its structure loops)"
        ) from None
    except MediaProbeError:
        raise
    except (av.FFmpegError, EOFError, OSError, ValueError, IndexError, OverflowError):
        # FFmpeg's messages name its internals; the client is told what, not how.
        raise MediaProbeError(
            f"the data cannot be read as {fmt.upper()} {modality} (damaged or cut short)"
        ) from None


def _facts(
    container: av.container.InputContainer,
    reader: _BudgetedReader,
    data: bytes,
    fmt: str,
    modality: str,
    max_pixels: int,
) -> MediaFacts:
    streams = container.streams.video if modality == "video" else container.streams.audio
    if not streams:
        raise MediaProbeError(f"the {fmt.upper()} file holds no {modality} stream")
    stream = streams[0]
    if stream.codec_context is None:  # no decoder for it, or its parameters are unreadable
        raise MediaProbeError(f"the {modality} stream's codec cannot be decoded")
    context = stream.codec_context
    codec = context.codec.canonical_name  # h264, not the decoder's name (libdav1d for av1)
    pixels = (context.width or 0) * (context.height or 0) if modality == "video" else 0
    declared_frames = stream.frames or None
    declared_seconds = _declared_seconds(container, stream)
    packets, start, end, step = 0, None, None, None
    first = _FirstFrame(context, skip=max_pixels > 0 and pixels > max_pixels)
    last = None
    for packet in container.demux(stream):
        size = packet.size
        if not size:
            first.feed(packet)  # the flush packet at the end: a codec with delay may answer
            continue
        packets += 1
        if packets <= FIRST_FRAME_PACKETS:
            first.feed(packet)
        elif not packets & 255:
            reader.check_time()
        last = packet
        pos = packet.pos
        if pos is not None and pos >= 0 and pos + size > len(data):
            raise MediaProbeError(f"the {modality} is cut short (a frame ends past the file)")
        pts = packet.pts
        if pts is not None:
            duration = packet.duration
            if start is None or pts < start:
                start = pts
            stop = pts + (duration or 0)
            if end is None or stop > end:
                end = stop
            if duration:
                step = duration
    if packets == 0:
        raise MediaProbeError(f"the {modality} holds no frames")
    base = stream.time_base or Fraction(1, 1)
    seconds = float((end - start) * base) if start is not None and end is not None else 0.0
    if declared_frames is not None and packets < declared_frames:
        raise MediaProbeError(
            f"the {modality} declares {declared_frames} frames but holds {packets} (cut short,"
            " or its frame count is false)",
        )
    slack = 0.5 * float(step * base) if step else 0.0
    if declared_seconds is not None and seconds < declared_seconds * 0.99 - slack - 0.001:
        raise MediaProbeError(
            f"the {modality} declares {declared_seconds:.3f} s but holds {seconds:.3f} s (cut"
            " short, or its duration is false)",
        )
    if not first.decoded:
        raise MediaProbeError(
            f"the {modality}'s first frame cannot be decoded (its codec data is damaged)"
        )
    if modality == "audio" and packets > 1 and not _decodes(stream.codec_context, last):
        # Audio frames decode alone; a bare stream's (FLAC's) last one may be cut short.
        raise MediaProbeError("the audio's last frame is cut short or damaged")
    if modality == "video":
        rate = stream.average_rate or stream.guessed_rate
        return MediaFacts(
            fmt, codec, seconds, declared_seconds, packets, declared_frames,
            width=context.width, height=context.height,
            frame_rate=float(rate) if rate else None,
        )  # fmt: skip
    return MediaFacts(
        fmt, codec, seconds, declared_seconds, packets, declared_frames,
        sample_rate=context.sample_rate, channels=context.channels,
    )  # fmt: skip


def _declared_seconds(
    container: av.container.InputContainer, stream: av.stream.Stream
) -> float | None:
    """The stream's length as declared; a file of one stream is held to the container's
    length too (a loader may read either)."""
    declared = []
    if stream.duration and stream.time_base:
        declared.append(float(stream.duration * stream.time_base))
    if container.duration and (len(container.streams) == 1 or not declared):
        declared.append(container.duration / av.time_base)
    return max(declared) if declared else None


def _decodes(decoder: av.codec.context.CodecContext, packet: av.Packet | None) -> bool:
    try:
        decoder.decode(packet)
    except av.FFmpegError:
        return False
    return True


class _FirstFrame:
    """Feeds the first packets to the decoder until a frame comes out: the codec data
    is what the container says it is. Later packets are only counted."""

    def __init__(self, decoder: av.codec.context.CodecContext, skip: bool) -> None:
        self._decoder = decoder
        self._fed = 0
        self.decoded = skip  # frames too large to decode: refused by their size instead

    def feed(self, packet: av.Packet) -> None:
        if self.decoded or self._fed >= FIRST_FRAME_PACKETS:
            return
        self._fed += 1
        try:
            self.decoded = bool(self._decoder.decode(packet))
        except av.FFmpegError:
            self._fed = FIRST_FRAME_PACKETS  # a damaged first packet: no frame to come
