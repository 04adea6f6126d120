import pytest
import torch
from conftest import synthetic_batch

from diffusion.models import build_model
from diffusion.models.base import EVAL_SEED


def _batch(built, n=2, size=64):
    ids = built.tokenizers["input_ids"](
        ["a red cube", "two cats"][:n] * (n // 2 or 1),
        padding="max_length",
        max_length=77,
        truncation=True,
        return_tensors="pt",
    ).input_ids
    return {"image": torch.rand(n, 3, size, size) * 2 - 1, "input_ids": ids}


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_forward_shapes_and_loss(prediction_type):
    built = build_model("sd-tiny", prediction_type=prediction_type)
    model = built.model
    assert model.prediction_type == prediction_type
    batch = _batch(built)
    pred, target, weights = model(batch)
    assert pred.shape == target.shape == (2, 4, 8, 8) and weights is None  # loss_weighting=none: plain MSE
    loss = model.loss((pred, target, weights), batch)
    assert loss.ndim == 0 and torch.isfinite(loss)


def test_targets_are_noise_or_velocity():
    """epsilon: the target is the drawn noise; v: sqrt(abar) * noise - sqrt(1 - abar) * x0."""
    torch.manual_seed(0)
    eps = build_model("sd-tiny", prediction_type="epsilon").model
    v = build_model("sd-tiny", prediction_type="v_prediction").model
    v.load_state_dict(eps.state_dict())
    batch = {"image": torch.rand(4, 3, 64, 64) * 2 - 1, "input_ids": torch.randint(0, 258, (4, 77))}
    _, noise = eps.eval_forward(batch)
    _, velocity = v.eval_forward(batch)
    x0 = eps.encode_latents(batch, torch.Generator().manual_seed(EVAL_SEED))
    timesteps = ((torch.arange(4) + 0.5) * 1000 / 4).long()
    abar = eps.noise_scheduler.alphas_cumprod[timesteps].view(-1, 1, 1, 1)
    expected = abar.sqrt() * noise - (1 - abar).sqrt() * x0
    torch.testing.assert_close(velocity, expected, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(velocity, noise)


def test_frozen_parts_get_no_gradient(sd_tiny):
    model = sd_tiny.model
    model.train()
    assert not model.vae.training and not model.text_encoder.training and model.unet.training
    model.zero_grad(set_to_none=True)
    batch = _batch(sd_tiny)
    model.loss(model(batch), batch).backward()
    assert all(p.grad is None and not p.requires_grad for p in model.vae.parameters())
    assert all(p.grad is None and not p.requires_grad for p in model.text_encoder.parameters())
    grads = [p.grad for p in model.unet.parameters()]
    assert all(g is not None for g in grads) and any(g.abs().sum() > 0 for g in grads)


def test_precomputed_inputs_skip_both_encoders(sd_tiny):
    model = sd_tiny.model

    def boom(*a, **k):
        raise AssertionError("a frozen encoder ran on a precomputed batch")

    vae_fwd, te_fwd = model.vae.encoder.forward, model.text_encoder.forward
    model.vae.encoder.forward, model.text_encoder.forward = boom, boom
    try:
        for key, channels in (("latent_moments", 8), ("latents", 4)):
            batch = {key: torch.randn(3, channels, 8, 8), "text_embeds": torch.randn(3, 77, 32)}
            pred, *_ = model(batch)
            assert pred.shape == (3, 4, 8, 8)
            assert model.flops_per_batch(batch) == 3 * model.flops_per_sample(64, online=False)["total"]
    finally:
        model.vae.encoder.forward, model.text_encoder.forward = vae_fwd, te_fwd


def test_eval_forward_is_deterministic_and_feeds_the_metric(sd_tiny):
    model = sd_tiny.model
    batch = _batch(sd_tiny)
    with torch.no_grad():
        a, b = model.eval_forward(batch), model.eval_forward(batch)
    torch.testing.assert_close(a[0], b[0])
    metric = model.get_metrics(is_train=False)["ValidationLoss"]
    model.update_metric(batch, a, metric)
    torch.testing.assert_close(metric.compute(), model.loss(a, batch).detach())
    assert model.get_metrics(is_train=True) == {}


def test_sd2_base_flops_match_the_analytic_count():
    """The anchors: ~2.41 TFLOP per 512-px training image for the UNet, ~0.54 at 256 px."""
    with torch.device("meta"):
        model = build_model("sd2-base").model
    assert sum(p.numel() for p in model.unet.parameters()) == pytest.approx(865.9e6, rel=1e-3)
    assert model.flops_per_sample(512)["denoiser"] == pytest.approx(2.41e12, rel=0.02)
    assert model.flops_per_sample(256)["denoiser"] == pytest.approx(0.54e12, rel=0.02)
    online = model.flops_per_sample(512)
    assert online["total"] == online["denoiser"] + online["encoders"] and online["encoders"] > 1e12


def test_local_pipeline_directory_round_trip(sd_tiny, tmp_path):
    from diffusers import StableDiffusionPipeline

    from diffusion.errors import UsageError
    from diffusion.models.build import describe

    m = sd_tiny.model
    StableDiffusionPipeline(
        vae=m.vae,
        text_encoder=m.text_encoder,
        tokenizer=sd_tiny.tokenizers["input_ids"],
        unet=m.unet,
        scheduler=m.noise_scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    ).save_pretrained(tmp_path / "pipe")
    loaded = build_model(str(tmp_path / "pipe"))
    assert loaded.resolution == 64 and describe(str(tmp_path / "pipe")).downsample_factor == 16
    for a, b in zip(m.unet.parameters(), loaded.model.unet.parameters()):
        torch.testing.assert_close(a, b)
    tok, tok2 = loaded.tokenizers["input_ids"], sd_tiny.tokenizers["input_ids"]
    assert tok("hi").input_ids == tok2("hi").input_ids
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="no model_index.json"):
        build_model(str(tmp_path / "empty"))


def test_local_text_encoder_replaces_the_presets_and_mismatches_are_named(tmp_path):
    from transformers import CLIPTextConfig, CLIPTextModel

    from diffusion.config import TrainConfig, local_parts
    from diffusion.errors import UsageError
    from diffusion.models.build import describe
    from diffusion.models.presets import get_preset

    torch.manual_seed(3)
    pretrained = CLIPTextModel(CLIPTextConfig(**get_preset("sd-tiny")["text_encoder"]))
    pretrained.save_pretrained(tmp_path / "clip")
    cfg = TrainConfig(model_name="sd-tiny", text_encoder=str(tmp_path / "clip"))
    assert local_parts(cfg) == {"text_encoder": str(tmp_path / "clip")}
    for name in ("sd-tiny", "flux-tiny"):  # SD cross-attends to its states, FLUX takes its pooled output
        model = build_model(name, local_parts=local_parts(cfg)).model
        for a, b in zip(pretrained.parameters(), model.text_encoder.parameters()):
            torch.testing.assert_close(a, b)
        assert not any(p.requires_grad for p in model.text_encoder.parameters())  # frozen like any encoder
    wide = CLIPTextConfig(**{**get_preset("sd-tiny")["text_encoder"], "hidden_size": 48})
    CLIPTextModel(wide).save_pretrained(tmp_path / "wide")
    with pytest.raises(UsageError, match=r"text_encoder: .* has hidden_size=48 but sd-tiny's denoiser takes 32"):
        describe("sd-tiny", local_parts={"text_encoder": str(tmp_path / "wide")})
    with pytest.raises(UsageError, match="holds CLIPTextModel, not the AutoencoderKL this model's vae is"):
        describe("sd-tiny", local_parts={"vae": str(tmp_path / "clip")})
    with pytest.raises(UsageError, match="vae-tiny is an autoencoder"):
        describe("vae-tiny", local_parts={"text_encoder": str(tmp_path / "clip")})


# a preset, the number of the text encoder and tokenizer swapped, the batch key that tokenizer fills
LATER_TOKENIZER = {
    "sdxl-tiny": ("2", "input_ids_2"),
    "flux-tiny": ("2", "t5_input_ids"),
    "sd3-tiny": ("3", "t5_input_ids"),
}


@pytest.mark.parametrize("name", list(LATER_TOKENIZER))
def test_local_later_text_encoder_and_tokenizer_replace_the_presets(tmp_path, name):
    """text_encoder_2= and tokenizer_2= (SDXL's second CLIP tower, FLUX's T5), text_encoder_3= and tokenizer_3= (SD3's
    T5), here the folders of another pipeline of the same shape: they replace the model's, frozen."""
    from diffusion.config import LOCAL_TOKENIZERS, TrainConfig, local_parts

    number, key = LATER_TOKENIZER[name]
    part, tokenizer = f"text_encoder_{number}", f"tokenizer_{number}"
    torch.manual_seed(5)
    donor = build_model(name)
    donor.model.export(str(tmp_path / "donor"), donor.tokenizers)
    cfg = TrainConfig(
        model_name=name, **{part: str(tmp_path / "donor" / part), tokenizer: str(tmp_path / "donor" / tokenizer)}
    )
    assert local_parts(cfg, LOCAL_TOKENIZERS) == {tokenizer: getattr(cfg, tokenizer)}
    torch.manual_seed(6)
    built = build_model(name, local_parts=local_parts(cfg), tokenizers=local_parts(cfg, LOCAL_TOKENIZERS))
    swapped = getattr(built.model, part)
    for a, b in zip(getattr(donor.model, part).parameters(), swapped.parameters(), strict=True):
        torch.testing.assert_close(a, b)
    assert not any(p.requires_grad for p in swapped.parameters())
    assert not torch.equal(next(donor.model.text_encoder.parameters()), next(built.model.text_encoder.parameters()))
    assert built.tokenizers[key] is not donor.tokenizers[key]
    assert built.tokenizers[key]("a red cube").input_ids == donor.tokenizers[key]("a red cube").input_ids
    batch = synthetic_batch(name, built.model, 2)
    built.model.loss(built.model(batch), batch).backward()


def test_second_text_encoders_that_do_not_fit_are_named(tmp_path):
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    from diffusion.errors import UsageError
    from diffusion.models.build import describe
    from diffusion.models.presets import get_preset

    sdxl = get_preset("sdxl-tiny")["text_encoder_2"]
    CLIPTextModelWithProjection(CLIPTextConfig(**{**sdxl, "projection_dim": 16})).save_pretrained(tmp_path / "clip")
    with pytest.raises(UsageError, match=r"text_encoder_2: .* has projection_dim=16 but sdxl-tiny's denoiser takes 32"):
        describe("sdxl-tiny", local_parts={"text_encoder_2": str(tmp_path / "clip")})
    t5 = get_preset("flux-tiny")["text_encoder_2"]
    T5EncoderModel(T5Config(**{**t5, "d_model": 2 * t5["d_model"]})).save_pretrained(tmp_path / "t5")
    with pytest.raises(UsageError, match=rf"text_encoder_2: .* has d_model={2 * t5['d_model']} but flux-tiny's"):
        describe("flux-tiny", local_parts={"text_encoder_2": str(tmp_path / "t5")})
    with pytest.raises(UsageError, match="holds T5EncoderModel, not the CLIPTextModelWithProjection"):
        describe("sdxl-tiny", local_parts={"text_encoder_2": str(tmp_path / "t5")})
    sd3 = get_preset("sd3-tiny")["transformer"]["joint_attention_dim"]
    with pytest.raises(
        UsageError, match=rf"text_encoder_3: .* has d_model={2 * t5['d_model']} but sd3-tiny's .* {sd3}"
    ):
        describe("sd3-tiny", local_parts={"text_encoder_3": str(tmp_path / "t5")})
    with pytest.raises(UsageError, match="sd-tiny has no text_encoder_2 to replace; it takes vae, text_encoder"):
        describe("sd-tiny", local_parts={"text_encoder_2": str(tmp_path / "clip")})
    with pytest.raises(
        UsageError, match="--tokenizer_2: sd-tiny is an SD model with no tokenizer_2; its tokenizers are tokenizer$"
    ):
        build_model("sd-tiny", tokenizers={"tokenizer_2": str(tmp_path)})


def test_byte_tokenizer_offline():
    from diffusion.models.tokenizer import byte_tokenizer

    tok = byte_tokenizer(77)
    ids = tok("héllo", padding="max_length", max_length=77, truncation=True).input_ids
    assert ids[:8] == [256, 104, 195, 169, 108, 108, 111, 257] and len(ids) == 77 and set(ids[8:]) == {257}
    assert tok.decode(ids, skip_special_tokens=True) == "héllo"
    assert len(tok("x" * 500, truncation=True, max_length=77).input_ids) == 77


def test_t5_tokenizer_offline_cuts_as_t5_over_latin1():
    """The t5 kind: T5's ids for pad, eos and unk (0, 1, 2), "▁" (3) before each word, one piece per Latin-1 character
    (ASCII from 4, U+00A1 on from 98, the soft hyphen left out), any other character <unk>, </s> ending the text."""
    from diffusion.models.tokenizer import t5_tokenizer

    tok = t5_tokenizer(16)
    ids = tok("héllo wörld ☃ A", padding="max_length", max_length=16, truncation=True).input_ids
    assert ids == [3, 75, 169, 79, 79, 82, 3, 90, 182, 85, 79, 71, 3, 2, 3, 1]  # the last word cut for </s>
    assert tok("hi", padding="max_length", max_length=6).input_ids == [3, 75, 76, 1, 0, 0]
    assert tok.decode(ids[:12], skip_special_tokens=True).strip() == "héllo wörld" and len(tok) == 192


def test_clip_tokenizer_offline_cuts_as_clip_over_bytes():
    """The clip kind: lowercased, CLIP's words, each UTF-8 byte one symbol (0xC3 -> 193: 0xC0, 0xC1 left out) and a
    word's last one marked </w> (243 on), <|startoftext|> 486, <|endoftext|> 487 ending and padding."""
    from diffusion.models.tokenizer import clip_tokenizer

    tok = clip_tokenizer(77)
    ids = tok("Héllo, 42", padding="max_length", max_length=77, truncation=True).input_ids
    assert ids[:10] == [486, 104, 193, 169, 108, 108, 243 + 111, 243 + 44, 243 + 52, 243 + 50]
    assert set(ids[10:]) == {487}
    assert tok.decode(ids, skip_special_tokens=True) == "héllo , 4 2" and len(tok) == 488


@pytest.mark.parametrize("name", ["sd-tiny", "sdxl-tiny", "flux-tiny"])
def test_precompute_gives_what_the_precomputed_path_consumes(name):
    """Training on stored moments + embeddings equals training on the images + ids they came from."""
    from torch.utils.data import default_collate

    from diffusion.data.synthetic import SyntheticDataset

    model = build_model(name).model
    ds = SyntheticDataset(model.batch_shapes(64, precomputed=False), num_samples=2, pool=2)
    online = default_collate([ds[0], ds[1]])
    stored = model.precompute(online)
    assert set(stored) == set(model.batch_shapes(64, precomputed=True))
    a = model.eval_forward(online)
    b = model.eval_forward(stored)
    torch.testing.assert_close(a[0], b[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(a[1], b[1], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("model_name", ["sd-tiny", "sdxl-tiny", "flux-tiny"])
def test_half_precision_encoders_feed_an_fp32_denoiser(model_name):
    """encoder_dtype bf16 with precision fp32 (no autocast, as on CPU): the text features are cast to the
    denoiser's dtype; before, the first matmul failed on BFloat16 != float."""
    net = build_model(model_name, encoder_dtype=torch.bfloat16).model
    batch = synthetic_batch(model_name, net)
    loss = net.loss(net(batch), batch)
    loss.backward()
    assert torch.isfinite(loss) and loss.dtype == torch.float32


@pytest.mark.parametrize("name", ["sd-tiny", "flux-tiny"])
def test_a_presets_random_weights_are_drawn_where_asked(name, monkeypatch):
    """Training on a GPU draws a preset's weights there (the CPU took over 110 s for flux-mid's on an H200
    machine); FSDP and the CPU keep drawing them on the host. 'meta' stands in for the GPU here: every part's
    every tensor is made where init_device says, none on the CPU first."""
    from diffusion.config import TrainConfig
    from diffusion.trainer import init_device

    built = build_model(name, init_device="meta")
    tensors = [*built.model.parameters(), *built.model.buffers()]
    assert tensors and {t.device.type for t in tensors} == {"meta"}
    assert {t.device.type for t in build_model(name).model.parameters()} == {"cpu"}

    monkeypatch.setenv("LOCAL_RANK", "3")
    assert init_device(TrainConfig(model_name=name), on_gpu=True) == "cuda:3"
    assert init_device(TrainConfig(model_name=name, fsdp=True), on_gpu=True) is None
    assert init_device(TrainConfig(model_name=name), on_gpu=False) is None
