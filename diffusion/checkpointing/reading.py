"""A sharded checkpoint folder (torch.distributed.checkpoint, as FSDP runs save) read for a model: its metadata, the
run's config alone, and the model's tensors (or the EMA's average of them) straight into a built model, never the
optimizer state. One reader for export, generate and evaluate (eval/trained_model.py); unpickled the way every
checkpoint here is (unpickling.py)."""

from __future__ import annotations

import warnings

import torch
from torch.distributed.checkpoint import load

from diffusion.checkpointing.ema_weights import EMA_STATE
from diffusion.checkpointing.local import read_sharded, sharded_problem
from diffusion.checkpointing.unpickling import read_sharded_metadata, safe_loading
from diffusion.errors import UsageError
from diffusion.models.renamed_keys import stored_names

# where a sharded folder (Composer's state, flattened by torch.distributed.checkpoint) keeps what export reads
MODEL_KEYS, EMA_KEYS, RUN_CONFIG = "state.model.", f"state.callbacks.EMA.{EMA_STATE}.", "state.callbacks.RunConfig."


def sharded_keys(path: str, trust: bool, trust_flag: str) -> dict:
    """A sharded checkpoint folder's metadata: flattened key -> what is stored (torch.distributed.checkpoint)."""
    why = sharded_problem(path, "checkpoint", trust, trust_flag)
    if why:
        raise UsageError(
            f"checkpoint {path!r} is a directory but neither a sharded checkpoint ({why}) nor an exported "
            "pipeline (no model_index.json); pass a sharded checkpoint folder (SAVE_FOLDER/ep0-ba10), a .pt "
            "file or an exported pipeline directory"
        )
    return read_sharded_metadata(path, trust).state_dict_metadata


def sharded_config(path: str, keys: dict, trust: bool) -> dict | None:
    """The run's config from a sharded folder, read alone (a few small entries, no tensor)."""
    wanted = {k for k in keys if k.startswith(RUN_CONFIG)}
    if not wanted:
        return None
    return read_sharded(path, wanted, trust)["state"]["callbacks"]["RunConfig"]["config"]


def load_sharded_weights(model, path: str, keys: dict, use_ema: bool, trust: bool) -> tuple[list[str], bool]:
    """Each of ``model``'s tensors read from the sharded folder straight into it, the EMA's average for the
    trained weights it holds (``use_ema``), the model's own for the rest; the optimizer state and everything
    else is never read. (the model's keys the folder lacks, whether EMA weights were applied)."""
    ema = {k[len(EMA_KEYS) :] for k in keys if k.startswith(EMA_KEYS)} if use_ema else set()
    renames = stored_names(model, [k[len(MODEL_KEYS) :] for k in keys if k.startswith(MODEL_KEYS)])
    targets, objects, missing = {}, [], []
    for name, tensor in model.state_dict().items():
        key = f"{EMA_KEYS}{name}" if name in ema else f"{MODEL_KEYS}{renames.get(name, name)}"
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
