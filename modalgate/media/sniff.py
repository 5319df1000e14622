"""What the bytes really are, from their first few bytes (magic numbers).

A declared ``image_url`` or an ``image/png`` MIME type is a claim; the bytes are
the fact. 64 bytes decide every format here, except Matroska and Ogg, whose codec
names sit a little further in (a 4 KiB prefix is plenty).
"""

from __future__ import annotations

from dataclasses import dataclass

SNIFF_BYTES = 4096


@dataclass(frozen=True, slots=True)
class Sniffed:
    modality: str  # image | video | audio | file
    format: str


# ISO base media (MP4 family): the major brand says image, video or audio.
_FTYP_IMAGE = {
    b"heic": "heif",
    b"heix": "heif",
    b"hevc": "heif",
    b"heim": "heif",
    b"heis": "heif",
    b"mif1": "heif",
    b"msf1": "heif",
    b"avif": "avif",
    b"avis": "avif",
}
_FTYP_AUDIO = {b"M4A ": "m4a", b"M4B ": "m4a", b"M4P ": "m4a", b"F4A ": "m4a"}


def sniff(head: bytes) -> Sniffed | None:
    """Classify by magic bytes; ``None`` when nothing known matches."""
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return Sniffed("image", "png")
    if head.startswith(b"\xff\xd8\xff"):
        return Sniffed("image", "jpeg")
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return Sniffed("image", "gif")
    if head[:4] == b"RIFF" and len(head) >= 12:
        kind = head[8:12]
        if kind == b"WEBP":
            return Sniffed("image", "webp")
        if kind == b"WAVE":
            return Sniffed("audio", "wav")
        if kind == b"AVI ":
            return Sniffed("video", "avi")
    if head[4:8] == b"ftyp":
        brand = head[8:12]
        if brand in _FTYP_IMAGE:
            return Sniffed("image", _FTYP_IMAGE[brand])
        if brand in _FTYP_AUDIO:
            return Sniffed("audio", _FTYP_AUDIO[brand])
        return Sniffed("video", "mov" if brand == b"qt  " else "mp4")
    if head.startswith(b"\x1a\x45\xdf\xa3"):
        return Sniffed("video", "webm" if b"webm" in head[:64] else "mkv")
    if head.startswith(b"OggS"):
        return Sniffed("video", "ogv") if b"\x80theora" in head else Sniffed("audio", "ogg")
    if head.startswith(b"fLaC"):
        return Sniffed("audio", "flac")
    if head.startswith(b"ID3") or _is_mpeg_audio_frame(head):
        return Sniffed("audio", "mp3")
    if head[:2] == b"\xff\xf1" or head[:2] == b"\xff\xf9":
        return Sniffed("audio", "aac")
    if len(head) > 376 and head[0] == head[188] == head[376] == 0x47:  # TS packets' sync
        return Sniffed("video", "ts")
    if head.startswith(b"%PDF-"):
        return Sniffed("file", "pdf")
    if head.startswith(b"BM") and len(head) >= 14:
        return Sniffed("image", "bmp")
    if head[:4] in (b"II*\x00", b"MM\x00*"):
        return Sniffed("image", "tiff")
    if head[:4] == b"\x00\x00\x01\x00":
        return Sniffed("image", "ico")
    return None


def _is_mpeg_audio_frame(head: bytes) -> bool:
    # Frame sync (11 set bits), a valid version, layer III, and a valid bitrate.
    if len(head) < 4 or head[0] != 0xFF or head[1] & 0xE0 != 0xE0:
        return False
    version = (head[1] >> 3) & 0x3
    layer = (head[1] >> 1) & 0x3
    bitrate = head[2] >> 4
    return version != 1 and layer == 1 and bitrate not in (0, 15)


# MIME types as clients send them in data URLs, mapped to a modality.
def mime_modality(mime: str) -> str | None:
    top = mime.partition("/")[0]
    if top in ("image", "video", "audio"):
        return top
    if mime == "application/pdf":
        return "file"
    if mime in ("application/ogg",):
        return "audio"
    return None
