"""P13: what the gate's video and audio probe costs, beside a full decode of the same file.

The gate reads every video and audio part to its end: the container walked
(``media.container_walk``), every packet of the judged stream demuxed by FFmpeg
(``media.av_probe``), the first frame decoded (and an audio stream's last), nothing
else. A server that takes the part decodes at least the frames it samples. This
prints, per file (real media made here with PyAV: H.264 MP4, VP8 WebM, MJPEG AVI,
WAV, FLAC, MP3, AAC M4A), the probe's time, its ms per MB and per second of media,
and PyAV's full decode of every frame of the same bytes, side by side in one run.

Ratio = median over the files of (probe ms / full decode ms). Target: <= 0.2 (the
check costs a fifth of decoding at most; a server's sampled decode can cost less
than a full one, so the full decode is an upper bound of the server's work).

Usage: .venv/bin/python benchmarks/p13_av_probe.py [--quick]
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from _common import begin, best, result_line, table

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from av_media import decode_all, make_audio, make_video

from modalgate.media.av_probe import probe_media
from modalgate.media.sniff import SNIFF_BYTES, sniff

NAME = "p13_av_probe"
TARGET = 0.2


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
    rows, ratios = [], []
    for label, data, modality in media(args.quick):
        fmt = sniff(data[:SNIFF_BYTES]).format
        facts = probe_media(data, fmt, modality)
        probe = best(lambda d=data, f=fmt, m=modality: probe_media(d, f, m), reps)
        decode = best(lambda d=data: decode_all(d), reps)
        megabytes = len(data) / 1e6
        ratios.append(probe / decode)
        rows.append(
            (label, megabytes, facts.seconds, probe * 1e3, probe * 1e3 / megabytes,
             probe * 1e3 / facts.seconds, decode * 1e3, ratios[-1])
        )  # fmt: skip
    headers = ("file", "MB", "s", "probe ms", "ms/MB", "ms/s", "full decode ms", "probe/decode")
    print(table(headers, rows))
    ratio = statistics.median(ratios)
    print(f"median probe / full decode: {ratio:.3f} (max {max(ratios):.3f})")
    print(result_line(NAME, ratio, f"<={TARGET}", ratio <= TARGET))


if __name__ == "__main__":
    main()
