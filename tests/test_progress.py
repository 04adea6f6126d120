"""progress=auto|bar|lines|metrics: a bar with the loss and images/s at a terminal (or when forced), one
readable line per log interval in logs and pipes (pytest's captured stderr is not a terminal, like a Slurm
log), Composer's whole metric dump when asked for."""

import io
import re
import sys

import pytest
from conftest import REPO, write_images

import benchmark
import data
import train

TINY = ["--model_name", "sd-tiny", "--use_synth_data", "--batch_size", "2", "--num_workers", "0"]


def _is_bar(err: str) -> bool:
    return "ba/s" in err or "s/ba" in err  # tqdm's rate; the lines never show one


def test_forced_bar_shows_loss_and_images_per_sec_instead_of_the_lines(capfd, monkeypatch, tmp_path):
    # capfd: Composer's bar needs a stream with a fileno. images/s is SpeedMonitor's figure, there once its
    # window (speed_window batches) is full.
    monkeypatch.chdir(tmp_path)
    assert (
        train.main(
            [
                str(REPO / "yamls/sd-tiny-cpu.yaml"),
                "eval_interval=null",
                "num_workers=0",
                "batch_size=2",
                "max_duration=4ba",
                "speed_window=2",
                "autoresume=false",
                "save_folder=null",
                "progress=bar",
            ]
        )
        == 0
    )
    out, err = capfd.readouterr()
    assert _is_bar(err) and "4/4" in err and "loss/train/total=" in err and "images/s=" in err, err[-2000:]
    assert "[batch=" not in err and "Train loss/train/total:" not in err
    assert out.startswith("results: ")  # printed after the bar is finished, on its own line


@pytest.mark.parametrize("mode", ["lines", "auto"])  # auto: stderr is not a terminal here
def test_lines_and_auto_off_a_terminal_print_one_readable_line_per_log_interval(mode, capsys):
    args = ["--max_duration", "5ba", "--log_interval", "2ba", "--speed_window", "2", "--progress", mode]
    assert benchmark.main([*TINY, *args]) == 0
    out, err = capsys.readouterr()
    lines = err.splitlines()  # the first batch, every second one and the last: nothing else
    assert [line.split(":")[0] for line in lines] == [f"batch {b}/5, epoch 1" for b in (1, 2, 4, 5)], err
    assert re.fullmatch(r"batch 1/5, epoch 1: loss [0-9.]+, ETA \d:\d\d:\d\d", lines[0]), lines
    assert re.fullmatch(r"batch 4/5, epoch 1: loss [0-9.]+, [0-9.,]+ images/s, ETA \d:\d\d:\d\d", lines[2]), lines
    assert "Train time/token" not in err and "[batch=" not in err and not _is_bar(err)
    assert out.startswith("results: ")


def test_metrics_is_composers_whole_dump(capsys):
    assert benchmark.main([*TINY, "--max_duration", "2ba", "--progress", "metrics"]) == 0
    err = capsys.readouterr().err
    assert "[batch=1/2]:" in err and "[batch=2/2]:" in err and "\t Train loss/train/total: " in err
    assert "Train time/token" in err and "batch 1/2, epoch 1" not in err and not _is_bar(err)


def test_lines_name_each_evaluation_and_count_batches_of_a_run_in_samples(tmp_path, capsys):
    recipe = [str(REPO / "yamls/sd-tiny-cpu.yaml"), "num_workers=0", "batch_size=2", "save_folder=null"]
    run = [
        "autoresume=false",
        "max_duration=6sp",
        "warmup=2sp",
        "eval_interval=2ba",
        "eval_samples=2",
        "progress=lines",
    ]
    assert train.main([*recipe, *run]) == 0
    err = capsys.readouterr().err.splitlines()
    assert [line.split(":")[0] for line in err] == [
        "batch 1/3, epoch 1",  # then every log_interval (10ba) and the last
        "eval at batch 2",
        "batch 3/3, epoch 1",
        "eval at batch 3",
    ], err
    assert re.fullmatch(r"eval at batch 2: ValidationLoss [0-9.]+", err[1]), err


def test_auto_on_a_terminal_draws_the_bar(monkeypatch, tmp_path):
    class Terminal(io.TextIOWrapper):
        def isatty(self):
            return True

    with Terminal(open(tmp_path / "tty", "wb"), write_through=True) as term:
        monkeypatch.setattr(sys, "stderr", term)
        assert benchmark.main([*TINY, "--max_duration", "2ba"]) == 0
    err = (tmp_path / "tty").read_text()
    assert _is_bar(err) and "loss/train/total=" in err and "[batch=" not in err


def test_only_rank_zero_draws_a_bar(monkeypatch):
    from diffusion.progress import wants_bar

    assert wants_bar("bar") and not wants_bar("lines") and not wants_bar("auto")
    monkeypatch.setenv("RANK", "1")
    assert not wants_bar("bar")


def test_unknown_mode_is_one_line(tmp_path, capsys):
    assert train.main([str(REPO / "yamls/sd-tiny-cpu.yaml"), "progress=fancy"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.py: error: progress='fancy' is not one of auto, bar, lines, metrics" in err[0], err


@pytest.mark.parametrize("mode", ["bar", "lines"])
def test_precompute_bar_or_one_line_per_part(mode, tmp_path, capsys):
    src = write_images(tmp_path / "src", 6)
    assert (
        data.main(
            [
                "precompute",
                src,
                str(tmp_path / "lat"),
                "--model_name",
                "sd-tiny",
                "--batch_size",
                "2",
                "--num_workers",
                "0",
                "--part_size",
                "4",
                "--progress",
                mode,
            ]
        )
        == 0
    )
    out, err = capsys.readouterr()
    assert "precompute: 6 samples encoded with sd-tiny" in out
    if mode == "bar":
        assert "precompute sd-tiny 64px" in err and "6/6" in err and " images/s" in err and "part-00000 done" not in err
    else:
        lines = [line for line in err.splitlines() if line.startswith("precompute: part-")]
        assert len(lines) == 2 and lines[1].startswith("precompute: part-00001 done; 6 of 6 images on rank 0 (")
        assert lines[1].endswith(" images/s)") and "\r" not in err


def test_evaluate_sampling_bar_counts_images(monkeypatch, capsys):
    import diffusion.eval.sampling
    import evaluate
    from diffusion.eval.quality import sample_and_measure

    assert (
        evaluate.parse_args(
            ["ckpt", "--prompts", "p", "--inception", "i", "--clip", "c", "--reference_stats", "r", "--progress", "bar"]
        ).progress
        == "bar"
    )
    monkeypatch.setattr(diffusion.eval.sampling, "sample", lambda pipe, prompts, **kw: [None] * len(prompts))

    class Metrics:
        def update(self, images, prompts):
            pass

    for progress in (True, False):
        sample_and_measure(
            None,
            ["a"] * 5,
            Metrics(),
            steps=1,
            guidance_scale=1.0,
            seed=0,
            image_size=None,
            batch_size=2,
            progress=progress,
        )
        err = capsys.readouterr().err
        assert ("sampling" in err and "5/5" in err and " images/s" in err) == progress, err
