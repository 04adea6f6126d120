"""FID pieces around torchmetrics' FrechetInceptionDistance: Inception weights from a local file, reference
statistics from an .npz (``mu``/``sigma``, as MLPerf ships them) or from a folder of images.

torchmetrics keeps the real set as running sums (features, outer products, count), summed across ranks at
``compute``. Statistics from an npz enter as the sums of a two-sample set with exactly that mean and
covariance, held by rank 0 only, so the sum over ranks is the npz itself.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from PIL import Image

from diffusion.checkpointing.unpickling import safe_loading
from diffusion.errors import UsageError

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
FEATURE_DIMS = (64, 192, 768, 2048)  # Inception v3 layers torchmetrics offers; FID proper uses 2048
INCEPTION_URL = (
    "https://github.com/toshas/torch-fidelity/releases/download/v0.2.0/weights-inception-2015-12-05-6726825d.pth"
)


def load_fid(inception: str | torch.nn.Module, features: int = 2048):
    """FrechetInceptionDistance on the Inception v3 weights file ``inception`` (or any module mapping uint8
    NCHW images to (N, d) features). Reference features are kept across ``reset`` (set them once)."""
    from torchmetrics.image.fid import FrechetInceptionDistance

    if isinstance(inception, torch.nn.Module):
        return FrechetInceptionDistance(feature=inception, reset_real_features=False)
    if features not in FEATURE_DIMS:
        raise UsageError(
            f"--fid_features {features} is not one of {', '.join(map(str, FEATURE_DIMS))} "
            "(2048, the pool layer, is the FID everyone reports)"
        )
    if not os.path.isfile(inception):
        raise UsageError(
            f"--inception: weights file {inception!r} does not exist; download {INCEPTION_URL} "
            "(see docs/evaluation.md) and pass its path"
        )
    try:
        import torch_fidelity  # noqa: F401
    except ImportError:
        raise UsageError(
            "--inception: FID needs torch-fidelity (Inception v3 for torchmetrics); pip install torch-fidelity==0.4.0"
        ) from None
    try:  # torch-fidelity unpickles the file with weights_only=False: forced to weights_only (unpickling.py)
        with safe_loading():
            return FrechetInceptionDistance(
                feature=features, feature_extractor_weights_path=inception, reset_real_features=False
            )
    except Exception as e:  # not a torch file, a pickle of anything but tensors, or a state dict of another network
        first = (str(e).splitlines() or [type(e).__name__])[0][:200]
        raise UsageError(
            f"--inception: {inception!r} is not the FID Inception v3 weights ({first}); use {INCEPTION_URL}"
        ) from None


def read_stats(path: str) -> tuple[np.ndarray, np.ndarray]:
    """(mu, sigma) from an npz with those two arrays (pytorch-fid / MLPerf layout)."""
    if not os.path.isfile(path):
        raise UsageError(f"--reference_stats: file {path!r} does not exist")
    try:
        with np.load(path) as f:
            missing = [k for k in ("mu", "sigma") if k not in f.files]
            if missing:
                raise UsageError(
                    f"--reference_stats: {path!r} has no {' or '.join(missing)} array (it holds: "
                    f"{', '.join(f.files) or 'nothing'}); pass FID statistics saved as mu=, sigma="
                )
            mu, sigma = f["mu"].astype(np.float64), f["sigma"].astype(np.float64)
    except UsageError:
        raise
    except Exception as e:
        raise UsageError(f"--reference_stats: {path!r} is not a readable .npz ({str(e).splitlines()[0]})") from None
    if mu.ndim != 1 or sigma.shape != (mu.size, mu.size):
        raise UsageError(
            f"--reference_stats: {path!r} holds mu {mu.shape} and sigma {sigma.shape}; expected (d,) and (d, d)"
        )
    return mu, sigma


def set_reference_stats(fid, mu: np.ndarray, sigma: np.ndarray, *, rank: int = 0) -> None:
    """Make ``fid``'s real set the Gaussian (mu, sigma): sums of a 2-sample set with that mean and
    covariance on rank 0, zeros elsewhere (the states are summed over ranks)."""
    dim = fid.real_features_sum.numel()
    if mu.size != dim:
        raise UsageError(
            f"--reference_stats holds {mu.size}-dimensional statistics but the FID features are "
            f"{dim}-dimensional; use statistics of the same Inception layer (--fid_features {mu.size})"
        )
    fid.real_features_sum.zero_()
    fid.real_features_cov_sum.zero_()
    fid.real_features_num_samples.zero_()
    if rank == 0:
        n = 2
        m = torch.as_tensor(mu, dtype=torch.float64, device=fid.real_features_sum.device)
        s = torch.as_tensor(sigma, dtype=torch.float64, device=m.device)
        fid.real_features_sum += n * m
        fid.real_features_cov_sum += (n - 1) * s + n * torch.outer(m, m)
        fid.real_features_num_samples += n


def reference_stats(fid) -> tuple[np.ndarray, np.ndarray]:
    """(mu, sigma) of ``fid``'s real set over all ranks (call on every rank)."""
    with fid.sync_context():
        n = int(fid.real_features_num_samples)
        if n < 2:
            raise UsageError("FID needs at least 2 reference images")
        mu = fid.real_features_sum / n
        sigma = (fid.real_features_cov_sum - n * torch.outer(mu, mu)) / (n - 1)
        return mu.cpu().numpy(), sigma.cpu().numpy()


def list_images(folder: str) -> list[str]:
    if not os.path.isdir(folder):
        raise UsageError(f"--reference_images: folder {folder!r} does not exist")
    files = sorted(f for f in os.listdir(folder) if f.lower().endswith(IMAGE_EXTENSIONS))
    if not files:
        raise UsageError(f"--reference_images: {folder!r} holds no images ({', '.join(IMAGE_EXTENSIONS)})")
    return [os.path.join(folder, f) for f in files]


def to_uint8(images: list[Image.Image]) -> torch.Tensor:
    """PIL images of one size -> uint8 (N, 3, H, W), the input torchmetrics' Inception expects."""
    return torch.stack([torch.from_numpy(np.array(im.convert("RGB"))).permute(2, 0, 1) for im in images])


def add_reference_images(fid, paths: list[str], *, batch_size: int = 32, device="cpu") -> None:
    """Real-set features from image files; runs of consecutive same-size images go through in batches."""
    batch: list[Image.Image] = []
    for path in paths + [None]:
        im = None
        if path is not None:
            try:
                with Image.open(path) as f:
                    im = f.convert("RGB")
            except OSError as e:
                raise UsageError(f"--reference_images: cannot read {path!r} ({e})") from None
        if batch and (im is None or im.size != batch[0].size or len(batch) == batch_size):
            fid.update(to_uint8(batch).to(device), real=True)
            batch = []
        if im is not None:
            batch.append(im)
