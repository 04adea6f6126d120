"""Rebuild a trained model from a checkpoint, with its EMA weights.

The run's configuration travels inside every checkpoint (callbacks.RunConfig), so a checkpoint file (or
an FSDP sharded-checkpoint directory, or a checkpoint object in a bucket) is all export and sampling need.
The file is read the way every checkpoint here is (``unpickling.py``: nothing in it can run code).
"""

from __future__ import annotations

import os
import tempfile

from composer.utils import reproducibility

from diffusion.checkpointing.ema_weights import ema_in_checkpoint, load_averaged_weights
from diffusion.checkpointing.reading import load_sharded_weights, sharded_config, sharded_keys
from diffusion.checkpointing.unpickling import TRUST, load_checkpoint_file
from diffusion.config import LOCAL_TOKENIZERS, TrainConfig, local_parts
from diffusion.errors import UsageError
from diffusion.models import Built, build_model
from diffusion.techniques import TECHNIQUES


def _read(path: str, trust: bool, trust_flag: str) -> dict:
    """A checkpoint file's state, its tensors memory-mapped (torch.load mmap=True): what the model does not take
    (the optimizer state, often twice the model) is never read from disk."""
    if not os.path.exists(path):
        raise UsageError(
            f"checkpoint {path!r} does not exist; pass a .pt file (e.g. SAVE_FOLDER/latest-rank0.pt), "
            "a sharded checkpoint directory, or an exported pipeline directory"
        )
    loaded = load_checkpoint_file(path, trust=trust, trust_flag=trust_flag, mmap=True)
    if not isinstance(loaded, dict) or not isinstance(loaded.get("state"), dict):
        raise UsageError(
            f"checkpoint {path} is a torch file but not a training checkpoint (no 'state'); pass "
            "SAVE_FOLDER/latest-rank0.pt or an exported pipeline directory"
        )
    return loaded


# what the techniques add for training alone (REPA's projector): not part of the model the sampler and export use
TRAINING_ONLY = tuple(prefix for technique in TECHNIQUES for prefix in technique.training_only())


def load_trained(
    path: str, use_ema: bool = True, trust: bool = False, trust_flag: str = f"{TRUST}=true"
) -> tuple[Built, dict, bool]:
    """(the built model with trained weights, the run's config, whether EMA weights were applied): only the
    model's tensors (or the EMA's, for the weights it averages) are read, never the optimizer state; a sharded
    folder's straight into the built model. ``trust``: unpickle without the ``weights_only`` restriction (the
    trust_checkpoint key)."""
    if "://" in path:  # a checkpoint object or folder (s3://...): read from a local copy, named by its URL
        from diffusion.checkpointing.remote import fetch

        with tempfile.TemporaryDirectory() as tmp:
            local = fetch(path, tmp, "checkpoint")
            try:
                return load_trained(local, use_ema, trust, trust_flag)
            except UsageError as e:
                raise UsageError(str(e).replace(local, path)) from None
    if os.path.isdir(path):
        keys = sharded_keys(path, trust, trust_flag)
        config = _checked_config(sharded_config(path, keys, trust), path)
        built = _build(config)
        missing, ema = load_sharded_weights(built.model, path, keys, use_ema, trust)
        _check_fits(missing, [], config, path)
        return built, config, ema
    state = _read(path, trust, trust_flag)["state"]
    config = _checked_config(state.get("callbacks", {}).get("RunConfig", {}).get("config"), path)
    built = _build(config)
    weights = {k.removeprefix("module."): v for k, v in state["model"].items()}
    weights = {k: v for k, v in weights.items() if not k.startswith(TRAINING_ONLY)}
    missing, unexpected = built.model.load_state_dict(weights, strict=False)
    _check_fits(missing, unexpected, config, path)
    ema = ema_in_checkpoint(state) if use_ema else None
    if ema:
        load_averaged_weights(built.model, {k: v for k, v in ema.items() if not k.startswith(TRAINING_ONLY)})
    return built, config, bool(ema)


def _checked_config(config: dict | None, path: str) -> dict:
    if config is None:
        raise UsageError(
            f"checkpoint {path!r} carries no run configuration (it was not written by train.py or "
            "benchmark.py); export it from the run that made it"
        )
    return config


def _build(config: dict) -> Built:
    """The run's model as it trained: its model_name, then what each technique the run used needs before the
    checkpoint's weights load (LoRA: fresh adapters the checkpoint's fill). A preset's weights the checkpoint does
    not hold (a LoRA run's frozen base) are its random initialisation: built after the run's seed, as training
    built them."""
    reproducibility.seed_all(config.get("seed", TrainConfig.seed))
    built = build_model(
        config["model_name"],
        tokenizers=local_parts(config, LOCAL_TOKENIZERS),
        prediction_type=config.get("prediction_type"),
        objective=config.get("objective") or None,
        local_parts=local_parts(config),
    )
    for technique in TECHNIQUES:
        if technique.on(config):
            technique.rebuild(config, built.model)
    return built


def _check_fits(missing: list[str], unexpected: list[str], config: dict, path: str) -> None:
    """The checkpoint holds every trained weight of the rebuilt model (frozen encoders may come from their
    own folders) and nothing the model lacks."""
    if unexpected or [k for k in missing if not k.startswith(("vae.", "text_encoder"))]:
        raise UsageError(
            f"checkpoint {path!r} does not match {config['model_name']}: missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}"
        )
