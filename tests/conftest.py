import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")


def run(cmd: list[str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run a command from the repo's environment; output is captured for assertions and failures."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def composer(n: int, script: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    launcher = Path(sys.executable).with_name("composer")
    return run([str(launcher), "-n", str(n), str(REPO / script), *args], cwd=cwd)


def read_results(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


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
            w.write({"latent_moments": rng.standard_normal((8, 8, 8)).astype(np.float16),
                     "text_embeds": rng.standard_normal((77, 32)).astype(np.float16)})
    return out
