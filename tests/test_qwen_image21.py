"""Qwen-Image 2.1 (diffusion/models/qwen_image21.py): its caption layout, text states (before the final norm, the
system message dropped), RGBA latents and transformer inputs are QwenImage21Pipeline's, its prediction the velocity
the pipeline steps with, its timestep shift the scheduler's line, the full-size preset's sizes and traced FLOPs
against a hand count, the tiny preset through benchmark.py (FLOPs in the results line; 2 ranks, FSDP2 + EMA,
autoresume: test_family_resume.py), export (a Turbo folder's sampling grid kept) and sampling, the LoRA commands
(benchmark.py on a pipeline folder, export.py, diffusers' load_lora_weights, generate.py --lora), precompute, and bad
input as one line; REPA and token routing, which the block-causal attention has no hooks for, refuse it in one
line."""

import json

import pytest
import torch
from conftest import caption_batch, encoded_batch, first_step, fixed_batch_losses, lora_round_trip, synthetic_benchmark

import benchmark
import export
import generate
from diffusion.eval.sampling import native_size
from diffusion.models import build_model
from diffusion.models.qwen_image21 import PREFIX, SUFFIX, rgba
from diffusion.models.rectified_flow import sample_timesteps, shift

CAPTIONS = ("a red 3", "two cats sitting on a long mat")
DROP = 12  # the offline tokenizer's system message


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return build_model("qwen-image-21-tiny")


def test_the_layout_is_the_pipelines_template_then_padding(tiny):
    """The template is the pipeline's text-to-image one and the dropped tokens its _drop_idx; a caption's ids are the
    processor's of the formatted caption, then the padding (256); a caption too long is cut before the suffix."""
    pipe = tiny.model.pipeline(tiny.tokenizers)
    assert PREFIX + "{}" + SUFFIX == pipe.prompt_template_t2i
    assert pipe._drop_idx == tiny.model.objective["system_tokens"] == DROP
    ids = caption_batch(tiny, CAPTIONS)["input_ids"]
    assert ids.shape == (2, DROP + 64)
    theirs = pipe.processor(text=[pipe.prompt_template_t2i.format(CAPTIONS[0])], return_tensors="pt").input_ids[0]
    assert ids[0, : len(theirs)].tolist() == theirs.tolist() and (ids[0, len(theirs) :] == 256).all()
    one = tiny.tokenizers["input_ids"]("a red 3", max_length=DROP + 64)
    assert one.input_ids == ids[0].tolist()  # one caption, no tensors: the loader's full call
    long = tiny.tokenizers["input_ids"]("word " * 100, max_length=DROP + 64).input_ids
    assert len(long) == DROP + 64 and pipe.processor.tokenizer.decode(long[-5:]) == SUFFIX


def test_text_states_and_latents_are_the_pipelines(tiny):
    """The states after the system message are the pipeline's prompt embeddings where its mask is set (read before
    the final norm, positions counting real tokens although the pipeline pads on the left), zeros after; the mask read
    back from them is its mask; the latents its VAE's posterior sample of the opaque RGBA image, normalised per
    channel."""
    model, batch = tiny.model, caption_batch(tiny, CAPTIONS)
    pipe = model.pipeline(tiny.tokenizers)
    theirs, their_mask, image_pad = pipe.encode_prompt(list(CAPTIONS), device="cpu")
    ours, pooled = model.encode_text(batch)
    length = theirs.shape[1]
    assert pooled is None and ours.shape == (2, 64, 32) and not image_pad.any()
    torch.testing.assert_close(ours[:, :length], theirs * their_mask[..., None])
    assert (ours[:, length:] == 0).all() and their_mask.sum(dim=1).tolist() == [3 + 7 + 5, 3 + 30 + 5]
    assert model.text_mask(ours)[:, :length].tolist() == their_mask.bool().tolist()
    cfg = model.vae.config
    mean = torch.tensor(cfg.latents_mean).view(1, -1, 1, 1)
    z = model.vae.encode(rgba(batch["image"])[:, :, None]).latent_dist.sample(torch.Generator().manual_seed(3))
    expected = (z[:, :, 0] - mean) / torch.tensor(cfg.latents_std).view(1, -1, 1, 1)
    torch.testing.assert_close(model.encode_latents(batch, generator=torch.Generator().manual_seed(3)), expected)
    assert rgba(batch["image"])[:, 3].eq(1).all()  # opaque, as convert("RGBA") then the image processor gives it


def test_the_prediction_is_the_velocity_the_pipeline_steps_with(tiny):
    """At the pipeline's first step (sigma 1: x_t is the noise), the velocity its scheduler steps with is our
    prediction at t = 1 (the same flattening, text cut to the caption, mask, img_mask and img_shapes), and the
    target is eps - x0 flattened."""
    model, batch = tiny.model, caption_batch(tiny, CAPTIONS[1:])
    seq, _ = model.encode_text(batch)
    noise, x0 = torch.randn(1, 16, 4, 4), torch.randn(1, 16, 4, 4)
    pipe = model.pipeline(tiny.tokenizers)
    flat = noise.flatten(2).transpose(1, 2)
    velocity, sigma = first_step(
        pipe, prompt=CAPTIONS[1], latents=flat.clone(), num_inference_steps=2, height=64, width=64, output_type="latent"
    )
    with torch.no_grad():
        pred, target = model._predict(x0, noise, torch.ones(1), seq)
    assert sigma == 1000.0
    torch.testing.assert_close(pred, velocity)
    torch.testing.assert_close(target, flat - x0.flatten(2).transpose(1, 2))


def test_a_batch_is_cut_to_its_longest_caption_and_a_dropped_one_keeps_every_token(tiny):
    """The image's RoPE frame follows the text, so a caption's prediction is the same alone or padded further (the
    batch cut to its longest caption, as the pipeline pads a batch); text_dropout's zeros keep every token (no text
    row without a key) and train without NaNs."""
    model = tiny.model
    seq, _ = model.encode_text(caption_batch(tiny, CAPTIONS))
    x0, noise, t = torch.randn(2, 16, 4, 4), torch.randn(2, 16, 4, 4), torch.tensor([0.3, 0.7])
    with torch.no_grad():
        both, _ = model._predict(x0, noise, t, seq)
        alone, _ = model._predict(x0[1:], noise[1:], t[1:], seq[1:, :40])
    torch.testing.assert_close(both[1:], alone)
    zeros = torch.zeros(1, 64, 32)
    assert model.text_mask(zeros).all() and model.longest_caption(zeros).shape[1] == 1
    pred, _ = model._predict(x0[:1], noise[:1], t[:1], zeros)
    assert torch.isfinite(pred).all()


def test_timesteps_shift_on_the_schedulers_line_by_image_size():
    """shift=auto: s = exp(mu), mu from 0.5 at 256 image tokens to 1.15 at 4096 (the scheduler's base and max image
    tokens, read from it); t uniform before the shift, or logit-normal."""
    torch.manual_seed(0)
    objective = build_model("qwen-image-21-tiny").model.objective
    assert shift(objective, 256) == pytest.approx(torch.e**0.5)
    assert shift(objective, 4096) == pytest.approx(torch.e**1.15)
    t = sample_timesteps(objective, 20000, 256, "cpu")
    s = torch.e**0.5
    u = t / (s - (s - 1) * t)  # the shift undone
    assert abs(u.mean() - 0.5) < 0.01 and abs((u < 0.1).float().mean() - 0.1) < 0.01
    logit = build_model("qwen-image-21-tiny", objective={"timesteps": "logit_normal", "shift": 1.0}).model
    assert sample_timesteps(logit.objective, 20000, 16, "cpu").median() == pytest.approx(0.5, abs=0.02)


def test_loss_falls_when_training_on_a_fixed_batch():
    torch.manual_seed(0)
    built = build_model("qwen-image-21-tiny")
    model = built.model
    losses = fixed_batch_losses(model, encoded_batch(model, caption_batch(built, CAPTIONS)))
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5
    assert all(p.grad is not None for p in model.transformer.parameters() if p.requires_grad)


def test_the_full_preset_is_the_published_size_and_its_flops_the_hand_count():
    """A 7.12B transformer (the Turbo card's 14.2 GB in fp16), Qwen3-VL-8B (8.77B with its vision tower: its 17.5 GB
    in bf16); the traced training FLOPs of the transformer at 1024 px equal a count by hand: per block and token the
    attention's four d x d projections and the SwiGLU's three d x 3d, 2 FLOPs a multiply-add; attention as the
    processor runs it, the text segment over its own keys (4 L^2 d) and the image over all (4 S N d); the text
    projection (C x d, d x d) over the caption, img_in over the image, proj_out over the whole sequence, the shared
    modulation, the time embedding and the final norm's scale for the sample and for t = 0 (causal_condition); x3 for
    forward and backward."""
    with torch.device("meta"):
        model = build_model("qwen-image-21").model
    assert sum(p.numel() for p in model.transformer.parameters()) == pytest.approx(7.115e9, rel=0.001)
    assert sum(p.numel() for p in model.text_encoder.parameters()) == pytest.approx(8.77e9, rel=0.005)
    d, c, text, image = 4096, 4096, 512, (1024 // 16) ** 2
    tokens = text + image
    forward = (
        32 * (2 * 13 * d * d * tokens + 4 * text**2 * d + 4 * image * tokens * d)
        + 2 * (c * d + d * d) * text
        + 2 * 64 * d * image
        + 2 * d * 64 * tokens
        + 2 * 2 * (4 * d * d + (256 * d + d * d) + d * d)  # modulation, time embedding, final scale: 2 rows
    )
    assert model.flops_per_sample(1024, online=False)["denoiser"] == pytest.approx(3 * forward, rel=0.001)


def test_benchmark_results_line_has_traced_flops(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (rec,) = synthetic_benchmark("qwen-image-21-tiny")
    assert rec["family"] == "qwen-image-21" and rec["prediction_type"] == "flow"
    assert rec["tflop_per_image"] > rec["tflop_per_image_denoiser"] > 0


def test_export_loads_as_the_pipeline_and_a_turbo_folder_keeps_its_grid(tmp_path):
    """The export is a QwenImage21Pipeline folder at the run's caption length; a folder recording sample_sigmas (the
    Turbo checkpoint) builds a model that exports them again; generate.py samples from it."""
    from diffusers import DiffusionPipeline

    out = tmp_path / "qwen21"
    assert export.main(["qwen-image-21-tiny", str(out)]) == 0
    pipe = DiffusionPipeline.from_pretrained(out, local_files_only=True)
    assert type(pipe).__name__ == "QwenImage21Pipeline" and pipe.processor.tokenizer.model_max_length == 64
    assert pipe.config.sample_sigmas is None
    index = json.loads((out / "model_index.json").read_text())
    (out / "model_index.json").write_text(json.dumps({**index, "sample_sigmas": [1.0, 0.75, 0.5]}))
    model = build_model(str(out)).model
    assert model.objective["sample_sigmas"] == (1.0, 0.75, 0.5) and model.objective["system_tokens"] == DROP
    assert model.objective["max_sequence_length"] == 64  # the folder keeps its caption length
    assert model.pipeline({"input_ids": pipe.processor}).config.sample_sigmas == [1.0, 0.75, 0.5]
    args = ["--prompt", "a red 3", "--steps", "2", "--image_size", "64", "--guidance_scale", "3"]
    assert generate.main([str(out), *args, "--out", str(tmp_path / "gen")]) == 0
    assert (tmp_path / "gen" / "00000-a-red-3.png").exists()
    assert (
        native_size(pipe) == 1024
    )  # no --image_size: the pipeline's output_resolution (it has no default_sample_size)


def test_lora_on_a_pipeline_folder_exports_loads_in_diffusers_and_samples(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    pipe, gen = lora_round_trip("qwen-image-21-tiny")
    adapted = [n for n, _ in pipe.transformer.named_modules() if n.endswith(".to_q.lora_A.lora")]
    assert len(adapted) == 2  # the 2 blocks' attention
    # the adapters on a Krea 2 base (another family; without the record of their base): one line
    assert export.main(["krea2-tiny", "krea"]) == 0
    (tmp_path / "lora" / "lora_base.json").unlink()
    capsys.readouterr()
    assert generate.main(["krea", "--lora", "lora", *gen]) == 2
    err = capsys.readouterr().err
    (line,) = [line for line in err.splitlines() if line.startswith("generate.py: error:")]
    assert "made for another model" in line and "Traceback" not in err, err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--objective", "guidance=3"], "unknown Qwen-Image 2.1 objective key(s)"),
        (["--objective", "sample_sigmas=1,2"], "sample_sigmas"),
        (["--prediction_type", "v_prediction"], "applies to SD models"),
        (["--repa_encoder", "ENC"], "REPA aligns a denoiser's hidden states; qwen-image-21-tiny is a Qwen-Image 2.1"),
        (["--routing_share", "0.5"], "token routing needs block stacks it can hook; qwen-image-21-tiny is"),
    ],
)
def test_bad_input_is_one_line(argv, message, capsys):
    assert benchmark.main(["--use_synth_data", "--batch_size", "4", "--model_name", "qwen-image-21-tiny", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_precompute_from_captioned_images_then_train_on_the_result(mds_images, tmp_path):
    """data.py precompute reads captioned images (laid out as the pipeline's processor tokenizes them) and stores
    the states (padding zero, as the mask reads them) and the RGBA image's VAE moments; training reads them."""
    from conftest import read_mds, read_results

    from diffusion.precompute import precompute

    out = tmp_path / "latents"
    report = precompute(
        str(mds_images), str(out), model_name="qwen-image-21-tiny", image_size=64, batch_size=8, num_workers=0,
        progress=False,
    )  # fmt: skip
    assert report["written"] == 32 and report["columns"]["text_embeds"].endswith(":64,32")
    row = read_mds(out)[0]
    assert row["latent_moments"].shape == (32, 4, 4)
    assert (row["text_embeds"][-1] == 0).all() and (row["text_embeds"][0] != 0).any()
    results = tmp_path / "r.jsonl"
    args = ["--model_name", "qwen-image-21-tiny", "--local", str(out), "--precomputed_latents", "--batch_size", "4"]
    args += ["--num_workers", "0", "--max_duration", "2ba", "--results", str(results)]
    assert benchmark.main(args) == 0
    (rec,) = read_results(results)
    assert rec["precomputed_latents"] and rec["tflop_per_image"] == rec["tflop_per_image_denoiser"] > 0
