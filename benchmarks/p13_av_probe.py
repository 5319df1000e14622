"""P13: what the gate's video and audio probe costs, beside the decode a server does.

The gate reads every video and audio part to its end: the container walked
(``media.container_walk``), every packet of the judged stream demuxed by FFmpeg
(``media.av_probe``) and, by default (``verify_media_data``), every packet decoded,
without converting the frames. Header-deep (``verify_media_data: false``) it decodes
the first frame only (and an audio stream's last). A server that takes the part
decodes the frames it samples and converts them to arrays (PyAV's ``to_ndarray``:
RGB for video). This prints, per file (real media made here with PyAV: H.264 MP4,
VP8 WebM, MJPEG AVI, WAV, FLAC, MP3, AAC M4A), both probes' times, ms per MB and per
second of media, a full decode of every frame and a server's load (decode and
convert) of the same bytes, side by side in one run.

Ratios, medians over the files:
- header-deep probe / full decode. Target: <= 0.2.
- verifying probe (the default) / a server's load. Target: <= 1.0: checking every
  frame costs at most what the server spends loading them (it cannot be "well under":
  the decode is the check).

Usage: .venv/bin/python benchmarks/p13_av_probe.py [--quick]
"""

from __future__ import annotations

import io
import statistics
import sys
from pathlib import Path

import av
from _common import begin, best, result_line, table

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from av_media import decode_all, make_audio, make_video

from modalgate.media.av_probe import probe_media
from modalgate.media.sniff import SNIFF_BYTES, sniff

NAME = "p13_av_probe"
TARGET = 0.2
VERIFY_TARGET = 1.0


def load_like_a_server(data: bytes) -> int:
    """Every frame of the first video or audio stream decoded and made an array."""
    with av.open(io.BytesIO(data)) as container:
        stream = (container.streams.video or container.streams.audio)[0]
        video = stream.type == "video"
        arrays = [
            frame.to_ndarray(format="rgb24") if video else frame.to_ndarray()
            for frame in container.decode(stream)
        ]
    return len(arrays)


def media(quick: bool) -> list[tuple[str, bytes, str]]:
    frames = 60 if quick else 150
    seconds = 10.0 if quick else 60.0
    return [
        (f"H.264 MP4 320x240, {frames} frames", make_video("mp4", frames, 320, 240, 30), "video"),
        (f"VP8 WebM 320x240, {frames} frames", make_video("webm", frames, 320, 240, 30), "video"),
        (f"MJPEG AVI 320x240, {frames} frames", make_video("avi", frames, 320, 240, 30), "video"),
        (f"WAV 16 kHz, {seconds:g} s", make_audio("wav", seconds), "audio"),
        (f"FLAC 16 kHz, {seconds:g} s", make_audio("flac", seconds), "audio"),
        (f"MP3 44.1 kHz, {seconds:g} s", make_audio("mp3", seconds), "audio"),
        (f"AAC M4A 44.1 kHz, {seconds:g} s", make_audio("m4a", seconds), "audio"),
    ]


def main() -> None:
    args = begin(NAME, __doc__)
    reps = 3 if args.quick else 7
    rows, ratios, verify_ratios = [], [], []
    for label, data, modality in media(args.quick):
        fmt = sniff(data[:SNIFF_BYTES]).format
        facts = probe_media(data, fmt, modality)
        shallow = best(lambda d=data, f=fmt, m=modality: probe_media(d, f, m, verify=False), reps)
        verified = best(lambda d=data, f=fmt, m=modality: probe_media(d, f, m), reps)
        decode = best(lambda d=data: decode_all(d), reps)
        load = best(lambda d=data: load_like_a_server(d), reps)
        megabytes = len(data) / 1e6
        ratios.append(shallow / decode)
        verify_ratios.append(verified / load)
        rows.append(
            (label, megabytes, facts.seconds, shallow * 1e3, shallow * 1e3 / megabytes,
             verified * 1e3, verified * 1e3 / facts.seconds, decode * 1e3, load * 1e3,
             ratios[-1], verify_ratios[-1])
        )  # fmt: skip
    headers = ("file", "MB", "s", "shallow ms", "ms/MB", "verify ms", "ms/s", "decode ms",
               "load ms", "shallow/decode", "verify/load")  # fmt: skip
    print(table(headers, rows))
    ratio, verify_ratio = statistics.median(ratios), statistics.median(verify_ratios)
    print(f"median header-deep probe / full decode: {ratio:.3f} (max {max(ratios):.3f})")
    print(
        f"median verifying probe / server load: {verify_ratio:.3f} (max {max(verify_ratios):.3f})"
    )
    passed = ratio <= TARGET and verify_ratio <= VERIFY_TARGET
    print(
        result_line(
            NAME, ratio, f"<={TARGET}; verify/load {verify_ratio:.3f} <={VERIFY_TARGET}", passed
        )
    )


if __name__ == "__main__":
    main()
