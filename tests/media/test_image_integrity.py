"""Whole-file checks on images: bounded frame counts, and truncation disguised as a whole file.

Every image here is a real one made by Pillow (noise, so it does not compress to
nothing), then cut: in half with the format's end marker glued on, or at a chunk
boundary. The default (structural) checks catch what a container walk can see;
``verify_image_data`` decodes, and catches the rest.
"""

from __future__ import annotations

import io
import re
import struct
import warnings
import zlib

import numpy as np
import pytest
from PIL import GifImagePlugin, Image, ImageFile

from conftest import body, chat, data_url, image_part
from media_stubs import png_chunk
from modalgate.errors import ErrorCode
from modalgate.media import pillow
from modalgate.media.decode import DecodeError, verify_image_data
from modalgate.media.image_integrity import ImageIntegrityError, check_structure
from modalgate.media.png_pixels import raw_size as png_raw_size
from modalgate.policy import RuleMatcher, load_policy, parse_policy
from modalgate.validators import Verdict, validate_body

URL = "messages.[0].content.[0].image_url.url"
DEFAULT = RuleMatcher(load_policy(None), None)
VERIFY = RuleMatcher(parse_policy("limits:\n  verify_image_data: true\n", fmt="yaml"), None)
MIMES = {"png": "image/png", "jpeg": "image/jpeg", "gif": "image/gif", "webp": "image/webp"}


def noise(size: tuple[int, int] = (160, 120), mode: str = "RGB", seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    image = Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
    return image if mode == "RGB" else image.convert(mode)


def encode(image: Image.Image, fmt: str, **options: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


IEND = png_chunk(b"IEND", b"")
JPEGS = {
    "baseline": encode(noise(), "JPEG", quality=90),
    "progressive": encode(noise(), "JPEG", quality=90, progressive=True),
    "restarts": encode(noise(), "JPEG", quality=90, restart_marker_rows=1),
    "gray-progressive": encode(noise(mode="L"), "JPEG", progressive=True),
}
ADAM7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2))
ADAM7 += ((0, 1, 1, 2),)


def interlaced_png(size: tuple[int, int], seed: int = 0) -> bytes:
    """Pillow reads Adam7 but does not write it, so the passes are laid out here (8-bit gray)."""
    width, height = size
    rng = np.random.default_rng(seed)
    rows = []
    for x0, y0, dx, dy in ADAM7:
        w, h = -(-(width - x0) // dx), -(-(height - y0) // dy)
        if w > 0 and h > 0:
            rows += [b"\x00" + rng.integers(0, 256, w, dtype=np.uint8).tobytes() for _ in range(h)]
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 1)
    idat = zlib.compress(b"".join(rows))
    return b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IDAT", idat) + IEND


PNGS = {
    "rgb": encode(noise(), "PNG"),
    "palette": encode(noise(mode="P"), "PNG"),
    "interlaced": interlaced_png((150, 101)),
}


# Exception text and what libjpeg, zlib or Pillow say about damage.
_LEAKS = re.compile(r"Traceback|\b0x[0-9a-fA-F]+|Error|premature|libjpeg|zlib|broken|Corrupt JPEG")


def validate(data: bytes, fmt: str, m: RuleMatcher = DEFAULT) -> Verdict:
    return validate_body(body(chat(image_part(data_url(data, MIMES[fmt])))), m)


def assert_refused(verdict: Verdict, code: ErrorCode = ErrorCode.INVALID_IMAGE) -> str:
    assert not verdict.accepted
    first = verdict.violations[0]
    assert (first.code, first.param, first.status) == (code, URL, 400), first.message
    assert not _LEAKS.search(first.message), first.message
    return first.message


def png_cut_at_chunk(data: bytes, keep: int) -> bytes:
    """The PNG's first ``keep`` chunks after the signature, then IEND: every CRC right."""
    pos = 8
    for _ in range(keep):
        pos += 12 + struct.unpack_from(">I", data, pos)[0]
    return data[:pos] + IEND


def many_frame_gif(frames: int, side: int = 16) -> bytes:
    images = []
    for i in range(frames):  # each frame differs, or Pillow merges them
        image = Image.new("L", (side, side), 0)
        image.putpixel((i % side, (i // side) % side), 255 - (i // (side * side)) * 40)
        images.append(image)
    return encode(images[0], "GIF", save_all=True, append_images=images[1:], duration=20)


# ---------------------------------------------------------------- whole images still pass


@pytest.mark.parametrize("name", sorted(JPEGS))
def test_whole_jpegs_pass_both_tiers(name):
    assert validate(JPEGS[name], "jpeg").accepted
    assert validate(JPEGS[name], "jpeg", VERIFY).accepted


@pytest.mark.parametrize("name", sorted(PNGS))
def test_whole_pngs_pass_both_tiers(name):
    assert validate(PNGS[name], "png").accepted
    assert validate(PNGS[name], "png", VERIFY).accepted


@pytest.mark.parametrize("size", [(2, 2), (3, 5), (9, 9), (17, 2), (2, 40)])
def test_interlaced_pass_sizes_match_the_data(size):
    data = interlaced_png(size, seed=size[0])
    assert Image.open(io.BytesIO(data)).convert("L").size == size  # Pillow reads it whole
    verify_image_data(data, "png")
    assert png_raw_size(*size, 8, True) > png_raw_size(*size, 8, False)


def test_png_zero_padding_after_iend_still_passes():
    assert validate(PNGS["rgb"] + b"\x00" * 100, "png", VERIFY).accepted
    assert_refused(validate(PNGS["rgb"] + b"\x00junk", "png"))


@pytest.mark.parametrize("fmt", ["GIF", "WEBP"])
def test_other_formats_pass_both_tiers(fmt):
    data = encode(noise(mode="P" if fmt == "GIF" else "RGB"), fmt)
    assert validate(data, fmt.lower(), VERIFY).accepted


# ---------------------------------------------------------------- disguised truncation


@pytest.mark.parametrize("name", ["progressive", "restarts", "gray-progressive"])
def test_jpeg_cut_in_half_with_eoi_caught_by_the_structural_check(name):
    whole = JPEGS[name]
    message = assert_refused(validate(whole[: len(whole) // 2] + b"\xff\xd9", "jpeg"))
    assert "truncated" in message


def test_baseline_jpeg_cut_in_half_with_eoi_needs_verify_image_data():
    pytest.importorskip("simplejpeg")  # Pillow's JPEG decoder pads it silently
    whole = JPEGS["baseline"]
    cut = whole[: len(whole) // 2] + b"\xff\xd9"
    assert validate(cut, "jpeg").accepted  # the documented limit of the structural tier
    message = assert_refused(validate(cut, "jpeg", VERIFY))
    assert message.endswith("the JPEG image data is corrupt or truncated")


@pytest.mark.parametrize("name", sorted(PNGS))
def test_png_cut_in_half_with_iend_caught_by_the_structural_check(name):
    whole = PNGS[name]
    assert_refused(validate(whole[: len(whole) // 2] + IEND, "png"))


def test_png_cut_at_an_idat_boundary_is_refused_without_verify_image_data(monkeypatch):
    whole = encode(noise((400, 300)), "PNG")  # Pillow writes 64 KiB IDAT chunks
    cut = png_cut_at_chunk(whole, 3)  # IHDR and the first two IDATs
    assert len(cut) < len(whole) // 2
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)  # no matter
    assert "truncated" in assert_refused(validate(cut, "png"))
    assert "truncated" in assert_refused(validate(cut, "png", VERIFY))


def test_tiny_png_declaring_7000x7000_is_refused():
    ihdr = struct.pack(">IIBBBBB", 7000, 7000, 8, 2, 0, 0, 0)
    idat = next(z for n in range(1, 9999) if len(z := zlib.compress(b"\x00" * n)) == 12)
    data = b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IDAT", idat) + IEND
    assert len(data) == 69
    message = assert_refused(validate(data, "png"))
    assert "cannot hold a 7000x7000 image" in message


def test_gif_lzw_cut_at_a_sub_block_boundary_needs_verify_image_data():
    whole = encode(noise((200, 200), mode="P"), "GIF")
    pos = 13 + 768  # Pillow writes a full global colour table
    while whole[pos] == 0x21:  # extensions
        pos += 2
        while whole[pos]:
            pos += whole[pos] + 1
        pos += 1
    pos += 11  # descriptor and LZW code size
    for _ in range(20):
        pos += whole[pos] + 1
    cut = whole[:pos] + b"\x00;"
    assert validate(cut, "gif").accepted
    assert_refused(validate(cut, "gif", VERIFY))


@pytest.mark.parametrize(
    ("fmt", "damage"),
    [
        ("gif", lambda d: d[:-1]),  # no trailer
        ("gif", lambda d: d[: len(d) // 2]),  # a sub-block chain runs past the end
        ("png", lambda d: d[:40] + bytes([d[40] ^ 1]) + d[41:]),  # a CRC fails
        ("png", lambda d: d[:33] + png_chunk(b"tEXt", b"a\x00b") + d[33:]),  # fine: ancillary
        ("jpeg", lambda d: d[:2] + d[d.index(b"\xff\xda") :]),  # a scan before its frame
        ("webp", lambda d: d[:30] + d[40:]),
    ],
)
def test_structural_damage(fmt, damage):
    whole = {"gif": encode(noise(mode="P"), "GIF"), "png": PNGS["rgb"]}.get(fmt)
    whole = whole or (JPEGS["baseline"] if fmt == "jpeg" else encode(noise(), "WEBP"))
    damaged = damage(whole)
    if b"tEXt" in damaged:
        assert validate(damaged, fmt).accepted
    else:
        assert_refused(validate(damaged, fmt))


def test_png_idat_chunks_must_be_contiguous():
    whole = encode(noise((400, 300)), "PNG")
    first = 8 + 25
    length = struct.unpack_from(">I", whole, first)[0]
    split = (
        whole[: first + 12 + length] + png_chunk(b"tEXt", b"a\x00b") + whole[first + 12 + length :]
    )
    assert "contiguous" in assert_refused(validate(split, "png"))


# ---------------------------------------------------------------- bounded frame counts


def test_1000_frame_gif_is_refused_after_counting_two(monkeypatch):
    gif = many_frame_gif(1000)

    def never(self):  # Pillow's count decodes every frame: never on the validation path
        raise AssertionError("n_frames was read")

    monkeypatch.setattr(GifImagePlugin.GifImageFile, "n_frames", property(never))
    verdict = validate(gif, "gif")
    message = assert_refused(verdict, ErrorCode.ANIMATED_IMAGE)
    assert message.endswith("animated GIF with more than one frame; send a still image")
    assert verdict.parts[0].frames == 2
    assert check_structure(gif, "gif", frame_limit=1).capped


def test_frame_limit_when_animation_is_allowed():
    gif = many_frame_gif(40)
    m = RuleMatcher(
        parse_policy("limits:\n  allow_animated: true\n  max_image_frames: 10\n", fmt="yaml"), None
    )
    message = assert_refused(validate(gif, "gif", m), ErrorCode.IMAGE_TOO_LARGE)
    assert message.endswith("animated GIF with more than 10 frames; the limit is 10 frames")
    verdict = validate(many_frame_gif(10), "gif", m)
    assert verdict.accepted and verdict.parts[0].frames == 10


def test_apng_and_webp_counts_come_from_the_container():
    frames = [noise((32, 32), seed=i) for i in range(3)]
    for fmt in ("PNG", "WEBP"):
        data = encode(frames[0], fmt, save_all=True, append_images=frames[1:])
        assert check_structure(data, fmt.lower(), frame_limit=10).frames == 3
        assert check_structure(data, fmt.lower(), frame_limit=1).capped


# ---------------------------------------------------------------- no lock, no leaked warnings


def test_no_process_wide_lock_or_warning_state_on_the_hot_path():
    assert not hasattr(pillow, "_QUIET")
    # acTL declaring 0 frames: Pillow warns "Invalid APNG"; the gate stays quiet.
    data = PNGS["rgb"]
    actl = png_chunk(b"acTL", struct.pack(">II", 0, 0))
    hostile = data[:33] + actl + data[33:]
    with warnings.catch_warnings(record=True) as caught:
        verdict = validate(hostile, "png")
    assert verdict.accepted
    assert [str(w.message) for w in caught] == []


def test_structure_errors_are_value_errors_with_safe_text():
    with pytest.raises(ImageIntegrityError, match=r"^the PNG data is truncated$"):
        check_structure(PNGS["rgb"][:100], "png")
    with pytest.raises(DecodeError):
        verify_image_data(PNGS["rgb"][:100] + IEND, "png")


def test_stray_bytes_between_gif_blocks_are_skipped_as_pillow_does():
    whole = encode(noise(mode="P"), "GIF")
    assert validate(whole[:-1] + b"\x00\x00;", "gif", VERIFY).accepted
    assert_refused(validate(b"GIF89a" + b"\x00" * 20 + b";", "gif"))  # still no image
