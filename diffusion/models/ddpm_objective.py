"""The DDPM objective's options (SD and SDXL's ``objective`` section) and the pieces that apply them: which
timesteps a training batch draws, the noise it adds, and how each sample's squared error is weighted.

- timesteps: ``uniform`` integers 0..T-1 (DDPM, the default), or ``logit_normal``: t = sigmoid(u),
  u ~ N(logit_mean, logit_std), mapped to the timestep min(floor(t T), T - 1), T the scheduler's
  num_train_timesteps ("Scaling Rectified Flow Transformers for High-Resolution Image Synthesis", Esser et al.
  2024, 3.1, the sampling FLUX's objective uses; larger t is noisier in both).
- loss_weighting: ``none`` (plain mean squared error, the default) or ``min_snr``: sample i's squared error
  times min(SNR_i, gamma) / SNR_i for an epsilon target and min(SNR_i, gamma) / (SNR_i + 1) for a v target,
  SNR_i = abar_i / (1 - abar_i) from the scheduler's alphas_cumprod at its timestep ("Efficient Diffusion
  Training via Min-SNR Weighting Strategy", Hang et al. 2023; diffusers' train_text_to_image.py weights so).
- noise_offset: the training noise plus noise_offset * N(0, 1) per sample and channel, constant over the
  image ("Diffusion with Offset Noise", Guttenberg 2023; diffusers' train_text_to_image.py --noise_offset).

All three change training only: the validation loss (sd.py's eval_forward) keeps evenly spread timesteps,
plain noise and an unweighted mean, so it compares across objectives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from diffusers.training_utils import compute_snr

from diffusion.settings import OneOf, Range, setting

TIMESTEPS = ("uniform", "logit_normal")
WEIGHTINGS = ("none", "min_snr")
# The keys that only mean something with another key's value: key -> (that key, its value).
APPLIES_WITH = {
    "logit_mean": ("timesteps", "logit_normal"),
    "logit_std": ("timesteps", "logit_normal"),
    "snr_gamma": ("loss_weighting", "min_snr"),
}


@dataclass
class DDPMObjective:
    """An SD or SDXL run's loss options (the ``objective`` section of a recipe). Training only: the
    validation loss is the same for every choice."""

    timesteps: str = setting(
        "uniform",
        "training timesteps: uniform integers 0..T-1, or logit_normal: t = sigmoid(N(logit_mean, logit_std)), "
        "timestep min(floor(t T), T - 1), T the scheduler's num_train_timesteps",
        OneOf(TIMESTEPS),
    )
    logit_mean: float = setting(0.0, "mean of u, t = sigmoid(u) (timesteps=logit_normal)", Range(ge=-10, le=10))
    logit_std: float = setting(1.0, "spread of u (timesteps=logit_normal)", Range(gt=0))
    loss_weighting: str = setting(
        "none",
        "per-sample weight of the training loss: none, or min_snr: min(SNR, snr_gamma) / SNR for epsilon, "
        "/ (SNR + 1) for v (Hang et al. 2023); the validation loss is never weighted",
        OneOf(WEIGHTINGS),
    )
    snr_gamma: float = setting(5.0, "gamma of loss_weighting=min_snr (the paper's 5)", Range(gt=0))
    noise_offset: float = setting(
        0.0, "training noise + noise_offset * N(0, 1) per sample and channel (offset noise; 0: none)", Range(ge=0, le=1)
    )


def sample_timesteps(objective: dict, num_train_timesteps: int, n: int, device) -> torch.Tensor:
    """``n`` training timesteps (long, 0..num_train_timesteps - 1) as ``objective["timesteps"]`` says."""
    if objective["timesteps"] == "uniform":
        return torch.randint(0, num_train_timesteps, (n,), device=device)
    t = torch.sigmoid(torch.randn(n, device=device) * objective["logit_std"] + objective["logit_mean"])
    return (t * num_train_timesteps).long().clamp_(0, num_train_timesteps - 1)


def offset_noise(noise: torch.Tensor, offset: float) -> torch.Tensor:
    """``noise`` plus ``offset`` times one normal draw per sample and channel (the same over the image)."""
    if offset == 0:
        return noise
    n, c = noise.shape[:2]
    return noise + offset * torch.randn(n, c, *([1] * (noise.ndim - 2)), device=noise.device, dtype=noise.dtype)


def loss_weights(objective: dict, scheduler, timesteps: torch.Tensor) -> torch.Tensor | None:
    """Each sample's weight of its mean squared error (None: unweighted). min_snr's limit at SNR 0 (a zero
    terminal SNR schedule) is 1 for epsilon, so it is written min(1, gamma / SNR) there."""
    if objective["loss_weighting"] == "none":
        return None
    snr = compute_snr(scheduler, timesteps)
    gamma = objective["snr_gamma"]
    if scheduler.config.prediction_type == "epsilon":
        return (gamma / snr).clamp(max=1.0)
    return snr.clamp(max=gamma) / (snr + 1)


def weighted_mse(pred: torch.Tensor, target: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """The mean squared error (in fp32), each sample's mean times its weight when ``weights`` are given."""
    if weights is None:
        return F.mse_loss(pred.float(), target.float())
    per_sample = F.mse_loss(pred.float(), target.float(), reduction="none").mean(dim=tuple(range(1, pred.ndim)))
    return (per_sample * weights.to(per_sample.device)).mean()
