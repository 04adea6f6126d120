"""Hugging Face ids as users type them (``stabilityai/stable-diffusion-2-base``, ``org/name@revision``),
resolved to their snapshot in the local Hugging Face cache, never downloaded.

huggingface_hub's own ``snapshot_download(..., local_files_only=True)`` does the lookup (refs -> commit ->
snapshots/<commit>, commit-hash revisions, incomplete snapshots) without a network call. We only hand it the
cache folder read from the environment at call time: huggingface_hub reads HF_HUB_CACHE / HF_HOME once, at
import, and a cache set later (a test, a launcher) would otherwise be missed.
"""

from __future__ import annotations

import os
import re

from huggingface_hub import snapshot_download
from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

from diffusion.errors import UsageError

HUB_ID = re.compile(r"^(?P<repo>\w[\w.-]*/\w[\w.-]*)(?:@(?P<revision>[^@\s]+))?$")


def hub_cache_dir() -> str:
    """The folder huggingface_hub keeps models in, by its own rules (HF_HUB_CACHE, then the legacy
    HUGGINGFACE_HUB_CACHE, then HF_HOME/hub, then XDG_CACHE_HOME/huggingface/hub), read now."""
    env = os.environ.get
    home = env("HF_HOME") or os.path.join(env("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "huggingface")
    return os.path.expandvars(
        os.path.expanduser(env("HF_HUB_CACHE") or env("HUGGINGFACE_HUB_CACHE") or os.path.join(home, "hub"))
    )


def hub_id_to_path(name: str, key: str) -> str:
    """``name`` unchanged when it exists on disk or is not shaped like a hub id (presets, paths); else the
    cached snapshot directory of the hub id ``org/name[@revision]``, or a one-line UsageError, prefixed with
    ``key``, naming the id, the cache looked in and how to get the model there."""
    match = HUB_ID.match(name)
    if match is None or os.path.exists(name):
        return name
    repo, revision = match["repo"], match["revision"]
    cache, folder = hub_cache_dir(), f"models--{repo.replace('/', '--')}"  # huggingface_hub's layout
    try:
        return snapshot_download(repo, revision=revision, cache_dir=cache, local_files_only=True)
    except HFValidationError:  # shaped like an id but not a valid one: a missing path, reported by the caller
        return name
    except LocalEntryNotFoundError as e:
        command = f"{repo} --revision {revision}" if revision else repo
        raise UsageError(
            f"{key}: {name!r} is not a local directory and {_why_missing(e, folder, revision, cache)}; "
            f"on a machine with network run `hf download {command}` (`huggingface-cli download {command}` "
            f"on huggingface_hub < 1) and copy its {folder} folder into {cache} (or point HF_HUB_CACHE at "
            "a copied cache), or pass a local directory"
        ) from None


def _why_missing(error: Exception, folder: str, revision: str | None, cache: str) -> str:
    if type(error).__name__ == "IncompleteSnapshotError":  # huggingface_hub >= 1.x knows the files it lacks
        return f"its snapshot in the Hugging Face cache {cache} is incomplete (an interrupted download?)"
    refs = os.path.join(cache, folder, "refs")
    cached = sorted(os.listdir(refs)) if os.path.isdir(refs) else []
    if cached:
        return f"revision {revision or 'main'} is not in the Hugging Face cache {cache} (cached: {', '.join(cached)})"
    return f"it is not in the Hugging Face cache {cache}"
