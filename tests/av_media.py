"""Real video and audio files made in the tests: PyAV (FFmpeg's encoders and muxers), frames
and samples drawn with numpy, deterministic for a given seed."""

from __future__ import annotations

import io
import os
import tempfile

import av
import numpy as np

# Sniffed format -> (FFmpeg muxer, video codec, pixel format).
VIDEO_KINDS = {
    "mp4": ("mp4", "libx264", "yuv420p"),
    "mov": ("mov", "libx264", "yuv420p"),
    "webm": ("webm", "libvpx", "yuv420p"),
    "mkv": ("matroska", "mpeg4", "yuv420p"),
    "avi": ("avi", "mjpeg", "yuvj420p"),
    "ts": ("mpegts", "mpeg2video", "yuv420p"),
}
# Sniffed format -> (FFmpeg muxer, audio codec, sample rate).
AUDIO_KINDS = {
    "wav": ("wav", "pcm_s16le", 16000),
    "flac": ("flac", "flac", 16000),
    "ogg": ("ogg", "libopus", 48000),
    "mp3": ("mp3", "libmp3lame", 44100),
    "m4a": ("ipod", "aac", 44100),
}


def make_video(
    fmt: str = "mp4",
    frames: int = 10,
    width: int = 64,
    height: int = 48,
    fps: int = 10,
    seed: int = 0,
    codec: str | None = None,
    options: dict[str, str] | None = None,
) -> bytes:
    """A real ``fmt`` video of noise frames (written to a file: some muxers seek back)."""
    muxer, default_codec, pixel_format = VIDEO_KINDS[fmt]
    fd, name = tempfile.mkstemp(suffix="." + fmt)
    os.close(fd)
    try:
        with av.open(name, "w", format=muxer, options=options or {}) as out:
            stream = out.add_stream(codec or default_codec, rate=fps)
            stream.width, stream.height, stream.pix_fmt = width, height, pixel_format
            stream.codec_context.thread_count = 1  # the same bytes every run
            rng = np.random.default_rng(seed)
            for _ in range(frames):
                pixels = rng.integers(0, 256, (height, width, 3), np.uint8)
                for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                    out.mux(packet)
            for packet in stream.encode():
                out.mux(packet)
        with open(name, "rb") as file:
            return file.read()
    finally:
        os.unlink(name)


def make_audio(
    fmt: str = "wav",
    seconds: float = 1.0,
    rate: int | None = None,
    channels: int = 1,
    tone_hz: float = 440.0,
) -> bytes:
    """A real ``fmt`` audio file of a sine tone."""
    muxer, codec, default_rate = AUDIO_KINDS[fmt]
    rate = rate or default_rate
    layout = "mono" if channels == 1 else "stereo"
    buffer = io.BytesIO()
    with av.open(buffer, "w", format=muxer) as out:
        stream = out.add_stream(codec, rate=rate, layout=layout)
        context = stream.codec_context
        count = int(seconds * rate)
        tone = (np.sin(2 * np.pi * tone_hz * np.arange(count) / rate) * 0.3).astype(np.float32)
        step = context.frame_size or 1024
        sample_format = context.format
        for start in range(0, count, step):
            chunk = np.tile(tone[start : start + step], (channels, 1))
            if sample_format.name.startswith("s16"):
                chunk = (chunk * 32767).astype(np.int16)
            elif sample_format.name.startswith("s32"):
                chunk = (chunk * 2_000_000_000).astype(np.int32)
            if not sample_format.is_planar:
                chunk = chunk.T.reshape(1, -1)
            frame = av.AudioFrame.from_ndarray(
                np.ascontiguousarray(chunk), format=sample_format.name, layout=layout
            )
            frame.rate = rate
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buffer.getvalue()


def decode_all(data: bytes) -> int:
    """Every frame of every stream, through PyAV as a server's loader reads it."""
    with av.open(io.BytesIO(data)) as container:
        return sum(1 for _ in container.decode(*container.streams))


def cut_points(data: bytes) -> list[int]:
    """Every structural boundary of ``data`` (box, chunk, page starts), each with its
    neighbours, and byte strides between them."""
    marks = {0, len(data)}
    for signature in (
        b"moov",
        b"mdat",
        b"ftyp",
        b"free",
        b"trak",
        b"LIST",
        b"idx1",
        b"data",
        b"fmt ",
        b"OggS",
        b"\x1f\x43\xb6\x75",
        b"\x1c\x53\xbb\x6b",
        b"fLaC",
    ):
        start = data.find(signature)
        while start >= 0:
            marks.add(max(start - 4, 0))
            marks.add(start)
            start = data.find(signature, start + 1)
    cuts = {c + d for c in marks for d in (-1, 0, 1, 8)}
    cuts.update(range(1, len(data), max(1, len(data) // 97)))
    return sorted(c for c in cuts if 0 < c < len(data))  # fmt: skip
