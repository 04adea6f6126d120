"""Training on shards in object storage, against a real S3 server (SeaweedFS, conftest.s3): remote= and
eval_remote= stream into local caches; a shard object cut short in the bucket is one line; a store
that stops while shards stream costs nothing if it is back within the retry budget, one line if not;
precompute from and to the bucket on 2 ranks, and benchmark.py --remote on its output."""

import pytest
from conftest import REPO, composer, upload_folder, write_mds_images

import benchmark
import train

TINY = [str(REPO / "yamls/sd-tiny-cpu.yaml"), "num_workers=0", "batch_size=4", "autoresume=false", "progress=lines"]


def _one_line(capsys, prog: str) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert err and err[-1].startswith(f"{prog}: error: "), err
    return err[-1]


def test_train_and_validate_on_remote_shards(s3, mds_images, tmp_path):
    url = upload_folder(s3, mds_images, "mds")
    args = [*TINY, "use_synth_data=false", f"remote={url}", f"local={tmp_path / 'cache'}", "max_duration=2ba"]
    args += [f"eval_remote={url}", f"eval_local={tmp_path / 'eval-cache'}", "eval_interval=2ba", "save_folder=null"]
    assert train.main(args) == 0
    assert (tmp_path / "cache" / "index.json").is_file() and list((tmp_path / "eval-cache").glob("shard.*.mds"))


def test_a_shard_object_cut_short_is_one_line_before_training(s3, mds_images, tmp_path, capsys):
    url = upload_folder(s3, mds_images, "mds")
    s3.client().put_object(Bucket=s3.bucket, Key="mds/shard.00000.mds", Body=b"cut" * 100)
    args = [*TINY, "use_synth_data=false", f"remote={url}", f"local={tmp_path / 'cache'}", "max_duration=1ba"]
    assert train.main([*args, "eval_interval=null", "save_folder=null"]) == 2
    line = _one_line(capsys, "train.py")
    assert f"shard object {url}/shard.00000.mds is 300 bytes, its index.json says " in line, line


@pytest.fixture(scope="module")
def many_shards(tmp_path_factory):
    """32 image-caption samples in 16 shards of 2: downloads go on while the epoch runs."""
    return write_mds_images(tmp_path_factory.mktemp("mds") / "many", size=(48, 48), size_limit=1 << 13)


def _stop_once_opened(monkeypatch, s3, restart_after=None):
    """Stop the server right after the training dataset is opened (its index read, no shard downloaded);
    with ``restart_after``, start it again that many seconds later."""
    import threading

    from diffusion.data.streaming import _MDSDataset

    real, done = _MDSDataset.__init__, []

    def opened(self, **kwargs):
        real(self, **kwargs)
        if not done:
            done.append(True)
            s3.stop()
            if restart_after is not None:
                threading.Timer(restart_after, s3.start).start()

    monkeypatch.setattr(_MDSDataset, "__init__", opened)
    return done


@pytest.mark.parametrize("back", [True, False], ids=["back-within-budget", "stays-down"])
def test_a_store_down_while_shards_stream(back, s3, many_shards, tmp_path, monkeypatch, capsys):
    url = upload_folder(s3, many_shards, "mds")
    monkeypatch.setenv("OBJECT_STORE_RETRY_SECONDS", "60" if back else "2")
    stopped = _stop_once_opened(monkeypatch, s3, restart_after=1 if back else None)
    args = [*TINY, "use_synth_data=false", f"remote={url}", f"local={tmp_path / 'cache'}", "max_duration=3ba"]
    workers = "num_workers=0" if back else "num_workers=1"  # stays down: the error is raised in a loader worker
    rc = train.main([*args, "eval_interval=null", "save_folder=null", "image_size=32", workers])
    assert stopped
    if back:
        assert rc == 0
    else:
        assert rc == 2
        line = _one_line(capsys, "train.py")
        assert line.startswith(f"train.py: error: remote {url}: a shard download failed: cannot reach the object store at {s3.endpoint}"), line  # fmt: skip


@pytest.mark.slow
def test_two_ranks_precompute_s3_to_s3_then_benchmark_streams_the_latents(s3, mds_images, tmp_path):
    """data.py precompute from and to the bucket on 2 ranks (each writes its parts there, rank 0 merges the
    index in the bucket), then benchmark.py --remote on the result."""
    url = upload_folder(s3, mds_images, "mds")
    lat = f"s3://{s3.bucket}/latents"
    argv = ["precompute", url, lat, "--model_name", "sd-tiny", "--image_size", "64", "--num_workers", "0"]
    proc = composer(2, "data.py", *argv, "--part_size", "8", "--batch_size", "4", "--local", str(tmp_path / "c"), cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "precompute: 32 samples encoded with sd-tiny at 64 px into " + lat in proc.stdout
    parts = {o["Key"].split("/")[1] for o in s3.client().list_objects_v2(Bucket=s3.bucket, Prefix="latents/")["Contents"]}  # fmt: skip
    assert {"part-00000", "part-00003", "index.json"} <= parts
    common = ["--model_name", "sd-tiny", "--batch_size", "4", "--max_duration", "2ba", "--num_workers", "0"]
    common += ["--image_size", "64", "--results", str(tmp_path / "r.jsonl")]
    assert benchmark.main(["--remote", lat, "--local", str(tmp_path / "lc"), "--precomputed_latents", *common]) == 0
