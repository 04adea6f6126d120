"""With autoresume, a run says in one line, before training, where it starts (diffusion/callbacks/resume_line.py):
the checkpoint, its batch of the run's, and when it was saved; or that the save folder holds none yet. Phased,
object-store and sharded runs are checked where their own tests resume (test_phases.py,
test_object_store_checkpoints.py, ema_fsdp_worker.py)."""

import datetime
import os
import re

from conftest import FAST, REPO

import train

SAVED = r"saved (\d{4}-\d\d-\d\d \d\d:\d\d) UTC"


def test_a_second_run_says_where_it_resumes_from_and_a_first_that_there_is_nothing_yet(tmp_path, capsys):
    folder = tmp_path / "ck"
    args = [str(REPO / "yamls/sd-tiny-cpu.yaml"), *FAST, "batch_size=2", f"save_folder={folder}", "save_interval=2ba"]
    args += ["progress=lines", "log_interval=1ba"]
    assert train.main([*args, "max_duration=2ba"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"autoresume: no checkpoint in {folder} yet, starting from batch 0", err
    assert err[1].startswith("batch 1/2, epoch 1: ") and sum("autoresume" in line for line in err) == 1, err

    assert train.main([*args, "max_duration=3ba"]) == 0
    err = capsys.readouterr().err.splitlines()
    said = re.fullmatch(rf"autoresume: resuming from {re.escape(str(folder))}/ep0-ba2-rank0\.pt \(batch 2 of 3, {SAVED}\)", err[0])  # fmt: skip
    assert said and err[1].startswith("batch 3/3, epoch 1: ") and sum("autoresume" in line for line in err) == 1, err
    saved = datetime.datetime.strptime(said[1], "%Y-%m-%d %H:%M").replace(tzinfo=datetime.timezone.utc)
    written = os.path.getmtime(folder / "ep0-ba2-rank0.pt")  # the checkpoint's own time, not the resume's
    assert abs(saved.timestamp() - written) < 61, (said[1], written)


def test_a_rerun_with_other_settings_is_refused_and_a_finished_run_says_it_has_nothing_to_train(tmp_path, capsys):
    """A recipe rerun with other overrides on its save folder used to continue the earlier run, a finished one
    too, with the new settings and without a word: settings that define the run (model, data, batch size, image
    size, objective, optimizer) that differ are one line before any model is built, unless resume_with_changes."""
    import diffusion.trainer

    folder = tmp_path / "ck"
    args = [str(REPO / "yamls/sd-tiny-cpu.yaml"), *FAST, "batch_size=2", f"save_folder={folder}", "save_interval=2ba"]
    args += ["progress=lines", "autoresume=true"]
    assert train.main([*args, "max_duration=2ba"]) == 0
    capsys.readouterr()
    assert train.main([*args, "max_duration=2ba"]) == 0  # the same command again: finished, said so
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("autoresume:")]
    assert said[0].endswith("; that run has finished: nothing to train (raise max_duration to train on)"), said
    build = diffusion.trainer.build_model
    diffusion.trainer.build_model = lambda *a, **k: (_ for _ in ()).throw(AssertionError("a model was built"))
    try:
        assert train.main([*args, "max_duration=4ba", "batch_size=4", "objective.loss_weighting=min_snr"]) == 2
    finally:
        diffusion.trainer.build_model = build
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert err == [
        f"train.py: error: autoresume: save_folder {folder} holds a run of other settings (batch_size=2 there, "
        "batch_size=4 now, objective={} there, objective={'loss_weighting': 'min_snr'} now), which this run would "
        "continue from ep0-ba2-rank0.pt; to start over there set save_overwrite=true autoresume=false, give another "
        "save_folder, or set resume_with_changes=true to continue it with these settings"
    ], err
    assert train.main([*args, "max_duration=4ba", "batch_size=4", "resume_with_changes=true"]) == 0
    assert f"autoresume: resuming from {folder}/ep0-ba2-rank0.pt (batch 2 of 4" in capsys.readouterr().err
