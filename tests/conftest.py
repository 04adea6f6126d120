"""Shared by the test files: the repo path, launchers, and writers of small datasets and checkpoint readers.

Test files import what they need from here (``from conftest import ...``), never from each other. The repo
root is on sys.path through pyproject.toml's ``pythonpath``, so the entry-point scripts import as modules."""

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
# A stack newer than the tested one warns in one line at every entry point; the tests that expect exactly one
# line on stderr would fail on it where nothing broke. tests/test_versions.py checks the warning itself.
os.environ.setdefault("DIFFUSION_NO_NEWER_WARNING", "1")


def run(cmd: list[str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run a command from the repo's environment, importing this checkout's diffusion package (whatever the
    venv has installed); output is captured for assertions and failures."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=path)
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def composer(n: int, script: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    launcher = Path(sys.executable).with_name("composer")
    return run([str(launcher), "-n", str(n), str(REPO / script), *args], cwd=cwd)


def read_results(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# train.py overrides that keep a CPU run short: no evaluation, no loader workers.
FAST = ["eval_interval=null", "num_workers=0"]


def final_state(folder: Path) -> dict:
    """The model weights, EMA weights and batch count of the checkpoint ``latest-rank0.pt`` in ``folder``."""
    import torch

    from diffusion.callbacks.ema import ema_in_checkpoint

    state = torch.load(folder / "latest-rank0.pt", map_location="cpu", weights_only=False)["state"]
    ema = ema_in_checkpoint(state)
    return {"model": state["model"], "ema": ema, "batch": state["timestamp"]["Timestamp"]["batch"]}


def assert_same_weights(uninterrupted: Path, resumed: Path, batches: int) -> None:
    """The two save folders' final checkpoints (``latest-rank0.pt``) are at ``batches`` and hold bitwise the same
    model and EMA weights: what every kill-and-resume test ends with."""
    import torch

    a, b = final_state(uninterrupted), final_state(resumed)
    assert a["batch"] == b["batch"] == batches
    assert a["model"].keys() == b["model"].keys()
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name
    assert a["ema"] and a["ema"].keys() == b["ema"].keys()
    for name in a["ema"]:
        assert torch.equal(a["ema"][name], b["ema"][name]), name


def read_mds(path) -> list[dict]:
    """Every sample of an MDS dataset, in order."""
    from streaming import StreamingDataset

    ds = StreamingDataset(local=str(path))
    samples = [ds.get_item(i) for i in range(ds.num_samples)]
    del ds
    return samples


# Sources the way the tools people use write them (img2dataset tars with key.jpg/.txt/.json).


def image_bytes(w: int = 96, h: int = 80, seed: int = 0, fmt: str = "JPEG") -> bytes:
    """A smooth image with some texture (decodes like a photo, not like noise)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([(x * (c + 1) * 255 // max(w, 1) + y * 3 + rng.integers(0, 255)) % 256 for c in range(3)], -1)
    pixels = (base + rng.integers(0, 24, (h, w, 3))).clip(0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt)
    return buf.getvalue()


def _img2dataset_meta(key: str, i: int) -> dict:
    """img2dataset's json, with LAION scores (pwatermark missing on every 4th sample)."""
    m = {
        "key": key,
        "status": "success",
        "url": f"http://x/{key}.jpg",
        "width": 96,
        "height": 80,
        "original_width": 960 + i,
        "original_height": 800,
        "similarity": 0.3,
        "AESTHETIC_SCORE": 5.0 + i / 10,
    }
    if i % 4:
        m["pwatermark"] = i / 100
    return m


def _tar_add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def img2dataset_tar(path, shard: int, n: int, *, corrupt=(), truncated=(), no_caption=(), fmt="JPEG") -> list[str]:
    """A tar as img2dataset writes it; returns the keys of the samples that are good."""
    good = []
    with tarfile.open(path, "w") as tar:
        for i in range(n):
            key = f"{shard:05d}{i:04d}"
            data = image_bytes(seed=shard * 1000 + i, fmt=fmt)
            if i in corrupt:
                data = b"not an image at all"
            elif i in truncated:
                data = data[: len(data) // 2]
            _tar_add(tar, f"{key}.{'jpg' if fmt == 'JPEG' else fmt.lower()}", data)
            if i not in no_caption:
                _tar_add(tar, f"{key}.txt", f"a photo number {shard}-{i}".encode())
            _tar_add(tar, f"{key}.json", json.dumps(_img2dataset_meta(key, i)).encode())
            if not ({i} & (set(corrupt) | set(truncated) | set(no_caption))):
                good.append(key)
    return good


def img2dataset_dir(root, shards: int = 2, n: int = 8, **bad) -> list[str]:
    """img2dataset's webdataset output folder: NNNNN.tar + NNNNN.parquet + NNNNN_stats.json per shard."""
    root.mkdir(parents=True, exist_ok=True)
    keys = []
    for s in range(shards):
        keys += img2dataset_tar(root / f"{s:05d}.tar", s, n, **(bad if s == 0 else {}))
        (root / f"{s:05d}_stats.json").write_text(json.dumps({"count": n, "successes": n}))
        (root / f"{s:05d}.parquet").write_bytes(b"PAR1 metadata-only parquet stand-in PAR1")
    return keys


# MDS datasets in the layouts data.py writes them (convert's image-caption columns, precompute's latents).


def png_bytes(i: int, w: int = 12, h: int = 8) -> bytes:
    """A flat w x h PNG of grey level i % 256."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.full((h, w, 3), i % 256, dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def write_images(path, n: int, bad=(), pwatermark=lambda i: i / 100) -> str:
    """n samples in convert's layout; caption "sample i"; the images in ``bad`` do not decode."""
    from streaming import MDSWriter

    from diffusion.data.columns import image_caption_columns

    with MDSWriter(out=str(path), columns=image_caption_columns(["pwatermark"]), size_limit=4096) as w:
        for i in range(n):
            w.write(
                {
                    "key": f"k{i}",
                    "image": b"\xff\xd8garbage" if i in bad else png_bytes(i),
                    "caption": f"sample {i}",
                    "original_width": 12,
                    "original_height": 8,
                    "pwatermark": pwatermark(i),
                }
            )
    return str(path)


def write_latents(path, n, moments=(8, 8, 8), text=(77, 32), fixed=True) -> str:
    """n precomputed samples: latent_moments filled with i, text_embeds with -i (fixed: shapes in the schema)."""
    from streaming import MDSWriter

    from diffusion.data.columns import array_encoding

    enc = array_encoding if fixed else (lambda shape: "ndarray:float16")
    with MDSWriter(out=str(path), columns={"latent_moments": enc(moments), "text_embeds": enc(text)}) as w:
        for i in range(n):
            w.write({"latent_moments": np.full(moments, i, np.float16), "text_embeds": np.full(text, -i, np.float16)})
    return str(path)


@pytest.fixture(scope="session")
def sd_tiny():
    from diffusion.models import build_model

    return build_model("sd-tiny")


@pytest.fixture(scope="session")
def mds_images(tmp_path_factory) -> Path:
    """32 JPEG image-caption pairs of odd sizes, as MDS shards."""
    from PIL import Image
    from streaming import MDSWriter

    out = tmp_path_factory.mktemp("mds") / "images"
    rng = np.random.default_rng(0)
    with MDSWriter(out=str(out), columns={"image": "bytes", "caption": "str"}) as w:
        for i in range(32):
            buf = io.BytesIO()
            Image.fromarray(rng.integers(0, 255, (80, 96, 3), dtype=np.uint8)).save(buf, format="JPEG")
            w.write({"image": buf.getvalue(), "caption": f"a picture number {i}"})
    return out


@pytest.fixture(scope="session")
def mds_latents(tmp_path_factory) -> Path:
    """32 precomputed samples for sd-tiny at 64 px: 8-channel latent moments (8x8) and 77x32 embeddings."""
    from streaming import MDSWriter

    out = tmp_path_factory.mktemp("mds") / "latents"
    rng = np.random.default_rng(1)
    cols = {"latent_moments": "ndarray:float16", "text_embeds": "ndarray:float16"}
    with MDSWriter(out=str(out), columns=cols) as w:
        for _ in range(32):
            w.write(
                {
                    "latent_moments": rng.standard_normal((8, 8, 8)).astype(np.float16),
                    "text_embeds": rng.standard_normal((77, 32)).astype(np.float16),
                }
            )
    return out


@pytest.fixture(scope="session")
def slurm():
    """A real 2-node Slurm 22.05 cluster on this machine (tests/slurm_cluster.py), up for the whole session. Where
    the machine cannot run one (not root, no namespaces, packages missing) the tests skip with one line; with
    DIFFUSION_REQUIRE_CLUSTER=1 (CI) that is a failure instead."""
    from slurm_cluster import SlurmCluster, unavailable

    why = unavailable()
    if why:
        (pytest.fail if os.environ.get("DIFFUSION_REQUIRE_CLUSTER") == "1" else pytest.skip)(why)
    # Not under pytest's tmp folder: that is private to root, and munged (as the munge user) reads its key here.
    root = Path(tempfile.mkdtemp(prefix="diffusion-slurm-"))
    cluster = SlurmCluster(root).start()
    yield cluster
    cluster.stop()
    shutil.rmtree(root, ignore_errors=True)
