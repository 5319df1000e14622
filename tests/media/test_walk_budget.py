"""Container walks are bounded by the file's size: a body of empty entries is refused
before Pillow's header reader (which walks the same entries in Python) sees it.

Each hostile file here is a real Pillow image with ~1 MB of empty entries spliced
in where the format allows them; the same splice at a real file's scale passes.
"""

from __future__ import annotations

import io
import struct
import zlib

import pytest
from PIL import (
    GifImagePlugin,
    Image,
    ImageCms,
    JpegImagePlugin,
    PngImagePlugin,
    WebPImagePlugin,
)

from conftest import body, chat, data_url, image_part, noise_png
from media_stubs import (
    gif_with,
    gif_with_sub_blocks,
    jpeg_with,
    padded_images,
    png_chunk,
    png_with_chunks,
    webp_with_chunks,
)
from modalgate.errors import ErrorCode
from modalgate.media.image_integrity import (
    BYTES_PER_PNG_CHUNK,
    ImageIntegrityError,
    check_structure,
)
from modalgate.media.walk_budget import BASE_ENTRIES, MAX_JPEG_SCANS, entry_budget
from modalgate.policy import RuleMatcher, load_policy
from modalgate.validators import Verdict, validate_body

MB = 1 << 20
URL = "messages.[0].content.[0].image_url.url"
DEFAULT = RuleMatcher(load_policy(None), None)
PLUGINS = {
    "jpeg": JpegImagePlugin.JpegImageFile,
    "png": PngImagePlugin.PngImageFile,
    "gif": GifImagePlugin.GifImageFile,
    "webp": WebPImagePlugin.WebPImageFile,
}


def validate(data: bytes, fmt: str) -> Verdict:
    return validate_body(body(chat(image_part(data_url(data, f"image/{fmt}")))), DEFAULT)


def assert_refused(verdict: Verdict) -> str:
    first = verdict.violations[0] if verdict.violations else None
    assert first is not None, "accepted"
    assert (first.code, first.param, first.status) == (ErrorCode.INVALID_IMAGE, URL, 400)
    return first.message


def encode(fmt: str, size: tuple[int, int], **options: object) -> bytes:
    buffer = io.BytesIO()
    Image.linear_gradient("L").resize(size).convert("RGB").save(buffer, fmt, **options)
    return buffer.getvalue()


HOSTILE = padded_images(MB)
WHAT = {
    "jpeg fill bytes": "stray bytes between segments",
    "jpeg stray bytes": "stray bytes between segments",
}
WHAT_OF = {"jpeg": "segments", "png": "chunks", "gif": "blocks", "webp": "chunks"}


@pytest.mark.parametrize("name", HOSTILE)
def test_a_megabyte_of_empty_entries_is_refused_before_pillow_reads_it(name, monkeypatch):
    fmt, data = HOSTILE[name]

    def never(self):
        raise AssertionError("Pillow's header reader walked the hostile file")

    monkeypatch.setattr(PLUGINS[fmt], "_open", never)
    message = assert_refused(validate(data, fmt))
    shown = "WebP" if fmt == "webp" else fmt.upper()
    expected = f"the {shown} data is corrupt (more {WHAT.get(name, WHAT_OF[fmt])}"
    assert message.endswith(f"{expected} than any encoder writes in {len(data)} bytes)"), message


@pytest.mark.parametrize("fmt", ["png", "gif", "webp"])
def test_the_same_splice_at_a_real_files_scale_passes(fmt):
    few = {"png": png_with_chunks(100), "gif": gif_with_sub_blocks(100)}
    few["webp"] = webp_with_chunks(100)
    assert validate(few[fmt], fmt).accepted


@pytest.mark.parametrize("fmt", ["GIF", "PNG", "WEBP"])
def test_a_thousand_tiny_frames_pass_where_a_thousand_are_allowed(fmt):
    """Each frame brings entries of its own (a GIF frame is two block chains and their
    ends, an APNG frame a control chunk and its data) whatever its size."""
    frames = [Image.new("RGB", (8, 8), (i % 256, 60 * (i // 256), 0)) for i in range(1000)]
    buffer = io.BytesIO()
    options = {"lossless": True} if fmt == "WEBP" else {}
    frames[0].save(buffer, fmt, save_all=True, append_images=frames[1:], duration=20, **options)
    data = buffer.getvalue()
    assert check_structure(data, fmt.lower(), frame_limit=1000).frames == 1000


def test_png_chunks_before_the_image_data_are_few():
    """Pillow reads each chunk before the first IDAT in Python: more than 64 is refused
    whatever the budget, since no encoder writes that many."""
    assert validate(png_with_chunks(62, before_image=True), "png").accepted  # + IHDR: 63
    assert validate(png_with_chunks(63, before_image=True), "png").accepted  # 64: the most
    message = assert_refused(validate(png_with_chunks(64, before_image=True), "png"))
    assert message.endswith("the PNG data is corrupt (over 64 chunks before the image data)")


def _with_metadata(fmt: str, **options: object) -> bytes:
    """A photo-like image saved with the metadata encoders write: EXIF, ICC, text."""
    image = Image.open(io.BytesIO(noise_png(200, 150, seed=5)))
    exif = Image.Exif()
    exif[0x010F], exif[0x9286] = "Camera", "x" * 30_000  # make, a long user comment
    srgb = ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB")).tobytes()
    options = {"exif": exif, "icc_profile": srgb, **options}
    if fmt == "PNG":
        text = PngImagePlugin.PngInfo()
        for i in range(20):
            text.add_text(f"key{i}", "value " * 20)
        text.add_itxt("XML:com.adobe.xmp", "<x:xmpmeta>" + "a" * 5000 + "</x:xmpmeta>")
        options.update(pnginfo=text, dpi=(300, 300))
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


METADATA = {
    # An ICC profile over 64 KiB: Pillow splits it across APP2 segments, as cameras do.
    "jpeg progressive, EXIF, a 260 KB ICC profile": (
        "jpeg",
        lambda: _with_metadata("JPEG", progressive=True, optimize=True, icc_profile=bytes(260_000)),
    ),
    "jpeg restart markers, EXIF": ("jpeg", lambda: _with_metadata("JPEG", restart_marker_blocks=1)),
    "png 21 text chunks, iCCP, pHYs": ("png", lambda: _with_metadata("PNG")),
    "webp ICC and EXIF": ("webp", lambda: _with_metadata("WEBP")),
    "gif a 2 KB comment, looping": ("gif", lambda: _with_metadata("GIF", comment=b"c" * 2000)),
}


@pytest.mark.parametrize("name", METADATA)
def test_images_with_the_metadata_encoders_write_pass(name):
    fmt, make = METADATA[name]
    assert validate(make(), fmt).accepted


def test_jpeg_comments_and_fill_at_a_real_files_scale_pass():
    assert validate(jpeg_with(b"\xff\xfe\x00\x02" * 100), "jpeg").accepted
    assert validate(jpeg_with(b"\xff" * 100), "jpeg").accepted


def test_png_idat_split_at_the_budgets_own_rate_still_passes():
    """One chunk per ``BYTES_PER_PNG_CHUNK`` bytes, far past the base: a real file's
    worst case (libpng writes 8 KiB chunks) still walks."""
    whole = noise_png(1400, 1100, seed=3)
    start = whole.index(b"IDAT") - 4
    end = whole.index(b"IEND") - 4
    stream = b"".join(whole[p + 8 : p + 8 + n] for p, n in _chunks(whole, start, end, b"IDAT"))
    step = BYTES_PER_PNG_CHUNK - 12
    pieces = (stream[i : i + step] for i in range(0, len(stream), step))
    rechunked = b"".join(png_chunk(b"IDAT", piece) for piece in pieces)
    data = whole[:start] + rechunked + whole[end:]
    assert len(data) // BYTES_PER_PNG_CHUNK > BASE_ENTRIES  # the per-size term is what allows it
    assert check_structure(data, "png").frames == 1
    assert validate(data, "png").accepted


def _chunks(data: bytes, start: int, end: int, kind: bytes) -> list[tuple[int, int]]:
    found, pos = [], start
    while pos < end:
        length = struct.unpack_from(">I", data, pos)[0]
        if data[pos + 4 : pos + 8] == kind:
            found.append((pos, length))
        pos += 12 + length
    return found


def test_progressive_scans_are_counted():
    progressive = encode("JPEG", (160, 120), progressive=True)
    first = progressive.index(b"\xff\xda")
    second = progressive.index(b"\xff\xda", first + 2)
    scan = progressive[first:second]  # the first scan (DC) and the next scan's table
    # 64 KiB comments: a file big enough that its segment budget is not what refuses.
    comments = (b"\xff\xfe\xff\xff" + bytes(65533)) * 40
    data = progressive[:first] + comments + progressive[first:second]
    data += scan * MAX_JPEG_SCANS + progressive[second:]
    message = assert_refused(validate(data, "jpeg"))
    assert message.endswith(f"the JPEG data is corrupt (more than {MAX_JPEG_SCANS} scans)")
    assert validate(progressive, "jpeg").accepted


def test_restart_markers_are_counted_in_place():
    """A scan of restart markers was counted by listing every one (40 bytes of memory per
    2 sent); the count is the same without the list."""
    whole = encode("JPEG", (160, 120), restart_marker_rows=1)
    assert validate(whole, "jpeg").accepted
    cut = whole[: len(whole) // 2] + b"\xff\xd9"
    assert assert_refused(validate(cut, "jpeg")).endswith("restart markers are missing")


def test_the_budget_grows_with_size():
    assert entry_budget(0, 1024) == BASE_ENTRIES
    assert entry_budget(MB, 1024) == BASE_ENTRIES + 1024
    # The edge, exactly: IHDR, IDAT and IEND plus ``empty`` chunks against the budget.
    empty = 0
    while empty + 3 <= entry_budget(len(png_with_chunks(empty)), BYTES_PER_PNG_CHUNK):
        empty += 1
    assert check_structure(png_with_chunks(empty - 1), "png").frames == 1
    with pytest.raises(ImageIntegrityError, match="more chunks than any encoder writes"):
        check_structure(png_with_chunks(empty), "png")


def test_a_tiff_directory_of_thousands_of_tags_is_refused():
    tiff = encode("TIFF", (32, 32))
    junk = struct.pack("<HHII", 999, 3, 1, 0)  # an unknown SHORT tag, value inline
    for count, refused in ((1024, False), (1025, True)):
        directory = struct.pack("<H", count) + junk * count + bytes(4)
        data = b"II*\x00" + struct.pack("<I", len(tiff)) + tiff[8:] + directory
        if refused:
            with pytest.raises(ImageIntegrityError, match=r"TIFF data is corrupt \(a directory"):
                check_structure(data, "tiff")
        else:
            assert check_structure(data, "tiff").frames == 1


def segment(marker: int, payload: bytes) -> bytes:
    return bytes((0xFF, marker)) + struct.pack(">H", len(payload) + 2) + payload


def exif(tags: int) -> bytes:
    """An Exif APP1 payload whose first directory holds ``tags`` entries."""
    entry = struct.pack("<HHI4s", 0x9000, 3, 1, b"\x01\x00\x00\x00")
    return b"Exif\x00\x00II*\x00" + struct.pack("<IH", 8, tags) + entry * tags + bytes(4)


# What Pillow's JPEG header reader loops over inside segments, each refused past its cap.
SEGMENT_LOOPS = {
    "exif segments": (segment(0xE1, exif(1)) * 5, "more than 4 Exif segments"),
    "an exif directory": (segment(0xE1, exif(1025)), "an Exif directory of 1025 entries"),
    # Pillow joins the Exif segments before it reads them: a directory in the second.
    "an exif directory in a later segment": (
        segment(0xE1, b"Exif\x00\x00II*\x00" + struct.pack("<I", 108) + bytes(100))
        + segment(0xE1, b"Exif\x00\x00" + exif(1025)[14:]),
        "an Exif directory of 1025 entries",
    ),
    "photoshop resources": (
        segment(0xED, b"Photoshop 3.0\x00" + (b"8BIM\x04\x04\x00\x00\x00\x00\x00\x00") * 1025),
        "more than 1024 Photoshop resources",
    ),
    "quantisation tables": (
        segment(0xDB, (b"\x10" + bytes(range(1, 129))) * 5),  # five 16-bit tables
        "a quantisation segment holds more tables than a JPEG uses",
    ),
}


@pytest.mark.parametrize("name", SEGMENT_LOOPS)
def test_what_pillow_loops_over_inside_a_jpeg_segment_is_capped(name):
    inserted, reason = SEGMENT_LOOPS[name]
    message = assert_refused(validate(jpeg_with(inserted), "jpeg"))
    assert message.endswith(f"the JPEG data is corrupt ({reason})")


def test_what_real_jpegs_hold_inside_segments_passes():
    one_of_each = segment(0xE1, exif(1024)) + segment(0xED, b"Photoshop 3.0\x00" + b"8BIM" * 8)
    one_of_each += segment(0xDB, (b"\x00" + bytes(range(1, 65))) * 4)
    assert validate(jpeg_with(one_of_each), "jpeg").accepted


def test_a_few_hundred_stray_bytes_pass_as_libjpeg_reads_them():
    assert validate(jpeg_with(bytes(600)), "jpeg").accepted


def test_compressed_png_chunks_are_few():
    """Pillow inflates each zTXt, compressed iTXt and iCCP chunk (up to 1 MiB apiece)."""

    def with_chunks(kind: bytes, payload: bytes, count: int) -> bytes:
        small = png_with_chunks(0)
        return small[:33] + png_chunk(kind, payload) * count + small[33:]

    text = b"key\x00\x00" + zlib.compress(b"a" * 100)
    assert validate(with_chunks(b"zTXt", text, 8), "png").accepted
    message = assert_refused(validate(with_chunks(b"zTXt", text, 9), "png"))
    assert message.endswith("the PNG data is corrupt (over 8 compressed text or profile chunks)")
    plain_itxt = b"key\x00\x00\x00\x00\x00" + b"text"  # not compressed: not counted
    assert validate(with_chunks(b"iTXt", plain_itxt, 20), "png").accepted
    # The flag is found as Pillow finds it, after the first zero byte, however far.
    long_key = b"k" * 100 + b"\x00\x01\x00\x00\x00" + zlib.compress(b"a" * 100)
    message = assert_refused(validate(with_chunks(b"iTXt", long_key, 9), "png"))
    assert message.endswith("the PNG data is corrupt (over 8 compressed text or profile chunks)")


def test_gif_stray_bytes_count_one_by_one():
    """Pillow's reader steps over stray bytes between GIF blocks one at a time."""
    assert validate(gif_with(bytes(50)), "gif").accepted
    message = assert_refused(validate(gif_with(bytes(MB)), "gif"))
    assert "the GIF data is corrupt (more blocks than any encoder writes" in message


def test_an_animated_webp_is_counted_as_animated_however_many_its_chunks():
    """Frames are counted as the chunks come, so a long animation is refused for being
    animated (two frames counted), not for its chunk count."""
    frames = [Image.new("RGB", (32, 32), (i % 256, i // 256, 0)) for i in range(400)]
    buffer = io.BytesIO()
    frames[0].save(buffer, "WEBP", save_all=True, append_images=frames[1:], lossless=True)
    structure = check_structure(buffer.getvalue(), "webp", frame_limit=1)
    assert (structure.frames, structure.capped) == (2, True)


def test_restart_markers_across_a_window_edge_count_once():
    from modalgate.media.jpeg_structure import _RST_WINDOW, _restart_markers

    data = bytes(_RST_WINDOW - 1) + b"\xff\xd0" + bytes(10) + b"\xff\xd1"
    assert _restart_markers(data, 0, len(data), 2)
    assert not _restart_markers(data, 0, len(data), 3)
