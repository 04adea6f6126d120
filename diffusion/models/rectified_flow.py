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

A family composes the objective by listing ``RectifiedFlowSteps`` before ``LatentDiffusion`` among its bases: it gives
the family its ComposerModel steps (forward, loss, eval_forward and the validation metric), and the family gives
the steps its own pieces: ``encode_latents`` (clean latents), ``encode_text`` (a tuple of text states and a pooled
embedding, lengths or None), ``image_tokens`` (what shift=auto reads) and ``_predict`` (x0, noise, t, *text ->
(prediction, target)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from diffusers.pipelines.flux.pipeline_flux import calculate_shift
from torchmetrics import Metric

from diffusion.batch import IMAGE, LATENT_MOMENTS, SAMPLE_ID, TIMESTEP_INDEX
from diffusion.errors import UsageError, spell
from diffusion.models.base import EVAL_SEED, hw
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


# shift=auto's line as a pipeline's FlowMatchEulerDiscreteScheduler records it: objective key -> scheduler config key
SCHEDULER_LINE = {
    "base_seq_len": "base_image_seq_len",
    "max_seq_len": "max_image_seq_len",
    "base_shift": "base_shift",
    "max_shift": "max_shift",
}


def scheduler_line(objective: dict, scheduler, given: dict) -> None:
    """shift=auto's line in ``objective`` set from ``scheduler``'s config (a folder's or a preset's), as the pipelines
    that compute mu from their scheduler's config do (Krea2Pipeline, QwenImage21Pipeline), except the keys the run's
    own objective section (``given``) sets; none without a scheduler."""
    for key, name in SCHEDULER_LINE.items():
        if scheduler is not None and key not in given and name in scheduler.config:
            objective[key] = scheduler.config[name]


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


class RectifiedFlowSteps:
    """A rectified-flow family's ComposerModel steps (see the module's docstring for what the family provides). Its
    ``objective`` section is the constructor's ``objective`` option; ``prediction_type`` (SD's) is refused."""

    OPTIONS = ("objective",)

    def __init__(self, scheduler=None, *, objective: dict | None = None, encoder_dtype=None, **parts):
        """``parts`` by the family's PARTS names (the trained part, the VAE, the text encoders); ``scheduler`` the
        pipeline's (None: the family's default); ``objective`` the section's values (a preset's, then a run's)."""
        merged = self.objective_options(objective)
        if set(parts) != set(self.PARTS):
            raise TypeError(f"{type(self).__name__} takes the parts {', '.join(self.PARTS)}, not {', '.join(parts)}")
        super().__init__(encoder_dtype, **{name: parts[name] for name in self.PARTS})
        self.objective = merged
        self.scheduler = scheduler

    @classmethod
    def check_config(cls, cfg) -> None:
        if cfg.prediction_type is not None:
            raise UsageError(
                f"{spell('prediction_type')} applies to SD models; {cfg.model_name} is a {cls.NAME} model "
                "(rectified flow always predicts the velocity noise - data)"
            )
        super().check_config(cfg)

    @property
    def prediction_type(self) -> str:
        """What the denoiser predicts, as results lines record it."""
        return "flow"

    @property
    def text_length(self) -> int:
        """Text states per caption (the objective's max_sequence_length)."""
        return self.objective["max_sequence_length"]

    def forward(self, batch: dict):
        """One training step's (prediction, target): the rectified-flow objective on this family's inputs."""
        x0 = self.encode_latents(batch)
        n = x0.shape[0]
        text = drop_text(self.encode_text(batch), self.objective["text_dropout"], n, x0.device)
        t = sample_timesteps(self.objective, n, self.image_tokens(x0), x0.device)
        return self._predict(x0, torch.randn_like(x0), t, *text)

    def loss(self, outputs, batch):
        pred, target = outputs[0], outputs[1]
        return F.mse_loss(pred.float(), target.float())

    def eval_forward(self, batch: dict, outputs=None):
        """MLPerf validation: t = k / val_timesteps from each sample's timestep bin, and noise fixed per sample id
        (CPU-seeded, so the same on any device)."""
        if outputs is not None:
            return outputs
        n, image_size = self.batch_size_and_image_size(batch)
        k_max = self.objective["val_timesteps"]
        bins, ids = validation_bins(batch, n, k_max)
        moments_noise = None
        if IMAGE in batch or LATENT_MOMENTS in batch:  # the VAE posterior is sampled: fix its noise too
            h, w = (side // self.vae_scale_factor for side in hw(image_size))
            moments_noise = fixed_noise(ids, (self.latent_channels, h, w), 10_000_000, bins.device)
        x0 = self.encode_latents(batch, posterior_noise=moments_noise)
        text = self.encode_text(batch)
        noise = fixed_noise(ids, tuple(x0.shape[1:]), 0, bins.device)
        pred, target = self._predict(x0, noise, bins.float() / k_max, *text)
        return pred, target, bins

    def get_metrics(self, is_train: bool = False):
        return {} if is_train else {"ValidationLoss": TimestepBinnedLoss(self.objective["val_timesteps"])}

    def update_metric(self, batch, outputs, metric) -> None:
        pred, target, bins = outputs
        metric.update(((pred.float() - target.float()) ** 2).flatten(1).mean(dim=1), bins)
