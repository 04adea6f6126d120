"""Checkpoints in object storage, against a real S3 server (SeaweedFS, conftest.s3): save_folder=s3://... with
autoresume continues from the newest whole checkpoint (a cut or missing object skipped in one line, a killed
run resumed bitwise), the pointer never names an object that is not whole (the server crashed in the middle of
an upload), a store that comes back within the retry budget costs nothing, training goes on while a checkpoint
uploads and a failed upload stops every rank at the next batch end, load_path and the tools take s3
checkpoints, local scratch is left empty, and two FSDP ranks killed resume their sharded checkpoint from the bucket
bitwise (diffusion/checkpointing/remote.py; docs/reliability.md)."""

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from composer.core import Callback
from composer.utils.object_store import S3ObjectStore
from conftest import (
    REPO,
    Job,
    assert_same_weights,
    composer_launcher,
    download_folder,
    final_state,
    run,
    run_or_kill,
    sharded_state,
)

import export
import generate
import train
from diffusion.checkpointing import remote as remote_checkpoints
from diffusion.checkpointing.local import check_checkpoint
from diffusion.errors import UsageError

BATCHES = 4
TINY = [str(REPO / "yamls/sd-tiny-cpu.yaml"), "eval_interval=null", "num_workers=0", "batch_size=4"]
TINY += ["progress=lines", "save_interval=1ba", "save_num_checkpoints_to_keep=-1", "autoresume=true"]


def _args(folder, batches: int = BATCHES) -> list[str]:
    return [*TINY, f"save_folder={folder}", f"max_duration={batches}ba"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run, in a local folder: ep0-ba1-rank0.pt ... ep0-ba4-rank0.pt."""
    folder = tmp_path_factory.mktemp("reference") / "ck"
    assert train.main(_args(folder)) == 0
    return folder


def _pointer(s3, run: str = "run") -> str:
    return s3.client().get_object(Bucket=s3.bucket, Key=f"{run}/latest-rank0.pt.symlink")["Body"].read().decode()


def _fetch(s3, key: str, tmp_path):
    local = tmp_path / key.replace("/", "-")
    s3.client().download_file(s3.bucket, key, str(local))
    return local


def _same_as_reference(s3, reference, tmp_path, name: str = f"ep0-ba{BATCHES}-rank0.pt") -> None:
    local = _fetch(s3, f"run/{name}", tmp_path)
    assert_same_weights(final_state(reference, name), final_state(local.parent, local.name))


def _one_line(capsys, prog: str) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert err and err[-1].startswith(f"{prog}: error: "), err
    return err[-1]


def test_autoresume_skips_a_cut_checkpoint_object_and_ends_bitwise_and_scratch_is_empty(s3, reference, tmp_path, capsys):  # fmt: skip
    url = f"s3://{s3.bucket}/run"
    capsys.readouterr()
    assert train.main(_args(url, 2)) == 0
    assert f"autoresume: no checkpoint in {url} yet, starting from batch 0\n" in capsys.readouterr().err
    assert _pointer(s3) == "run/ep0-ba2-rank0.pt"
    # this run's scratch (other tests' runs in this process, e.g. one whose upload failed, keep their own)
    assert not list(Path(remote_checkpoints._scratch[url]).rglob("*.pt"))
    whole = _fetch(s3, "run/ep0-ba2-rank0.pt", tmp_path).read_bytes()
    s3.client().put_object(Bucket=s3.bucket, Key="run/ep0-ba2-rank0.pt", Body=whole[:1000])  # cut short
    capsys.readouterr()
    assert train.main(_args(url)) == 0
    err = capsys.readouterr().err
    assert (
        f"autoresume: skipped {url}/ep0-ba2-rank0.pt: truncated or not a torch file: 1,000 bytes, not a zip archive "
        f"(torch.save's format); resuming from {url}/ep0-ba1-rank0.pt"
    ) in err
    said = re.search(rf"^autoresume: resuming from {url}/ep0-ba1-rank0\.pt \(batch 1 of {BATCHES}, saved [-\d]+ [:\d]+ UTC\)$", err, re.M)  # fmt: skip
    assert said, err
    assert _pointer(s3) == f"run/ep0-ba{BATCHES}-rank0.pt"
    _same_as_reference(s3, reference, tmp_path)


def test_a_missing_pointer_target_is_skipped(s3, reference, tmp_path, capsys):
    url = f"s3://{s3.bucket}/run"
    for i in (1, 2):
        s3.client().upload_file(str(reference / f"ep0-ba{i}-rank0.pt"), s3.bucket, f"run/ep0-ba{i}-rank0.pt")
    s3.client().put_object(Bucket=s3.bucket, Key="run/latest-rank0.pt.symlink", Body=b"run/ep0-ba3-rank0.pt")
    local = remote_checkpoints.remote_resume_point(url)
    assert local.endswith("ep0-ba2-rank0.pt") and check_checkpoint(local) is None
    assert f"skipped {url}/ep0-ba3-rank0.pt: cannot be read (no such object); resuming from {url}/ep0-ba2-rank0.pt" in capsys.readouterr().err  # fmt: skip
    assert _pointer(s3) == "run/ep0-ba2-rank0.pt"


def test_a_killed_run_continues_from_the_bucket_bitwise(s3, reference, tmp_path):
    url = f"s3://{s3.bucket}/run"
    cmd = [sys.executable, str(REPO / "train.py"), *_args(url)]
    client = s3.client()

    def uploaded() -> bool:
        return "Contents" in client.list_objects_v2(Bucket=s3.bucket, Prefix="run/ep0-ba2-rank0.pt")

    run_or_kill(cmd, tmp_path, kill_when=uploaded)
    assert _pointer(s3) in ("run/ep0-ba1-rank0.pt", "run/ep0-ba2-rank0.pt")
    client.delete_object(Bucket=s3.bucket, Key="run/ep0-ba1-rank0.pt")  # a run that started over would write it
    again = run(cmd, tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "Contents" not in client.list_objects_v2(Bucket=s3.bucket, Prefix="run/ep0-ba1-rank0.pt"), "started over"
    _same_as_reference(s3, reference, tmp_path)


def _crash_during_upload(monkeypatch, s3, name: str, restart_after: float | None = None):
    """Kill the server (SIGKILL) once the first bytes of the object ``name`` are sent; with ``restart_after``,
    start it again that many seconds later."""
    real, done = S3ObjectStore.upload_object, []

    def upload_object(self, object_name, filename, callback=None, **kwargs):
        if not object_name.endswith(name) or done:
            return real(self, object_name, filename, callback=callback, **kwargs)

        def sent(got, total):
            if not done:
                done.append(got)
                s3.stop()
                if restart_after is not None:
                    threading.Timer(restart_after, s3.start).start()

        return real(self, object_name, filename, callback=sent, **kwargs)

    monkeypatch.setattr(S3ObjectStore, "upload_object", upload_object)
    return done


class _Batches(Callback):
    """A probe among the run's callbacks: the batches that ended, in order; at the end of batch ``hold_at``
    it waits (at most 30 s) until ``until()`` holds, and records whether it did."""

    def __init__(self, hold_at: int | None = None, until=None):
        self.ended, self.hold_at, self.until, self.held = [], hold_at, until, None

    def batch_end(self, state, logger):
        self.ended.append(state.timestamp.batch.value)
        if self.ended[-1] == self.hold_at:
            deadline = time.monotonic() + 30
            while not self.until() and time.monotonic() < deadline:
                time.sleep(0.05)
            self.held = self.until()


def _probe(monkeypatch, **kwargs) -> _Batches:
    import diffusion.trainer

    probe, real = _Batches(**kwargs), diffusion.trainer.callbacks
    monkeypatch.setattr(diffusion.trainer, "callbacks", lambda *a, **k: [probe, *real(*a, **k)])
    return probe


def _uploading() -> bool:
    return any(t.name.startswith("upload ") for t in threading.enumerate())


def test_training_goes_on_while_a_checkpoint_uploads_and_the_pointer_moves_after_it(s3, reference, tmp_path, monkeypatch):  # fmt: skip
    """The upload of ep0-ba2 is held until batch 3 has ended: batch 3 trains meanwhile (a save that waited for
    its upload would wait here in vain); the pointer names ep0-ba2 only once it is whole, before ep0-ba4 goes
    up (the next save waited for it), and the run ends bitwise as the reference with its scratch empty."""
    url, real, seen, released = f"s3://{s3.bucket}/run", S3ObjectStore.upload_object, {}, threading.Event()

    def upload_object(self, object_name, filename, callback=None, **kwargs):
        if object_name.endswith("-rank0.pt"):  # a checkpoint, not the pointer: what the bucket names then
            seen[object_name] = _pointer_or_none(s3)
        if object_name.endswith("ep0-ba2-rank0.pt"):
            seen["released while training"] = released.wait(30)
        return real(self, object_name, filename, callback=callback, **kwargs)

    probe = _probe(monkeypatch, hold_at=3, until=lambda: released.set() or True)
    monkeypatch.setattr(S3ObjectStore, "upload_object", upload_object)
    assert train.main([*_args(url), "save_interval=2ba"]) == 0
    assert probe.ended == [1, 2, 3, 4]
    assert seen == {
        "run/ep0-ba2-rank0.pt": None,
        "released while training": True,
        "run/ep0-ba4-rank0.pt": "run/ep0-ba2-rank0.pt",
    }
    assert _pointer(s3) == "run/ep0-ba4-rank0.pt"
    assert not list(Path(remote_checkpoints._scratch[url]).rglob("*.pt"))
    _same_as_reference(s3, reference, tmp_path)


def _pointer_or_none(s3) -> str | None:
    try:
        return _pointer(s3)
    except s3.client().exceptions.NoSuchKey:
        return None


def test_a_store_down_during_an_upload_keeps_the_pointer_on_a_whole_checkpoint(s3, reference, tmp_path, monkeypatch, capsys):  # fmt: skip
    """The store crashes while ep0-ba2 uploads: batch 3 trains meanwhile, and once the upload has given up the
    run stops at the next batch end (batch 4 never runs) with one line."""
    url = f"s3://{s3.bucket}/run"
    monkeypatch.setenv("OBJECT_STORE_RETRY_SECONDS", "3")
    crashed = _crash_during_upload(monkeypatch, s3, "ep0-ba2-rank0.pt")
    probe = _probe(monkeypatch, hold_at=3, until=lambda: not _uploading())
    assert train.main(_args(url)) == 2
    assert crashed and probe.held and probe.ended == [1, 2, 3]
    line = _one_line(capsys, "train.py")
    assert line == (
        f"train.py: error: could not upload checkpoint ep0-ba2-rank0.pt to {url}: cannot reach the object store "
        f"at {s3.endpoint}; check S3_ENDPOINT_URL and that the store is up and reachable from this host; the "
        "pointer still names run/ep0-ba1-rank0.pt, whole. Run the same command once the store answers to resume"
    )
    s3.start()
    assert _pointer(s3) == "run/ep0-ba1-rank0.pt"
    assert check_checkpoint(str(_fetch(s3, "run/ep0-ba1-rank0.pt", tmp_path))) is None
    monkeypatch.undo()
    for key, value in s3.env().items():
        monkeypatch.setenv(key, value)
    assert train.main(_args(url)) == 0  # the same command, once the store is back
    _same_as_reference(s3, reference, tmp_path)


def test_a_pointer_whose_answer_was_lost_names_either_whole_checkpoint(s3, reference, tmp_path, monkeypatch, capsys):  # fmt: skip
    """The store takes ep0-ba2's pointer and goes down before it answers (the way the 2-rank test once met it):
    the run's line names both checkpoints the pointer may name, both whole, and the same command resumes."""
    url = f"s3://{s3.bucket}/run"
    monkeypatch.setenv("OBJECT_STORE_RETRY_SECONDS", "2")
    real = remote_checkpoints.write_pointer

    def write_pointer(url, target, *latest):
        real(url, target, *latest)
        if target.endswith("ep0-ba2-rank0.pt"):
            s3.stop()
            real(url, target, *latest)  # the client's retry of the write whose answer was lost

    monkeypatch.setattr(remote_checkpoints, "write_pointer", write_pointer)
    assert train.main(_args(url)) == 2
    assert _one_line(capsys, "train.py") == (
        f"train.py: error: could not upload checkpoint ep0-ba2-rank0.pt to {url}: cannot reach the object store "
        f"at {s3.endpoint}; check S3_ENDPOINT_URL and that the store is up and reachable from this host; the "
        "pointer names run/ep0-ba1-rank0.pt or run/ep0-ba2-rank0.pt, both whole. Run the same command once the "
        "store answers to resume"
    )
    s3.start()
    assert _pointer(s3) == "run/ep0-ba2-rank0.pt"
    monkeypatch.undo()
    for key, value in s3.env().items():
        monkeypatch.setenv(key, value)
    assert train.main(_args(url)) == 0
    _same_as_reference(s3, reference, tmp_path)


@pytest.mark.slow
def test_two_ranks_stop_together_when_an_upload_fails(s3, tmp_path, monkeypatch):
    """2 ranks, the store stopped once the first checkpoint is in the bucket and pointed at: the upload under way
    gives up and both ranks stop at the same batch end (no rank left waiting in a collective), exit 2, rank 0
    with the one line, rank 1 pointing at it; the pointer names a whole checkpoint."""
    url = f"s3://{s3.bucket}/run"
    monkeypatch.setenv("OBJECT_STORE_RETRY_SECONDS", "2")
    cmd = [composer_launcher(), "-n", "2", str(REPO / "train.py"), *_args(url, 40)]
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH")))))  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    while _pointer_or_none(s3) is None and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    s3.stop()
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2, out[-3000:]
    errors = [line for line in out.splitlines() if line.startswith("train.py: error: ")]
    named = r"(run/ep0-ba\d+-rank0\.pt)"
    first = re.search(  # the store may stop while the pointer is written: then either name is whole
        rf"could not upload checkpoint ep0-ba(\d+)-rank0\.pt to {url}: cannot reach the object store at "
        rf"{s3.endpoint}; .*; the pointer (?:still names {named}, whole|names {named} or {named}, both whole|names "
        rf"{named}, whole, or the checkpoint this run resumed from, if any)\. Run the same command",
        "\n".join(errors),
    )
    assert first, out[-3000:]
    assert (
        f"train.py: error: rank 0 could not upload the checkpoint of batch {first[1]} to {url} (its line says why); "
        "run the same command once the store answers to resume"
    ) in errors, errors
    s3.start()
    assert _pointer(s3) in set(first.groups()[1:]) - {None}
    assert check_checkpoint(str(_fetch(s3, _pointer(s3), tmp_path))) is None


def test_a_store_back_within_the_retry_budget_costs_nothing(s3, reference, tmp_path, monkeypatch, capsys):
    url = f"s3://{s3.bucket}/run"
    crashed = _crash_during_upload(monkeypatch, s3, "ep0-ba2-rank0.pt", restart_after=1)
    assert train.main(_args(url)) == 0
    assert crashed and "cannot reach the object store" in capsys.readouterr().out  # the retries, announced
    assert _pointer(s3) == f"run/ep0-ba{BATCHES}-rank0.pt"
    _same_as_reference(s3, reference, tmp_path)


def test_load_path_export_and_generate_take_an_s3_checkpoint(s3, reference, tmp_path, capsys):
    s3.client().upload_file(str(reference / "ep0-ba2-rank0.pt"), s3.bucket, "ck/ep0-ba2-rank0.pt")
    good = f"s3://{s3.bucket}/ck/ep0-ba2-rank0.pt"
    args = [*TINY, "save_folder=null", "autoresume=false", "max_duration=1ba", "load_weights_only=true"]
    assert train.main([*args, f"load_path={good}"]) == 0
    assert export.main([good, str(tmp_path / "exported")]) == 0
    assert (tmp_path / "exported" / "model_index.json").is_file()
    assert generate.main([good, "--prompt", "a cube", "--steps", "2", "--out", str(tmp_path / "samples")]) == 0
    assert len(list((tmp_path / "samples").glob("*.png"))) == 2  # the image and grid.png
    whole = (reference / "ep0-ba2-rank0.pt").read_bytes()
    s3.client().put_object(Bucket=s3.bucket, Key="ck/cut.pt", Body=whole[:1000])
    capsys.readouterr()
    assert export.main([f"s3://{s3.bucket}/ck/cut.pt", str(tmp_path / "x")]) == 2
    assert _one_line(capsys, "export.py").startswith(
        f"export.py: error: checkpoint s3://{s3.bucket}/ck/cut.pt is truncated or not a torch file: 1,000 bytes"
    )
    assert train.main([*args, f"load_path=s3://{s3.bucket}/ck/nothing.pt"]) == 2
    assert _one_line(capsys, "train.py") == (
        f"train.py: error: load_path s3://{s3.bucket}/ck/nothing.pt does not exist; pass a checkpoint object "
        "(e.g. s3://BUCKET/RUN/ep0-ba100-rank0.pt)"
    )


BROKEN = {
    "down": (
        "S3_ENDPOINT_URL",
        "http://127.0.0.1:9",
        "cannot reach the object store at http://127.0.0.1:9; check S3_ENDPOINT_URL and that the store is up",
    ),  # fmt: skip
    "bucket": (None, None, "bucket 'no-such-bucket' does not exist at http://127.0.0.1:"),
    "credentials": ("AWS_ACCESS_KEY_ID", "nobody", "access denied by http://127.0.0.1:"),
}


@pytest.mark.parametrize("key", ["save_folder", "remote"])
@pytest.mark.parametrize("fault", list(BROKEN))
def test_a_store_that_does_not_answer_stops_train_before_any_model_is_built(fault, key, s3, monkeypatch, capsys):
    import diffusion.trainer

    env, value, message = BROKEN[fault]
    if env:
        monkeypatch.setenv(env, value)
    monkeypatch.setattr(diffusion.trainer, "build_model", lambda *a, **k: pytest.fail("a model was built"))
    url = f"s3://{'no-such-bucket' if fault == 'bucket' else s3.bucket}/x"
    data = ["use_synth_data=false", f"remote={url}", "autoresume=false"] if key == "remote" else []
    start = time.monotonic()
    assert train.main([*_args(url if key == "save_folder" else "null", 1), *data]) == 2
    assert time.monotonic() - start < 30
    line = _one_line(capsys, "train.py")
    assert line.startswith(f"train.py: error: {key} {url}: {message}"), line


def test_a_used_bucket_folder_is_refused_before_any_work_or_started_over_with_save_overwrite(
    s3, capsys, monkeypatch, tmp_path
):
    """A second run on a save_folder in the bucket: refused in one line before any model is built (it was refused
    only at its first save, after training); with save_overwrite it starts over, and the old run's objects go once
    the new run's first checkpoint and pointer are up."""
    import diffusion.trainer

    url = f"s3://{s3.bucket}/run"
    assert train.main([*_args(url, 3), "autoresume=false", "seed=1"]) == 0
    build = diffusion.trainer.build_model
    monkeypatch.setattr(diffusion.trainer, "build_model", lambda *a, **k: pytest.fail("a model was built"))
    capsys.readouterr()
    assert train.main([*_args(url, 2), "autoresume=false"]) == 2
    assert _one_line(capsys, "train.py") == (
        f"train.py: error: save_folder {url} already holds a run's checkpoints (newest ep0-ba3-rank0.pt and 2 older); "
        "to continue that run set autoresume=true, to start over there set save_overwrite=true (they are deleted "
        "once this run has saved a whole checkpoint), or give another save_folder"
    )
    monkeypatch.setattr(diffusion.trainer, "build_model", build)
    args = [*_args(url, 2), "autoresume=false", "save_overwrite=true", "save_interval=2ba", "seed=2"]
    assert train.main(args) == 0
    assert sorted(_keys(s3.client(), s3.bucket, "run/")) == ["run/ep0-ba2-rank0.pt", "run/latest-rank0.pt.symlink"]
    assert _pointer(s3) == "run/ep0-ba2-rank0.pt"
    s3.client().download_file(s3.bucket, "run/ep0-ba2-rank0.pt", str(tmp_path / "new.pt"))
    state = torch.load(tmp_path / "new.pt", map_location="cpu", weights_only=False)["state"]
    assert state["callbacks"]["RunConfig"]["config"]["seed"] == 2  # the new run's, not the old ep0-ba2


def test_save_num_checkpoints_to_keep_rotates_the_runs_objects(s3, tmp_path):
    assert train.main([*_args(f"s3://{s3.bucket}/run", 3), "save_num_checkpoints_to_keep=2"]) == 0
    names = sorted(o["Key"] for o in s3.client().list_objects_v2(Bucket=s3.bucket, Prefix="run/")["Contents"])
    assert names == ["run/ep0-ba2-rank0.pt", "run/ep0-ba3-rank0.pt", "run/latest-rank0.pt.symlink"]
    assert _pointer(s3) == "run/ep0-ba3-rank0.pt"


# fsdp=true, 2 ranks; a constant learning rate, so a run cut short and resumed with an end of its own follows
# the uninterrupted run to that end (the run that is cut short asks for many batches: uploads in the rank's threads
# keep up with the tiny model, and a short run ended before it could be cut)
SHARDED = [*TINY, "fsdp=true", "schedule=constant", "warmup=0ba"]
LONG = "max_duration=100000ba"


def _keys(client, bucket: str, prefix: str) -> list[str]:
    return [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])]


def _newest_whole(client, bucket: str, prefix: str) -> int:
    """The batch of the newest folder under ``prefix`` holding both ranks' shards and the metadata (0: none)."""
    keys = _keys(client, bucket, prefix)
    batches = {int(m[1]) for k in keys if (m := re.search(r"/ep\d+-ba(\d+)/", k))}
    whole = [b for b in batches if sum(f"-ba{b}/" in k and k.endswith(".distcp") for k in keys) == 2]
    return max((b for b in whole if any(k.endswith(f"-ba{b}/.metadata") for k in keys)), default=0)


def test_the_uploaders_threads_run_at_most_max_workers_jobs_and_shut_down_as_composer_asks():
    """remote_checkpoints._UploadThreads, the executor Composer's uploader gets: at most max_workers jobs at once,
    each result or error in its future; shutdown(cancel_futures=True) drops the jobs not yet started and
    shutdown(wait=True) returns once the running ones have ended; its threads never hold the process's exit."""
    pool = remote_checkpoints._UploadThreads(max_workers=2)
    gate, running, most = threading.Event(), [], []

    def job(i):
        running.append(i)
        most.append(len(running))
        gate.wait(10)
        running.remove(i)
        if i == 1:
            raise OSError("store down")
        return i

    futures = [pool.submit(job, i) for i in range(4)]
    deadline = time.monotonic() + 10
    while len(running) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    assert len(running) == 2 and max(most) == 2
    assert all(t.daemon for t in threading.enumerate() if t.name == "sharded checkpoint upload")
    pool.shutdown(wait=False, cancel_futures=True)
    gate.set()
    started = [f for f in futures if not f.cancelled()]
    assert len(started) == 2 and sum(f.cancelled() for f in futures) == 2
    pool.shutdown(wait=True)
    assert all(f.done() for f in started)
    assert {type(f.exception()) for f in started} <= {OSError, type(None)}


def test_keep_rotates_sharded_folders_in_the_bucket_behind_the_pointer(s3, tmp_path):
    """save_num_checkpoints_to_keep=2 for sharded folders in object storage (Composer's saver deleted none): the
    pointer's folder and the newest whole one before it stay; older ones go, a half-uploaded one among them; a
    folder newer than the pointer (still on its way up) is left."""
    import torch
    import torch.distributed.checkpoint as dcp

    client = s3.client()
    for batch in (1, 2, 3, 4, 5):
        folder = tmp_path / f"ep0-ba{batch}"
        dcp.save({"w": torch.arange(100.0) * batch}, storage_writer=dcp.FileSystemWriter(str(folder)), no_dist=True)
        if batch in (2, 5):  # killed mid-upload: a shard up, no .metadata
            (folder / ".metadata").unlink()
        for path in folder.iterdir():
            client.upload_file(str(path), s3.bucket, f"run/{folder.name}/{path.name}")
    url = f"s3://{s3.bucket}/run"
    remote_checkpoints.write_pointer(url, "run/ep0-ba4")
    assert remote_checkpoints.rotate_sharded(url, keep=2) == ["ep0-ba2", "ep0-ba1"]
    folders = {o["Key"].split("/")[1] for o in client.list_objects_v2(Bucket=s3.bucket, Prefix="run/")["Contents"]}
    assert folders == {"ep0-ba3", "ep0-ba4", "ep0-ba5", "latest-rank0.pt.symlink"}
    assert remote_checkpoints.rotate_sharded(url, keep=2) == []
    assert remote_checkpoints.rotate_sharded(url, keep=-1) == []


def test_a_sharded_pointer_behind_or_on_a_broken_folder_moves_to_the_newest_whole_one(s3, tmp_path, capsys):
    """The pointer trails a folder's last shard by a check: a run killed in between left it on an older folder
    (the 2-rank FSDP test below, under load, resumed from it). A pointer naming a folder that is not whole
    (removed or damaged in the bucket) made Composer fail with its traceback. Now both resume from the newest
    whole folder, the second with a line; with no whole folder at all, one line."""
    import torch
    import torch.distributed.checkpoint as dcp

    client = s3.client()
    for batch in (1, 2, 3):
        folder = tmp_path / f"ep0-ba{batch}"
        dcp.save({"w": torch.arange(10.0) * batch}, storage_writer=dcp.FileSystemWriter(str(folder)), no_dist=True)
        if batch == 3:  # on its way up: a shard, no .metadata
            (folder / ".metadata").unlink()
        for path in folder.iterdir():
            client.upload_file(str(path), s3.bucket, f"run/{folder.name}/{path.name}")
    url = f"s3://{s3.bucket}/run"
    remote_checkpoints.write_pointer(url, "run/ep0-ba1")
    assert remote_checkpoints.remote_resume_point(url) is None  # Composer's autoresume reads the pointer
    assert remote_checkpoints.read_pointer(url) == "run/ep0-ba2" and "skipped" not in capsys.readouterr().err
    for key in _keys(client, s3.bucket, "run/ep0-ba2/"):  # removed in the bucket
        if key.endswith(".metadata"):
            client.delete_object(Bucket=s3.bucket, Key=key)
    remote_checkpoints.remote_resume_point(url)
    assert remote_checkpoints.read_pointer(url) == "run/ep0-ba1"
    assert f"autoresume: skipped {url}/ep0-ba2: not whole in the bucket; resuming from {url}/ep0-ba1" in capsys.readouterr().err  # fmt: skip
    for key in _keys(client, s3.bucket, "run/ep0-ba1/"):
        client.delete_object(Bucket=s3.bucket, Key=key)
    with pytest.raises(UsageError, match=r"autoresume: no checkpoint in s3://.*/run loads \(the pointer names ep0-ba1, which is not whole, and no other sharded folder is\)"):  # fmt: skip
        remote_checkpoints.remote_resume_point(url)


def test_a_sharded_folder_of_the_same_name_is_set_aside_until_the_new_one_is_whole(s3, tmp_path):
    """save_overwrite into s3:// where the old run's sharded folder has the name of the new run's save. Composer's
    uploader wrote the new objects over the old ones one by one, rank 0's .metadata among the first: a folder of the
    new .metadata beside an old shard passes the check (same names and sizes) and loads as neither run, so a kill
    in between left a 'whole' mix. Now the old folder leaves the name before any rank uploads (copied aside within
    the store, then deleted) and its copy goes once the new folder is whole; a torn leftover is just deleted."""
    import torch.distributed.checkpoint as dcp

    client, url = s3.client(), f"s3://{s3.bucket}/run"

    def folder(name: str, scale: float, metadata: bool = True, shard: bool = True) -> None:
        local = tmp_path / f"{name}-{scale}"
        dcp.save({"w": torch.arange(100.0) * scale}, storage_writer=dcp.FileSystemWriter(str(local)), no_dist=True)
        for path in local.iterdir():
            if (path.name == ".metadata" and metadata) or (path.name != ".metadata" and shard):
                client.upload_file(str(path), s3.bucket, f"run/{name}/{path.name}")

    def loads(name: str) -> float:
        got = download_folder(s3, f"run/{name}/", tmp_path / f"got-{time.monotonic_ns()}")
        state = {"w": torch.zeros(100)}
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(got)), no_dist=True)
        return float(state["w"][1])

    folder("ep0-ba2", 1.0)  # the old run's, whole
    folder("ep0-ba2", 2.0, shard=False)  # what the uploader did first: the new .metadata over the old folder
    assert remote_checkpoints._whole_sharded(url, "ep0-ba2", remote_checkpoints.object_store.sizes(url))  # passes
    assert loads("ep0-ba2") == 1.0  # yet holds the old run's weights under the new run's metadata

    folder("ep0-ba3", 1.0)  # whole
    folder("ep0-ba4", 1.0, metadata=False)  # torn
    assert remote_checkpoints.set_aside(url, "ep0-ba3") is True
    assert remote_checkpoints.set_aside(url, "ep0-ba4") is False
    keys = _keys(client, s3.bucket, "run/")
    assert not [k for k in keys if k.startswith(("run/ep0-ba3/", "run/ep0-ba4/"))], keys
    assert loads(".partial-ep0-ba3") == 1.0 and not [k for k in keys if "partial-ep0-ba4" in k], keys
    assert remote_checkpoints.checkpoints_at(url) == ["ep0-ba2"]  # a set-aside copy is no checkpoint

    folder("ep0-ba3", 3.0, shard=False)  # the new folder on its way up: the copy stays
    assert remote_checkpoints.drop_set_aside(url, {"ep0-ba3"}) == {"ep0-ba3"}
    assert loads(".partial-ep0-ba3") == 1.0
    folder("ep0-ba3", 3.0)  # whole: the copy goes
    assert remote_checkpoints.drop_set_aside(url, {"ep0-ba3"}) == set()
    assert not [k for k in _keys(client, s3.bucket, "run/") if "partial" in k] and loads("ep0-ba3") == 3.0


@pytest.mark.slow
def test_save_overwrite_of_sharded_folders_in_the_bucket_sets_the_old_ones_aside_until_each_new_one_is_whole(
    s3, tmp_path
):
    """Two FSDP ranks, save_folder=s3://..., a run of 2 batches, then another with save_overwrite=true and another
    seed saving at the same batches: each old folder is set aside before the new one is written into its name (a
    line says so), no copy is left at the end, and the bucket holds the new run's weights."""
    launch = [composer_launcher(), "-n", "2", str(REPO / "train.py"), *SHARDED, "max_duration=2ba"]
    url, client = f"s3://{s3.bucket}/over", s3.client()
    first = run([*launch, f"save_folder={url}", "seed=1"], tmp_path, timeout=600)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    old = sharded_state(download_folder(s3, "over/ep0-ba2/", tmp_path / "old"))
    again = run([*launch, f"save_folder={url}", "seed=2", "autoresume=false", "save_overwrite=true"], tmp_path, 600)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]

    def set_aside(name: str) -> bool:
        return f"checkpoint: {url}/{name} held an earlier run's whole checkpoint: set aside as .partial-{name}" in (
            again.stderr
        )

    # ep0-ba1 is saved while the old run's folders are all there. ep0-ba2 is set aside the same way, unless the
    # upload of the new ep0-ba1 was whole before batch 2's save: then save_overwrite deleted the old ep0-ba2 first
    # (CI's run of 2026-12-03): both keep a whole checkpoint in the bucket at every moment
    deleted_first = f"deleted the previous run's 1 (ep0-ba2) from {url}"
    assert set_aside("ep0-ba1"), again.stderr[-3000:]
    assert set_aside("ep0-ba2") != (deleted_first in again.stderr), again.stderr[-3000:]
    keys = _keys(client, s3.bucket, "over/")
    assert not [k for k in keys if "partial" in k], keys
    new = sharded_state(download_folder(s3, "over/ep0-ba2/", tmp_path / "new"))
    assert new["batch"] == 2 and any(not torch.equal(new["model"][k], old["model"][k]) for k in old["model"])


@pytest.mark.slow
def test_two_fsdp_ranks_killed_resume_their_sharded_checkpoint_from_the_bucket_bitwise(s3, tmp_path):
    """fsdp=true, 2 ranks, save_folder=s3://...: every rank's shard of each checkpoint goes to the bucket; the
    run killed (the whole process group) once batch 2's folder is there resumes from the bucket's newest whole folder
    and ends, 3 batches later, bitwise with the weights and EMA of an uninterrupted local run. Composer's saver
    uploads the pointer to a sharded folder only after a check that a killed run may not reach: the restart finds
    the newest whole folder itself (remote_checkpoints._newest_whole_sharded); before, it began again at batch 0."""
    launch = [composer_launcher(), "-n", "2", str(REPO / "train.py"), *SHARDED]
    url, client = f"s3://{s3.bucket}/fsdp", s3.client()

    def keys(prefix: str) -> list[str]:
        return _keys(client, s3.bucket, prefix)

    killed, finished = tmp_path / "tmp-killed", tmp_path / "tmp-finished"  # the ranks' temp dirs (TMPDIR)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TMPDIR", str(killed.resolve()))
        killed.mkdir()
        whole = lambda: _newest_whole(client, s3.bucket, "fsdp/") >= 2  # noqa: E731
        run_or_kill([*launch, LONG, f"save_folder={url}"], tmp_path, kill_when=whole)
    stop = _newest_whole(client, s3.bucket, "fsdp/")
    # Composer's saver kept every checkpoint it had uploaded in each rank's temp dir: now at most the one being saved
    copies = sorted(str(p.relative_to(killed)) for p in killed.rglob("ep*-ba*") if p.is_dir())
    assert len(copies) <= 2, copies
    end = stop + 3
    for key in keys("fsdp/ep0-ba1/"):  # a run that started over would write them again
        client.delete_object(Bucket=s3.bucket, Key=key)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TMPDIR", str(finished.resolve()))
        finished.mkdir()
        again = run(
            [*launch, f"max_duration={end}ba", f"save_folder={url}", "save_num_checkpoints_to_keep=2"],
            tmp_path,
            timeout=600,
        )
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
    left = sorted(finished.rglob("*"))
    assert not left, f"left in the ranks' temp dir: {left}\n{again.stdout[-2000:]}{again.stderr[-3000:]}"
    folders = {int(k.split("-ba")[1].split("/")[0]) for k in keys("fsdp/ep")}
    assert {b for b in folders if b <= end} == {end - 1, end}, folders  # the rest rotated out of the bucket
    assert f"autoresume: resuming from {url}/ep0-ba{stop} " in again.stderr, again.stderr[-3000:]
    assert not keys("fsdp/ep0-ba1/"), "the resumed run started over"
    straight = run([*launch, f"max_duration={end}ba", f"save_folder={tmp_path / 'straight'}"], tmp_path, timeout=600)
    assert straight.returncode == 0, straight.stdout[-2000:] + straight.stderr[-3000:]
    got = download_folder(s3, f"fsdp/ep0-ba{end}/", tmp_path / "got")
    assert_same_weights(sharded_state(tmp_path / "straight" / f"ep0-ba{end}"), sharded_state(got), end)


@pytest.mark.slow
def test_the_store_down_during_a_sharded_upload_ends_the_run_in_one_line_and_the_same_command_resumes(s3, tmp_path):
    """fsdp=true, 2 ranks, save_folder=s3://...: the store is killed once the first shard of batch 2's folder is up
    and stays down. Composer's uploader gives up: the run ends with exit 2 and one line a rank (no traceback; before,
    botocore's traceback from the uploader's process, and the rank then never exited: its exit joined the idle
    upload workers Composer shuts only after a success). The store back, the same command finishes, resuming from
    a whole folder if one was up."""
    url = f"s3://{s3.bucket}/fsdp"
    launch = [composer_launcher(), "-n", "2", str(REPO / "train.py"), *SHARDED, f"save_folder={url}"]
    client = s3.client()

    def keys(prefix: str) -> list[str]:
        return _keys(client, s3.bucket, prefix)

    with Job([*launch, LONG], tmp_path) as job:
        job.wait_until(lambda: any(k.endswith(".distcp") for k in keys("fsdp/ep0-ba2/")))
        s3.stop()
        seconds = job.seconds_to_end(timeout=120)
    text, proc = job.text(), job.proc
    assert proc.returncode != 0 and seconds < 60, (proc.returncode, seconds, text[-3000:])
    line = f"train.py: error: could not upload a shard of a sharded checkpoint to {url}: cannot reach the object store"
    assert line in text and "Traceback" not in text, text[-3000:]
    s3.start()
    end = _newest_whole(client, s3.bucket, "fsdp/") + 2
    again = run([*launch, f"max_duration={end}ba"], tmp_path, timeout=600)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
    resumed = re.search(rf"autoresume: resuming from {re.escape(url)}/(ep\d+-ba\d+) ", again.stderr)
    assert resumed or "autoresume: no checkpoint in" in again.stderr, again.stderr[-3000:]
    assert any(k.endswith(".metadata") for k in keys(f"fsdp/ep0-ba{end}/"))
