"""Hugging Face ids (org/name[@revision]) resolve from the local cache, never the network; a missing one is
one line naming the id, the cache and the download command."""

import hashlib
import os

import pytest
import torch

import benchmark
from diffusion.errors import UsageError
from diffusion.models.build import build_model, describe
from diffusion.models.hub_cache import hub_id_to_path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cache_repo(cache, repo_id: str, src, commit: str = COMMIT, ref: str = "main"):
    """The layout huggingface_hub writes: blobs/<sha256> files, snapshots/<commit>/... relative symlinks to
    them, and refs/<ref> holding the commit."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    for root, _, files in os.walk(src):
        for name in files:
            data = (open(os.path.join(root, name), "rb")).read()
            blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
            blob.parent.mkdir(parents=True, exist_ok=True)
            blob.write_bytes(data)
            link = repo / "snapshots" / commit / os.path.relpath(os.path.join(root, name), src)
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return repo / "snapshots" / commit


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """sd-tiny exported as a diffusers pipeline, and its VAE alone as an AutoencoderKL folder."""
    tmp = tmp_path_factory.mktemp("exported")
    built = build_model("sd-tiny")
    built.model.export(str(tmp / "pipe"), built.tokenizers)
    built.model.vae.save_pretrained(tmp / "vae")
    return tmp


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty hub cache that huggingface_hub was not told about at import (HF_HUB_CACHE set only now)."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)  # no 'org/...' folder in the working directory
    return tmp_path / "hub"


def test_hub_id_builds_the_same_model_as_its_directory(exported, cache):
    snapshot = cache_repo(cache, "org/sd-tiny", exported / "pipe")
    assert hub_id_to_path("org/sd-tiny", "model_name") == str(snapshot)
    assert hub_id_to_path(f"org/sd-tiny@{COMMIT}", "model_name") == str(snapshot)  # a commit hash is a revision too
    assert describe("org/sd-tiny") == describe(str(exported / "pipe"))
    by_id, by_dir = build_model("org/sd-tiny@main"), build_model(str(exported / "pipe"))
    assert by_id.family == "sd" and by_id.resolution == by_dir.resolution
    for a, b in zip(by_dir.model.parameters(), by_id.model.parameters(), strict=True):
        torch.testing.assert_close(a, b)
    tok = by_id.tokenizers["input_ids"]
    assert tok("a cube").input_ids == by_dir.tokenizers["input_ids"]("a cube").input_ids
    # a local part and the tokenizer take ids as well
    cache_repo(cache, "org/tiny-vae", exported / "vae")
    cache_repo(cache, "org/tiny-tokenizer", exported / "pipe" / "tokenizer")
    assert describe("sd-tiny", local_parts={"vae": "org/tiny-vae"}).family == "sd"
    swapped = build_model(
        "sd-tiny", local_parts={"vae": "org/tiny-vae"}, tokenizers={"tokenizer": "org/tiny-tokenizer"}
    )
    for a, b in zip(by_dir.model.vae.parameters(), swapped.model.vae.parameters(), strict=True):
        torch.testing.assert_close(a, b)
    assert swapped.tokenizers["input_ids"]("a cube").input_ids == tok("a cube").input_ids


@pytest.mark.parametrize(
    "preset, repo_id",
    [("flux-tiny", "black-forest-labs/FLUX.1-schnell"), ("sdxl-tiny", "stabilityai/stable-diffusion-xl-base-1.0")],
)
def test_pipeline_ids_as_users_type_them(cache, tmp_path, preset, repo_id):
    built = build_model(preset)
    built.model.export(str(tmp_path / preset), built.tokenizers)
    cache_repo(cache, repo_id, tmp_path / preset)
    by_id = build_model(repo_id)
    assert by_id.family == built.family and describe(repo_id) == describe(str(tmp_path / preset))
    assert set(by_id.tokenizers) == set(built.tokenizers)  # every tokenizer folder (SDXL's two, FLUX's CLIP + T5)
    for a, b in zip(built.model.parameters(), by_id.model.parameters(), strict=True):
        torch.testing.assert_close(a, b)


def test_presets_and_existing_directories_are_kept(exported, cache, monkeypatch):
    assert hub_id_to_path("sd-tiny", "model_name") == "sd-tiny"
    assert hub_id_to_path(str(exported / "pipe"), "model_name") == str(exported / "pipe")
    (cache.parent / "org" / "sd-tiny").mkdir(parents=True)  # a relative folder shaped like an id wins
    assert hub_id_to_path("org/sd-tiny", "model_name") == "org/sd-tiny"


def test_missing_id_is_one_line_with_the_download_command(cache, capsys):
    argv = ["--model_name", "stabilityai/stable-diffusion-2-base", "--use_synth_data", "--batch_size", "4"]
    assert benchmark.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("benchmark.py: error: --model_name: "), err
    for part in (
        "stabilityai/stable-diffusion-2-base",
        str(cache),
        "`hf download stabilityai/stable-diffusion-2-base`",
        "huggingface-cli download",
        "pass a local directory",
    ):
        assert part in err[0], (part, err[0])
    with pytest.raises(UsageError, match=r"^--vae: 'org/no-vae' is not a local directory and it is not in the Hugging"):
        describe("sd-tiny", local_parts={"vae": "org/no-vae"})


def test_uncached_revision_is_named(exported, cache):
    cache_repo(cache, "org/sd-tiny", exported / "pipe")
    with pytest.raises(UsageError) as e:
        describe("org/sd-tiny@v2")
    message = str(e.value)
    assert "\n" not in message and "revision v2 is not in the Hugging Face cache" in message
    assert "(cached: main)" in message and "`hf download org/sd-tiny --revision v2`" in message
    with pytest.raises(UsageError, match=f"revision {'f' * 40} is not"):
        describe(f"org/sd-tiny@{'f' * 40}")


def test_generate_and_clip_take_hub_ids(exported, cache):
    """generate.py / evaluate.py's pipeline source and evaluate.py's --clip resolve like --model_name."""
    from diffusion.eval.clip_score import load_clip
    from diffusion.eval.sampling import load_pipeline

    cache_repo(cache, "org/sd-tiny", exported / "pipe")
    pipe = load_pipeline("org/sd-tiny")
    assert type(pipe).__name__ == "StableDiffusionPipeline"
    with pytest.raises(UsageError, match=r"^--clip: 'openai/clip-vit-large-patch14' is not a local directory"):
        load_clip("openai/clip-vit-large-patch14")
