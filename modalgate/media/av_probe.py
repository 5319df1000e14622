"""Video and audio facts from FFmpeg's own demuxers (PyAV): container, streams, length.

A server loads a video by asking its container how many frames and seconds it holds,
then decodes the frames it samples; a file that declares more than it holds, whose
index points past its end, or whose coded data is damaged anywhere fails there (a 500,
or a decode error deep in the model's preprocessing). So the probe reads what the
container declares, demuxes every packet of the stream it judges and counts what is
really there, and decodes every packet as it goes (``verify``, the default: damage in
any frame is found here; a clip whose packets decode to fewer frames is refused). With
``verify`` off it decodes the first frame only (and an audio stream's last), so codec
data that is not what the container says is still caught, at a fraction of the cost.

The demuxer is the one the sniffed format names (``DEMUXERS``), not FFmpeg's own
guess: the bytes were judged to be that format, and are read as that format. It
reads through a callback that holds it to a time and a read budget
(``PROBE_SECONDS``, ``READ_BUDGET``; decoding earns time by the pixels or samples it
decodes), so a hostile container cannot make it loop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from fractions import Fraction

import av

from modalgate.media.container_walk import end_problem, ogg_final_granule

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
# Audio files that are frames back to back, with no container to say where each is.
BARE_STREAMS = frozenset(("mp3", "aac", "flac"))
# Wall time and bytes read (as a multiple of the file, plus a constant) one probe may take.
PROBE_SECONDS = 2.0
READ_BUDGET = 4
READ_ALLOWANCE = 1 << 20
# Stream analysis bounded to the first packets: FFmpeg reads up to 5 MB of them by
# default to find what the headers already say (~3.7 ms for a 10 s WAV, 0.35 at 4 KiB);
# every packet is read below anyway. PCM's header says everything.
_OPEN = {"analyzeduration": "0", "probesize": "32768"}
# PCM in packets of 64 KiB, not 4 KiB: a sixteenth of the packets to count.
_OPEN_PCM = {"analyzeduration": "0", "probesize": "4096", "max_size": "65536"}
# Packets fed to the decoder to get the first frame out (codecs with delay need a few).
FIRST_FRAME_PACKETS = 32
# Time a verifying probe earns per decoded pixel and sample: a tenth of what one core
# decodes (H.264 at ~200 Mpixel/s, PCM and FLAC at ~50 Msample/s), so a real clip never
# runs out and a hostile one runs out soon after the work it has earned.
VERIFY_PIXELS_PER_SECOND = 20e6
VERIFY_SAMPLES_PER_SECOND = 5e6
# Pixels a verifying probe decodes of one video before it only counts the rest: a server
# samples a long video's frames (vLLM: 32), the gate must not decode thousands of them.
# 2^27: 64 frames of 1080p, 1,747 of 320x240; about a second of one core.
VERIFY_PIXELS = 1 << 27


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
    decoded_samples: int | None = None  # audio, verified: what a loader gets, priming trimmed


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

    def earn(self, seconds: float) -> None:
        self._deadline += seconds


def probe_media(
    data: bytes,
    fmt: str,
    modality: str,
    max_pixels: int = 0,
    verify: bool = True,
    verify_pixels: int = VERIFY_PIXELS,
) -> MediaFacts:
    """The facts of the first ``modality`` stream ("video" or "audio") of ``data``, read
    as ``fmt``; raise MediaProbeError where it is not a whole file of that kind, or
    (``verify``) where any of its frames does not decode: every frame of audio, a video's
    frames until ``verify_pixels`` pixels are decoded (the rest are counted). A video
    whose frames are over ``max_pixels`` is not decoded (its facts say why it is refused)."""
    problem = end_problem(data, fmt)
    if problem is not None:
        raise MediaProbeError(f"the {fmt.upper()} {modality} is not whole: {problem}")
    reader = _BudgetedReader(data)
    try:
        with av.open(
            reader, format=DEMUXERS[fmt], mode="r", options=_OPEN_PCM if fmt == "wav" else _OPEN
        ) as container:
            return _facts(container, reader, data, fmt, modality, max_pixels, verify, verify_pixels)
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
    verify: bool,
    verify_pixels: int,
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
    bare, follows, data_length = fmt in BARE_STREAMS, None, len(data)
    opus_samples = 0 if fmt == "ogg" and codec == "opus" else None
    skip = max_pixels > 0 and pixels > max_pixels
    frames = _FrameCheck(
        context, reader, modality, skip=skip, every=verify, pixel_budget=verify_pixels
    )
    last = None
    for packet in container.demux(stream):
        size = packet.size
        if not size:
            frames.feed(packet)  # the flush packet at the end: a codec with delay may answer
            continue
        packets += 1
        if packets <= FIRST_FRAME_PACKETS or frames.complete:
            frames.feed(packet)
        if not packets & 255:
            reader.check_time()
        last = packet
        if opus_samples is not None:
            opus_samples += _opus_packet_samples(bytes(packet))
        pos = packet.pos
        if pos is not None and pos >= 0:
            if pos + size > data_length:
                raise MediaProbeError(f"the {modality} is cut short (a frame ends past the file)")
            if bare and follows is not None and pos != follows:
                # The demuxer resyncs past what is not a frame; libmpg123 and libFLAC
                # recover otherwise, so the two would not hear the same clip.
                raise MediaProbeError(
                    f"the {fmt.upper()} audio has bytes between its frames (it is damaged)"
                )
            follows = pos + size
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
    if opus_samples is not None and len(container.streams) == 1:
        # RFC 7845: the last page's granule (samples at 48 kHz, pre-skip included) can trim
        # the packets' samples, never add to them; libsndfile refuses a file that does.
        granule = ogg_final_granule(data)
        if granule is not None and granule > opus_samples:
            raise MediaProbeError(
                "the Ogg Opus audio's last page counts more samples than its packets hold"
            )
    if not frames.first_decoded:
        raise MediaProbeError(
            f"the {modality}'s first frame cannot be decoded (its codec data is damaged)"
        )
    if frames.complete and not skip and frames.decoded < packets - (modality == "audio"):
        # (audio: an encoder's priming may fill a whole first frame, which is dropped)
        raise MediaProbeError(
            f"the {modality} holds {packets} frames but {frames.decoded} decode (its data is"
            " damaged)"
        )
    if verify and modality == "audio" and frames.samples == 0:
        raise MediaProbeError("the audio's frames decode to no samples (its data is damaged)")
    if not verify and modality == "audio" and packets > 1 and not _decodes(context, last):
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
        decoded_samples=frames.samples if verify else None,
    )  # fmt: skip


# RFC 6716 3.1: a packet's TOC byte names its frames' length (config = toc >> 3), in
# samples at 48 kHz: SILK 10/20/40/60 ms, hybrid 10/20 ms, CELT 2.5/5/10/20 ms.
_OPUS_FRAME_SAMPLES = (480, 960, 1920, 2880) * 3 + (480, 960) * 2 + (120, 240, 480, 960) * 4


def _opus_packet_samples(packet: bytes) -> int:
    toc = packet[0]
    count = (1, 2, 2, 0)[toc & 3] or (packet[1] & 0x3F if len(packet) > 1 else 0)
    return _OPUS_FRAME_SAMPLES[toc >> 3] * count


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


class _FrameCheck:
    """Feeds packets to the decoder as they are demuxed: every one (``every``), so damage
    anywhere is refused with the frame it is in, or the first ones only, until a frame
    comes out (the codec data is what the container says it is)."""

    def __init__(
        self,
        decoder: av.codec.context.CodecContext,
        reader: _BudgetedReader,
        modality: str,
        skip: bool,
        every: bool,
        pixel_budget: int,
    ) -> None:
        self._decoder, self._reader, self._modality = decoder, reader, modality
        self._skip, self._every = skip, every
        self._pixels_left = pixel_budget
        self.complete = every  # every frame was decoded
        if every and modality == "audio":
            # As strict as libsndfile and libmpg123, a server's loaders: checksums checked
            # (FLAC's frame CRCs), and an error FFmpeg would conceal raised.
            decoder.options = {"err_detect": "crccheck+explode"}
        self._fed = 0
        self._size: tuple[int, int] | None = None
        self.decoded = 0
        self.samples = 0
        self.first_decoded = skip  # frames too large to decode: refused by their size instead

    def feed(self, packet: av.Packet) -> None:
        if self._skip or (
            not self._every and (self.first_decoded or self._fed >= FIRST_FRAME_PACKETS)
        ):
            return
        self._fed += 1
        try:
            frames = self._decoder.decode(packet)
        except av.FFmpegError:
            if self._every and self.first_decoded:
                raise MediaProbeError(
                    f"the {self._modality}'s frame {self.decoded + 1} cannot be decoded"
                    " (its data is damaged)"
                ) from None
            self._fed = FIRST_FRAME_PACKETS  # a damaged first packet: no frame to come
            self._skip = self._every  # refused below as a first frame that cannot be decoded
            return
        for frame in frames:
            self.decoded += 1
            if self._modality == "video":
                self._same_size(frame)
                pixels = frame.width * frame.height
                self._reader.earn(pixels / VERIFY_PIXELS_PER_SECOND)
                self._pixels_left -= pixels
                if self._pixels_left <= 0 and self._every:  # the rest is only counted
                    self._every = self.complete = False
            else:
                self.samples += frame.samples
                self._reader.earn(frame.samples / VERIFY_SAMPLES_PER_SECOND)
        self.first_decoded = self.first_decoded or self.decoded > 0

    def _same_size(self, frame: av.VideoFrame) -> None:
        """A loader stacks the frames it samples: frames of two sizes fail there."""
        size = (frame.width, frame.height)
        if self._size is None:
            self._size = size
        elif size != self._size:
            raise MediaProbeError(
                f"the video's frames change size (frame {self.decoded} is {size[0]}x{size[1]},"
                f" the first {self._size[0]}x{self._size[1]})"
            )
