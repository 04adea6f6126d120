"""Rebuild a trained model from a checkpoint, with its EMA weights.

The run's configuration travels inside every checkpoint (callbacks.RunConfig), so a checkpoint file (or
an FSDP sharded-checkpoint directory, or a checkpoint object in a bucket) is all export and sampling need.
The file is read the way every checkpoint here is (``unpickling.py``: nothing in it can run code).
"""

from __future__ import annotations

import os
import tempfile
import warnings

import torch
from composer.utils import reproducibility

from diffusion.config import LOCAL_TOKENIZERS, TrainConfig, local_parts
from diffusion.ema_weights import EMA_STATE, ema_in_checkpoint, load_averaged_weights
from diffusion.errors import UsageError
from diffusion.models import Built, build_model
from diffusion.models.lora import install_lora, lora_options
from diffusion.models.repa import PROJECTOR
from diffusion.unpickling import TRUST, load_checkpoint_file, read_sharded_metadata, safe_loading


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


def _sharded_keys(path: str, trust: bool, trust_flag: str) -> dict:
    """A sharded checkpoint folder's metadata: flattened key -> what is stored (torch.distributed.checkpoint)."""
    from diffusion.checkpoints import sharded_problem

    why = sharded_problem(path, "checkpoint", trust, trust_flag)
    if why:
        raise UsageError(
            f"checkpoint {path!r} is a directory but neither a sharded checkpoint ({why}) nor an exported "
            "pipeline (no model_index.json); pass a sharded checkpoint folder (SAVE_FOLDER/ep0-ba10), a .pt "
            "file or an exported pipeline directory"
        )
    return read_sharded_metadata(path, trust).state_dict_metadata


def _sharded_config(path: str, keys: dict, trust: bool) -> dict | None:
    """The run's config from a sharded folder, read alone (a few small entries, no tensor)."""
    from diffusion.checkpoints import read_sharded

    wanted = {k for k in keys if k.startswith(RUN_CONFIG)}
    if not wanted:
        return None
    return read_sharded(path, wanted, trust)["state"]["callbacks"]["RunConfig"]["config"]


def _load_sharded_weights(model, path: str, keys: dict, use_ema: bool, trust: bool) -> tuple[list[str], bool]:
    """Each of ``model``'s tensors read from the sharded folder straight into it, the EMA's average for the
    trained weights it holds (``use_ema``), the model's own for the rest; the optimizer state and everything
    else is never read. (the model's keys the folder lacks, whether EMA weights were applied)."""
    from torch.distributed.checkpoint import load

    from diffusion.checkpoints import read_sharded

    ema = {k[len(EMA_KEYS) :] for k in keys if k.startswith(EMA_KEYS)} if use_ema else set()
    targets, objects, missing = {}, [], []
    for name, tensor in model.state_dict().items():
        key = f"{EMA_KEYS}{name}" if name in ema else f"{MODEL_KEYS}{name}"
        if not isinstance(tensor, torch.Tensor):  # extra state (a LoRA run's base record), stored flattened
            objects.append(name)
        elif key in keys:
            targets[key] = tensor
        else:
            missing.append(name)
    with safe_loading(trust), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load(targets, checkpoint_id=path, no_dist=True)
    wanted = {k for k in keys for name in objects if k.startswith(f"{MODEL_KEYS}{name}")}
    stored = read_sharded(path, wanted, trust)["state"]["model"] if wanted else {}
    for name in objects:  # through the model, which checks them (a LoRA base record against the rebuilt base)
        if name in stored:
            model.load_state_dict({name: stored[name]}, strict=False)
        else:
            missing.append(name)
    return missing, bool(ema)


TRAINING_ONLY = (f"{PROJECTOR}.",)
# where a sharded folder (Composer's state, flattened by torch.distributed.checkpoint) keeps what export reads
MODEL_KEYS, EMA_KEYS, RUN_CONFIG = "state.model.", f"state.callbacks.EMA.{EMA_STATE}.", "state.callbacks.RunConfig."


def load_trained(
    path: str, use_ema: bool = True, trust: bool = False, trust_flag: str = f"{TRUST}=true"
) -> tuple[Built, dict, bool]:
    """(the built model with trained weights, the run's config, whether EMA weights were applied): only the
    model's tensors (or the EMA's, for the weights it averages) are read, never the optimizer state; a sharded
    folder's straight into the built model. ``trust``: unpickle without the ``weights_only`` restriction (the
    trust_checkpoint key)."""
    if "://" in path:  # a checkpoint object or folder (s3://...): read from a local copy, named by its URL
        from diffusion.remote_checkpoints import fetch

        with tempfile.TemporaryDirectory() as tmp:
            local = fetch(path, tmp, "checkpoint")
            try:
                return load_trained(local, use_ema, trust, trust_flag)
            except UsageError as e:
                raise UsageError(str(e).replace(local, path)) from None
    if os.path.isdir(path):
        keys = _sharded_keys(path, trust, trust_flag)
        config = _checked_config(_sharded_config(path, keys, trust), path)
        built = _build(config)
        missing, ema = _load_sharded_weights(built.model, path, keys, use_ema, trust)
        _check_fits(missing, [], config, path)
        return built, config, ema
    state = _read(path, trust, trust_flag)["state"]
    config = _checked_config(state.get("callbacks", {}).get("RunConfig", {}).get("config"), path)
    built = _build(config)
    # training-only modules (REPA's projector) are not part of the model the sampler and export use
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
    """The run's model as it trained: for a LoRA run, its base (model_name) with fresh adapters the checkpoint's
    fill (their record of the base checked as they load). A preset's base is its random initialisation: built
    after the run's seed, as training built it."""
    options = lora_options(config)
    if options is not None:
        reproducibility.seed_all(config.get("seed", TrainConfig.seed))
    built = build_model(
        config["model_name"],
        tokenizers=local_parts(config, LOCAL_TOKENIZERS),
        prediction_type=config.get("prediction_type"),
        objective=config.get("objective") or None,
        local_parts=local_parts(config),
    )
    if options is not None:  # the base as its folder stores it (lora_base_dtype is training's memory saving)
        install_lora(built.model, {**options, "base_dtype": "fp32"}, config["model_name"])
    return built


def _check_fits(missing: list[str], unexpected: list[str], config: dict, path: str) -> None:
    """The checkpoint holds every trained weight of the rebuilt model (frozen encoders may come from their
    own folders) and nothing the model lacks."""
    if unexpected or [k for k in missing if not k.startswith(("vae.", "text_encoder"))]:
        raise UsageError(
            f"checkpoint {path!r} does not match {config['model_name']}: missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}"
        )
