"""Damaged, foreign and hostile files wherever a path is taken: one line naming the file and the fault,
exit 2, no traceback; and a checkpoint never runs code from its pickle unless trusted."""

import os
import shutil

import pytest
import torch
from conftest import REPO, write_mds_images

import data
import export
import generate
import train
from diffusion.cli import run
from diffusion.errors import UsageError

TINY = [
    str(REPO / "yamls/sd-tiny-cpu.yaml"),
    "eval_interval=null",
    "num_workers=0",
    "batch_size=4",
    "autoresume=false",
    "save_folder=null",
    "progress=lines",
]


def _one_line(capsys, prog: str) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith(f"{prog}: error: "), err
    return err[0]


def _cut(path, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


def _open_checkpoint(prog: str, path, tmp_path) -> int:
    """Give the checkpoint ``path`` to ``prog`` the way a user would; its exit code."""
    if prog == "generate.py":
        return generate.main([str(path), "--prompt", "x", "--out", str(tmp_path / "o")])
    if prog == "export.py":
        return export.main([str(path), str(tmp_path / "o")])
    return train.main([*TINY, "max_duration=1ba", f"load_path={path}"])


class Hostile:
    """Unpickled unsafely, it runs a shell command that leaves a marker file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A real 2-batch sd-tiny checkpoint with EMA (what Composer and our RunConfig pickle)."""
    folder = tmp_path_factory.mktemp("ckpt")
    assert (
        train.main([*TINY[:-2], "max_duration=2ba", f"save_folder={folder}", "save_interval=2ba", "progress=lines"])
        == 0
    )
    return folder / "latest-rank0.pt"


@pytest.fixture()
def hostile(tmp_path):
    marker = tmp_path / "MARKER"
    path = tmp_path / "hostile.pt"
    torch.save({"state": {"model": {}}, "rng": Hostile(marker)}, path)
    return path, marker


# --- item 7: hostile checkpoints -------------------------------------------------------------------------


@pytest.mark.parametrize("prog", ["generate.py", "export.py", "train.py"])
def test_a_hostile_checkpoint_runs_no_code_and_is_refused_in_one_line(prog, hostile, tmp_path, capsys):
    path, marker = hostile
    assert _open_checkpoint(prog, path, tmp_path) == 2
    line = _one_line(capsys, prog)
    assert not marker.exists()
    assert str(path) in line and "system" in line and "could run code" in line
    assert ("trust_checkpoint=true" if prog == "train.py" else "--trust_checkpoint") in line


def test_composers_own_load_is_weights_only_inside_the_trainer_build(hostile):
    """Composer 0.32.1 calls torch.load(weights_only=False) for load_path and autoresume; within
    safe_loading (all of build_trainer) torch is forced to weights_only, so the pickle cannot run."""
    from composer.utils.checkpoint import safe_torch_load

    from diffusion.checkpointing.unpickling import safe_loading

    path, marker = hostile
    with safe_loading(trust=False), pytest.raises(Exception, match="Weights only load failed"):
        safe_torch_load(str(path))
    assert not marker.exists()
    assert "TORCH_FORCE_WEIGHTS_ONLY_LOAD" not in os.environ  # restored after the build


def test_our_own_checkpoints_load_safely_and_resume(checkpoint, tmp_path):
    from diffusion.checkpointing.unpickling import load_checkpoint_file
    from diffusion.eval.trained_model import load_trained

    assert load_checkpoint_file(str(checkpoint))["state"]["timestamp"]  # weights_only, SAFE_GLOBALS only
    _, config, used_ema = load_trained(str(checkpoint))
    assert used_ema and config["model_name"] == "sd-tiny"
    # Composer's own load of load_path, under the forced weights_only (a type missing from SAFE_GLOBALS fails)
    assert train.main([*TINY, "max_duration=3ba", f"load_path={checkpoint}"]) == 0


def test_trust_checkpoint_loads_a_file_with_other_types(tmp_path):
    from fractions import Fraction

    from diffusion.checkpointing.unpickling import load_checkpoint_file

    path = tmp_path / "other.pt"
    torch.save({"state": {"note": Fraction(1, 3)}}, path)
    with pytest.raises(UsageError, match="holds fractions.Fraction.*trust_checkpoint=true"):
        load_checkpoint_file(str(path))
    assert load_checkpoint_file(str(path), trust=True)["state"]["note"] == Fraction(1, 3)


# --- item 6: damaged or foreign files ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "damage,message",
    [
        (0, "is zero bytes"),
        (1000, "is truncated or not a torch file: 1,000 bytes, not a zip archive"),
        ("json", "is truncated or not a torch file: 13 bytes, not a zip archive"),
    ],
)
@pytest.mark.parametrize("prog", ["generate.py", "export.py", "train.py"])
def test_a_damaged_checkpoint_is_one_line(prog, damage, message, checkpoint, tmp_path, capsys):
    path = tmp_path / "damaged.pt"
    if damage == "json":
        path.write_text('{"a": "json"}')
    else:
        shutil.copy(checkpoint, path)
        _cut(path, damage)
    assert _open_checkpoint(prog, path, tmp_path) == 2
    line = _one_line(capsys, prog)
    assert f"{path} {message}" in line


@pytest.fixture(scope="module")
def exported(sd_tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("exported") / "sd-tiny"
    sd_tiny.model.export(str(out), sd_tiny.tokenizers)
    return out


@pytest.mark.parametrize(
    "part,file,size,message",
    [
        ("vae", "diffusion_pytorch_model.safetensors", 100, "is a safetensors file whose header is cut (100 bytes"),
        ("vae", "diffusion_pytorch_model.safetensors", 0, "is zero bytes"),
        ("text_encoder", "model.safetensors", 5000, "is truncated: 5,000 bytes, its header lists tensors up to byte"),
    ],
)
def test_a_damaged_local_part_is_one_line(part, file, size, message, exported, tmp_path, capsys):
    folder = tmp_path / part
    shutil.copytree(exported / part, folder)
    _cut(folder / file, size)
    assert train.main([*TINY, "max_duration=1ba", f"{part}={folder}"]) == 2
    assert f"{part}: {folder / file} {message}" in _one_line(capsys, "train.py")


@pytest.mark.parametrize(
    "file,size,message",
    [
        ("unet/diffusion_pytorch_model.safetensors", 5000, "is a safetensors file whose header is cut"),
        ("model_index.json", 0, "is zero bytes"),
        ("model_index.json", 10, "is not JSON"),
    ],
)
def test_a_damaged_pipeline_directory_is_one_line(file, size, message, exported, tmp_path, capsys):
    folder = tmp_path / "pipe"
    shutil.copytree(exported, folder)
    _cut(folder / file, size)
    assert generate.main([str(folder), "--prompt", "x", "--out", str(tmp_path / "o")]) == 2
    assert f"{folder / file} {message}" in _one_line(capsys, "generate.py")


def test_a_damaged_clip_directory_names_the_file(exported, tmp_path):
    from diffusion.eval.clip_score import load_clip

    folder = tmp_path / "clip"
    shutil.copytree(exported / "text_encoder", folder)
    _cut(folder / "model.safetensors", 0)
    with pytest.raises(UsageError, match=f"--clip: {folder / 'model.safetensors'} is zero bytes"):
        load_clip(str(folder))


@pytest.fixture(scope="module")
def mds_shards(tmp_path_factory):
    """32 image-caption samples in 6 small shards."""
    out = write_mds_images(tmp_path_factory.mktemp("mds") / "shards", size_limit=1 << 15)
    assert len(list(out.glob("shard.*.mds"))) > 2
    return out


@pytest.mark.parametrize("damage", ["shard", "index"])
@pytest.mark.parametrize("prog", ["inspect", "bench", "train-local", "train-remote"])
def test_a_damaged_mds_dataset_is_one_line(prog, damage, mds_shards, tmp_path, capsys):
    folder = tmp_path / "mds"
    shutil.copytree(mds_shards, folder)
    if damage == "shard":
        bad, message = folder / "shard.00001.mds", "is truncated: 1,000 bytes, its index.json says"
        _cut(bad, 1000)
    else:
        bad, message = folder / "index.json", "is zero bytes"
        _cut(bad, 0)
    if prog == "inspect":
        rc = run("data.py", data.main, ["inspect", str(folder)])
    elif prog == "bench":
        rc = run(
            "data.py",
            data.main,
            ["bench", str(folder), "--image_size", "64", "--batch_size", "4", "--num_workers", "0"],
        )
    elif prog == "train-local":
        rc = train.main([*TINY, "max_duration=1ba", "use_synth_data=false", f"local={folder}"])
    else:
        if damage == "shard":
            pytest.skip("a remote shard is downloaded when read: the next test covers it")
        cache = tmp_path / "cache"
        rc = train.main([*TINY, "max_duration=1ba", "use_synth_data=false", f"remote={folder}", f"local={cache}"])
        bad = cache / "index.json"  # the copy Streaming downloaded and opened
    assert rc == 2
    prog = "data.py" if prog in ("inspect", "bench") else "train.py"
    assert f"{bad} {message}" in _one_line(capsys, prog)


def test_a_shard_cut_short_while_training_is_skipped_and_named(mds_shards, tmp_path, caplog):
    """A shard that turns bad after the dataset was opened (a download cut short) costs its samples, like
    a bad image (bad_samples.py), and the log names its file."""
    from diffusion.data.streaming import StreamingImageCaptionDataset

    folder = tmp_path / "mds"
    shutil.copytree(mds_shards, folder)
    ds = StreamingImageCaptionDataset(local=str(folder), tokenizers={}, image_size=32, batch_size=4)
    shard_id, _ = ds.spanner[len(ds) // 2]
    bad = folder / ds.shards[shard_id].raw_data.basename
    _cut(bad, 40)
    index = next(i for i in range(len(ds)) if ds.spanner[i][0] == shard_id)
    assert ds[index]["image"].shape == (3, 32, 32)  # the next readable sample stands in
    assert ds.skipped.counts["unreadable shard"] == 1
    assert str(bad) in ds.skipped.examples["unreadable shard"][0]
