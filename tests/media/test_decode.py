"""Decoding for the encoder: every odd mode and orientation to RGB, compared pixel for pixel."""

from __future__ import annotations

import io

import anyio
import pytest
from PIL import Image, ImageFile

from conftest import image_bytes, png_bomb
from modalgate.media.decode import DecodeError, DecodeOptions, DecodePool, decode_image

RED, GREEN, BLUE = (255, 0, 0), (0, 255, 0), (0, 0, 255)
CYAN, MAGENTA, YELLOW = (0, 255, 255), (255, 0, 255), (255, 255, 0)
WHITE, BLACK = (255, 255, 255), (0, 0, 0)
GREY_BG = (10, 20, 30)


def encode(image: Image.Image, fmt: str = "PNG", **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


def pixels(image: Image.Image) -> list[list[tuple[int, int, int]]]:
    width, height = image.size
    return [[image.getpixel((x, y)) for x in range(width)] for y in range(height)]


# Stored 3x2:  a b c / d e f. What a viewer shows for each EXIF orientation, written out by hand.
A, B, C, D, E, F = RED, GREEN, BLUE, CYAN, MAGENTA, YELLOW
ORIENTED = {
    1: [[A, B, C], [D, E, F]],
    2: [[C, B, A], [F, E, D]],
    3: [[F, E, D], [C, B, A]],
    4: [[D, E, F], [A, B, C]],
    5: [[A, D], [B, E], [C, F]],
    6: [[D, A], [E, B], [F, C]],
    7: [[F, C], [E, B], [D, A]],
    8: [[C, F], [B, E], [A, D]],
}


@pytest.mark.parametrize("orientation", sorted(ORIENTED))
def test_exif_orientation_is_applied(orientation):
    stored = Image.new("RGB", (3, 2))
    for (x, y), color in zip(
        [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)], [A, B, C, D, E, F], strict=True
    ):
        stored.putpixel((x, y), color)
    exif = Image.Exif()
    exif[0x0112] = orientation
    decoded = decode_image(encode(stored, "PNG", exif=exif))
    assert decoded.mode == "RGB"
    assert pixels(decoded) == ORIENTED[orientation]


def test_rgba_is_composited_on_the_background():
    image = Image.new("RGBA", (3, 1))
    image.putpixel((0, 0), (255, 0, 0, 255))  # opaque red
    image.putpixel((1, 0), (0, 255, 0, 0))  # fully transparent green
    image.putpixel((2, 0), (0, 0, 255, 128))  # half blue
    decoded = decode_image(encode(image), DecodeOptions(background=GREY_BG))
    row = pixels(decoded)[0]
    assert row[0] == RED
    assert row[1] == GREY_BG
    expected = tuple(round((c * 128 + b * 127) / 255) for c, b in zip(BLUE, GREY_BG, strict=True))
    assert all(abs(got - want) <= 1 for got, want in zip(row[2], expected, strict=True))


def test_la_is_composited_as_grey():
    image = Image.new("LA", (2, 1))
    image.putpixel((0, 0), (200, 255))
    image.putpixel((1, 0), (200, 0))
    assert pixels(decode_image(encode(image)))[0] == [(200, 200, 200), WHITE]


def test_palette_with_transparency():
    image = Image.new("P", (2, 1))
    image.putpalette([*BLACK, *RED] + [0] * (256 * 3 - 6))
    image.putpixel((0, 0), 0)
    image.putpixel((1, 0), 1)
    decoded = decode_image(encode(image, transparency=0), DecodeOptions(background=GREY_BG))
    assert pixels(decoded)[0] == [GREY_BG, RED]


def test_palette_without_transparency():
    image = Image.new("P", (2, 1))
    image.putpalette([*GREEN, *BLUE] + [0] * (256 * 3 - 6))
    image.putpixel((1, 0), 1)
    assert pixels(decode_image(encode(image)))[0] == [GREEN, BLUE]


def test_sixteen_bit_grey_is_scaled_not_clipped():
    image = Image.new("I;16", (3, 1))
    for x, value in enumerate((0, 100 * 256, 65535)):
        image.putpixel((x, 0), value)
    decoded = decode_image(encode(image))
    assert pixels(decoded)[0] == [BLACK, (100, 100, 100), WHITE]


def test_one_bit():
    image = Image.new("1", (2, 1))
    image.putpixel((1, 0), 1)
    assert pixels(decode_image(encode(image)))[0] == [BLACK, WHITE]


def test_cmyk():
    image = Image.new("CMYK", (3, 1))
    image.putpixel((0, 0), (255, 0, 0, 0))
    image.putpixel((1, 0), (0, 0, 0, 255))
    image.putpixel((2, 0), (0, 0, 0, 0))
    assert pixels(decode_image(encode(image, "TIFF")))[0] == [CYAN, BLACK, WHITE]


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "GIF", "WEBP"])
def test_common_formats_decode_to_rgb(fmt):
    decoded = decode_image(image_bytes(fmt, (33, 17)))
    assert (decoded.mode, decoded.size) == ("RGB", (33, 17))


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_truncated_is_refused_even_when_pillow_would_pad(fmt, monkeypatch):
    whole = encode(Image.effect_noise((64, 64), 50).convert("RGB"), fmt)
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    with pytest.raises(DecodeError, match="truncated"):
        decode_image(whole[: len(whole) // 2])


def test_pixel_ceiling_is_checked_before_decoding():
    with pytest.raises(DecodeError, match="100000x100000"):
        decode_image(png_bomb())


def test_not_an_image():
    with pytest.raises(DecodeError, match="not a supported image"):
        decode_image(b"%PDF-1.4 hello")


def test_pool_isolates_failures():
    async def run():
        pool = DecodePool(workers=2)
        try:
            return await pool.decode_many([image_bytes("PNG"), b"junk", image_bytes("JPEG")])
        finally:
            pool.close()

    first, second, third = anyio.run(run)
    assert isinstance(first, Image.Image) and first.size == (64, 48)
    assert isinstance(second, DecodeError)
    assert isinstance(third, Image.Image)
