"""REPA on precomputed latents (diffusion/techniques/repa/alignment.py, data/precompute.py): data.py precompute --repa_encoder stores
the encoder's patch features beside the latents and records the encoder; a run reads them instead of loading the
encoder, its REPA loss equals the online one on the same images, its FLOPs count the projector alone; another
encoder, a set without features and a second encoder into the same OUT are one line; bucketed sets train."""

import json

import numpy as np
import pytest
import torch
from conftest import read_mds, read_results, release_streaming_memory, tiny_clip_vision
from torch.utils.data import default_collate

import benchmark
import data
from diffusion.batch import IMAGE, LATENT_MOMENTS, REPA_FEATURES, REPA_RECORD, TEXT_EMBEDS
from diffusion.cli import run as run_cli
from diffusion.config import TrainConfig
from diffusion.data.loaders import on_device, streaming_dataset, token_lengths
from diffusion.models import build_model
from diffusion.techniques import Repa
from diffusion.techniques.repa.alignment import FrozenEncoder, encoder_spec
from diffusion.trainer import check_before_build

RUN = ["--model_name", "sd-tiny", "--batch_size", "4", "--num_workers", "0", "--max_duration", "2ba"]


def _precompute(src, out, encoder: str | None, *more: str) -> int:
    argv = ["precompute", str(src), str(out), "--model_name", "sd-tiny", "--batch_size", "8", "--num_workers", "0"]
    code = run_cli("data.py", data.main, [*argv, *(["--repa_encoder", encoder] if encoder else []), *more])
    release_streaming_memory()
    return code


@pytest.fixture(scope="module")
def stored(tmp_path_factory, mds_images):
    """mds_images precomputed for sd-tiny at 64 px with a tiny CLIP vision tower's features: (encoder, OUT)."""
    root = tmp_path_factory.mktemp("repa-precompute")
    encoder = tiny_clip_vision(root / "clip")
    assert _precompute(mds_images, root / "latents", encoder) == 0
    return encoder, root / "latents"


def _one_line(capsys, message: str, prog: str = "benchmark.py") -> None:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"{prog}: error: ") and message in err[0], err


def test_the_features_are_stored_compact_with_a_record_of_their_encoder(stored):
    encoder, out = stored
    samples = read_mds(out)
    features = samples[0][REPA_FEATURES]
    assert len(samples) == 32 and features.dtype == np.float16 and features.shape == (32, 4, 4)  # 64 px -> 16 px
    assert features.nbytes == 1024 and np.isfinite(features).all() and np.abs(features).max() > 0.1
    record = json.loads((out / REPA_RECORD).read_text())
    assert record["encoder"] == encoder and record["stored"] == "float16" and len(record["weights_sha256"]) == 64


def test_the_stored_loss_equals_the_online_loss_on_the_same_images(stored, mds_images):
    """One training forward on the stored batch; the REPA loss from its stored features and from the encoder run
    on the very images precompute read (same projector, same captured block) agree to fp16's rounding."""
    encoder, out = stored
    cfg = TrainConfig(model_name="sd-tiny", repa_encoder=encoder, precomputed_latents=True)
    check_before_build(cfg, world_size=1, on_gpu=False)
    built = build_model("sd-tiny")
    model = built.model
    (alignment,) = Repa.install(cfg, model)
    assert alignment.encoder is None  # not loaded: the batches carry its features
    rows = read_mds(out)[:4]
    batch = {k: torch.from_numpy(np.stack([r[k] for r in rows])).float() for k in (LATENT_MOMENTS, TEXT_EMBEDS)}
    batch[REPA_FEATURES] = torch.from_numpy(np.stack([r[REPA_FEATURES] for r in rows])).float()
    source = streaming_dataset(
        remote=None, local=str(mds_images), key="SRC", precomputed=False, image_size=64, tokenizers=built.tokenizers,
        token_lengths=token_lengths(model, 64), shuffle=False,
    )  # fmt: skip  # the images as precompute read them
    images = on_device(default_collate([source[i] for i in range(4)]))[IMAGE]
    del source
    release_streaming_memory()
    alignment.active = True
    model.train()
    model(batch)
    from_stored = alignment.loss(batch)
    alignment.encoder = FrozenEncoder(encoder_spec(encoder))
    online = alignment.loss({IMAGE: images})
    assert 0 < from_stored.item() < 2 and from_stored.grad_fn is not None
    torch.testing.assert_close(from_stored, online, atol=1e-3, rtol=0)
    torch.testing.assert_close(batch[REPA_FEATURES], alignment.encoder.maps(images), atol=2e-3, rtol=2e-3)


def test_a_run_reads_the_features_logs_the_loss_and_counts_the_projector_alone(stored, tmp_path, capfd):
    encoder, out = stored
    results = tmp_path / "r.jsonl"
    argv = [*RUN, "--local", str(out), "--precomputed_latents", "--repa_encoder", encoder, "--image_size", "64"]
    assert benchmark.main([*argv, "--progress", "metrics", "--results", str(results)]) == 0
    logged = capfd.readouterr()
    assert "loss/train/repa" in logged.out + logged.err
    (rec,) = read_results(results)
    assert rec["precomputed_latents"] and rec["repa"]["encoder"] == encoder
    # sd-tiny's mid block at 64 px: 4x4 tokens 64 wide; the projector 64 -> 128 -> 128 -> 32 (the encoder's width)
    projector = 6 * (64 * 128 + 128 * 128 + 128 * 32) * 16
    assert rec["tflop_per_image_repa"] == pytest.approx(projector / 1e12)
    cfg = TrainConfig(model_name="sd-tiny", repa_encoder=encoder)
    check_before_build(cfg, world_size=1, on_gpu=False)
    online = Repa.install(cfg, build_model("sd-tiny").model)[0].flops(64)
    assert online > projector  # a run on the images also pays the encoder's forward


def test_another_encoder_a_set_without_features_and_a_second_encoder_into_one_out_are_one_line(
    stored, mds_latents, mds_images, tmp_path, capsys
):
    encoder, out = stored
    other = tiny_clip_vision(tmp_path / "other", seed=1)  # the same config, other weights
    argv = [*RUN, "--precomputed_latents", "--image_size", "64"]
    assert benchmark.main([*argv, "--local", str(out), "--repa_encoder", other]) == 2
    _one_line(capsys, f"--local {out} holds the REPA features of {encoder}, not of --repa_encoder {other} (its "
              f"weights differ from {encoder}'s): pass --repa_encoder {encoder}, or precompute again")  # fmt: skip
    assert benchmark.main([*argv, "--local", str(mds_latents), "--repa_encoder", encoder]) == 2
    _one_line(capsys, f"holds no REPA features (no {REPA_RECORD}), which --repa_encoder {encoder} on "
              f"--precomputed_latents reads: precompute it with data.py precompute --repa_encoder {encoder}")  # fmt: skip
    assert _precompute(mds_images, out, other) == 2
    _one_line(capsys, f"OUT {out} holds REPA features of another encoder than --repa_encoder {other}", "data.py")


def test_a_bucketed_set_stores_each_buckets_grid_and_trains(mds_buckets, stored, tmp_path):
    encoder, _ = stored
    out = tmp_path / "latents"
    assert _precompute(mds_buckets, out, encoder) == 0
    grids = {b.name: read_mds(b)[0][REPA_FEATURES].shape for b in sorted(out.iterdir()) if b.is_dir()}
    # each bucket's size (h, w): 1x1 64x64, 1x2 96x48, 2x1 48x96, 4x3 48x80 -> the encoder's grid at 16 px short side
    assert grids == {"1x1": (32, 4, 4), "1x2": (32, 8, 4), "2x1": (32, 4, 8), "4x3": (32, 4, 7)}, grids
    results = tmp_path / "r.jsonl"
    argv = [*RUN, "--local", str(out), "--precomputed_latents", "--repa_encoder", encoder, "--image_size", "64"]
    assert benchmark.main([*argv, "--results", str(results)]) == 0
    assert read_results(results)[0]["repa"]["encoder"] == encoder
