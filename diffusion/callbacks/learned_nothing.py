"""Say so when a run learned nothing: its figures at the end are those of a model that never trained.

Two signs, each checked at the end of a run of at least ``MIN_BATCHES`` batches on real data (synthetic
images have nothing to learn):

- **PSNR near a flat image's.** Where the model's eval metrics hold a PSNR (an autoencoder), the eval
  images' mean colour as a flat image is the baseline: a reconstruction less than ``PSNR_MARGIN_DB``
  above it learned no more than one colour (Qwen-Image's autoencoder through its decode's clamp sat at
  the all-white image's PSNR on shapes on white: docs/training.md). The baseline comes from the first
  eval's images, all ranks' together.
- **A loss that never left its start**, for weights drawn at random (a preset): the mean loss of the
  last ``WINDOW`` batches less than ``LOSS_DROP`` below that of the first ``WINDOW``. A fine-tune starts
  from weights that already fit; its loss is not expected to fall, so it is not judged.

Either sign gives rank 0's one ``PROG: warning: learned nothing: ...`` line on stderr and the results
line's ``learned_nothing`` field (None when neither holds). The run still exits 0: it did what it was
asked; the warning says its result is worth nothing. The first losses are kept in the checkpoint, so a
resumed run judges from the run's real start.
"""

from __future__ import annotations

import math
import os
import sys
from collections import deque
from typing import Optional

import torch
from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist

from diffusion.batch import IMAGE
from diffusion.callbacks.nan_guard import loss_values

MIN_BATCHES = 50
WINDOW = 10
LOSS_DROP = 0.10  # a loss at least 10% below its start has learned something
PSNR_MARGIN_DB = 2.0


def _loss_of(state: State) -> Optional[torch.Tensor]:
    """The batch's loss, summed over its parts, left on its device (read once, at the end: no sync a batch)."""
    values = [v.detach().float().sum() for v in loss_values(state.loss) if isinstance(v, torch.Tensor)]
    return torch.stack(values).sum() if values else None


def flat_image_psnr(channel_sum: torch.Tensor, channel_sq: torch.Tensor, count: float) -> float:
    """PSNR (data range [-1, 1]) of the flat image of the mean colour against images with these per-channel
    sums of values and of squares over ``count`` values per channel: its error is each channel's variance."""
    mean = channel_sum / count
    mse = (channel_sq / count - mean**2).clamp(min=0).mean().item()
    return 10 * math.log10(4.0 / mse) if mse > 0 else math.inf


class LearnedNothing(Callback):
    def __init__(self, from_random_weights: bool):
        self.from_random_weights = from_random_weights
        self.first: list = []  # the first WINDOW batches' losses of the run (kept in checkpoints, as floats)
        self.last: deque = deque(maxlen=WINDOW)
        self.psnr: Optional[float] = None  # the last eval's
        self.flat_psnr: Optional[float] = None  # the baseline, from the first eval's images
        self._moments: Optional[list] = None  # [channel sums, channel squares, values per channel] of the first eval

    def state_dict(self) -> dict:
        return {"first": [float(v) for v in self.first], "flat_psnr": self.flat_psnr}

    def load_state_dict(self, state: dict) -> None:
        self.first = list(state.get("first", []))
        self.flat_psnr = state.get("flat_psnr")

    def batch_end(self, state: State, logger: Logger) -> None:
        if (loss := _loss_of(state)) is None:
            return
        if len(self.first) < WINDOW and state.timestamp.batch.value == len(self.first) + 1:  # the run's own start
            self.first.append(loss)
        self.last.append(loss)

    def eval_batch_end(self, state: State, logger: Logger) -> None:
        if self.flat_psnr is not None or not isinstance(state.batch, dict) or IMAGE not in state.batch:
            return
        images = state.batch[IMAGE].detach().float()
        if images.dim() != 4:
            return
        per_channel = images.transpose(0, 1).reshape(images.shape[1], -1)
        if self._moments is None:
            zeros = torch.zeros(images.shape[1], dtype=torch.float64, device=images.device)
            self._moments = [zeros, zeros.clone(), 0]
        self._moments[0] += per_channel.sum(1).double()
        self._moments[1] += per_channel.pow(2).sum(1).double()
        self._moments[2] += per_channel.shape[1]

    def eval_end(self, state: State, logger: Logger) -> None:
        psnr = state.eval_metric_values.get("PSNR")  # keyed by the metric's name (Composer's _compute_and_log_metrics)
        if psnr is None:
            return
        self.psnr = float(psnr)
        if self.flat_psnr is None and self._moments is not None:
            sums, squares, count = self._moments
            together = torch.cat([sums, squares, torch.tensor([float(count)], dtype=torch.float64, device=sums.device)])
            dist.all_reduce(together)  # every rank evaluates a share of the images
            n = len(sums)
            self.flat_psnr = flat_image_psnr(together[:n], together[n : 2 * n], together[-1].item())
            self._moments = None

    def verdict(self, state: State) -> Optional[str]:
        """Why this run learned nothing, or None (asked at fit end here and by the results line)."""
        batches = state.timestamp.batch.value
        if batches < MIN_BATCHES:
            return None
        reasons = []
        if self.psnr is not None and self.flat_psnr is not None and self.psnr < self.flat_psnr + PSNR_MARGIN_DB:
            reasons.append(
                f"eval PSNR {self.psnr:.2f} dB is not {PSNR_MARGIN_DB:g} dB above {self.flat_psnr:.2f} dB, the PSNR of "
                "a flat image of the eval images' mean colour"
            )
        if self.from_random_weights and len(self.first) == WINDOW and len(self.last) == WINDOW:
            start, end = (sum(float(v) for v in losses) / WINDOW for losses in (self.first, self.last))
            if end > start * (1 - LOSS_DROP):
                reasons.append(
                    f"the loss of the last {WINDOW} batches ({end:.4g}) is less than {LOSS_DROP:.0%} below that of "
                    f"the first {WINDOW} ({start:.4g}), from weights drawn at random"
                )
        if not reasons:
            return None
        return (
            f"{'; and '.join(reasons)}, after {batches} batches. Check the data (are the images what you expect?), "
            "the learning rate, and the model's output range"
        )

    def fit_end(self, state: State, logger: Logger) -> None:
        if (reason := self.verdict(state)) is not None and dist.get_global_rank() == 0:
            print(f"{os.path.basename(sys.argv[0])}: warning: learned nothing: {reason}", file=sys.stderr, flush=True)
