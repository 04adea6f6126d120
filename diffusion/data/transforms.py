"""Image decoding and the training transform: decode, square crop, resize, flip (with the crop's position, SDXL's
crop conditioning); [-1, 1] on the device.

Decoding is the CPU cost of online training, so the loader does the least work that gives the same
pixels: JPEGs are decoded at a reduced DCT scale when they are at least twice the target size
(libjpeg's ``draft``), the crop box is resized straight to the target (``resize(box=...)``) instead of
resizing the whole image and cropping afterwards, and images leave the workers as uint8: converting to
float and collating 4-byte pixels cost a 2-core machine more than the JPEG decode itself at 512 px, and
4x the bytes to copy to the GPU. ``to_unit_range`` scales them to [-1, 1] once they are on the device.
"""

from __future__ import annotations

import io
from typing import NamedTuple

import numpy as np
import PIL
import torch
from PIL import Image, ImageOps

from diffusion.data.bad_samples import BadSample, describe_error
from diffusion.versions import release

# Malformed bytes make PIL raise OSError, SyntaxError, ValueError, struct.error, IndexError, EOFError,
# DecompressionBombError...: anything raised while decoding one sample's bytes is that sample's fault.
DECODE_ERRORS = (Exception,)
# The formats decoded (data/sources.py's IMAGE_EXTS; JPEG opens a camera's MPO too): PIL recognises a file by its bytes,
# not its name, and Pillow < 12 (Composer 0.32.1 holds it there) has out-of-bounds writes and reads in decoders no
# training set needs (PSD, JPEG 2000, FITS, McIdas, FPX, WMF, EPS...) that Pillow 12.1-13 fixed (docs/install.md).
DECODE_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")
# Compressed TIFFs decode through libtiff: out-of-bounds reads and writes there (tiles, YCbCr) were fixed in 13.0.
SAFE_LIBTIFF = (13, 0)
ORIENTATION = 0x0112  # the EXIF tag: 1 upright, 2 to 8 mirrored and/or rotated
TURNED = (5, 6, 7, 8)  # orientations rotated by 90 degrees: width and height swap


def decode(data: bytes | Image.Image, min_side: int | None = None) -> Image.Image:
    """An RGB image from encoded bytes (every pixel decoded, so truncation is caught here), or
    BadSample("corrupt_image"). ``min_side``: a JPEG may be decoded at a reduced scale as long as both
    sides stay at least this long."""
    return decode_sized(data, min_side)[0]


def decode_sized(
    data: bytes | Image.Image, min_side: int | tuple[int, int] | None = None
) -> tuple[Image.Image, tuple[int, int]]:
    """``decode``, with the (height, width) the image is stored at (before a reduced-scale JPEG decode, which
    keeps at least ``min_side``: a side, or a (width, height)), both upright: an EXIF orientation (a phone's
    rotated JPEG) is applied, so the size and the aspect-ratio bucket are those of the picture as seen."""
    if isinstance(data, Image.Image):
        return _rgb(data), (data.height, data.width)
    try:
        image = _open(data)
        orientation = image.getexif().get(ORIENTATION, 1)
        turned = orientation in TURNED
        stored = (image.width, image.height) if turned else (image.height, image.width)
        if min_side and image.format == "JPEG":
            w, h = min_side if isinstance(min_side, tuple) else (min_side, min_side)
            image.draft("RGB", (h, w) if turned else (w, h))
        return _rgb(ImageOps.exif_transpose(image) if orientation != 1 else image), stored
    except BadSample:
        raise
    except DECODE_ERRORS as e:
        raise BadSample("corrupt_image", describe_error(e)) from None


def _rgb(image: Image.Image) -> Image.Image:
    """RGB, 8 bits a channel. 16-bit and 32-bit grey ("I;16", "I") are scaled down from their 16-bit range, and
    float grey ("F") from [0, 1]: PIL's own convert clips them, so a 16-bit PNG would turn white."""
    if image.mode.startswith("I;16") or image.mode in ("I", "F"):
        pixels = np.asarray(image, dtype=np.float64)
        full = 1.0 if image.mode == "F" else 65535.0
        image = Image.fromarray((pixels / full * 255.0).round().clip(0, 255).astype(np.uint8))
    return image.convert("RGB")


def _open(data: bytes) -> Image.Image:
    """PIL's open, of DECODE_FORMATS only; a compressed TIFF only on a Pillow whose libtiff path is fixed."""
    image = Image.open(io.BytesIO(data), formats=DECODE_FORMATS)  # another: "cannot identify image file"
    if image.format == "TIFF" and _PILLOW < SAFE_LIBTIFF and any(tile[0] == "libtiff" for tile in image.tile):
        raise BadSample(
            "refused_image",
            f"a compressed TIFF, which Pillow {PIL.__version__} decodes through a libtiff with known out-of-bounds "
            "reads and writes (fixed in Pillow 13); save it as PNG first (docs/install.md)",
        )
    return image


_PILLOW = release(PIL.__version__)


def probe(data: bytes) -> tuple[int, int, str]:
    """(width, height, format) from the header alone, upright (the EXIF orientation applied)."""
    try:
        image = _open(data)
        turned = image.getexif().get(ORIENTATION, 1) in TURNED
        w, h = (image.height, image.width) if turned else (image.width, image.height)
        return w, h, image.format
    except BadSample:
        raise
    except DECODE_ERRORS as e:
        raise BadSample("corrupt_image", describe_error(e)) from None


def shrink(image: Image.Image, max_side: int) -> Image.Image:
    """``image`` with its shorter side at most ``max_side`` (aspect kept), resized only when larger."""
    w, h = image.size
    s = min(w, h)
    if s <= max_side:
        return image
    return image.resize(
        (max(1, round(w * max_side / s)), max(1, round(h * max_side / s))), Image.BICUBIC, reducing_gap=3.0
    )


def to_tensor(image: Image.Image) -> torch.Tensor:
    """(3, H, W) uint8."""
    return torch.from_numpy(np.array(image, dtype=np.uint8)).permute(2, 0, 1).contiguous()


def to_unit_range(images: torch.Tensor) -> torch.Tensor:
    """uint8 pixels -> float32 in [-1, 1] (what the models take); float input is returned as it is."""
    return images.float().div_(127.5).sub_(1.0) if images.dtype == torch.uint8 else images


class Cropped(NamedTuple):
    pixels: torch.Tensor  # (3, height, width) uint8
    stored_size: tuple[int, int]  # (height, width) of the image as stored
    crop_top_left: tuple[int, int]  # (top, left) in pixels of the image resized so the crop is height x width


class ImageTransform:
    """Bytes -> (3, height, width) uint8: the largest centred (or randomly placed) box of the target's aspect
    ratio (a square for an int ``size``; an aspect-ratio bucket's (height, width), data/buckets.py), resized
    with bicubic antialiasing, optionally flipped left-right with probability 1/2; with the stored size and
    the crop's top-left corner (SDXL's crop conditioning, batch.py's CROP_TOP_LEFT), measured as SDXL does: in
    the image resized so the crop is the target size, and, when flipped, on the flipped image."""

    def __init__(self, size: int | tuple[int, int], crop: str = "center", hflip: bool = False):
        self.height, self.width = (size, size) if isinstance(size, int) else size
        self.crop, self.hflip = crop, hflip

    def __call__(self, data, rng: np.random.Generator | None = None) -> Cropped:
        image, stored = decode_sized(data, min_side=(self.width, self.height))
        w, h = image.size
        scale = min(w / self.width, h / self.height)  # image pixels per target pixel in the largest box
        bw, bh = min(w, round(self.width * scale)), min(h, round(self.height * scale))
        if self.crop == "random" and rng is not None:
            left, top = int(rng.integers(0, w - bw + 1)), int(rng.integers(0, h - bh + 1))
        else:
            left, top = (w - bw) // 2, (h - bh) // 2
        image = image.resize(
            (self.width, self.height), Image.BICUBIC, box=(left, top, left + bw, top + bh), reducing_gap=3.0
        )
        if self.hflip and rng is not None and rng.random() < 0.5:
            image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
            left = w - bw - left  # the same pixels, cropped from the mirrored image
        scale = self.width / bw
        return Cropped(to_tensor(image), stored, (round(top * scale), round(left * scale)))
