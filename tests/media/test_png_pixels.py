"""PNG pixel data checked to its end at every size: what kills a real server is refused.

A PNG with every chunk intact (lengths, CRCs, order) whose zlib stream is damaged,
a row short, or a row with an invalid filter byte made ``transformers serve``'s
image decoder (torchvision on libpng) kill its process at 32x32 as at 200x200.
Each case here is built byte by byte; the control is the same image made right,
which Pillow decodes to its last pixel.
"""

from __future__ import annotations

import io
import random
import struct
import zlib

import pytest
from PIL import Image

from conftest import body, chat, data_url, image_part
from media_stubs import png_chunk, png_of, png_rows
from modalgate.errors import ErrorCode
from modalgate.media.image_integrity import check_structure
from modalgate.media.inline_work import INLINE_WORK_BYTES, InlineWorkExceeded, run_within
from modalgate.media.png_pixels import EXTRA_ROW_BYTES, PngPixelError, check_stream, raw_size
from modalgate.policy import RuleMatcher, load_policy
from modalgate.validators import Verdict, validate_body

URL = "messages.[0].content.[0].image_url.url"
DEFAULT = RuleMatcher(load_policy(None), None)
SIDES = [2, 32, 64, 200]


def validate(data: bytes) -> Verdict:
    return validate_body(body(chat(image_part(data_url(data)))), DEFAULT)


def refused_because(data: bytes) -> str:
    verdict = validate(data)
    assert not verdict.accepted
    first = verdict.violations[0]
    assert (first.code, first.param, first.status) == (ErrorCode.INVALID_IMAGE, URL, 400)
    return first.message


def decodes(data: bytes) -> bool:
    try:
        Image.open(io.BytesIO(data)).load()
    except Exception:
        return False
    return True


def corrupt_zlib(raw: bytes) -> bytes:
    packed = bytearray(zlib.compress(raw))
    for i in range(6, min(len(packed) - 4, 40)):
        packed[i] ^= 0x55
    return bytes(packed)


@pytest.mark.parametrize("side", SIDES)
def test_the_control_is_accepted_and_decodes(side):
    data = png_of(side, side, zlib.compress(png_rows(side, side)))
    assert decodes(data)
    assert validate(data).accepted


@pytest.mark.parametrize("side", SIDES)
def test_a_row_short_is_refused(side):
    raw = png_rows(side, side)[: -(3 * side + 1)]
    assert "truncated (fewer rows" in refused_because(png_of(side, side, zlib.compress(raw)))


@pytest.mark.parametrize("side", SIDES)
def test_a_few_bytes_short_is_refused(side):
    raw = png_rows(side, side)[:-2]
    assert "truncated" in refused_because(png_of(side, side, zlib.compress(raw)))


@pytest.mark.parametrize("side", SIDES)
def test_a_few_extra_rows_pass_as_decoders_finish_them(side):
    """libpng calls "too much image data" benign, Pillow stops at the last row, and
    transformers serve answered 200 (tests/realserver); a stream far longer is refused."""
    data = png_of(side, side, zlib.compress(png_rows(side, side + 2)))
    assert decodes(data)
    assert validate(data).accepted
    much = png_of(side, side, zlib.compress(png_rows(side, side) + bytes(EXTRA_ROW_BYTES + 1)))
    assert "longer than its header" in refused_because(much)


@pytest.mark.parametrize("side", SIDES)
def test_damage_after_the_last_row_is_refused(side):
    """Pillow fails on a bad Adler-32 where the image is small (it reads the whole
    stream at once); past the last row is not past harm."""
    packed = bytearray(zlib.compress(png_rows(side, side)))
    packed[-1] ^= 1
    assert "corrupt" in refused_because(png_of(side, side, bytes(packed)))


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("row_filter", [5, 9, 255])
def test_an_invalid_row_filter_is_refused(side, row_filter):
    raw = png_rows(side, side, row_filter=row_filter)
    message = refused_because(png_of(side, side, zlib.compress(raw)))
    assert message.endswith("corrupt (a row has an invalid filter)")


@pytest.mark.parametrize("side", SIDES)
def test_one_bad_filter_in_the_last_row_is_refused(side):
    raw = bytearray(png_rows(side, side))
    raw[(side - 1) * (3 * side + 1)] = 7
    assert "invalid filter" in refused_because(png_of(side, side, zlib.compress(bytes(raw))))


@pytest.mark.parametrize("side", SIDES)
def test_a_damaged_zlib_stream_is_refused(side):
    data = png_of(side, side, corrupt_zlib(png_rows(side, side)))
    assert not decodes(data)
    refused_because(data)


@pytest.mark.parametrize("side", SIDES)
def test_a_stream_without_its_end_is_refused_though_every_row_is_there(side):
    """Every row, no final block: Pillow decodes it; transformers serve died of it."""
    packer = zlib.compressobj()
    flushed = packer.compress(png_rows(side, side)) + packer.flush(zlib.Z_SYNC_FLUSH)
    assert "does not end" in refused_because(png_of(side, side, flushed))
    buffered = zlib.compressobj().compress(png_rows(side, side))  # held back: rows missing
    assert "truncated" in refused_because(png_of(side, side, buffered))


def test_every_filter_and_mode_pillow_writes_is_accepted():
    """Pillow picks filters per row (all five); every mode's rows are sized right."""
    for mode in ("1", "L", "LA", "P", "RGB", "RGBA", "I;16"):
        for side in (2, 3, 17, 130):  # the policy's min_image_side is 2
            image = Image.linear_gradient("L").resize((side, side + 1)).convert(mode)
            for optimize in (False, True):
                buffer = io.BytesIO()
                image.save(buffer, "PNG", optimize=optimize)
                assert validate(buffer.getvalue()).accepted, (mode, side, optimize)


@pytest.mark.parametrize("size", [(2, 2), (3, 5), (9, 9), (17, 2), (2, 40), (150, 101)])
def test_interlaced_streams_are_checked_pass_by_pass(size):
    width, height = size
    runs = []
    for x0, y0, dx, dy in ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4)):
        runs.append((x0, y0, dx, dy))
    runs += [(0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2)]
    rows = []
    for x0, y0, dx, dy in runs:
        w, h = -(-(width - x0) // dx), -(-(height - y0) // dy)
        if w > 0 and h > 0:
            rows += [b"\x02" + bytes(range(w % 256))[:w].ljust(w, b"\x01") for _ in range(h)]
    raw = b"".join(rows)
    assert len(raw) == raw_size(width, height, 8, True)
    good = png_of(width, height, zlib.compress(raw), colour=0, interlace=1)
    assert decodes(good) and validate(good).accepted
    last = len(raw) - len(rows[-1])  # the last pass's last row
    bad = raw[:last] + b"\x06" + raw[last + 1 :]
    refused_because(png_of(width, height, zlib.compress(bad), colour=0, interlace=1))


def test_a_png_that_lacks_only_iend_is_accepted():
    data = png_of(64, 64, zlib.compress(png_rows(64, 64)), tail=b"")
    assert decodes(data)
    assert validate(data).accepted
    iend = png_chunk(b"IEND", b"")
    for cut in range(1, len(iend)):  # IEND itself cut short: the image is whole
        assert validate(data + iend[:cut]).accepted
    # Cut inside the IDAT, it is truncated.
    assert "truncated" in refused_because(data[:-3])


def test_pixel_data_split_across_many_idats_is_read_as_one_stream():
    noise = random.Random(0).randbytes(80 * 301)
    rows = b"".join(b"\x00" + noise[y * 301 + 1 : (y + 1) * 301] for y in range(80))
    packed = zlib.compress(rows, 1)
    assert len(packed) > 5000
    ihdr = struct.pack(">IIBBBBB", 100, 80, 8, 2, 0, 0, 0)
    idats = b"".join(png_chunk(b"IDAT", packed[i : i + 1000]) for i in range(0, len(packed), 1000))
    data = b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + idats + png_chunk(b"IEND", b"")
    assert validate(data).accepted
    cut = b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IDAT", packed[:1000])
    assert "truncated" in refused_because(cut + png_chunk(b"IEND", b""))


def test_every_apng_frame_is_inflated():
    frames = [Image.new("RGB", (40, 30), (i * 60, 0, 0)) for i in range(3)]
    buffer = io.BytesIO()
    frames[0].save(buffer, "PNG", save_all=True, append_images=frames[1:])
    whole = buffer.getvalue()
    assert check_structure(whole, "png", frame_limit=5).frames == 3
    at = whole.rindex(b"fdAT")  # the last frame's data: its sequence number, then zlib
    length = struct.unpack_from(">I", whole, at - 4)[0]
    payload = whole[at + 4 : at + 4 + length]
    broken = payload[:4] + zlib.compress(b"\x09" * len(zlib.decompress(payload[4:])))
    hostile = whole[: at - 4] + png_chunk(b"fdAT", broken) + whole[at + 4 + length + 4 :]
    with pytest.raises(ValueError, match="invalid filter"):
        check_structure(hostile, "png", frame_limit=5)


def test_apng_whose_default_image_is_not_a_frame_counts_it_as_pillow_does():
    """acTL of one frame, IDAT (the default image, no fcTL before it), then one frame in
    fcTL + fdAT: Pillow says n_frames 2, is_animated; a viewer shows the frame, a model
    gets the default image."""
    rows = zlib.compress(png_rows(16, 16))
    ihdr = struct.pack(">IIBBBBB", 16, 16, 8, 2, 0, 0, 0)
    fctl = struct.pack(">IIIIIHHBB", 0, 16, 16, 0, 0, 1, 10, 0, 0)
    data = (
        b"\x89PNG\r\n\x1a\n"
        + png_chunk(b"IHDR", ihdr)
        + png_chunk(b"acTL", struct.pack(">II", 1, 0))
        + png_chunk(b"IDAT", rows)
        + png_chunk(b"fcTL", fctl)
        + png_chunk(b"fdAT", struct.pack(">I", 1) + rows)
        + png_chunk(b"IEND", b"")
    )
    image = Image.open(io.BytesIO(data))
    assert (image.n_frames, image.is_animated) == (2, True)
    verdict = validate(data)
    assert not verdict.accepted
    first = verdict.violations[0]
    assert (first.code, first.param) == (ErrorCode.ANIMATED_IMAGE, URL)
    assert check_structure(data, "png", frame_limit=5).frames == 2


def test_an_apng_frame_outside_the_image_is_refused():
    rows = zlib.compress(png_rows(16, 16))
    ihdr = struct.pack(">IIBBBBB", 16, 16, 8, 2, 0, 0, 0)
    fctl = struct.pack(">IIIIIHHBB", 0, 16, 16, 8, 0, 1, 10, 0, 0)  # x offset 8: past the edge
    data = (
        b"\x89PNG\r\n\x1a\n"
        + png_chunk(b"IHDR", ihdr)
        + png_chunk(b"acTL", struct.pack(">II", 1, 0))
        + png_chunk(b"fcTL", fctl)
        + png_chunk(b"IDAT", rows)
        + png_chunk(b"IEND", b"")
    )
    assert "outside the image" in refused_because(data)


def test_inflation_counts_against_the_inline_allowance():
    """A small file whose image inflates past the event loop's allowance is sent to a
    thread: the check raises InlineWorkExceeded inside an allowance, and passes outside."""
    side = 1024  # 3 MiB of rows from ~3 KB of zlib
    data = png_of(side, side, zlib.compress(b"\x00" * (3 * side + 1) * side, 9))
    assert len(data) < 8 * 1024 and raw_size(side, side, 24, False) > INLINE_WORK_BYTES
    assert isinstance(run_within(validate, data), InlineWorkExceeded)
    assert validate(data).accepted
    small = png_of(32, 32, zlib.compress(png_rows(32, 32)))
    assert run_within(validate, small).accepted


def test_a_check_error_is_a_value_error_with_safe_text():
    packed = zlib.compress(png_rows(8, 8))
    data = b"\x00" * 10 + packed
    with pytest.raises(PngPixelError, match=r"^the PNG image data is truncated"):
        check_stream(data, [(10, len(packed) - 20)], 8, 8, 24, False)


def test_a_jpeg_with_a_marker_libjpeg_does_not_know_inside_its_scan_is_refused():
    """torchvision's decoder raises "Unsupported marker type" (transformers serve: 500);
    the scan was not searched before, as the file's only scan."""
    image = Image.linear_gradient("L").resize((64, 64)).convert("RGB")
    buffer = io.BytesIO()
    image.save(buffer, "JPEG")
    whole = buffer.getvalue()
    assert validate(whole).accepted
    hostile = bytearray(whole)
    hostile[hostile.rindex(b"\xff\xd9") - 40 : hostile.rindex(b"\xff\xd9") - 38] = b"\xff\xa5"
    verdict = validate(bytes(hostile))
    assert not verdict.accepted
    first = verdict.violations[0]
    assert (first.code, first.param) == (ErrorCode.INVALID_IMAGE, URL)
    assert first.message.endswith("the JPEG data is corrupt (a marker decoders do not know (FFA5))")
