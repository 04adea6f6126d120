"""Datasets in object storage, against a real S3 server (SeaweedFS, conftest.s3): data.py convert to an s3 URL
(resumable), inspect and bench on it (bench's download rate apart from decoding), and what a store that is
down, a missing bucket, wrong credentials or a shard object cut short look like (one line, exit 2)."""

import json
import re
import sys
import time

import pytest
from conftest import REPO, img2dataset_dir, run, run_or_kill

import data
from diffusion.cli import run as run_main
from diffusion.data.convert import convert


def _one_line(capsys, prog: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith(f"{prog}: error: "), err
    return err[-1]


@pytest.fixture
def remote_mds(s3, tmp_path):
    """16 samples converted from 2 img2dataset tars into s3://BUCKET/mds."""
    img2dataset_dir(tmp_path / "wds", shards=2, n=8)
    url = f"s3://{s3.bucket}/mds"
    convert(str(tmp_path / "wds"), url, workers=1, progress=False)
    return url


def test_convert_to_s3_resumes_like_a_local_one(s3, tmp_path, capsys):
    img2dataset_dir(tmp_path / "wds", shards=3, n=4)
    url = f"s3://{s3.bucket}/mds"
    assert run_main("data.py", data.main, ["convert", str(tmp_path / "wds"), url, "--workers", "2"]) == 0
    assert "12 samples from 3 webdataset input shards written to " + url in capsys.readouterr().out
    client = s3.client()
    names = {o["Key"] for o in client.list_objects_v2(Bucket=s3.bucket)["Contents"]}
    assert {"mds/index.json", "mds/00000/index.json", "mds/00001/shard.00000.mds"} <= names
    client.delete_object(Bucket=s3.bucket, Key="mds/00001/index.json")  # as if killed while writing that part
    client.put_object(Bucket=s3.bucket, Key="mds/00001/shard.00000.mds", Body=b"half a shard")
    again = convert(str(tmp_path / "wds"), url, progress=False)
    assert (again["already_done"], again["converted"], again["written"], again["dataset_samples"]) == (2, 1, 4, 12)
    assert convert(str(tmp_path / "wds"), url, progress=False)["converted"] == 0


def test_convert_to_s3_refuses_a_second_source_and_a_folder_of_other_objects(remote_mds, s3, tmp_path, capsys):
    """OUT in a bucket belongs to one conversion as a local one does (its .convert.json is an object there)."""
    img2dataset_dir(tmp_path / "other", shards=1, n=2)
    index = s3.client().get_object(Bucket=s3.bucket, Key="mds/index.json")["Body"].read()
    assert run_main("data.py", data.main, ["convert", str(tmp_path / "other"), remote_mds, "--workers", "1"]) == 2
    line = _one_line(capsys, "data.py")
    assert f"OUT '{remote_mds}' holds the conversion of '{tmp_path / 'wds'}' (webdataset, 16 samples" in line
    assert s3.client().get_object(Bucket=s3.bucket, Key="mds/index.json")["Body"].read() == index
    s3.client().put_object(Bucket=s3.bucket, Key="photos/holiday.jpg", Body=b"the user's own photo")
    url = f"s3://{s3.bucket}/photos"
    assert run_main("data.py", data.main, ["convert", str(tmp_path / "other"), url, "--workers", "1"]) == 2
    assert f"OUT '{url}' is not empty (it holds holiday.jpg)" in _one_line(capsys, "data.py")


def test_convert_to_s3_killed_midway_resumes(s3, tmp_path):
    """SIGKILLed once the second part is in the bucket, the same command converts only what is left."""
    img2dataset_dir(tmp_path / "wds", shards=12, n=4)
    url = f"s3://{s3.bucket}/mds"
    cmd = [sys.executable, str(REPO / "data.py"), "convert", str(tmp_path / "wds"), url, "--workers", "1"]
    client = s3.client()
    run_or_kill(cmd, tmp_path, kill_when=lambda: "Contents" in client.list_objects_v2(Bucket=s3.bucket, Prefix="mds/00001/index.json"))  # fmt: skip
    again = run(cmd, tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    done = int(re.search(r"\((\d+) shards already converted", again.stdout)[1])
    assert 2 <= done < 12 and "the dataset has 48 samples" in again.stdout


def test_inspect_and_bench_read_an_s3_dataset(remote_mds, tmp_path, capsys):
    assert run_main("data.py", data.main, ["inspect", remote_mds, "--grid", str(tmp_path / "g.png"), "--n", "4"]) == 0
    out = capsys.readouterr().out
    assert f"{remote_mds}: 16 samples in 2 shards" in out and (tmp_path / "g.png").is_file()
    results = tmp_path / "bench.jsonl"
    argv = ["bench", remote_mds, "--local", str(tmp_path / "cache"), "--image_size", "32", "--batch_size", "4"]
    argv += ["--batches", "3", "--warmup", "1", "--num_workers", "0", "--results", str(results)]
    assert run_main("data.py", data.main, argv) == 0
    out = capsys.readouterr().out
    assert "bench: downloaded 2 shards, " in out and "MiB/s" in out and "the decoding rates below read" in out
    row = json.loads(results.read_text().splitlines()[0])
    assert row["download_mib_per_sec"] > 0 and row["samples_per_sec"] > 0
    assert run_main("data.py", data.main, argv) == 0  # the cache is warm now: nothing to download, nothing reported
    assert "bench: downloaded" not in capsys.readouterr().out


BROKEN = {
    "down": (
        "S3_ENDPOINT_URL",
        "http://127.0.0.1:9",
        "cannot reach the object store at http://127.0.0.1:9; check S3_ENDPOINT_URL and that the store is up",
    ),  # fmt: skip
    "bucket": (None, None, "bucket 'no-such-bucket' does not exist at http://127.0.0.1:"),
    "credentials": ("AWS_SECRET_ACCESS_KEY", "wrong", "access denied by http://127.0.0.1:"),
}


@pytest.mark.parametrize("fault", list(BROKEN))
@pytest.mark.parametrize("command", ["convert", "precompute", "inspect", "bucket", "bench"])
def test_a_store_that_does_not_answer_is_one_line_and_exit_2(fault, command, s3, tmp_path, monkeypatch, capsys):
    env, value, message = BROKEN[fault]
    if env:
        monkeypatch.setenv(env, value)
    bucket = "no-such-bucket" if fault == "bucket" else s3.bucket
    url = f"s3://{bucket}/mds"
    argv, key = {
        "convert": (["convert", str(tmp_path), url], "OUT"),
        "precompute": (["precompute", str(tmp_path), url, "--model_name", "sd-tiny"], "OUT"),
        "inspect": (["inspect", url], "SRC"),
        "bucket": (["bucket", url, str(tmp_path / "buckets")], "SRC"),
        "bench": (["bench", url], "DIR"),
    }[command]
    start = time.monotonic()
    assert run_main("data.py", data.main, argv) == 2
    line = _one_line(capsys, "data.py")
    assert time.monotonic() - start < 20
    assert line.startswith(f"data.py: error: {key} {url}: {message}"), line
