"""The RNG state a checkpoint saved, restored after a mid-epoch resume on a dataset that resumes by itself.

Composer 0.32.1 (its last release) restores the checkpoint's RNG state in two places only (Trainer._train_loop):
at an epoch's first batch, or while spinning the dataloader forward to the batch it stopped at. A
StreamingDataset resumes mid-epoch by itself (its state_dict), so Composer skips the spin, and with it the
RNG restore: the noise and timesteps after the resume then come from the freshly seeded generator, and the run
drifts from an uninterrupted one from its first batch on (found by tests/test_preemption.py; synthetic data,
which is spun, resumed bitwise). This restores the state where the spin path would have, before the first
batch's step and after the dataloader's iterator was made (making it draws from the RNG in both runs' past).
"""

from __future__ import annotations

from composer import Trainer
from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import reproducibility


class ResumeRng(Callback):
    def __init__(self, rng_state: list[dict]):
        self.rng_state = rng_state

    def batch_start(self, state: State, logger: Logger) -> None:
        if self.rng_state is not None:
            reproducibility.load_rng_state(self.rng_state)
            self.rng_state = None


def restore_rng_after_dataset_resumption(trainer: Trainer) -> Trainer:
    """Add a ResumeRng to ``trainer`` when it resumed mid-epoch on a dataset that resumes itself (the case
    Composer leaves out); reads Composer's pending state, ``Trainer._rng_state``, which it would else drop."""
    pending = getattr(trainer, "_rng_state", None)
    if (
        pending is not None
        and "train" in trainer.state.dataset_resumption
        and int(trainer.state.timestamp.batch_in_epoch) > 0
    ):
        trainer.state.callbacks.append(ResumeRng(pending))
        trainer._rng_state = None
    return trainer
