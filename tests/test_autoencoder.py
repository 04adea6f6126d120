"""Autoencoder training (family "vae"): objective, latent statistics, export, and vae=DIR in diffusion runs."""

import re
import sys

import pytest
import torch
from conftest import REPO, run

from diffusion.config import TrainConfig
from diffusion.errors import UsageError
from diffusion.models import build_model
from diffusion.models.build import describe
from diffusion.trainer import check_before_build


def test_latent_statistics_are_running_moments_and_set_the_exported_scale():
    model = build_model("vae-tiny").model
    with pytest.raises(UsageError, match="not trained a single batch"):
        model.latent_stats()
    for _ in range(500):  # latents with mean 3 and standard deviation 2 in every channel
        model._track(3.0 + 2.0 * torch.randn(64, 4, 8, 8))
    mean, std = model.latent_stats()
    assert mean == pytest.approx(3.0, abs=0.05) and std == pytest.approx(2.0, abs=0.05)
    vae = model.for_diffusion()
    assert vae.config.shift_factor == pytest.approx(mean) and vae.config.scaling_factor == pytest.approx(1 / std)


def test_objective_options_and_metrics():
    torch.manual_seed(0)
    batch = {"image": torch.rand(2, 3, 16, 16) * 2 - 1}
    l1 = build_model("vae-tiny", objective={"kl_weight": 0.0}).model
    outputs = l1(batch)
    assert l1.loss(outputs, batch).item() == pytest.approx((outputs[0] - batch["image"]).abs().mean().item(), rel=1e-5)
    with pytest.raises(UsageError, match=r"unknown autoencoder objective key\(s\) \['kl'\]"):
        build_model("vae-tiny", objective={"kl": 1.0})
    with pytest.raises(UsageError, match="--objective reconstruction='l2' is not one of l1, mse"):
        build_model("vae-tiny", objective={"reconstruction": "l2"})
    l1.eval()
    metrics = l1.get_metrics()
    assert set(metrics) == {"ValidationLoss", "PSNR"}
    for metric in metrics.values():
        l1.update_metric(batch, l1.eval_forward(batch), metric)
    assert metrics["PSNR"].compute().item() < 20  # untrained


def train_and_export(tmp_path, preset: str, *extra: str):
    """3 batches of ``preset`` on synthetic images (an eval at the end), exported; (folder, the checkpoint's model
    state)."""
    ckpt = tmp_path / "ckpt"
    args = [f"model_name={preset}", "use_synth_data=true", "batch_size=4", "num_workers=0", "max_duration=3ba"]
    args += [f"save_folder={ckpt}", "save_interval=3ba", "eval_interval=3ba", "eval_samples=4", *extra]
    done = run([sys.executable, str(REPO / "train.py"), *args], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"^eval at batch 3: ValidationLoss [\d.]+, PSNR [\d.]+$", done.stderr, re.M), done.stderr[-2000:]
    exported = tmp_path / "vae"
    done = run([sys.executable, str(REPO / "export.py"), str(ckpt / "latest-rank0.pt"), str(exported)], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    return exported, torch.load(ckpt / "latest-rank0.pt", weights_only=False)["state"]["model"]


def test_train_export_and_use_as_the_vae_of_sd_and_flux(tmp_path):
    exported, state = train_and_export(tmp_path, "vae-tiny", "use_ema=true")
    mean = state["latent_mean"].mean().item()
    std = (state["latent_sq"].mean().item() - mean**2) ** 0.5
    from diffusers import AutoencoderKL

    vae = AutoencoderKL.from_pretrained(exported)
    assert vae.config.shift_factor == pytest.approx(mean, rel=1e-4)
    assert vae.config.scaling_factor == pytest.approx(1 / std, rel=1e-4)

    sd = build_model("sd-tiny", local_parts={"vae": str(exported)}).model
    assert sd.vae.config.scaling_factor == pytest.approx(1 / std, rel=1e-4)
    assert (
        describe("sd-tiny", local_parts={"vae": str(exported)}).downsample_factor == 2 * 2
    )  # f2 VAE x one UNet downsample
    image = {"image": torch.rand(1, 3, 16, 16) * 2 - 1}
    with torch.no_grad():
        z = vae.encode(image["image"]).latent_dist.mean
    torch.manual_seed(0)
    sd_latents = sd.encode_latents(image, posterior_noise=torch.zeros_like(z))
    assert torch.allclose(sd_latents, z * vae.config.scaling_factor, atol=1e-5)  # SD: no shift, as its pipeline
    flux = build_model("flux-tiny", local_parts={"vae": str(exported)}).model
    flux_latents = flux.encode_latents(image, posterior_noise=torch.zeros_like(z))
    assert torch.allclose(flux_latents, (z - vae.config.shift_factor) * vae.config.scaling_factor, atol=1e-5)


def test_vae_mismatches_are_named(tmp_path):
    from diffusers import AutoencoderKL

    wide = AutoencoderKL(
        block_out_channels=(8,),
        down_block_types=("DownEncoderBlock2D",),
        up_block_types=("UpDecoderBlock2D",),
        latent_channels=8,
        norm_num_groups=4,
    )
    wide.save_pretrained(tmp_path / "wide")
    with pytest.raises(UsageError, match="has latent_channels=8 but sd-tiny's denoiser takes 4"):
        describe("sd-tiny", local_parts={"vae": str(tmp_path / "wide")})
    with pytest.raises(UsageError, match="vae: directory .* does not exist"):
        describe("sd-tiny", local_parts={"vae": str(tmp_path / "nowhere")})
    with pytest.raises(UsageError, match="vae-tiny is an autoencoder"):
        describe("vae-tiny", local_parts={"vae": str(tmp_path / "wide")})
    assert describe(str(tmp_path / "wide")).family == "vae"  # an AutoencoderKL folder trains as is
    with pytest.raises(UsageError, match="--tokenizer: vae-tiny is an autoencoder with no tokenizer; it reads no text"):
        build_model("vae-tiny", tokenizers={"tokenizer": str(tmp_path)})
    cfg = TrainConfig(model_name="vae-tiny", image_size=16, batch_size=4, precomputed_latents=True)
    with pytest.raises(UsageError, match="precomputed_latents does not apply to an autoencoder"):
        check_before_build(cfg, world_size=1, on_gpu=False)


@pytest.mark.parametrize(
    "preset, family", [("vae-flux2-tiny", "flux2-tiny"), ("vae-qwen-image-tiny", "qwen-image-tiny")]
)
def test_flux2_and_qwen_image_autoencoders_train_export_and_serve_their_family(tmp_path, preset, family):
    """The autoencoder family trains the class its preset names; the exported folder is that class with the latent
    statistics written where the family reads them, so the family's latents come out near zero mean, unit variance."""
    exported, state = train_and_export(tmp_path, preset)
    mean, var = state["latent_mean"], state["latent_sq"] - state["latent_mean"] ** 2

    model = build_model(family, local_parts={"vae": str(exported)}).model
    vae = model.vae
    if preset == "vae-flux2-tiny":  # per channel of the 2x2 patches: 4 x 4
        assert mean.shape == (16,)
        assert torch.allclose(vae.bn.running_mean, mean) and torch.allclose(vae.bn.running_var, var, atol=1e-6)
    else:
        assert mean.shape == (4,)
        assert vae.config.latents_mean == pytest.approx(mean.tolist(), rel=1e-5)
        assert vae.config.latents_std == pytest.approx(var.sqrt().tolist(), rel=1e-5)
    assert describe(family, local_parts={"vae": str(exported)}).downsample_factor == 2 * 2  # f2 x 2x2 patches
    torch.manual_seed(0)
    z = model.encode_latents({"image": torch.rand(64, 3, 16, 16) * 2 - 1})  # the synthetic images it trained on
    assert abs(z.mean().item()) < 0.2 and z.std().item() == pytest.approx(1.0, abs=0.2)
    assert type(build_model(str(exported)).model.vae) is type(vae)  # the folder trains on as its own class
    # a VAE of another family's class: one line, exit 2
    done = run([sys.executable, str(REPO / "train.py"), "model_name=sd-tiny", f"vae={exported}"], cwd=tmp_path)
    assert done.returncode == 2 and f"holds {type(vae).__name__}, not the AutoencoderKL" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_qwen_image_autoencoder_learns_shapes_on_white():
    """Qwen-Image's VAE clamps its decoded output to [-1, 1]: trained through that clamp, a white background pushed
    every pixel past 1 within the first steps, the clamp passed no gradient to the shapes' pixels and the run sat at
    the all-white image's PSNR (shapes at 32 px: 8.5-10 dB against vae-tiny's 22). The family decodes unclamped;
    the decoder is what ``decode`` computes before its clamp, and a few steps on four such images learn them."""
    torch.manual_seed(0)
    model = build_model("vae-qwen-image-tiny", objective={"kl_weight": 1e-4}).model
    z = torch.randn(2, 4, 8, 8)
    with torch.no_grad():
        assert torch.equal(model.decode(z).clamp(-1, 1), model.vae.decode(z[:, :, None]).sample[:, :, 0])
    images = torch.ones(4, 3, 16, 16)  # white, a coloured square on each
    for i, colour in enumerate(([1, -1, -1], [-1, 0.2, -1], [-1, -1, 1], [-0.9, -0.9, -0.9])):
        images[i, :, 3 + i : 11 + i, 2 + 2 * i : 8 + 2 * i] = torch.tensor(colour)[:, None, None]
    batch = {"image": images}
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    for _ in range(150):
        loss = model.loss(model(batch), batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    metric = model.get_metrics()["PSNR"]
    with torch.no_grad():
        model.update_metric(batch, model.eval_forward(batch), metric)
    white = 10 * torch.log10(4 / (images - 1).pow(2).mean())  # the all-white image's PSNR (about 8 dB)
    assert metric.compute() > white + 6, (metric.compute(), white)
