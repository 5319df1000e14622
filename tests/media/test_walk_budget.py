"""Container walks are bounded by the file's size: a body of empty entries is refused
before Pillow's header reader (which walks the same entries in Python) sees it.

Each hostile file here is a real Pillow image with ~1 MB of empty entries spliced
in where the format allows them; the same splice at a real file's scale passes.
"""

from __future__ import annotations

import io
import struct

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
WHAT = {"jpeg": "segments and stray bytes", "png": "chunks", "gif": "blocks", "webp": "chunks"}


@pytest.mark.parametrize("name", HOSTILE)
def test_a_megabyte_of_empty_entries_is_refused_before_pillow_reads_it(name, monkeypatch):
    fmt, data = HOSTILE[name]

    def never(self):
        raise AssertionError("Pillow's header reader walked the hostile file")

    monkeypatch.setattr(PLUGINS[fmt], "_open", never)
    message = assert_refused(validate(data, fmt))
    expected = f"the {fmt.upper() if fmt != 'webp' else 'WebP'} data is corrupt (more {WHAT[fmt]}"
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


def test_the_budget_grows_with_size_and_frames_up_to_a_bound():
    assert entry_budget(0, 1024) == BASE_ENTRIES + 8
    assert entry_budget(MB, 1024, 10) == BASE_ENTRIES + 80 + 1024
    assert entry_budget(0, 1024, 10**9) == entry_budget(0, 1024, 1 << 16)
    # The edge, exactly: IHDR, IDAT and IEND plus ``empty`` chunks against the budget.
    empty = BASE_ENTRIES
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
