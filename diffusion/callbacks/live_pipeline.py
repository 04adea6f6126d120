"""A training run's own model as a diffusers pipeline, for the callbacks that sample during a run.

ImageLogger and QualityEval sample with the live model (no copy) and, when the run keeps an EMA, with its
averaged weights swapped in; sampling itself is eval's (eval/sampling.py, eval/quality.py).
"""

from __future__ import annotations

import contextlib

from diffusion.callbacks.ema import find_ema
from diffusion.models.base import denoiser_of


@contextlib.contextmanager
def run_pipeline(state, tokenizers: dict):
    """A training run's model as a diffusers pipeline (its own modules, no copy), in eval mode and holding
    the EMA weights when the run keeps them, with the parts it holds in host memory (text_encoders_on_cpu) on the
    trained part's device; training mode, live weights and held parts come back afterwards."""
    model = getattr(state.model, "module", state.model)  # unwrap DDP
    ema = find_ema(state)
    pipe = model.pipeline(tokenizers)
    pipe.set_progress_bar_config(disable=True)
    was_training = model.training
    device = next(denoiser_of(model).parameters()).device
    model.eval()
    try:
        with model.parts_on(device), ema.averaged_weights() if ema is not None else contextlib.nullcontext():
            yield pipe
    finally:
        model.train(was_training)
