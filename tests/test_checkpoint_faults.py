"""What clusters do to a run's checkpoints: torn files, kills in the middle of a save, a full disk
(diffusion/checkpointing/local.py; the table of faults is docs/reliability.md)."""

import argparse
import errno
import os
import shutil
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import FAST, REPO, assert_same_weights, composer, final_state

import train
from diffusion.checkpointing.local import check_checkpoint, local_resume_point

RECIPE = str(REPO / "yamls/sd-tiny-cpu.yaml")


def _args(folder: Path, duration: str, every: str = "4ba") -> list[str]:
    return [
        RECIPE,
        *FAST,
        "batch_size=4",
        f"max_duration={duration}",
        f"save_folder={folder}",
        f"save_interval={every}",
        "save_num_checkpoints_to_keep=-1",
    ]


def _latest(folder: Path) -> Path:
    return folder / os.readlink(folder / "latest-rank0.pt")


def _assert_all_whole(folder: Path) -> None:
    """`latest` names a whole file and no file under a checkpoint's name is torn."""
    assert (folder / "latest-rank0.pt").exists(), "latest-rank0.pt is gone"
    for path in [folder / "latest-rank0.pt", *folder.glob("ep*-ba*-rank0.pt")]:
        assert check_checkpoint(str(path)) is None, f"{path.name} is torn"
        torch.load(path, map_location="cpu", weights_only=False)  # the full read, not only the quick check


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """12 batches in one go, a checkpoint every 4."""
    folder = tmp_path_factory.mktemp("full") / "ck"
    assert train.main(_args(folder, "12ba")) == 0
    return folder


def test_check_tells_whole_checkpoints_from_torn_ones(tmp_path):
    good = tmp_path / "good.pt"
    torch.save({"state": {"model": {"w": torch.arange(10000.0)}}}, good)
    assert check_checkpoint(str(good)) is None
    cut = tmp_path / "cut.pt"
    cut.write_bytes(good.read_bytes()[:1000])
    assert check_checkpoint(str(cut)) == (
        "truncated or not a torch file: 1,000 bytes, not a zip archive (torch.save's format)"
    )
    (tmp_path / "empty.pt").write_bytes(b"")
    assert check_checkpoint(str(tmp_path / "empty.pt")) == "zero bytes"
    with zipfile.ZipFile(tmp_path / "zip.pt", "w") as z:  # a whole zip, but not a torch file
        z.writestr("hello.txt", "hi")
    assert "does not load" in check_checkpoint(str(tmp_path / "zip.pt"))
    torch.save({"model": {}}, tmp_path / "other.pt")
    assert "not a Composer checkpoint" in check_checkpoint(str(tmp_path / "other.pt"))
    torch.save({"state": {}, "odd": argparse.Namespace()}, tmp_path / "foreign.pt")  # no checkpoint of ours has it
    assert check_checkpoint(str(tmp_path / "foreign.pt")).startswith("holds a type no checkpoint of this project")
    assert check_checkpoint(str(tmp_path / "foreign.pt"), trust=True) is None


def test_check_sharded_checkpoint_folders(tmp_path):
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "ep0-ba4"
    dcp.save({"w": torch.arange(1000.0)}, storage_writer=dcp.FileSystemWriter(str(folder)), no_dist=True)
    assert check_checkpoint(str(folder)) is None
    shard = next(folder.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    assert "cut short" in check_checkpoint(str(folder))
    (folder / ".metadata").unlink()
    assert "no .metadata" in check_checkpoint(str(folder))


def test_torn_latest_checkpoint_resumes_from_newest_whole_one_to_identical_weights(uninterrupted, tmp_path, capsys):
    folder = tmp_path / "ck"
    shutil.copytree(uninterrupted, folder, symlinks=True)
    (folder / "ep0-ba12-rank0.pt").unlink()  # the run was stopped after batch 8 ...
    with open(folder / "ep0-ba8-rank0.pt", "r+b") as f:  # ... and its last checkpoint is torn
        f.truncate(1000)
    os.replace(folder / "latest-rank0.pt", tmp_path / "old-link")
    os.symlink("ep0-ba8-rank0.pt", folder / "latest-rank0.pt")
    early = (folder / "ep0-ba4-rank0.pt").stat().st_mtime_ns
    capsys.readouterr()

    assert train.main(_args(folder, "12ba")) == 0
    said = [line for line in capsys.readouterr().err.splitlines() if "autoresume" in line]
    assert said[0] == (
        f"autoresume: skipped {folder}/ep0-ba8-rank0.pt: truncated or not a torch file: 1,000 bytes, "
        f"not a zip archive (torch.save's format); resuming from {folder}/ep0-ba4-rank0.pt"
    ), said
    assert len(said) == 2 and said[1].startswith(
        f"autoresume: resuming from {folder}/ep0-ba4-rank0.pt (batch 4 of 12, "
    )
    assert (folder / "ep0-ba4-rank0.pt").stat().st_mtime_ns == early  # resumed, did not start over
    _assert_all_whole(folder)
    assert_same_weights(final_state(uninterrupted), final_state(folder), 12)


def test_no_loadable_checkpoint_is_one_line_and_exit_2(tmp_path, capsys):
    folder = tmp_path / "ck"
    folder.mkdir()
    (folder / "ep0-ba4-rank0.pt").write_bytes(b"\0" * 1000)
    os.symlink("ep0-ba4-rank0.pt", folder / "latest-rank0.pt")
    assert train.main(_args(folder, "8ba")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"train.py: error: autoresume: no checkpoint in {folder} loads"), err
    assert "ep0-ba4-rank0.pt: truncated or not a torch file: 1,000 bytes" in err[0]


def test_empty_save_folder_starts_fresh(tmp_path):
    assert local_resume_point(str(tmp_path)) is None
    assert local_resume_point(str(tmp_path / "missing")) is None


def test_a_whole_latest_wins_over_newer_files_and_a_dangling_one_is_skipped(tmp_path, capsys):
    for batch in (4, 8, 12):
        torch.save({"state": {"batch": batch}}, tmp_path / f"ep0-ba{batch}-rank0.pt")
    os.symlink("ep0-ba4-rank0.pt", tmp_path / "latest-rank0.pt")  # pointed back on purpose (a loss spike)
    assert local_resume_point(str(tmp_path)) == str(tmp_path / "ep0-ba4-rank0.pt")
    assert _latest(tmp_path).name == "ep0-ba4-rank0.pt"
    (tmp_path / "ep0-ba4-rank0.pt").unlink()
    assert local_resume_point(str(tmp_path)) == str(tmp_path / "ep0-ba12-rank0.pt")
    assert "skipped " + str(tmp_path / "ep0-ba4-rank0.pt") + ": cannot be read" in capsys.readouterr().err
    assert _latest(tmp_path).name == "ep0-ba12-rank0.pt"


class Killed(BaseException):
    """Stands for SIGKILL: nothing below it runs, no cleanup, no except OSError."""


def _second_save_breaks(monkeypatch, error: BaseException) -> None:
    """torch.save of the batch-2 checkpoint writes half the file, then raises ``error``."""
    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        if "ba2" in str(getattr(f, "name", f)):
            real_save(obj, f, *args, **kwargs)
            f.truncate(f.tell() // 2)
            raise error
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)


def _kill_on_second_save(monkeypatch, where: str) -> None:
    if where == "write":  # the process dies with half the file written
        return _second_save_breaks(monkeypatch, Killed())
    real_symlink, real_replace = os.symlink, os.replace

    def symlink(src, dst, *args, **kwargs):
        if "ba2" in str(src) and "latest" in str(dst):
            raise Killed
        return real_symlink(src, dst, *args, **kwargs)

    def replace(src, dst, *args, **kwargs):
        if "ba2" in str(dst):
            raise Killed
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(*{"link": (os, "symlink", symlink), "rename": (os, "replace", replace)}[where])


@pytest.mark.parametrize("where", ["write", "rename", "link"])
def test_a_kill_at_any_moment_of_a_save_leaves_latest_on_a_whole_file(tmp_path, monkeypatch, where, capsys):
    folder = tmp_path / "ck"
    _kill_on_second_save(monkeypatch, where)
    with pytest.raises(Killed):
        train.main(_args(folder, "2ba", every="1ba"))
    monkeypatch.undo()
    _assert_all_whole(folder)
    assert _latest(folder).name == "ep0-ba1-rank0.pt"
    capsys.readouterr()
    assert local_resume_point(str(folder)) == str(folder / "ep0-ba1-rank0.pt")  # nothing to skip, leftovers gone
    assert "skipped" not in capsys.readouterr().err
    assert not list(folder.glob(".partial-*"))


def test_a_save_is_flushed_and_renamed_before_latest_moves(tmp_path, monkeypatch):
    events, real_fsync, real_replace = [], os.fsync, os.replace
    monkeypatch.setattr(
        os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))), real_fsync(fd))[1]
    )
    monkeypatch.setattr(
        os,
        "replace",
        lambda src, dst: (
            events.append(("rename", os.path.basename(src), os.path.basename(dst))),
            real_replace(src, dst),
        )[1],
    )
    folder = tmp_path / "ck"
    assert train.main(_args(folder, "1ba", every="1ba")) == 0
    assert events == [
        ("fsync", str(folder / ".partial-ep0-ba1-rank0.pt")),
        ("rename", ".partial-ep0-ba1-rank0.pt", "ep0-ba1-rank0.pt"),
        ("fsync", str(folder)),
        ("rename", ".partial-latest-rank0.pt", "latest-rank0.pt"),
        ("fsync", str(folder)),
    ], events


def test_a_full_disk_during_save_is_one_line_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch, capsys):
    _second_save_breaks(monkeypatch, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    folder = tmp_path / "ck"
    assert train.main(_args(folder, "2ba", every="1ba")) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"train.py: error: disk full: saving ep0-ba2-rank0.pt in {folder} needs about "), err
    need = int(err.split("needs about ")[1].split(" bytes")[0].replace(",", ""))
    assert abs(need - (folder / "ep0-ba1-rank0.pt").stat().st_size) < 0.05 * need, err  # the size of a checkpoint
    assert "latest-rank0.pt still points at the whole ep0-ba1-rank0.pt" in err
    monkeypatch.undo()
    _assert_all_whole(folder)
    assert _latest(folder).name == "ep0-ba1-rank0.pt"
    assert sorted(p.name for p in folder.iterdir()) == ["ep0-ba1-rank0.pt", "latest-rank0.pt"]


def test_another_write_error_during_save_is_one_line_too(tmp_path, monkeypatch, capsys):
    _second_save_breaks(monkeypatch, OSError(errno.EIO, os.strerror(errno.EIO)))
    folder = tmp_path / "ck"
    assert train.main(_args(folder, "2ba", every="1ba")) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (
        f"train.py: error: could not save ep0-ba2-rank0.pt in {folder}: Input/output error; "
        "latest-rank0.pt still points at the whole ep0-ba1-rank0.pt"
    ), err
    assert sorted(p.name for p in folder.iterdir()) == ["ep0-ba1-rank0.pt", "latest-rank0.pt"]


@pytest.mark.slow
def test_two_ranks_agree_on_the_whole_checkpoint_to_resume_from(tmp_path):
    folder = tmp_path / "ck"
    args = _args(folder, "8ba")[1:]
    first = composer(2, "train.py", RECIPE, *args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    expected = final_state(folder)
    with open(folder / "ep0-ba8-rank0.pt", "r+b") as f:
        f.truncate(1000)

    again = composer(2, "train.py", RECIPE, *args, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    said = [line for line in again.stderr.splitlines() if "autoresume: skipped" in line]
    assert len(said) == 1 and "ep0-ba8-rank0.pt" in said[0] and "resuming from" in said[0], said
    _assert_all_whole(folder)
    got = final_state(folder)
    assert got["batch"] == 8
    for name in expected["model"]:
        assert torch.equal(expected["model"][name], got["model"][name]), name
