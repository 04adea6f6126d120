"""Hostile data, as real datasets carry it, through the real `data.py convert` (and training's reader): each input
is either converted right or counted with a reason, and what would lose or mix data is refused in one line.

By kind: OUT folders (the user's files, another conversion, another dataset), images (16-bit, EXIF-rotated,
GIF/BMP/TIFF, upper-case names, truncated, 1x1, 100000x1), captions (latin-1, cp1252, empty, blank, a byte-order
mark, a caption without an image), names and metadata (not UTF-8, 1e400), folders (a symlink loop, duplicate
keys), and a dataset smaller than one global batch.
"""

import io
import math
import os
import tarfile

import numpy as np
import pytest
from conftest import image_bytes, img2dataset_tar, read_mds, write_images
from PIL import Image

import data
from diffusion.cli import run as run_cli
from diffusion.data.transforms import ImageTransform, decode_sized, probe


def convert(capsys, src, out, *flags) -> tuple[int, str, str]:
    """``data.py convert SRC OUT`` as a user runs it: (exit code, stdout, stderr)."""
    code = run_cli("data.py", data.main, ["convert", str(src), str(out), "--workers", "1", *map(str, flags)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def refused(capsys, src, out, *flags) -> str:
    """The one line a refused convert prints (exit 2)."""
    code, _, err = convert(capsys, src, out, *flags)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("data.py: error: "), err
    return lines[0]


def converted(capsys, src, out, *flags) -> tuple[dict, str]:
    """Convert, expecting success: ({key: sample}, stdout)."""
    code, out_text, err = convert(capsys, src, out, *flags)
    assert code == 0, err
    return {s["key"]: s for s in read_mds(out)}, out_text


def folder(root, files: dict) -> str:
    """A source folder: file name -> bytes or text."""
    root.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        path = os.path.join(os.fsencode(root), os.fsencode(name) if isinstance(name, str) else name)
        with open(path, "wb") as f:
            f.write(content.encode() if isinstance(content, str) else content)
    return str(root)


def tar_of(path, members: list[tuple[bytes | str, bytes]]) -> str:
    with tarfile.open(path, "w") as tar:
        for name, content in members:
            info = tarfile.TarInfo(os.fsdecode(name) if isinstance(name, bytes) else name)
            info.size = len(content)
            tar.addfile(info, io.BytesIO(content))
    return str(path)


# --- OUT: convert never deletes, hides or mixes what it did not write -------------------------------------------
def test_a_folder_of_the_users_named_like_the_part_is_never_deleted(tmp_path, capsys):
    img2dataset_tar(tmp_path / "photos.tar", 0, 3)
    out = tmp_path / "DIR"
    (out / "photos").mkdir(parents=True)
    (out / "photos" / "holiday.jpg").write_bytes(b"the user's own photo")
    line = refused(capsys, tmp_path / "photos.tar", out)
    assert f"OUT '{out}' is not empty (it holds photos); convert into a new or empty folder" in line
    assert (out / "photos" / "holiday.jpg").read_bytes() == b"the user's own photo"


def test_a_part_is_written_in_its_own_scratch_and_replaces_only_an_unfinished_part(tmp_path, capsys):
    img2dataset_tar(tmp_path / "photos.tar", 0, 3)
    out = tmp_path / "DIR"
    converted(capsys, tmp_path / "photos.tar", out)
    assert sorted(os.listdir(out)) == [".convert.json", "index.json", "photos"]  # no scratch left behind
    (out / "photos" / "index.json").unlink()  # an unfinished part, with a file of the user's put into it
    (out / "photos" / "holiday.jpg").write_bytes(b"the user's own photo")
    line = refused(capsys, tmp_path / "photos.tar", out)
    assert f"{out / 'photos'} is in the way of part 'photos' and is not one this tool wrote" in line
    assert (out / "photos" / "holiday.jpg").read_bytes() == b"the user's own photo"
    assert not (out / ".partial-photos").exists()


def test_a_second_source_into_a_finished_dataset_is_refused_and_the_first_stays_whole(tmp_path, capsys):
    first = folder(tmp_path / "a", {"x.png": image_bytes(fmt="PNG"), "x.txt": "first"})
    second = folder(tmp_path / "b", {"y.png": image_bytes(seed=1, fmt="PNG"), "y.txt": "second"})
    out = tmp_path / "mds"
    converted(capsys, first, out)
    index = (out / "index.json").read_text()
    line = refused(capsys, second, out)
    assert f"OUT '{out}' holds the conversion of '{first}' (folder, 1 samples in its index.json)" in line
    assert "convert" in line and "into another OUT" in line
    assert (out / "index.json").read_text() == index and [s["caption"] for s in read_mds(out)] == ["first"]


def test_a_second_source_into_an_unfinished_conversion_and_into_another_dataset_is_refused(tmp_path, capsys):
    first = folder(tmp_path / "a", {"x.png": image_bytes(fmt="PNG"), "x.txt": "first"})
    out = tmp_path / "mds"
    converted(capsys, first, out)
    (out / "index.json").unlink()
    (out / "folder-00000" / "index.json").unlink()
    second = folder(tmp_path / "b", {"y.png": image_bytes(fmt="PNG"), "y.txt": "second"})
    assert "(folder, not finished)" in refused(capsys, second, out)
    other = write_images(tmp_path / "other", 3)  # an MDS dataset another tool wrote
    line = refused(capsys, second, other)
    assert "holds an MDS dataset (3 samples in its index.json) with no record of its source" in line
    assert len(read_mds(other)) == 3


def test_an_out_that_is_a_file_or_under_one_is_one_line(tmp_path, capsys):
    img2dataset_tar(tmp_path / "a.tar", 0, 2)
    (tmp_path / "notes.txt").write_text("the user's notes")
    for out in (tmp_path / "notes.txt", tmp_path / "notes.txt" / "mds"):
        assert f"OUT '{out}' cannot be written (" in refused(capsys, tmp_path / "a.tar", out)
    assert (tmp_path / "notes.txt").read_text() == "the user's notes"


def test_the_same_source_resumes_and_takes_new_input_shards(tmp_path, capsys):
    src, out = tmp_path / "wds", tmp_path / "mds"
    src.mkdir()
    img2dataset_tar(src / "00000.tar", 0, 2)
    converted(capsys, src, out)
    img2dataset_tar(src / "00001.tar", 1, 3)
    samples, text = converted(capsys, src, out)
    assert len(samples) == 5 and "3 samples from 1 webdataset input shards" in text and "(1 shards already" in text


# --- images: decoded as they look, or counted ---------------------------------------------------------------
def test_a_16_bit_grey_png_is_scaled_to_8_bits_not_clipped_to_white(tmp_path, capsys):
    buf = io.BytesIO()
    Image.fromarray(np.full((40, 60), 30000, np.uint16)).save(buf, format="PNG")
    assert Image.open(io.BytesIO(buf.getvalue())).mode.startswith("I")
    samples, _ = converted(
        capsys, folder(tmp_path / "src", {"deep.png": buf.getvalue(), "deep.txt": "grey"}), tmp_path / "o"
    )
    pixels = ImageTransform(32)(samples["deep"]["image"]).pixels
    assert pixels.shape == (3, 32, 32) and abs(int(pixels.float().mean()) - round(30000 / 65535 * 255)) <= 1


def rotated_jpeg() -> bytes:
    """A 96x48 JPEG, left half red, right half blue, with EXIF orientation 6: shown upright as 48x96, red on top."""
    pixels = np.zeros((48, 96, 3), np.uint8)
    pixels[:, :48, 0], pixels[:, 48:, 2] = 255, 255
    exif = Image.Exif()
    exif[0x0112] = 6
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", exif=exif)
    return buf.getvalue()


def test_an_exif_rotated_jpeg_is_upright_in_its_size_its_bucket_and_its_pixels(tmp_path, capsys):
    samples, _ = converted(
        capsys, folder(tmp_path / "src", {"phone.jpg": rotated_jpeg(), "phone.txt": "tall"}), tmp_path / "o"
    )
    s = samples["phone"]
    assert (s["original_width"], s["original_height"]) == (48, 96) and probe(s["image"])[:2] == (48, 96)
    image, stored = decode_sized(s["image"], min_side=(40, 20))  # a reduced-scale decode keeps 40 wide, upright
    assert stored == (96, 48) and image.size == (48, 96)
    top, bottom = np.asarray(image)[10, 24], np.asarray(image)[85, 24]
    assert top[0] > 200 > top[2] and bottom[2] > 200 > bottom[0]
    pixels = ImageTransform((64, 32))(s["image"]).pixels  # a tall bucket: (height, width)
    assert pixels[0, 5, 16] > 200 and pixels[2, 58, 16] > 200


def test_gif_bmp_tiff_and_upper_case_names_are_images_and_unknown_formats_are_counted(tmp_path, capsys):
    files = {"a.gif": image_bytes(fmt="GIF"), "b.bmp": image_bytes(fmt="BMP"), "c.tif": image_bytes(fmt="TIFF")}
    files |= {"D.JPG": image_bytes(), "E.PNG": image_bytes(fmt="PNG"), "f.heic": b"\0\0\0 ftypheic"}
    files |= {f"{stem}.txt": f"caption {stem}" for stem in ("a", "b", "c", "D", "E", "f")}
    samples, text = converted(capsys, folder(tmp_path / "src", files), tmp_path / "o")
    assert sorted(samples) == ["D", "E", "a", "b", "c"]
    assert all(Image.open(io.BytesIO(samples[k]["image"])).format == "JPEG" for k in "abc")  # re-encoded
    assert "missing_image: 1 (e.g. " in text and "f.txt: no image (jpg" in text and "f.heic, f.txt" in text
    only_upper = folder(tmp_path / "upper", {"X.JPG": image_bytes(), "X.TXT": "upper-case caption file"})
    samples, _ = converted(capsys, only_upper, tmp_path / "o2")
    assert samples["X"]["caption"] == "upper-case caption file"


def test_only_the_listed_formats_are_decoded_and_compressed_tiffs_wait_for_pillow_13(tmp_path, capsys):
    """PIL recognises a file by its bytes: a PPM named .jpg was decoded as PPM, and so would a PSD or a JPEG 2000
    be (Pillow 11's decoders of those have out-of-bounds writes: docs/install.md). transforms.DECODE_FORMATS only;
    a compressed TIFF (libtiff) is refused below Pillow 13 and an uncompressed one is decoded."""
    import PIL

    from diffusion.data.transforms import SAFE_LIBTIFF
    from diffusion.versions import release

    lzw = io.BytesIO()
    Image.open(io.BytesIO(image_bytes())).save(lzw, format="TIFF", compression="tiff_lzw")
    files = {"ppm.jpg": image_bytes(fmt="PPM"), "lzw.tif": lzw.getvalue(), "raw.tif": image_bytes(fmt="TIFF")}
    files |= {f"{stem}.txt": stem for stem in ("ppm", "lzw", "raw")}
    samples, text = converted(capsys, folder(tmp_path / "src", files), tmp_path / "o")
    old = release(PIL.__version__) < SAFE_LIBTIFF
    assert sorted(samples) == (["raw"] if old else ["lzw", "raw"]), text
    assert "ppm.jpg: UnidentifiedImageError: cannot identify image file" in text
    if old:
        assert f"lzw.tif: a compressed TIFF, which Pillow {PIL.__version__} decodes through a libtiff" in text


def test_truncated_tiny_and_extreme_images(tmp_path, capsys):
    whole = image_bytes(200, 200)
    files = {
        "cut.jpg": whole[: len(whole) // 2],
        "dot.png": image_bytes(1, 1, fmt="PNG"),
        "line.png": image_bytes(100_000, 1, fmt="PNG"),
    }
    files |= {"empty.jpg": b"", **{f"{s}.txt": s for s in ("cut", "dot", "line", "empty")}}
    samples, text = converted(capsys, folder(tmp_path / "src", files), tmp_path / "o")
    assert (
        sorted(samples) == ["dot", "line"]
        and "corrupt_image: 2" in text
        and "cut.jpg: OSError: image file is truncated" in text
    )
    assert (samples["line"]["original_width"], samples["line"]["original_height"]) == (100_000, 1)
    for key in ("dot", "line"):  # training's transform makes a whole sample of each
        assert ImageTransform(32)(samples[key]["image"]).pixels.shape == (3, 32, 32)


# --- captions ---------------------------------------------------------------------------------------------------
def test_captions_not_in_utf8_are_decoded_and_counted_empty_or_blank_ones_are_skipped(tmp_path, capsys):
    img = image_bytes(fmt="PNG")
    files = {f"{k}.png": img for k in ("latin", "smart", "bom", "empty", "blank")}
    files |= {"latin.txt": "café crème".encode("latin-1"), "smart.txt": "\u201cquoted\u201d".encode("cp1252")}
    files |= {"bom.txt": "\ufeffa caption".encode("utf-8"), "empty.txt": b"", "blank.txt": b" \n\t \n"}
    samples, text = converted(capsys, folder(tmp_path / "src", files), tmp_path / "o")
    assert samples["latin"]["caption"] == "café crème" and samples["smart"]["caption"] == "\u201cquoted\u201d"
    assert samples["bom"]["caption"] == "a caption" and sorted(samples) == ["bom", "latin", "smart"]
    assert all("\ufffd" not in s["caption"] for s in samples.values())
    assert "convert: mended and kept 2 samples\n  caption_not_utf8: 2 (e.g. " in text and "decoded as cp1252" in text
    assert "missing_caption: 2" in text


# --- names and metadata -----------------------------------------------------------------------------------------
def test_a_file_name_not_in_utf8_is_converted_and_counted(tmp_path, capsys):
    files = {
        b"caf\xe9.png": image_bytes(fmt="PNG"),
        b"caf\xe9.txt": b"a cafe",
        b"bad\xff.jpg": b"no image",
        b"bad\xff.txt": b"x",
    }
    samples, text = converted(capsys, folder(tmp_path / "src", files), tmp_path / "o")
    assert list(samples) == ["caf\ufffd"] and "name_not_utf8: 1" in text
    assert "corrupt_image: 1 (e.g. " in text and "bad\ufffd.jpg: UnidentifiedImageError" in text  # reported, printable
    tar = tar_of(tmp_path / "t.tar", [(b"k\xff.jpg", image_bytes()), (b"k\xff.txt", b"in a tar")])
    samples, text = converted(capsys, tar, tmp_path / "o2")
    assert samples["k\ufffd"]["caption"] == "in a tar" and "name_not_utf8: 1" in text


def test_metadata_that_is_not_a_finite_number_is_nan_and_counted(tmp_path, capsys):
    meta = '{"pwatermark": 1e400, "aesthetic": 1' + "0" * 400 + ', "original_width": 1e400, "similarity": 0.3}'
    src = folder(tmp_path / "src", {"a.png": image_bytes(fmt="PNG"), "a.txt": "c", "a.json": meta})
    samples, text = converted(capsys, src, tmp_path / "o")
    s = samples["a"]
    assert math.isnan(s["pwatermark"]) and math.isnan(s["aesthetic"]) and s["similarity"] == pytest.approx(0.3)
    assert (
        s["original_width"] == 96 and "metadata_not_finite: 2 (e.g. " in text and "pwatermark=inf stored as NaN" in text
    )


def test_parquet_metadata_of_inf_is_nan_and_counted(tmp_path, capsys):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(
        pa.table({"jpg": [image_bytes(), image_bytes(seed=1)], "txt": ["a", "b"], "punsafe": [float("inf"), 0.5]}),
        tmp_path / "x.parquet",
    )
    samples, text = converted(capsys, tmp_path / "x.parquet", tmp_path / "o")
    assert math.isnan(samples["0"]["punsafe"]) and samples["1"]["punsafe"] == 0.5 and "metadata_not_finite: 1" in text


# --- folders and keys -------------------------------------------------------------------------------------------
def test_a_symlink_loop_in_the_source_is_walked_once(tmp_path, capsys):
    src = tmp_path / "src"
    folder(src / "sub", {"a.png": image_bytes(fmt="PNG"), "a.txt": "once"})
    (src / "sub" / "loop").symlink_to(src)
    (src / "elsewhere").symlink_to(tmp_path / "more")
    folder(tmp_path / "more", {"b.png": image_bytes(seed=2, fmt="PNG"), "b.txt": "through a link"})
    samples, _ = converted(capsys, src, tmp_path / "o")
    assert sorted(samples) == ["elsewhere/b", "sub/a"]


def test_duplicate_keys_keep_every_image_or_are_counted(tmp_path, capsys):
    files = {"dup.jpg": image_bytes(), "dup.png": image_bytes(seed=1, fmt="PNG"), "dup.txt": "two images, one caption"}
    samples, _ = converted(capsys, folder(tmp_path / "src", files), tmp_path / "o")
    assert sorted(samples) == ["dup.jpg", "dup.png"] and {s["caption"] for s in samples.values()} == {files["dup.txt"]}
    members = [
        ("k.jpg", image_bytes()),
        ("k.txt", b"first"),
        ("k.jpg", image_bytes(seed=1)),
        ("j.jpg", image_bytes(seed=2)),
    ]
    members += [("j.txt", b"other"), ("k.jpg", image_bytes(seed=3)), ("k.txt", b"again, later")]
    _, text, _ = convert(capsys, tar_of(tmp_path / "t.tar", members), tmp_path / "o2")
    got = read_mds(tmp_path / "o2")
    assert [(s["key"], s["caption"]) for s in got] == [("k", "first"), ("j", "other"), ("k", "again, later")]
    assert "missing_caption: 1 (e.g. t.tar:k" in text  # the second k.jpg in a row: a sample of its own, no caption


# --- a dataset smaller than one global batch ----------------------------------------------------------------------
def test_a_dataset_smaller_than_one_global_batch_is_refused_before_training(tmp_path, capsys):
    import benchmark

    mds = write_images(tmp_path / "mds", 3)
    args = ["--local", mds, "--model_name", "sd-tiny", "--batch_size", "4", "--max_duration", "2ba"]
    code = benchmark.main([*args, "--num_workers", "0", "--image_size", "64"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1] == (
        f"benchmark.py: error: --local {mds} has 3 samples, fewer than one global batch (--batch_size 4 over 1 rank, "
        "whole batches only): every epoch would be empty and the run would never end; lower --batch_size to 3 or "
        "less, or train on more data"
    ), err
