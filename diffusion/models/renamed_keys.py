"""Checkpoints across transformers releases: a text encoder's weights under the names another release gives them.

transformers 5.23 (the current set; the pinned set has 5.5) dropped ``CLIPTextModel``'s inner ``text_model.`` level:
its own ``from_pretrained`` renames older files (conversion_mapping.py's ``PrefixChange``), but a Composer checkpoint
holds the module's state dict as it was, and Composer loads model weights leniently. So a checkpoint saved on one set
and resumed or exported on the other (or saved on transformers 4.57, before issue 64) named SD's, SDXL's and FLUX's
first text encoder's weights as the loading release does not, and the encoder kept the weights it was built with,
without a word. Each transformers part of a model takes the other release's names as its own when loading
(``follow_renames``): the keys under it that it does not know, with one leading level taken off (or put on: the same
level for all), when every one of them is then a name it knows; anything else is left to the load's own missing-key
handling.
"""

from __future__ import annotations

import torch


def follow_renames(model: torch.nn.Module) -> None:
    """A load-time pre-hook on each transformers model inside ``model``."""
    for _, module in _transformers_models(model):
        module.register_load_state_dict_pre_hook(_take_other_names)


def renamed(module: torch.nn.Module, keys, prefix: str = "") -> dict[str, str]:
    """{stored key: the key ``module`` loads it as} for the ``keys`` under ``prefix`` that ``module`` does not know
    and knows with one leading level (the same for all) taken off or put on; {} where there are none or any is
    unknown either way."""
    keys = {k[len(prefix) :] for k in keys if k.startswith(prefix)}
    if not keys:  # none of this module's (a load of other parts only): its own names are not needed
        return {}
    own = set(module.state_dict(keep_vars=True))
    strange = sorted(keys - own)
    if not strange:
        return {}
    levels = {k.split(".", 1)[0] + "." for k in strange} | {k.split(".", 1)[0] + "." for k in own - keys}
    for level in sorted(levels):
        taken_off = [k[len(level) :] if k.startswith(level) else None for k in strange]
        for names in (taken_off, [level + k for k in strange]):
            if all(n in own for n in names):
                return {prefix + old: prefix + new for old, new in zip(strange, names)}
    return {}


def stored_names(model: torch.nn.Module, stored) -> dict[str, str]:
    """{``model``'s key: the key it is stored under} where the ``stored`` keys (a sharded checkpoint's, read by name)
    hold a transformers part's weights under the other release's names."""
    names = {}
    for path, module in _transformers_models(model):
        names.update({new: old for old, new in renamed(module, stored, f"{path}." if path else "").items()})
    return names


def _transformers_models(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(path, module) of each transformers model inside ``model``."""
    from transformers import PreTrainedModel

    return [(path, module) for path, module in model.named_modules() if isinstance(module, PreTrainedModel)]


def _take_other_names(module, state_dict, prefix, *_) -> None:
    for old, new in renamed(module, list(state_dict), prefix).items():
        state_dict[new] = state_dict.pop(old)  # over a copy of the module's own weight the loader may have put there
