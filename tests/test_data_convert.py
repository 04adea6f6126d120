"""data.py convert: each source format round-trips into MDS; bad input is skipped and counted; re-runs resume.

The sources are written the way the tools people use write them (img2dataset tars with key.jpg/.txt/.json,
folders with sidecar captions, parquet with image bytes); the writers other data tests share are in conftest.py.
"""

import io
import json
import math
import tarfile

import pytest
from conftest import image_bytes, img2dataset_dir, img2dataset_tar, read_mds
from PIL import Image

import data
from diffusion.data.convert import convert
from diffusion.data.filters import parse_filters
from diffusion.errors import UsageError


def test_webdataset_round_trip(tmp_path):
    src = tmp_path / "wds"
    keys = img2dataset_dir(src, shards=2, n=6)
    report = convert(str(src), str(tmp_path / "mds"), workers=2, progress=False)
    assert report["format"] == "webdataset" and report["written"] == 12 and report["skipped"] == {}
    samples = read_mds(tmp_path / "mds")
    assert sorted(s["key"] for s in samples) == sorted(keys)
    by_key = {s["key"]: s for s in samples}
    s = by_key["000010003"]
    assert s["image"] == image_bytes(seed=1003) and s["caption"] == "a photo number 1-3"
    assert (s["original_width"], s["original_height"]) == (963, 800)
    assert s["similarity"] == pytest.approx(0.3) and s["aesthetic"] == pytest.approx(5.3)
    assert s["pwatermark"] == pytest.approx(0.03) and math.isnan(by_key["000010004"]["pwatermark"])
    assert set(report["columns"]) == {
        "key",
        "image",
        "caption",
        "original_width",
        "original_height",
        "pwatermark",
        "similarity",
        "aesthetic",
    }


def test_folder_round_trip_with_png_webp_and_optional_json(tmp_path):
    src = tmp_path / "folder" / "sub"
    src.mkdir(parents=True)
    for i, fmt in enumerate(["JPEG", "PNG", "WEBP"]):
        ext = {"JPEG": "jpg"}.get(fmt, fmt.lower())
        (src / f"img{i}.{ext}").write_bytes(image_bytes(64 + i, 48, seed=i, fmt=fmt))
        (src / f"img{i}.txt").write_text(f"caption {i}\n")
    (src / "img0.json").write_text(json.dumps({"pwatermark": 0.2, "original_width": 640, "original_height": 480}))
    (src / "not-a-file.jpg").symlink_to(tmp_path / "nowhere")  # named like an image, cannot be read
    (src / "not-a-file.txt").write_text("x")
    report = convert(str(tmp_path / "folder"), str(tmp_path / "mds"), progress=False)
    assert report["format"] == "folder" and report["written"] == 3 and report["skipped"] == {"unreadable_file": 1}
    samples = {s["key"]: s for s in read_mds(tmp_path / "mds")}
    assert samples["sub/img1"]["image"] == image_bytes(65, 48, seed=1, fmt="PNG")  # stored as it came
    assert samples["sub/img2"]["image"][8:12] == b"WEBP" and samples["sub/img2"]["caption"] == "caption 2"
    assert (samples["sub/img0"]["original_width"], samples["sub/img0"]["original_height"]) == (640, 480)
    assert (samples["sub/img1"]["original_width"], samples["sub/img1"]["original_height"]) == (65, 48)
    assert samples["sub/img0"]["pwatermark"] == pytest.approx(0.2) and math.isnan(samples["sub/img1"]["pwatermark"])


def test_parquet_round_trip_with_named_columns_and_hf_image_structs(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    src = tmp_path / "pq"
    src.mkdir()
    images = [image_bytes(seed=i) for i in range(5)]
    pq.write_table(
        pa.table(
            {
                "picture": [{"bytes": b, "path": None} for b in images],
                "alt": [f"p{i}" for i in range(4)] + [None],
                "punsafe": [0.1, 0.2, None, 0.4, 0.5],
                "key": [f"k{i}" for i in range(5)],
            }
        ),
        src / "a.parquet",
    )
    pq.write_table(
        pa.table({"picture": [{"bytes": images[0], "path": None}], "alt": ["again"], "punsafe": [0.9], "key": ["k9"]}),
        src / "b.parquet",
    )
    (src / "c.parquet").write_bytes(b"PAR1 not really PAR1")
    report = convert(str(src), str(tmp_path / "mds"), image_column="picture", caption_column="alt", progress=False)
    assert report["format"] == "parquet" and report["written"] == 5 and report["skipped"] == {"missing_caption": 1}
    assert report["shard_problems"] == {"unreadable_shard": 1}
    samples = {s["key"]: s for s in read_mds(tmp_path / "mds")}
    assert samples["k3"]["image"] == images[3] and samples["k3"]["caption"] == "p3"
    assert samples["k1"]["punsafe"] == pytest.approx(0.2) and math.isnan(samples["k2"]["punsafe"])
    with pytest.raises(
        UsageError,
        match=r"a.parquet: no column named image/.* \(columns: picture, alt, punsafe, "
        r"key\); pass --image_column",
    ):
        convert(str(src), str(tmp_path / "mds2"), progress=False)


def test_bad_input_is_skipped_counted_and_reported(tmp_path, capsys):
    src = tmp_path / "wds"
    keys = img2dataset_dir(src, shards=2, n=8, corrupt=[1], truncated=[2], no_caption=[3])
    with tarfile.open(src / "00002.tar", "w"):
        pass  # an empty input shard
    keys3 = img2dataset_tar(src / "00003.tar", 3, 8)
    whole = (src / "00003.tar").read_bytes()
    (src / "00003.tar").write_bytes(whole[: len(whole) // 2 + 100])  # cut mid-member: a truncated shard
    img2dataset_tar(src / "00004.tar", 4, 8)
    with tarfile.open(src / "00004.tar") as tar:  # cut inside the header of sample 5's caption
        cut = next(m.offset for m in tar.getmembers() if m.name == "000040005.txt") + 100
    (src / "00004.tar").write_bytes((src / "00004.tar").read_bytes()[:cut])
    report = convert(str(src), str(tmp_path / "mds"), workers=2, progress=False)
    assert report["skipped"] == {"corrupt_image": 2, "missing_caption": 1}
    assert report["shard_problems"] == {"empty_shard": 1, "truncated_shard": 2}
    samples = read_mds(tmp_path / "mds")
    got = [s["key"] for s in samples]
    assert set(keys) <= set(got) and len(got) == len(set(got)) == report["dataset_samples"]
    from_cut = set(got) - set(keys) - {f"00004{i:04d}" for i in range(5)}  # shard 4: the 5 before the cut
    assert {f"00004{i:04d}" for i in range(5)} <= set(got) and "000040005" not in got
    assert from_cut and from_cut < set(keys3) and sorted(from_cut) == keys3[: len(from_cut)]
    out = capsys.readouterr().out
    assert "corrupt_image: 2 (e.g. 00000.tar:000000001: UnidentifiedImageError: cannot identify image file; " in out
    assert "00000.tar:000000002: OSError: image file is truncated" in out and "ends inside a member header" in out
    assert "missing_caption: 1 (e.g. 00000.tar:000000003" in out and "00003.tar" in out and "00002.tar" in out


def test_resumes_only_unfinished_input_shards(tmp_path):
    src, out = tmp_path / "wds", tmp_path / "mds"
    img2dataset_dir(src, shards=3, n=4)
    first = convert(str(src), str(out), progress=False)
    before = [(s["key"], s["image"], s["caption"]) for s in read_mds(out)]
    (out / "00001" / "index.json").unlink()  # as if killed while writing that part
    (out / "00001" / "shard.00000.mds").write_bytes(b"half a shard")
    again = convert(str(src), str(out), progress=False)
    assert (again["already_done"], again["converted"], again["written"]) == (2, 1, 4)
    assert [(s["key"], s["image"], s["caption"]) for s in read_mds(out)] == before
    assert again["dataset_samples"] == first["dataset_samples"] == 12
    assert convert(str(src), str(out), progress=False)["converted"] == 0


def test_max_size_shrinks_and_keeps_original_size_and_filter_on_write(tmp_path):
    src = tmp_path / "f"
    src.mkdir()
    for i, (w, h) in enumerate([(400, 300), (60, 50)]):
        (src / f"{i}.png").write_bytes(image_bytes(w, h, seed=i, fmt="PNG"))
        (src / f"{i}.txt").write_text("c")
    convert(str(src), str(tmp_path / "mds"), max_size=64, progress=False)
    big, small = read_mds(tmp_path / "mds")
    shrunk = Image.open(io.BytesIO(big["image"]))
    assert shrunk.format == "JPEG" and shrunk.size == (85, 64)
    assert (big["original_width"], big["original_height"]) == (400, 300)
    assert small["image"] == image_bytes(60, 50, seed=1, fmt="PNG")  # small enough: stored as it came
    report = convert(str(src), str(tmp_path / "mds2"), filters=parse_filters(["original_width>=200"]), progress=False)
    assert report["written"] == 1 and report["skipped"] == {"filtered": 1}


def test_brace_pattern_and_cli_one_command(tmp_path):
    src = tmp_path / "wds"
    img2dataset_dir(src, shards=3, n=2)
    pattern = str(src / "{00000..00001}.tar")
    assert data.main(["convert", pattern, str(tmp_path / "mds"), "--workers", "1", "--compression", "zstd"]) == 0
    assert len(read_mds(tmp_path / "mds")) == 4


BAD = [
    (["convert", "/no/such/src", "OUT"], "SRC '/no/such/src' does not exist"),
    (["convert", "/tmp/{0..1}.tar", "OUT"], "SRC '/tmp/{0..1}.tar': 2 of 2 files do not exist"),
    (["convert", ".", "OUT", "--filter", "pwatermark<<1"], "--filter 'pwatermark<<1' is not COLUMN OP NUMBER"),
    (["convert", ".", "OUT", "--workers", "0"], "argument --workers: expected a positive int, got '0'"),
    (["inspect", "/no/mds"], "SRC '/no/mds' is not an MDS dataset (no index.json)"),
    (["precompute", "/no/mds", "OUT", "--model_name", "sd-huge"], "--model_name: 'sd-huge' is neither a preset"),
]


@pytest.mark.parametrize("argv,message", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_arguments_are_one_line_exit_2(argv, message, capsys):
    from diffusion.cli import run as run_cli

    assert run_cli("data.py", data.main, argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("data.py: error: ") and message in err[0], err
