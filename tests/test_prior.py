"""A prior dataset mixed into every training batch (prior_local / prior_remote, prior_share): prior
preservation for fine-tunes and LoRA (docs/lora.md), through Streaming's stratified batching."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, final_state, pretrained_folder, upload_folder

import data
import generate
import train
from diffusion.batch import IMAGE


def write_grey_mds(out: Path, grey: int, count: int, names: tuple[str, str] = ("image", "caption")) -> Path:
    """``count`` 64x64 image-caption pairs of one grey level (PNG) as MDS shards, under the column ``names``:
    which dataset a sample came from reads off its pixels."""
    from PIL import Image
    from streaming import MDSWriter

    with MDSWriter(out=str(out), columns={names[0]: "bytes", names[1]: "str"}) as w:
        for i in range(count):
            buf = io.BytesIO()
            Image.fromarray(np.full((64, 64, 3), grey, dtype=np.uint8)).save(buf, format="PNG")
            w.write({names[0]: buf.getvalue(), names[1]: f"grey {grey} number {i}"})
    return out


@pytest.fixture(scope="module")
def two_sets(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("prior")
    return write_grey_mds(root / "own", 0, 24), write_grey_mds(root / "prior", 255, 40)


def _prior_counts(loader) -> list[int]:
    """Prior samples (the white ones) in each batch of ``loader``."""
    return [int((batch[IMAGE].float().mean(dim=(1, 2, 3)) > 128).sum()) for batch in loader]


def _cfg(own, prior, **kw):
    from diffusion.config import TrainConfig

    base = dict(model_name="sd-tiny", local=str(own), prior_local=str(prior), image_size=64, num_workers=0)
    return TrainConfig(**(base | {"batch_size": 8} | kw))


@pytest.mark.parametrize("share, batch", [(None, 8), (0.25, 8), (0.75, 4)])
def test_every_batch_holds_the_prior_share(share, batch, two_sets, sd_tiny):
    """Each batch holds exactly share x batch_size prior samples (0.5 unset), in every batch of the epoch, and
    the epoch draws the two sets' samples together (24 + 40) in those shares."""
    from diffusion.data import DataSettings, build_train_dataloader

    cfg = _cfg(*two_sets, batch_size=batch, prior_share=share)
    loader = build_train_dataloader(DataSettings.of(cfg), sd_tiny.model, sd_tiny.tokenizers, batch).dataloader
    counts = _prior_counts(loader)
    assert counts and set(counts) == {int((share or 0.5) * batch)}, counts
    assert len(counts) == (24 + 40) // batch


@pytest.mark.s3
def test_a_prior_in_object_storage_mixes_as_a_local_one(two_sets, s3, tmp_path, sd_tiny):
    """prior_remote on a real S3 server (conftest.s3), cached under prior_local: the same share in every batch."""
    from diffusion.data import DataSettings, build_train_dataloader

    own, prior = two_sets
    url = upload_folder(s3, prior, "prior")
    cfg = _cfg(own, None, prior_local=str(tmp_path / "cache"), prior_remote=url, prior_share=0.25)
    loader = build_train_dataloader(DataSettings.of(cfg), sd_tiny.model, sd_tiny.tokenizers, 8).dataloader
    counts = _prior_counts(loader)
    assert len(counts) == 8 and set(counts) == {2}, counts
    assert (tmp_path / "cache" / "index.json").is_file()


def test_a_run_with_a_prior_trains_and_resumes_bitwise(two_sets, tmp_path, monkeypatch):
    """train.py with a prior dataset: 4 batches in one go and 2 + 2 with a resume end at the same weights (the
    mixed order resumes exactly)."""
    monkeypatch.chdir(tmp_path)
    own, prior = two_sets
    run = [str(REPO / "yamls/sd-tiny-cpu.yaml"), "use_synth_data=false", f"local={own}", f"prior_local={prior}"]
    run += ["batch_size=4", "prior_share=0.25", "eval_interval=null", "save_interval=2ba", "use_ema=false"]
    assert train.main([*run, f"save_folder={tmp_path / 'whole'}", "max_duration=4ba", "autoresume=false"]) == 0
    assert train.main([*run, f"save_folder={tmp_path / 'parts'}", "max_duration=2ba", "autoresume=true"]) == 0
    assert train.main([*run, f"save_folder={tmp_path / 'parts'}", "max_duration=4ba", "autoresume=true"]) == 0
    a, b = final_state(tmp_path / "whole")["model"], final_state(tmp_path / "parts")["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["prior_share=0.3"], "prior_share=0.3 is the share of a prior dataset; give prior_local"),
        (["prior_local=PRIOR", "prior_share=0.3", "batch_size=4"], "prior_share=0.3 of batch_size=4 is 1.2 samples"),
        # the run's dataset beside synthetic data on one command line (tests/test_recipe_data.py: the prior alone)
        (["prior_local=PRIOR", "use_synth_data=true"], "use_synth_data=true (synthetic data) and local (a dataset)"),
        (["prior_local=NOWHERE"], "prior_local: no MDS dataset at"),
        (["prior_local=BARE"], "has no 'image', 'caption' column, which the run reads"),
        (["prior_local=PRIOR", "local=BUCKETS"], "is bucketed by aspect ratio"),
        (["prior_share=1.5", "prior_local=PRIOR"], "prior_share"),
    ],
    ids=["share-alone", "share-not-whole", "synthetic", "missing", "other-columns", "bucketed", "out-of-range"],
)
def test_bad_prior_settings_are_one_line(extra, message, two_sets, mds_buckets, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    own, prior = two_sets
    bare = write_grey_mds(tmp_path / "bare", 255, 8, names=("jpg", "txt"))
    places = {"PRIOR": str(prior), "NOWHERE": str(tmp_path / "nowhere"), "BARE": str(bare), "BUCKETS": str(mds_buckets)}
    for key, value in places.items():
        extra = [e.replace(key, value) for e in extra]
    run = [str(REPO / "yamls/sd-tiny-cpu.yaml"), "use_synth_data=false", f"local={own}", "max_duration=1ba"]
    assert train.main([*run, "eval_interval=null", "autoresume=false", *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
    assert json.dumps(err).count("\\n") <= 2, err


def test_the_bases_own_samples_become_a_prior_dataset(two_sets, tmp_path, monkeypatch):
    """The README's chain: generate.py --captions writes each prompt beside its image (no grid), data.py convert
    reads that folder, and a LoRA run of the same base trains with it as its prior."""
    monkeypatch.chdir(tmp_path)
    base = pretrained_folder(tmp_path / "base", "sd-tiny")
    drawn = tmp_path / "drawn"
    argv = [base, "--prompt", "a red cube", "--prompt", "two cats", "--images_per_prompt", "2", "--steps", "2"]
    assert generate.main([*argv, "--image_size", "64", "--out", str(drawn), "--captions"]) == 0
    files = sorted(p.name for p in drawn.iterdir())
    assert files == [
        f"0000{i}-{slug}.{ext}"
        for i, slug in enumerate(["a-red-cube"] * 2 + ["two-cats"] * 2)
        for ext in ("png", "txt")
    ]
    assert (drawn / "00002-two-cats.txt").read_text() == "two cats"
    assert data.main(["convert", str(drawn), str(tmp_path / "prior"), "--format", "folder", "--workers", "1"]) == 0
    own, _ = two_sets
    run = [str(REPO / "yamls/sd-tiny-cpu.yaml"), f"model_name={base}", "lora_rank=2", "use_synth_data=false"]
    run += [f"local={own}", f"prior_local={tmp_path / 'prior'}", "batch_size=4", "max_duration=2ba"]
    assert train.main([*run, "eval_interval=null", "autoresume=false", f"save_folder={tmp_path / 'ck'}"]) == 0


def test_precomputed_latents_take_a_precomputed_prior_shaped_alike(mds_latents, two_sets, tmp_path, sd_tiny):
    """On precomputed latents the prior is precomputed too, its arrays shaped as the run's; a prior of images, or
    of latents for another size, is one line naming the prior."""
    import shutil

    from streaming import MDSWriter

    from diffusion.data import DataSettings, build_train_dataloader
    from diffusion.errors import UsageError

    def loader(prior):
        cfg = _cfg(mds_latents, prior, precomputed_latents=True, batch_size=8, prior_share=0.25)
        return build_train_dataloader(DataSettings.of(cfg), sd_tiny.model, sd_tiny.tokenizers, 8).dataloader

    shutil.copytree(mds_latents, tmp_path / "same")
    assert len(list(loader(tmp_path / "same"))) == 64 // 8
    with pytest.raises(UsageError, match="prior_local .* has no 'latent_moments', 'text_embeds' column"):
        loader(two_sets[1])
    rng = np.random.default_rng(2)
    cols = {"latent_moments": "ndarray:float16", "text_embeds": "ndarray:float16"}
    with MDSWriter(out=str(tmp_path / "bigger"), columns=cols) as w:
        for _ in range(8):
            moments = rng.standard_normal((8, 16, 16)).astype(np.float16)
            w.write({"latent_moments": moments, "text_embeds": rng.standard_normal((77, 32)).astype(np.float16)})
    with pytest.raises(UsageError, match=r"prior_local .*: 'latent_moments' is \[8, 16, 16\] per sample"):
        loader(tmp_path / "bigger")
