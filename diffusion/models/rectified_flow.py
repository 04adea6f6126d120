"""The rectified-flow objective that FLUX.1, SD3, FLUX.2, Z-Image and Qwen-Image share, beside ddpm_objective.py
(SD and SDXL): its settings, declared once here (``RectifiedFlow``; a family's ``objective`` section takes the keys
it uses with ``settings.same_as``, and declares its own where its reference scripts differ), and the pieces of a
training and a validation step that apply them ("Scaling Rectified Flow Transformers for High-Resolution Image
Synthesis", Esser et al. 2024).

- timesteps: t uniform in [0, 1], or t = sigmoid(u), u ~ N(logit_mean, logit_std) (a section without the
  ``timesteps`` key: always the latter, as FLUX.1's and SD3's scripts draw); then shifted towards noise,
  t -> s t / (1 + (s - 1) t), s fixed or (shift=auto) exp(mu) with mu linear in the image tokens between
  (base_seq_len, base_shift) and (max_seq_len, max_shift), as FLUX.1's scheduler computes it;
- x_t = (1 - t) x0 + t eps, and the target is the velocity eps - x0 (mean squared error);
- text dropout: a sample's text states zeroed with probability text_dropout (classifier-free guidance);
- validation as MLPerf Training's FLUX benchmark: every validation sample carries a fixed timestep index k in
  0..N-1 (t = k / N) and fixed noise; the metric is the mean loss per timestep, then the mean over the timesteps,
  summed exactly across ranks (``TimestepBinnedLoss``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from diffusers.pipelines.flux.pipeline_flux import calculate_shift
from torchmetrics import Metric

from diffusion.batch import SAMPLE_ID, TIMESTEP_INDEX
from diffusion.models.base import EVAL_SEED
from diffusion.settings import Either, OneOf, Range, setting

TIMESTEPS = ("uniform", "logit_normal")


@dataclass
class RectifiedFlow:
    """The objective's settings, for the families' sections to take (``settings.same_as``)."""

    timesteps: str = setting(
        "uniform",
        "training t: uniform in [0, 1], or logit_normal (logit_mean, logit_std); then shifted (shift)",
        OneOf(TIMESTEPS),
    )
    logit_mean: float = setting(0.0, "timestep t = sigmoid(u), u ~ N(logit_mean, logit_std)", Range(ge=-10, le=10))
    logit_std: float = setting(1.0, "spread of u (see logit_mean)", Range(gt=0))
    shift: Any = setting(
        1.0, "t -> s t / (1 + (s - 1) t); auto: s = exp(mu(image tokens)) as in FLUX.1", Either(Range(gt=0), ("auto",))
    )
    base_seq_len: int = setting(256, "image tokens at which shift=auto gives base_shift", Range(gt=0, integer=True))
    max_seq_len: int = setting(4096, "image tokens at which shift=auto gives max_shift", Range(gt=0, integer=True))
    base_shift: float = setting(0.5, "mu at base_seq_len (shift=auto)", Range(ge=0))
    max_shift: float = setting(1.15, "mu at max_seq_len (shift=auto)", Range(ge=0))
    text_dropout: float = setting(
        0.0, "probability of zeroing a sample's text conditioning (classifier-free guidance)", Range(ge=0, lt=1)
    )
    guidance: float = setting(1.0, "guidance-embedding input, for models built with guidance_embeds", Range(ge=0))
    val_timesteps: int = setting(8, "validation timesteps t = k / N, k = 0..N-1 (MLPerf: 8)", Range(gt=0, integer=True))


def shift(objective: dict, image_tokens: int) -> float:
    """s of the timestep shift for an image of ``image_tokens`` tokens."""
    if objective["shift"] == "auto":
        o = objective
        return math.exp(
            calculate_shift(image_tokens, o["base_seq_len"], o["max_seq_len"], o["base_shift"], o["max_shift"])
        )
    return float(objective["shift"])


def sample_timesteps(objective: dict, n: int, image_tokens: int, device) -> torch.Tensor:
    """``n`` training timesteps in [0, 1] for images of ``image_tokens`` tokens, drawn and shifted as ``objective``
    says."""
    if objective.get("timesteps", "logit_normal") == "uniform":
        t = torch.rand(n, device=device)
    else:
        t = torch.sigmoid(torch.randn(n, device=device) * objective["logit_std"] + objective["logit_mean"])
    s = shift(objective, image_tokens)
    return s * t / (1 + (s - 1) * t)


def noised(x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_t, the velocity target) for clean latents ``x0`` (batch first), ``noise`` and timesteps ``t``."""
    tt = t.view(-1, *[1] * (x0.dim() - 1))
    return (1 - tt) * x0 + tt * noise, noise - x0


def drop_text(text: tuple, p: float, n: int, device) -> tuple:
    """``text`` (a family's encode_text: states, and a pooled embedding, lengths or None) with each of ``n`` samples'
    states zeroed with probability ``p``: its floating-point tensors; lengths and None pass unchanged. One draw of
    ``n`` uniforms when p > 0, none otherwise."""
    if p <= 0:
        return text
    keep = torch.rand(n, device=device) >= p
    return tuple(
        part * keep.to(text[0].dtype).view(-1, *[1] * (part.dim() - 1))
        if isinstance(part, torch.Tensor) and part.is_floating_point()
        else part
        for part in text
    )


def validation_bins(batch: dict, n: int, bins: int) -> tuple[torch.Tensor, list[int]]:
    """(each sample's timestep bin, its sample id): the bin from the batch's timestep index, else its sample id mod
    ``bins``, else its position; the id from the batch's sample id, else its position."""
    ids = batch[SAMPLE_ID].long().cpu() if SAMPLE_ID in batch else torch.arange(n)
    device = next(iter(batch.values())).device
    binned = (batch[TIMESTEP_INDEX].long() if TIMESTEP_INDEX in batch else ids % bins).to(device)
    return binned, ids.tolist()


def fixed_noise(ids: list[int], shape: tuple, offset: int, device) -> torch.Tensor:
    """Noise of ``shape`` per sample id, the same on any device and rank (CPU generators seeded EVAL_SEED + offset +
    id)."""
    return torch.stack(
        [torch.randn(shape, generator=torch.Generator().manual_seed(EVAL_SEED + offset + i)) for i in ids]
    ).to(device)


class TimestepBinnedLoss(Metric):
    """Mean over timestep bins of the mean per-sample loss in each bin (MLPerf FLUX validation loss).
    Sums and counts are reduced across ranks, so the result is exact however samples are split."""

    full_state_update = False

    def __init__(self, num_bins: int = 8, **kwargs):
        super().__init__(**kwargs)
        self.add_state("loss_sum", default=torch.zeros(num_bins, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", default=torch.zeros(num_bins, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, per_sample_loss: torch.Tensor, bins: torch.Tensor) -> None:
        self.loss_sum.index_add_(0, bins, per_sample_loss.detach().double())
        self.count.index_add_(0, bins, torch.ones_like(per_sample_loss, dtype=torch.float64))

    def compute(self) -> torch.Tensor:
        seen = self.count > 0
        return (self.loss_sum[seen] / self.count[seen]).mean().float()
