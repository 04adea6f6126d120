"""Rebuild a trained model from a Composer checkpoint, with its EMA weights when it has them.

The run's configuration travels inside every checkpoint (callbacks.RunConfig), so a checkpoint file (or
an FSDP sharded-checkpoint directory) is all export and sampling need.
"""
from __future__ import annotations

import os
import tempfile

import torch

from diffusion.algorithms import ema_in_checkpoint
from diffusion.config import local_parts
from diffusion.errors import UsageError
from diffusion.models import Built, build_model


def _read(path: str) -> dict:
    if not os.path.exists(path):
        raise UsageError(f"checkpoint {path!r} does not exist; pass a .pt file (e.g. SAVE_FOLDER/latest-rank0.pt), "
                         "a sharded checkpoint directory, or an exported pipeline directory")
    if os.path.isdir(path):  # FSDP2 sharded checkpoint (torch.distributed.checkpoint): gather to one file
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
        with tempfile.TemporaryDirectory() as tmp:
            dcp_to_torch_save(path, os.path.join(tmp, "full.pt"))
            return torch.load(os.path.join(tmp, "full.pt"), map_location="cpu", weights_only=False)
    return torch.load(path, map_location="cpu", weights_only=False)


def load_trained(path: str, use_ema: bool = True) -> tuple[Built, dict, bool]:
    """(the built model with trained weights, the run's config, whether EMA weights were applied)."""
    state = _read(path)["state"]
    config = state.get("callbacks", {}).get("RunConfig", {}).get("config")
    if config is None:
        raise UsageError(f"checkpoint {path!r} carries no run configuration (it was not written by train.py or "
                         "benchmark.py); export it from the run that made it")
    objective = config.get("objective") or None
    built = build_model(config["model_name"], tokenizer_path=config.get("tokenizer"),
                        prediction_type=config.get("prediction_type"), objective=objective,
                        local_parts=local_parts(config))
    weights = {k.removeprefix("module."): v for k, v in state["model"].items()}
    missing, unexpected = built.model.load_state_dict(weights, strict=False)
    if unexpected or [k for k in missing if not k.startswith(("vae.", "text_encoder"))]:
        raise UsageError(f"checkpoint {path!r} does not match {config['model_name']}: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}")
    ema = ema_in_checkpoint(state) if use_ema else None
    if ema:
        params = dict(built.model.named_parameters())
        with torch.no_grad():
            for name, value in ema.items():
                params[name].copy_(value.full_tensor() if hasattr(value, "full_tensor") else value)
    return built, config, bool(ema)
