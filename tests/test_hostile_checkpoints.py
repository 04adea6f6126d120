"""A hostile checkpoint from elsewhere runs no code on any path that reads one (docs/reliability.md, "Checkpoints from
elsewhere"): each path is given a pickle that, unpickled as it stands, leaves a marker file; the marker must not
appear, and an entry point stops in one line naming the file and the trust_checkpoint key (exit 2). A checkpoint
file is refused by torch.load's weights_only (diffusion/checkpointing/unpickling.py); a sharded folder's ``.metadata``, which
torch.distributed.checkpoint unpickles with a plain pickle.load, by ``unpickling.MetadataUnpickler``, installed
where every sharded read goes through, Composer's own included. Trusted, the payload does run: the tests can fail.
Files, load_path files, generate.py and export.py given a hostile file: tests/test_file_faults.py."""

import os
import pickle

import pytest
import torch
from conftest import REPO, pretrained_folder

import evaluate
import export
import generate
import train
from diffusion.bench import curves
from diffusion.cli import run
from diffusion.errors import UsageError

TINY = [str(REPO / "yamls/sd-tiny-cpu.yaml"), "eval_interval=null", "num_workers=0", "batch_size=4"]
TINY += ["progress=lines", "max_duration=1ba"]


class Hostile:
    """Unpickled unrestricted, it runs a shell command that leaves a marker file (``os.system``: posix.system)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture()
def marker(tmp_path):
    return tmp_path / "MARKER"


def hostile_file(path, marker):
    """A checkpoint file shaped as ours (a 'state'), whose 'rng' entry is the payload."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"state": {"model": {}}, "rng": Hostile(marker)}, path)
    return path


def hostile_folder(path, marker):
    """A sharded checkpoint folder whose ``.metadata`` is the payload (what FileSystemReader unpickles first)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / ".metadata").write_bytes(pickle.dumps(Hostile(marker)))
    return path


def _one_line(capsys, prog: str) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith(f"{prog}: error: "), err
    return err[0]


def _refused(line: str, path, flag: str) -> None:
    """The line names the file and the payload's function, says code could run, and how to trust it."""
    assert str(path) in line and "system" in line and flag in line, line


# --- the readers themselves -------------------------------------------------------------------------------------


def _torch_reader(folder):
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(str(folder)).read_metadata()


def _composers_reader(folder):
    """What Composer 0.32.1's load_sharded_checkpoint reads a local folder with (autoresume, load_path, fsdp)."""
    from composer.utils.checkpoint import FileSystemReaderWithValidation

    return FileSystemReaderWithValidation(str(folder)).read_metadata()


def _read_sharded(folder):
    from diffusion.checkpointing.local import read_sharded

    return read_sharded(str(folder))


def _unsharded(folder):
    from diffusion.checkpointing.local import unsharded

    return unsharded(str(folder))


READERS = {"torch": _torch_reader, "composer": _composers_reader, "read_sharded": _read_sharded,
           "unsharded": _unsharded}  # fmt: skip


@pytest.mark.parametrize("reader", READERS)
def test_every_reader_of_a_sharded_folder_refuses_a_hostile_metadata(reader, tmp_path, marker):
    folder = hostile_folder(tmp_path / "ep0-ba2", marker)
    with pytest.raises((pickle.UnpicklingError, UsageError), match=r"posix\.system"):
        READERS[reader](folder)
    assert not marker.exists()
    assert not (tmp_path / "ep0-ba2-rank0.pt").exists()  # the converter wrote nothing


def test_trusted_the_payload_runs(tmp_path, marker):
    """The same reads with trust_checkpoint: unrestricted, as torch and Composer read without the guard."""
    from diffusion.checkpointing.local import check_checkpoint
    from diffusion.checkpointing.unpickling import safe_loading

    folder = hostile_folder(tmp_path / "ep0-ba2", marker)
    with safe_loading(trust=True), pytest.raises(AttributeError):  # the payload's result is no Metadata
        _composers_reader(folder)
    assert marker.exists()
    marker.unlink()
    check_checkpoint(str(hostile_file(tmp_path / "ep0-ba4-rank0.pt", marker)), trust=True)
    assert marker.exists()


def test_check_checkpoint_skips_a_hostile_folder_or_file_with_the_reason(tmp_path, marker):
    from diffusion.checkpointing.local import check_checkpoint

    for path in (hostile_folder(tmp_path / "ep0-ba2", marker), hostile_file(tmp_path / "ep0-ba4-rank0.pt", marker)):
        why = check_checkpoint(str(path))
        assert "holds a type no checkpoint of this project does" in why and "posix.system" in why, why
        assert why.endswith("trust it with trust_checkpoint=true")
    assert not marker.exists()


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch: no process group; TypedStorage
def test_a_sharded_folder_torch_wrote_still_loads(tmp_path):
    """The allowed globals are those torch's writer puts in a .metadata (every dtype a run holds, objects saved as
    bytes, the path it records); read through the guarded reader, Composer's too."""
    import torch.distributed.checkpoint as dcp

    from diffusion.checkpointing.local import check_checkpoint, read_sharded

    state = {"w": torch.arange(6.0), "h": torch.ones(2, dtype=torch.bfloat16), "u": torch.zeros(3, dtype=torch.uint8),
             "i": torch.arange(2), "rng": {"python": (3, (1, 2), None)}, "note": "x"}  # fmt: skip
    folder = tmp_path / "ep0-ba2"
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(folder)), no_dist=True)
    assert check_checkpoint(str(folder)) is None
    assert _composers_reader(folder).state_dict_metadata.keys() >= {"w", "h", "u", "i", "note"}
    loaded = read_sharded(str(folder))
    assert torch.equal(loaded["h"], state["h"]) and loaded["rng"] == state["rng"] and loaded["note"] == "x"


# --- the entry points -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["file", "sharded"])
def test_autoresume_refuses_a_hostile_checkpoint_in_one_line(kind, tmp_path, marker, capsys):
    folder = tmp_path / "ck"
    if kind == "file":
        hostile_file(folder / "ep0-ba2-rank0.pt", marker)
        os.symlink("ep0-ba2-rank0.pt", folder / "latest-rank0.pt")
    else:
        hostile_folder(folder / "ep0-ba2", marker)
        os.symlink("ep0-ba2", folder / "latest-rank0.pt")
    assert train.main([*TINY, f"save_folder={folder}", "autoresume=true"]) == 2
    line = _one_line(capsys, "train.py")
    assert not marker.exists()
    assert f"autoresume: no checkpoint in {folder} loads" in line and "holds a type no checkpoint" in line, line
    _refused(line, "ep0-ba2", "trust_checkpoint=true")


@pytest.mark.parametrize("fsdp", [False, True], ids=["converted", "fsdp"])
def test_load_path_refuses_a_hostile_sharded_folder_in_one_line(fsdp, tmp_path, marker, capsys):
    """Without FSDP the folder would be converted (checkpointing.local.unsharded); with FSDP Composer's own sharded load
    reads it, on every rank: checked first on each (one process here; fsdp=true needs two to train)."""
    folder = hostile_folder(tmp_path / "ep0-ba2", marker)
    if fsdp:
        from diffusion.config import TrainConfig
        from diffusion.errors import keys_spelled
        from diffusion.trainer import _check_checkpoints

        with keys_spelled(flags=False), pytest.raises(UsageError) as refused:  # as train.py spells keys
            _check_checkpoints(TrainConfig(load_path=str(folder), fsdp=True, autoresume=False), on_gpu=False)
        line = f"train.py: error: {refused.value}"
    else:
        assert train.main([*TINY, f"load_path={folder}"]) == 2
        line = _one_line(capsys, "train.py")
    assert not marker.exists() and not (tmp_path / "ep0-ba2-rank0.pt").exists()
    assert line.startswith(f"train.py: error: load_path {folder / '.metadata'} holds posix.system, which a checkpoint")
    _refused(line, folder / ".metadata", "trust_checkpoint=true")


def _tool(prog: str, source, tmp_path) -> int:
    out = str(tmp_path / "out")
    if prog == "export.py":
        return export.main([str(source), out])
    if prog == "generate.py":
        return generate.main([str(source), "--prompt", "x", "--steps", "1", "--out", out])
    (tmp_path / "prompts.txt").write_text("a\nb\n")
    quality = ["--inception", "i.pth", "--clip", "clip", "--reference_stats", "r.npz"]  # read by _metrics alone
    return evaluate.main([str(source), "--prompts", str(tmp_path / "prompts.txt"), *quality])


@pytest.mark.parametrize("kind", ["file", "sharded"])
@pytest.mark.parametrize("prog", ["export.py", "generate.py", "evaluate.py"])
def test_the_tools_refuse_a_hostile_checkpoint_in_one_line(prog, kind, tmp_path, marker, capsys, monkeypatch):
    """evaluate.py loads its Inception and CLIP weights (``_metrics``) before the source: left out here, they are not
    what is tested (tests/test_quality.py loads them)."""
    monkeypatch.setattr(evaluate, "_metrics", lambda *a, **k: None)
    if kind == "file":
        source = hostile_file(tmp_path / "ck" / "ep0-ba2-rank0.pt", marker)
        named = source
    else:
        source = hostile_folder(tmp_path / "ck" / "ep0-ba2", marker)
        named = source / ".metadata"
    assert _tool(prog, source, tmp_path) == 2
    line = _one_line(capsys, prog)
    assert not marker.exists()
    assert line.startswith(f"{prog}: error: checkpoint {named} holds posix.system, which a checkpoint"), line
    _refused(line, named, "--trust_checkpoint")


def test_curves_refuses_a_hostile_checkpoint_in_one_line(tmp_path, marker, capsys, monkeypatch):
    """diffusion.bench.curves measuring checkpoints already there (--collect_only): each is read for its batch,
    samples and time first (curve_quality.trained_to)."""
    monkeypatch.chdir(REPO)
    hostile_file(tmp_path / "a" / "ep0-ba3-rank0.pt", marker)
    argv = ["yamls/sd-tiny-cpu.yaml", "max_duration=3ba", "--variant", "a", "--every", "3ba", "--quality",
            "os.path:getsize", "--better", "higher", "--out", str(tmp_path), "--collect_only"]  # fmt: skip
    assert run("diffusion.bench.curves", curves.main, argv) == 2
    line = _one_line(capsys, "diffusion.bench.curves")
    assert not marker.exists()
    _refused(line, tmp_path / "a" / "ep0-ba3-rank0.pt", "--trust_checkpoint")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return pretrained_folder(tmp_path_factory.mktemp("base") / "sd", "sd-tiny")


@pytest.mark.parametrize("name", ["pytorch_lora_weights.safetensors", "pytorch_lora_weights.bin"])
def test_a_lora_folder_holding_a_pickle_runs_no_code(name, base, tmp_path, marker, capsys):
    """--lora reads safetensors only (lora.adapter_file picks a .safetensors file; diffusers reads it with
    safetensors, which holds no code): a pickle under that name is not a safetensors file, and under diffusers'
    pickle name (.bin) it is not read at all."""
    folder = tmp_path / "lora"
    folder.mkdir()
    torch.save({"w": Hostile(marker)}, folder / name)
    argv = [base, "--lora", str(folder), "--prompt", "x", "--steps", "1", "--out", str(tmp_path / "s")]
    assert generate.main(argv) == 2
    line = _one_line(capsys, "generate.py")
    assert not marker.exists()
    assert str(folder) in line, line


def test_inception_weights_that_hold_code_are_refused(tmp_path, marker):
    """evaluate.py's and the quality callback's --inception file: torch-fidelity unpickles it with
    weights_only=False; forced to weights_only, a payload is refused as not the Inception weights."""
    from diffusion.eval.fid import load_fid

    path = tmp_path / "inception.pth"
    torch.save({"w": Hostile(marker)}, path)
    with pytest.raises(UsageError, match="is not the FID Inception v3 weights"):
        load_fid(str(path), 64)
    assert not marker.exists()


def test_a_hostile_sharded_folder_in_a_bucket_runs_no_code(s3, tmp_path, marker):
    """save_folder=s3://...: the pointer on a folder whose .metadata is the payload (Composer's own autoresume would
    unpickle it through DistCPObjectStoreReader); a checkpoint object that is the payload."""
    from diffusion.checkpointing import remote as remote_checkpoints

    client = s3.client()
    url = f"s3://{s3.bucket}/run"
    client.upload_file(str(hostile_folder(tmp_path / "ep0-ba2", marker) / ".metadata"), s3.bucket, "run/ep0-ba2/.metadata")  # fmt: skip
    remote_checkpoints.write_pointer(url, "run/ep0-ba2")
    with pytest.raises(UsageError, match=r"the pointer names ep0-ba2, whose \.metadata holds a type .*posix\.system.*trust_checkpoint=true"):  # fmt: skip
        remote_checkpoints.remote_resume_point(url)
    client.upload_file(str(hostile_file(tmp_path / "ep0-ba4-rank0.pt", marker)), s3.bucket, "file/ep0-ba4-rank0.pt")
    with pytest.raises(UsageError, match=r"no checkpoint in s3://.*/file loads .*posix\.system.*trust_checkpoint=true"):
        remote_checkpoints.remote_resume_point(f"s3://{s3.bucket}/file")
    assert not marker.exists()
