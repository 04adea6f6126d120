"""diffusion.bench.curves: variants of a recipe trained and measured side by side, resumed where they stopped;
the crossing of a target, the table and bad arguments."""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import REPO, run

from diffusion.bench import curves
from diffusion.bench.curve_report import crossing, curves_of, table
from diffusion.cli import run as run_cli


def point(batch, quality, seconds=None, tflop=None, variant="a"):
    return {"variant": variant, "batch": batch, "quality": quality, "seconds": seconds, "tflop": tflop}


def test_crossing_is_interpolated_between_the_points_around_the_target():
    falling = [point(100, 0.5, 10.0, 2.0), point(200, 0.3, 30.0, 4.0), point(300, 0.1, 50.0, 6.0)]
    assert crossing(falling, 0.4, higher_is_better=False) == {"batch": 150, "seconds": 20.0, "tflop": 3.0}
    rising = [point(250, 0.5, 5.0), point(500, 0.8, 9.0), point(750, 0.95, 13.0)]
    at = crossing(rising, 0.9, higher_is_better=True)
    assert at["batch"] == pytest.approx(500 + 250 * (0.1 / 0.15)) and at["seconds"] == pytest.approx(9 + 4 * 2 / 3)
    assert at["tflop"] is None  # FLOPs not known: not made up
    assert crossing(rising, 0.5, higher_is_better=True)["batch"] == 250  # reached at the first point: that point's
    assert crossing(rising, 0.99, higher_is_better=True) is None
    assert crossing([point(1, 0.2), point(2, 0.9), point(3, 0.7)], 0.8, True)["batch"] == pytest.approx(1 + 6 / 7)


def test_table_gives_each_variant_its_ratio_to_the_first():
    points = [point(b, q, b / 10, b / 100, "base") for b, q in ((100, 0.4), (200, 0.8), (300, 0.9))]
    points += [point(b, q, b / 5, b / 200, "fast") for b, q in ((100, 0.8), (200, 0.95))]
    points += [point(100, 0.1, 1.0, 1.0, "never")]
    lines = table(curves_of(points, ["base", "fast", "never"]), "digits", 0.8, higher_is_better=True)
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in lines[3:]}
    assert rows["base"] == ["3", "300", "0.9", "200", "1.00x", "20", "1.00x", "2", "1.00x"]
    assert rows["fast"] == ["2", "200", "0.95", "100", "0.50x", "20", "1.00x", "0.5", "0.25x"]
    assert rows["never"][3:] == ["–"] * 6


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--variant", "x=nosuchkey=1"], "--variant x: "),
        (["--variant", "x=save_folder=/tmp/elsewhere"], "--variant x: save_folder is set by the tool"),
        (["--variant", "x=seed=3"], "--variant x: seed differs per variant only with --vary_seed"),
        (["--variant", "x=load_path=/tmp/a.pt"], "--variant x: load_path: every variant starts from the same weights"),
        (["--variant", "a", "autoresume=false"], "autoresume: set by the tool for every variant"),
        (["--variant", "a", "--variant", "a=lr=1e-4"], "the name 'a' is given twice"),
        (["--variant", "a b=lr=1"], "a variant is NAME"),
        (["--variant", "a", "--quality", "digits", "--target", "1.5"], "--target 1.5: --quality digits takes values"),
        (["--variant", "a", "--quality", "os.path:nothing_here", "--better", "lower"], "os.path has no function"),
        (["--variant", "a", "--quality", "os.path:isfile"], "--better higher|lower"),
        (["--variant", "a", "--better", "higher"], "--better higher: for --quality val_loss lower is better"),
        (["--variant", "a", "--every", "3ep"], "batches like 250ba"),
        (["--variant", "a", "max_duration=2ep"], "max_duration=2ep: give it in batches"),
    ],
)
def test_bad_arguments_are_one_line(argv, message, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    full = ["yamls/sd-tiny-cpu.yaml", "--every", "3ba", "--quality", "val_loss", "--out", str(tmp_path), *argv]
    assert run_cli("diffusion.bench.curves", curves.main, full) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("diffusion.bench.curves: error: ") and message in err, err
    assert not any(tmp_path.iterdir())  # nothing ran, nothing written


def test_missing_recipe_is_one_line(tmp_path, capsys):
    argv = [str(tmp_path / "nope.yaml"), "--variant", "a", "--every", "3ba", "--quality", "val_loss"]
    assert run_cli("diffusion.bench.curves", curves.main, argv) == 2
    assert f"recipe {tmp_path / 'nope.yaml'}: no such yaml file" in capsys.readouterr().err


def test_a_folder_of_other_settings_is_not_reused(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "variant.json").write_text(json.dumps({"recipes": ["x.yaml"], "overrides": []}))
    argv = [
        "yamls/sd-tiny-cpu.yaml",
        "--variant",
        "a",
        "--every",
        "3ba",
        "--quality",
        "val_loss",
        "--out",
        str(tmp_path),
    ]
    assert run_cli("diffusion.bench.curves", curves.main, argv) == 2
    assert "holds a run of other settings" in capsys.readouterr().err


PLUGIN = """
import re
def batch_share(checkpoint):
    return int(re.search(r"-ba(\\d+)-", checkpoint)[1]) / 6
"""


@pytest.mark.slow
def test_two_variants_end_to_end_and_resumed(tmp_path):
    """Two 6-batch variants of sd-tiny measured every 3 batches (validation loss): the table, chart and points;
    both start from the same weights and data (equal first loss); then a lost checkpoint and point: only that
    run's last 3 batches are trained again and only its missing point measured."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "diffusion.bench.curves", "yamls/sd-tiny-cpu.yaml", "max_duration=6ba"]
    cmd += ["eval_samples=8", "--variant", "base", "--variant", "lr=lr=3e-4", "--every", "3ba", "--nproc", "1"]
    cmd += ["--quality", "val_loss", "--target", "5", "--out", str(out)]
    done = run(cmd, REPO, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = (out / "curves.md").read_text().splitlines()
    assert lines == [line for line in done.stdout.splitlines() if line in lines]  # the table printed as written
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in lines[4:]]
    assert [r[:3] for r in rows] == [["base", "2", "6"], ["lr", "2", "6"]]
    assert [(r[4], r[5], r[9]) for r in rows] == [("3", "1.00x", "1.00x")] * 2  # both under 5 at their first point
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    points = [json.loads(line) for line in (out / "points.jsonl").read_text().splitlines()]
    assert [(p["variant"], p["batch"], p["samples"]) for p in points] == [
        ("base", 3, 24),
        ("base", 6, 48),
        ("lr", 3, 24),
        ("lr", 6, 48),
    ]
    assert all(p["seconds"] > 0 and p["tflop"] > 0 and 0 < p["quality"] < 5 for p in points)
    first = [
        next(x for x in (out / v / "train.log").read_text().splitlines() if x.startswith("batch 1/"))
        for v in ("base", "lr")
    ]
    assert first[0].split(",")[1] == first[1].split(",")[1]  # "epoch 1: loss L": the same weights, data and noise

    base_log = (out / "base" / "train.log").read_text()
    (out / "lr" / "ep0-ba6-rank0.pt").unlink()  # as if killed before its last checkpoint: its point never measured
    (out / "points.jsonl").write_text("".join(json.dumps(p) + "\n" for p in points[:3]))
    again = run(cmd, REPO, timeout=900)
    assert again.returncode == 0, again.stdout + again.stderr
    assert (out / "base" / "train.log").read_text() == base_log  # finished: not started again
    resumed = [line for line in (out / "lr" / "train.log").read_text().splitlines() if line.startswith("autoresume:")]
    assert "resuming from" in resumed[-1] and "(batch 3 of 6" in resumed[-1]
    measured = [line for line in again.stdout.splitlines() if " at batch " in line]
    assert measured == [f"curves: lr at batch 6: val_loss {points[3]['quality']:.4g}"]  # resumed bitwise
    assert len((out / "points.jsonl").read_text().splitlines()) == 4

    (tmp_path / "judge.py").write_text(PLUGIN)  # a plug-in measure over the same checkpoints, nothing trained
    cmd = cmd[:-6] + ["--quality", f"{tmp_path / 'judge.py'}:batch_share", "--better", "higher", "--target", "0.75"]
    collected = run(cmd + ["--out", str(out), "--collect_only"], REPO, timeout=300)
    assert collected.returncode == 0, collected.stdout + collected.stderr
    assert "curves: training" not in collected.stdout
    row = next(line for line in collected.stdout.splitlines() if line.startswith("| lr |"))
    assert row.startswith("| lr | 2 | 6 | 1 | 4.5 | 1.00x |")  # 0.5 at batch 3, 1.0 at 6: 0.75 at 4.5


def test_digits_measure_samples_with_its_seed_into_a_folder_of_its_own(tmp_path, monkeypatch):
    """seed 0 is the curves' judge (generate.py's default noise); another seed re-judges a checkpoint on fresh
    noise, in a folder of its own beside seed 0's."""
    from diffusion.bench import curve_quality

    calls = []

    class Digits:  # examples/digits/digits.py's parts the measure uses
        parse_args = staticmethod(lambda argv: SimpleNamespace(samples_per_digit=2))
        train_judge = staticmethod(lambda: ("judge",))

        @staticmethod
        def judge_checkpoint(name, checkpoint, options, work, judge, logs, shapes=None, extra=()):
            calls.append((list(extra), work))
            return {"accuracy": 0.5}

    monkeypatch.setattr(curve_quality, "_digits_module", lambda: Digits)
    checkpoint = tmp_path / "ep1-ba250-rank0.pt"
    assert curve_quality.digits_measure()(str(checkpoint)) == 0.5
    assert curve_quality.digits_measure(seed=1)(str(checkpoint)) == 0.5
    (first, first_work), (second, second_work) = calls
    assert first[-2:] == ["--seed", "0"] and second[-2:] == ["--seed", "1"]
    assert Path(first_work).name == "digits-ba250" and Path(second_work).name == "digits-ba250-seed1"


def test_a_plug_in_file_imports_its_siblings_as_when_it_runs_as_a_script(tmp_path, monkeypatch):
    """examples/digits/aspects.py:quality imports digits.py beside it, as the script does: the plug-in's folder
    is on the import path when the tool loads it."""
    from diffusion.bench.curve_quality import plug_in

    (tmp_path / "helper_beside.py").write_text("def score(path):\n    return len(path) / 100\n")
    (tmp_path / "measure.py").write_text("import helper_beside\n\ndef quality(path):\n    return helper_beside.score(path)\n")  # fmt: skip
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert plug_in(f"{tmp_path / 'measure.py'}:quality")("abcd") == 0.04
    assert plug_in(f"{REPO / 'examples' / 'digits' / 'aspects.py'}:quality").__name__ == "quality"
