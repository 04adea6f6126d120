"""Rebuild a trained model from a checkpoint, with its EMA weights.

The run's configuration travels inside every checkpoint (callbacks.RunConfig), so a checkpoint file (or
an FSDP sharded-checkpoint directory, or a checkpoint object in a bucket) is all export and sampling need.
The file is read the way every checkpoint here is (``unpickling.py``: nothing in it can run code).
"""

from __future__ import annotations

import os
import tempfile

from diffusion.config import LOCAL_TOKENIZERS, local_parts
from diffusion.ema_weights import ema_in_checkpoint, load_averaged_weights
from diffusion.errors import UsageError
from diffusion.models import Built, build_model
from diffusion.models.repa import PROJECTOR
from diffusion.unpickling import TRUST, load_checkpoint_file, safe_loading


def _read(path: str, trust: bool, trust_flag: str) -> dict:
    if "://" in path:  # a checkpoint object (s3://...): read from a local copy, named by its URL
        from diffusion.remote_checkpoints import fetch

        with tempfile.TemporaryDirectory() as tmp:
            local = fetch(path, tmp, "checkpoint")
            try:
                return _read(local, trust, trust_flag)
            except UsageError as e:
                raise UsageError(str(e).replace(local, path)) from None
    if not os.path.exists(path):
        raise UsageError(
            f"checkpoint {path!r} does not exist; pass a .pt file (e.g. SAVE_FOLDER/latest-rank0.pt), "
            "a sharded checkpoint directory, or an exported pipeline directory"
        )
    if os.path.isdir(path):  # FSDP2 sharded checkpoint (torch.distributed.checkpoint): gather to one file
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        from diffusion.checkpoints import check_checkpoint

        why = check_checkpoint(path, trust)
        if why:
            raise UsageError(
                f"checkpoint {path!r} is a directory but neither a sharded checkpoint ({why}) nor an exported "
                "pipeline (no model_index.json); pass a sharded checkpoint folder (SAVE_FOLDER/ep0-ba10), a .pt "
                "file or an exported pipeline directory"
            )

        with tempfile.TemporaryDirectory() as tmp, safe_loading(trust):
            dcp_to_torch_save(path, os.path.join(tmp, "full.pt"))
            return load_checkpoint_file(
                os.path.join(tmp, "full.pt"), f"checkpoint {path}:", trust, trust_flag=trust_flag
            )
    loaded = load_checkpoint_file(path, trust=trust, trust_flag=trust_flag)
    if not isinstance(loaded, dict) or not isinstance(loaded.get("state"), dict):
        raise UsageError(
            f"checkpoint {path} is a torch file but not a training checkpoint (no 'state'); pass "
            "SAVE_FOLDER/latest-rank0.pt or an exported pipeline directory"
        )
    return loaded


TRAINING_ONLY = (f"{PROJECTOR}.",)


def load_trained(
    path: str, use_ema: bool = True, trust: bool = False, trust_flag: str = f"{TRUST}=true"
) -> tuple[Built, dict, bool]:
    """(the built model with trained weights, the run's config, whether EMA weights were applied).
    ``trust``: unpickle the file without the ``weights_only`` restriction (the trust_checkpoint key)."""
    state = _read(path, trust, trust_flag)["state"]
    config = state.get("callbacks", {}).get("RunConfig", {}).get("config")
    if config is None:
        raise UsageError(
            f"checkpoint {path!r} carries no run configuration (it was not written by train.py or "
            "benchmark.py); export it from the run that made it"
        )
    objective = config.get("objective") or None
    built = build_model(
        config["model_name"],
        tokenizers=local_parts(config, LOCAL_TOKENIZERS),
        prediction_type=config.get("prediction_type"),
        objective=objective,
        local_parts=local_parts(config),
    )
    # training-only modules (REPA's projector) are not part of the model the sampler and export use
    weights = {k.removeprefix("module."): v for k, v in state["model"].items()}
    weights = {k: v for k, v in weights.items() if not k.startswith(TRAINING_ONLY)}
    missing, unexpected = built.model.load_state_dict(weights, strict=False)
    if unexpected or [k for k in missing if not k.startswith(("vae.", "text_encoder"))]:
        raise UsageError(
            f"checkpoint {path!r} does not match {config['model_name']}: missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}"
        )
    ema = ema_in_checkpoint(state) if use_ema else None
    if ema:
        load_averaged_weights(built.model, {k: v for k, v in ema.items() if not k.startswith(TRAINING_ONLY)})
    return built, config, bool(ema)
