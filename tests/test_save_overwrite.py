"""A second run never writes over the first one's checkpoints: a save_folder that holds a run's checkpoints is
refused in one line before any work, unless the run continues it (autoresume) or starts over there
(save_overwrite), and then the old checkpoints go only once the new run has saved a whole one. Local files here,
sharded folders under 2 FSDP ranks below, s3:// in test_object_store_checkpoints.py."""

import os
from pathlib import Path

import pytest
import torch
from conftest import FAST, REPO, composer

import train
from diffusion.callbacks import previous_run
from diffusion.checkpointing.local import check_checkpoint

RECIPE = str(REPO / "yamls/sd-tiny-cpu.yaml")
TINY = [RECIPE, *FAST, "batch_size=4", "progress=lines", "save_interval=1ba", "autoresume=false"]
TINY += ["save_num_checkpoints_to_keep=-1"]


def _one_line(capsys, prog: str = "train.py") -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith(f"{prog}: error: "), err
    return err[0]


def _files(folder: Path) -> dict[str, tuple[int, int]]:
    """Every entry of ``folder`` (links as links) with its size and mtime: what a refused run must leave as is."""
    return {p.name: (p.lstat().st_size, p.lstat().st_mtime_ns) for p in sorted(folder.iterdir())}


def _seed(path: Path) -> int:
    state = torch.load(path, map_location="cpu", weights_only=False)["state"]
    return state["callbacks"]["RunConfig"]["config"]["seed"]


@pytest.fixture(scope="module")
def first_run(tmp_path_factory) -> Path:
    """A finished run of 3 batches, a checkpoint each: ep0-ba1 ... ep0-ba3, latest on ep0-ba3 (seed 1)."""
    folder = tmp_path_factory.mktemp("first") / "ck"
    assert train.main([*TINY, f"save_folder={folder}", "max_duration=3ba", "seed=1"]) == 0
    return folder


def _copy(first: Path, to: Path) -> Path:
    import shutil

    shutil.copytree(first, to, symlinks=True)
    return to


def test_a_used_save_folder_is_refused_before_any_model_is_built(first_run, tmp_path, capsys, monkeypatch):
    import diffusion.trainer

    folder = _copy(first_run, tmp_path / "ck")
    before = _files(folder)
    monkeypatch.setattr(diffusion.trainer, "build_model", lambda *a, **k: pytest.fail("a model was built"))
    capsys.readouterr()
    assert train.main([*TINY, f"save_folder={folder}", "max_duration=4ba"]) == 2
    assert _one_line(capsys) == (
        f"train.py: error: save_folder {folder} already holds a run's checkpoints (newest ep0-ba3-rank0.pt and 2 "
        "older); to continue that run set autoresume=true, to start over there set save_overwrite=true (they are "
        "deleted once this run has saved a whole checkpoint), or give another save_folder"
    )
    assert _files(folder) == before


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["save_overwrite=true", "autoresume=true", "save_folder=ck"],
            "save_overwrite=true starts over in save_folder and autoresume=true continues the run there: set one of "
            "them (with both, a requeued job would start over at every requeue); to start over with a recipe that "
            "sets autoresume, add autoresume=false",
        ),
        (
            ["save_overwrite=true", "save_folder=null"],
            "save_overwrite=true needs save_folder (the folder to start over in)",
        ),
    ],
    ids=["with-autoresume", "no-folder"],
)
def test_save_overwrite_beside_what_contradicts_it_is_one_line(args, message, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert train.main([*TINY, "max_duration=1ba", *args]) == 2
    assert _one_line(capsys) == f"train.py: error: {message}"


def test_save_overwrite_deletes_the_old_run_only_once_its_own_first_checkpoint_is_whole(
    first_run, tmp_path, monkeypatch
):
    folder = _copy(first_run, tmp_path / "ck")
    seen = []
    deleting = previous_run.delete_checkpoint

    def delete(save_folder, name):  # what the folder holds when the first old checkpoint goes
        if not seen:
            latest = folder / "latest-rank0.pt"
            seen.append((os.readlink(latest), check_checkpoint(str(latest)), _seed(latest)))
        deleting(save_folder, name)

    monkeypatch.setattr(previous_run, "delete_checkpoint", delete)
    args = [*TINY, f"save_folder={folder}", "save_overwrite=true", "seed=2", "save_interval=2ba"]
    assert train.main([*args, "max_duration=2ba"]) == 0
    assert seen == [("ep0-ba2-rank0.pt", None, 2)]  # the new run's own checkpoint, whole, named by latest
    assert sorted(p.name for p in folder.iterdir()) == ["ep0-ba2-rank0.pt", "latest-rank0.pt"]
    assert _seed(folder / "ep0-ba2-rank0.pt") == 2  # the old ep0-ba2 written over by the new run's, atomically


def test_a_run_stopped_before_its_first_save_leaves_the_old_checkpoints(first_run, tmp_path, monkeypatch, capsys):
    """save_overwrite, and the run fails at its first batch: every old checkpoint is still there, only latest is
    gone (it named the old run as this one's), so autoresume afterwards continues the old run from its newest."""
    from composer.core import Callback

    import diffusion.trainer

    folder = _copy(first_run, tmp_path / "ck")
    before = {k: v for k, v in _files(folder).items() if k != "latest-rank0.pt"}

    class Fails(Callback):
        def batch_end(self, state, logger):
            raise RuntimeError("killed before its first save")

    callbacks = diffusion.trainer.callbacks
    monkeypatch.setattr(diffusion.trainer, "callbacks", lambda *a, **k: [Fails(), *callbacks(*a, **k)])
    with pytest.raises(RuntimeError, match="killed before its first save"):
        train.main([*TINY, f"save_folder={folder}", "save_overwrite=true", "max_duration=2ba", "save_interval=2ba"])
    assert _files(folder) == before
    monkeypatch.setattr(diffusion.trainer, "callbacks", callbacks)
    capsys.readouterr()
    assert train.main([*TINY, f"save_folder={folder}", "autoresume=true", "max_duration=4ba"]) == 0
    assert f"autoresume: resuming from {folder}/ep0-ba3-rank0.pt (batch 3 of 4" in capsys.readouterr().err


@pytest.mark.slow
def test_sharded_checkpoints_of_two_fsdp_ranks_are_refused_then_overwritten_as_asked(tmp_path, capsys, monkeypatch):
    """The issue's own commands: FSDP2 on 2 ranks, sharded folders. The second run, 4 batches without autoresume,
    used to start at batch 0 and write over ep0-ba2 without a word; it is refused by global rank 0 before anything
    is built (here in this process: the refusal comes before the check that FSDP needs 2 ranks)."""
    import benchmark

    run = ["benchmark.py", "--use_synth_data", "--model_name", "flux-tiny", "--fsdp", "--use_ema", "--batch_size", "4"]
    run += ["--num_workers", "0", "--save_folder", "CK", "--save_interval", "2ba"]
    assert composer(2, *run, "--max_duration", "2ba", cwd=tmp_path).returncode == 0
    before = _files(tmp_path / "CK/ep0-ba2")
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert benchmark.main([*run[1:], "--max_duration", "4ba"]) == 2
    assert _one_line(capsys, "benchmark.py") == (
        "benchmark.py: error: --save_folder CK already holds a run's checkpoints (newest ep0-ba2); to continue that "
        "run set --autoresume, to start over there set --save_overwrite (they are deleted once this run has saved a "
        "whole checkpoint), or give another save_folder"
    )
    assert _files(tmp_path / "CK/ep0-ba2") == before
    done = composer(2, *run, "--max_duration", "4ba", "--save_overwrite", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "save_overwrite: CK holds another run's checkpoints (newest ep0-ba2)" in done.stderr
    assert sorted(p.name for p in (tmp_path / "CK").iterdir()) == ["ep0-ba2", "ep0-ba4", "latest-rank0.pt"]
    assert os.readlink(tmp_path / "CK/latest-rank0.pt") == "ep0-ba4"
    after = _files(tmp_path / "CK/ep0-ba2")
    assert after.keys() == before.keys() and all(after[k][1] > before[k][1] for k in before)  # written anew
