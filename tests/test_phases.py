"""Resolution phases (the phases key, config.phase_configs, trainer.fit): one run in phases of their own image
size, batch size and data, handing over by checkpoint; a restart continues in the phase it stopped in."""

import json
import re
import sys

from conftest import REPO, assert_same_weights, final_state, run_or_kill

import train

RECIPE = str(REPO / "yamls/sd-tiny-cpu.yaml")
PHASES = "phases=[{until: 24sp, image_size: 32, batch_size: 4}, {until: 56sp, image_size: 64, batch_size: 8}]"


def _args(tmp_path, *extra):
    return [
        RECIPE,
        PHASES,
        "eval_interval=null",
        "warmup=8sp",
        f"save_folder={tmp_path / 'ck'}",
        "save_interval=2ba",
        f"results={tmp_path / 'r.jsonl'}",
        *extra,
    ]


def test_phases_train_in_turn_each_with_its_results_line_and_a_restart_finds_the_end(tmp_path, capsys):
    assert train.main(_args(tmp_path)) == 0
    lines = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert [(r["phase"], r["resolution"], r["global_batch_size"]) for r in lines] == [(0, 32, 4), (1, 64, 8)]
    assert final_state(tmp_path / "ck")["batch"] == 6 + 4  # 24 samples in batches of 4, then 32 in 8s
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("autoresume:")]
    assert said == [f"autoresume: no checkpoint in {tmp_path / 'ck'} yet, starting from batch 0 (phase 1 of 2)"]
    assert train.main(_args(tmp_path)) == 0  # both phases are done: nothing trains, no new results line
    assert len((tmp_path / "r.jsonl").read_text().splitlines()) == 2
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("autoresume:")]
    assert len(said) == 1 and re.fullmatch(
        rf"autoresume: resuming from {re.escape(str(tmp_path / 'ck'))}/ep\d+-ba10-rank0\.pt "
        r"\(phase 2 of 2, batch 10 of 10, saved [-\d]+ [:\d]+ UTC\); that run has finished: nothing to train "
        r"\(raise max_duration to train on\)",
        said[0],
    ), said


def test_killed_in_the_second_phase_resumes_there_bitwise(tmp_path, mds_buckets):
    cmd = [
        sys.executable,
        str(REPO / "train.py"),
        *_args(tmp_path / "a", "use_synth_data=false", f"local={mds_buckets}"),
    ]
    full = run_or_kill(cmd, tmp_path)
    assert full.returncode == 0, full.stdout[-2000:] + full.stderr[-2000:]
    cmd_b = [
        sys.executable,
        str(REPO / "train.py"),
        *_args(tmp_path / "b", "use_synth_data=false", f"local={mds_buckets}"),
    ]
    folder = tmp_path / "b" / "ck"
    run_or_kill(cmd_b, tmp_path, kill_when=lambda: folder.is_dir() and any(folder.glob("*-ba8-rank0.pt")))
    again = run_or_kill(cmd_b, tmp_path)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    a, b = final_state(tmp_path / "a" / "ck"), final_state(folder)
    assert_same_weights(a, b, batches=10)


def test_phase_mistakes_are_one_line(tmp_path, capsys):
    for bad, message in (  # (warmup in sp: the phases' unit)
        ("phases=[{until: 24sp}, {until: 16sp}]", "the untils (24sp, 16sp) must grow"),
        ("phases=[{until: 24sp}, {until: 6ba}]", "all in samples (sp) or all in batches (ba)"),
        ("phases=[{until: 24sp, image_size: -5}]", "phases[0].image_size=-5 must be a positive integer"),
        ("phases=[{image_size: 32}]", "phases[0].until is required"),
        ("phases=[{until: 24sp, colour: red}]", "unknown phases[0] key(s) ['colour']"),
    ):
        assert train.main([RECIPE, bad, "warmup=8sp", f"save_folder={tmp_path}"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], (bad, err)
    assert train.main([RECIPE, "phases=[{until: 24sp}]", f"save_folder={tmp_path}"]) == 2  # warmup 10ba
    assert "warmup=10ba must be in the phases' unit (sp)" in capsys.readouterr().err
    assert train.main([RECIPE, "phases=[{until: 24sp}]", "warmup=0ba", "save_folder=null", "autoresume=false"]) == 2
    assert "phases need save_folder and autoresume=true" in capsys.readouterr().err


def test_a_later_phase_is_checked_before_the_first_starts(tmp_path, capsys):
    bad = "phases=[{until: 24sp, image_size: 32, batch_size: 4}, {until: 56sp, image_size: 72}]"
    assert train.main([RECIPE, bad, "warmup=8sp", f"save_folder={tmp_path}"]) == 2
    assert "image_size=72 must be a positive multiple of 16" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # nothing trained
