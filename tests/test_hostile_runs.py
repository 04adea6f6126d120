"""Hostile input to a run, by kind (recipes, checkpoints, outputs, data locations, concurrency): each is one
line and exit 2 before any work, never a traceback, a machine eaten, or another run's checkpoints lost."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from conftest import FAST, REPO, run, write_mds_images

import export
import generate
import train
from diffusion.checkpointing import lock as save_lock
from diffusion.errors import UsageError

RECIPE = str(REPO / "yamls/sd-tiny-cpu.yaml")
TINY = [RECIPE, *FAST, "batch_size=4", "autoresume=false", "save_folder=null", "progress=lines"]


def _one_line(capsys, prog: str) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith(f"{prog}: error: "), err
    return err[0]


# --- recipes ----------------------------------------------------------------------------------------------
BOMB = "".join(
    f"{a}: &{a} [{', '.join([f'*{b}'] * 9) if b else ', '.join(['lol'] * 9)}]\n"
    for b, a in zip(["", *"abcdefgh"], "abcdefghi")
)  # nine levels of nine: 387 million values from 400 bytes
BIG = "1" + "0" * 400


@pytest.mark.parametrize(
    "text,message",
    [
        (
            "model_name: sd-tiny\nlr: 1e-4\nbatch_size: 4\nlr: 2e-4\n",
            "r.yaml, line 4: not valid yaml: key 'lr' is given twice",
        ),
        (
            "- model_name: sd-tiny\n- lr: 1\n",
            "r.yaml: a recipe is a mapping of 'key: value' lines, this file holds a list",
        ),
        ("sd-tiny\n", "this file holds a single str value ('sd-tiny')"),
        ("model_name: sd-tiny\nlr: 1e400\n", "r.yaml, line 2: lr: the number 1e400 is out of range"),
        (f"model_name: sd-tiny\nbatch_size: {BIG}\n", "r.yaml, line 2: batch_size: the number 1000000"),
        (f"model_name: sd-tiny\nlr: {BIG}\n", "r.yaml, line 2: lr: the number 1000000"),
        ("a: &a [*a]\n", "an alias refers to a node that contains it"),
        ("model_name: sd-tiny\n\nlrr: 3\n", "r.yaml, line 3: unknown key 'lrr'; did you mean 'lr'?"),
    ],
)
def test_a_hostile_recipe_is_one_line_naming_file_and_line(tmp_path, text, message, capsys):
    path = tmp_path / "r.yaml"
    path.write_text(text)
    assert train.main([str(path)]) == 2
    line = _one_line(capsys, "train.py")
    assert message in line, line


def test_a_recipe_that_is_not_utf8_or_a_directory_is_one_line(tmp_path, capsys):
    latin = tmp_path / "latin.yaml"
    latin.write_bytes(b"model_name: sd-tiny\ncaption_key: caf\xe9\n")
    assert train.main([str(latin)]) == 2
    assert "latin.yaml, line 2: not UTF-8 text (byte 0xe9 at offset 36)" in _one_line(capsys, "train.py")
    (tmp_path / "dir.yaml").mkdir()
    assert train.main([str(tmp_path / "dir.yaml")]) == 2
    assert "dir.yaml' is a directory, not a yaml file" in _one_line(capsys, "train.py")


@pytest.mark.parametrize(
    "override,message",
    [
        ("lr=1e400", "command line: lr: the number 1e400 is out of range"),
        (f"lr={BIG}", "command line: lr: the number 1000000"),
        ("sample_prompts=[a, b", "command line: 'sample_prompts=[a, b': not valid yaml: expected ',' or ']'"),
    ],
)
def test_a_hostile_override_is_one_line(override, message, capsys):
    assert train.main([*TINY, override]) == 2
    line = _one_line(capsys, "train.py")
    assert message in line, line


def test_a_yaml_alias_bomb_is_refused_before_it_grows(tmp_path):
    """Today's main grows past gigabytes here; a separate process, so a regression costs its timeout only."""
    path = tmp_path / "bomb.yaml"
    path.write_text(BOMB)
    started = time.monotonic()
    done = run([sys.executable, str(REPO / "train.py"), str(path)], cwd=tmp_path, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    err = done.stderr.strip().splitlines()
    assert len(err) == 1 and "bomb.yaml: its anchors and aliases (&name, *name) expand to more than" in err[0], err
    assert time.monotonic() - started < 60


def test_a_recipe_with_a_few_aliases_still_reads(tmp_path):
    path = tmp_path / "aliases.yaml"
    path.write_text("sample_prompts: &p [a red cube, two cats]\nquality_prompts: null\n")
    from diffusion.config import load_config

    cfg = load_config([RECIPE, str(path)])
    assert cfg.sample_prompts == ["a red cube", "two cats"]


# --- checkpoints ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sd_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sd")
    args = [*TINY[:-2], "max_duration=1ba", f"save_folder={folder}", "save_interval=1ba", "progress=lines"]
    assert train.main(args) == 0
    return folder / "latest-rank0.pt"


def test_a_checkpoint_of_another_model_as_load_path_is_one_line(sd_checkpoint, tmp_path, capsys):
    flux = [str(REPO / "yamls/flux-tiny-cpu.yaml"), *FAST, "save_folder=null", "autoresume=false", "max_duration=1ba"]
    assert train.main([*flux, f"load_path={sd_checkpoint}", "progress=lines"]) == 2
    line = _one_line(capsys, "train.py")
    assert (
        f"load_path {sd_checkpoint} was saved by a model_name=sd-tiny run and this run trains model_name=flux-tiny"
        in line
    )


def test_a_torch_file_that_is_no_checkpoint_as_load_path_is_one_line(tmp_path, capsys):
    torch.save({"weights": torch.zeros(2)}, tmp_path / "w.pt")
    assert train.main([*TINY, "max_duration=1ba", f"load_path={tmp_path / 'w.pt'}"]) == 2
    assert "is a torch file but not a training checkpoint (no 'state')" in _one_line(capsys, "train.py")


@pytest.mark.parametrize("prog", ["generate.py", "export.py"])
def test_a_directory_that_is_no_sharded_checkpoint_is_one_line(prog, tmp_path, capsys):
    folder = tmp_path / "photos"
    folder.mkdir()
    (folder / "a.txt").write_text("not a checkpoint")
    if prog == "generate.py":
        code = generate.main([str(folder), "--prompt", "x", "--out", str(tmp_path / "o")])
    else:
        code = export.main([str(folder), str(tmp_path / "o")])
    assert code == 2
    line = _one_line(capsys, prog)
    assert f"checkpoint '{folder}' is a directory but neither a sharded checkpoint (no .metadata" in line, line


# --- outputs ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["file", "under a file"])
def test_a_save_folder_that_is_a_file_or_under_one_is_one_line(where, tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    folder = tmp_path / "f" if where == "file" else tmp_path / "f" / "run"
    assert train.main([*TINY, "max_duration=1ba", f"save_folder={folder}"]) == 2
    line = _one_line(capsys, "train.py")
    assert ("is a file, not a folder" if where == "file" else f"is under {tmp_path / 'f'}, which is a file") in line


@pytest.mark.parametrize("key", ["save_folder", "sample_folder", "tensorboard_dir", "results"])
def test_an_output_under_a_virtual_file_system_is_one_line_before_any_work(key, capsys, monkeypatch):
    """/proc lets root pass os.access but makes no folder: the run used to end in a FileNotFoundError traceback at
    its first save. Every output is asked of the file system itself (file_checks.folder_problem)."""
    import diffusion.trainer

    monkeypatch.setattr(diffusion.trainer, "build_model", lambda *a, **k: pytest.fail("a model was built"))
    value = "/proc/diffusion-run/r.jsonl" if key == "results" else "/proc/diffusion-run"
    extra = ["sample_interval=1ba", "sample_prompts=[a]"] if key == "sample_folder" else []
    assert train.main([*TINY, "max_duration=1ba", f"{key}={value}", *extra]) == 2
    line = _one_line(capsys, "train.py")
    assert "/proc/diffusion-run" in line and "cannot be made: in /proc no folder can be made (" in line, line
    assert "give a folder that can be written" in line


def test_generate_refuses_an_out_that_is_a_file_before_sampling(sd_checkpoint, tmp_path, capsys, monkeypatch):
    import diffusion.eval.sampling as sampling

    monkeypatch.setattr(sampling, "load_pipeline", lambda *a, **k: pytest.fail("loaded before --out was checked"))
    (tmp_path / "out").write_text("x")
    assert generate.main([str(sd_checkpoint), "--prompt", "x", "--out", str(tmp_path / "out")]) == 2
    assert f"--out '{tmp_path / 'out'}' is a file, not a folder" in _one_line(capsys, "generate.py")


def test_export_refuses_an_out_under_a_file(sd_checkpoint, tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    assert export.main([str(sd_checkpoint), str(tmp_path / "f" / "pipe")]) == 2
    assert "which is a file, not a folder" in _one_line(capsys, "export.py")


# --- data locations ---------------------------------------------------------------------------------------
def test_a_missing_local_remote_is_one_line(tmp_path, capsys):
    args = [*TINY, "use_synth_data=false", f"remote={tmp_path / 'none'}", f"local={tmp_path / 'cache'}"]
    assert train.main([*args, "max_duration=1ba"]) == 2
    line = _one_line(capsys, "train.py")
    assert f"remote: no MDS dataset at '{tmp_path / 'none'}' (no such folder)" in line, line


@pytest.mark.parametrize("how", ["local", "remote"])
def test_a_missing_shard_of_a_local_dataset_is_named_not_blamed_on_s3(how, tmp_path, capsys):
    data = write_mds_images(tmp_path / "ds", size_limit=20_000)
    os.remove(data / "shard.00001.mds")
    where = [f"local={data}"] if how == "local" else [f"remote={data}", f"local={tmp_path / 'cache'}"]
    assert train.main([*TINY, "use_synth_data=false", *where, "max_duration=1ba"]) == 2
    line = _one_line(capsys, "train.py")
    assert f"{how} {data}: shard {data / 'shard.00001.mds'} is missing (its index.json lists it)" in line, line
    assert "S3" not in line


# --- concurrency: one run per save folder -----------------------------------------------------------------
def _wait_for(predicate, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def test_a_second_run_on_a_busy_save_folder_is_refused_and_a_killed_runs_lock_does_not_block(tmp_path, capsys):
    folder = tmp_path / "ck"
    args = [*TINY[:-2], f"save_folder={folder}", "save_interval=1ba", "autoresume=true", "progress=lines"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    first = subprocess.Popen(
        [sys.executable, str(REPO / "train.py"), *args, "max_duration=10000ba"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        _wait_for(lambda: (folder / "latest-rank0.pt").exists())  # it holds the folder and has saved
        assert train.main([*args, "max_duration=2ba"]) == 2
        line = _one_line(capsys, "train.py")
        assert f"save_folder {folder} is in use by another run (pid {first.pid} on host {socket.gethostname()}" in line
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # as a preemption or a lost node does
        first.wait()
    saved = len(list(folder.glob("ep*-ba*-rank0.pt")))
    assert train.main([*args, f"max_duration={saved + 1}ba"]) == 0  # the kernel dropped the dead run's lock


def test_the_lock_is_released_when_a_run_ends_so_the_next_run_starts(tmp_path):
    folder = tmp_path / "ck"
    with save_lock.save_folder_lock(str(folder)):
        assert json.loads((folder / ".lock").read_text())["pid"] == os.getpid()
        with pytest.raises(UsageError, match="is in use by another run"):  # another open of it: another run
            save_lock._lock_local(str(folder))
    assert not list(folder.iterdir())  # a finished run leaves its folder as it was
    with save_lock.save_folder_lock(str(folder)):
        pass


def test_a_second_run_on_a_busy_s3_save_folder_is_refused_and_stale_locks_are_taken_over(s3, capsys, monkeypatch):
    url = f"s3://{s3.bucket}/run"
    monkeypatch.setattr(save_lock, "SETTLE_SECONDS", 0.1)
    holder = save_lock._RemoteLock(url)
    holder.acquire()  # a live run on this host
    args = [*TINY[:-2], f"save_folder={url}", "save_interval=1ba", "max_duration=1ba", "progress=lines"]
    assert train.main(args) == 2
    assert f"save_folder {url} is in use by another run (pid {os.getpid()}" in _one_line(capsys, "train.py")
    holder.release()
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = {"host": socket.gethostname(), "pid": dead.pid, "started": "earlier", "token": "x", "beat": 3}
    s3.client().put_object(Bucket=s3.bucket, Key="run/.lock", Body=json.dumps(stale).encode())
    assert train.main(args) == 0  # a killed run on this host: its pid is gone
    assert "Contents" not in s3.client().list_objects_v2(Bucket=s3.bucket, Prefix="run/.lock")  # released
    monkeypatch.setattr(save_lock, "STALE_SECONDS", 2.0)
    s3.client().put_object(Bucket=s3.bucket, Key="run/.lock", Body=json.dumps({**stale, "host": "gone"}).encode())
    assert train.main([*args[:-2], "max_duration=2ba", "autoresume=true", "progress=lines"]) == 0
