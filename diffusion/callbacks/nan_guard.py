"""Stop a run at the first non-finite loss, before the optimizer step can write NaN into the weights.

Checked after every (micro)batch's loss, so the last checkpoint on disk is always a good one.
"""

from __future__ import annotations

import torch
from composer.callbacks import CheckpointSaver
from composer.core import Callback, State
from composer.loggers import Logger

from diffusion.errors import TrainingDiverged


def loss_values(loss) -> list:
    """The parts of ``state.loss`` (a tensor, a list or tuple of them, or a dict of them)."""
    return list(loss.values() if isinstance(loss, dict) else loss if isinstance(loss, (list, tuple)) else [loss])


class NaNGuard(Callback):
    def after_loss(self, state: State, logger: Logger) -> None:
        for value in loss_values(state.loss):
            if isinstance(value, torch.Tensor) and not torch.isfinite(value.detach()).all():
                saver = next((cb for cb in state.callbacks if isinstance(cb, CheckpointSaver)), None)
                last = getattr(saver, "saved_checkpoints", None)
                where = f"the last checkpoint ({last[-1]}) is intact" if last else "no checkpoint was written yet"
                raise TrainingDiverged(
                    f"loss is {value.detach().float().mean().item()} at batch {state.timestamp.batch.value} "
                    f"(epoch {state.timestamp.epoch.value}); stopped before the optimizer step, so {where}. "
                    "Lower the learning rate, add warmup, or check the data for NaNs"
                )
