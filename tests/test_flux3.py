"""FLUX.3 (diffusion/models/flux3.py): its text states (each caption's 80-token window), latents and transformer inputs
are the modular pipeline's, its prediction the velocity the pipeline's scheduler steps with (the distilled model's with
the timestep it jumps to), its timestep draw, the full-size presets' sizes and traced FLOPs against a hand count, the
tiny preset through benchmark.py (FLOPs in the results line; 2 ranks, FSDP2 + EMA, autoresume: test_family_resume.py),
export as a folder the modular pipeline's loader reads and sampling, a LoRA exported for the pipeline's
load_lora_weights, and bad input as one line."""

import numpy as np
import pytest
import torch
from conftest import (
    adapters_sample_as_trained,
    assert_shifted_uniform,
    benchmark_error,
    caption_batch,
    encoded_batch,
    first_step,
    fixed_batch_losses,
    foreign_adapters_are_one_line,
    lora_run,
    read_mds,
    read_results,
    synthetic_benchmark,
    tiny_clip_vision,
)

import benchmark
import export
import generate
from diffusion.models import build_model
from diffusion.models.flux3 import PAD_MULTIPLE, TEXT_LAYERS, Flux3, Flux3Distilled, windows
from diffusion.models.rectified_flow import sample_timesteps
from diffusion.techniques.lora.adapters import WEIGHTS

CAPTIONS = ["a red 3", "two cats sitting on a long mat " * 3]


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return build_model("flux3-tiny")


def _unguided(pipe):
    from diffusers import ClassifierFreeGuidance

    if getattr(pipe, "guider", None) is not None:
        pipe.update_components(guider=ClassifierFreeGuidance(guidance_scale=1.0))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_windows_are_the_token_counts_rounded_up_to_80_and_capped():
    assert windows(torch.tensor([1, 80, 81, 500, 600]), 512).tolist() == [80, 80, 160, 512, 512]
    assert PAD_MULTIPLE == 80 and TEXT_LAYERS == tuple(range(4, 33, 4))


def test_the_reference_image_mode_is_frozen_and_takes_no_adapters(tiny):
    """Text-to-image training never runs the reference-image mode: it gets no gradient, so it is frozen (no optimizer
    or checkpoint state for weights that never step: a 2-rank FSDP2 resume needs that), and LoRA's targets are the
    attention projections of the text and image modes' blocks and the joint blocks, named per block."""
    model = tiny.model
    trainable = [n for n, p in model.transformer.named_parameters() if p.requires_grad]
    frozen = [n for n, p in model.transformer.named_parameters() if not p.requires_grad]
    assert trainable and frozen and all("image_cond" in n for n in frozen)
    assert len(model.LORA_TARGETS) == 4 * (1 + 1 + 2) and not any("image_cond" in t for t in model.LORA_TARGETS)
    assert "single_transformer_blocks.1.attn.to_out.0" in model.LORA_TARGETS


def test_text_states_and_latents_are_the_pipelines(tiny):
    """Each caption, through the processor's chat template, gives the pipeline's prompt embeddings over its own window
    (layers 4..32 stacked, padding masked with position id 1); zero after it, so stored states give the windows back.
    The latents are the VAE encoder step's: the mode, 2x2 patches, batch-norm normalised."""
    from diffusers.modular_pipelines.flux3.encoders import Flux3TextEncoderStep, Flux3VaeEncoderStep
    from diffusers.modular_pipelines.modular_pipeline import PipelineState

    model = tiny.model
    captions = ["a red 3", "two cats sitting on a long mat " * 3, "a horse " * 40]
    batch = caption_batch(tiny, captions)
    pipe = model.pipeline(tiny.tokenizers)
    assert pipe.tokenizer.tokenizer.decode(batch["input_ids"][0][:1]) == "<|im_start|>"
    seq, window = model.encode_text(batch)
    assert seq.shape == (3, 80, len(TEXT_LAYERS) * 32) and window.tolist() == [80, 80, 80]
    for caption, states, n in zip(captions, seq, window):
        theirs = Flux3TextEncoderStep._get_qwen3_vl_prompt_embeds(
            model.text_encoder, pipe.tokenizer, caption, max_sequence_length=model.text_length
        )
        torch.testing.assert_close(states[:n], theirs[0])
    assert model.encode_text({"text_embeds": seq})[1].tolist() == window.tolist()
    bn = model.vae.bn
    saved = bn.running_mean.clone(), bn.running_var.clone()
    try:
        bn.running_mean.normal_(), bn.running_var.uniform_(0.5, 2.0)  # statistics a trained VAE has
        state = PipelineState()
        state.set("condition_images", list(batch["image"][:, None]))
        _, state = Flux3VaeEncoderStep()(pipe, state)
        torch.testing.assert_close(model.encode_latents(batch), torch.cat(state.get("image_cond_latents")))
    finally:
        bn.running_mean.copy_(saved[0]), bn.running_var.copy_(saved[1])


def test_a_longer_run_length_gives_each_caption_its_own_window():
    """At 240 tokens a caption: a short caption's window is 80, a long one's 160 or 240; the short one's states past
    its window are zero, and the batch's transformer call sees the longest window."""
    torch.manual_seed(0)
    built = build_model("flux3-tiny", objective={"max_sequence_length": 240})
    model = built.model
    batch = caption_batch(built, ["a red 3", "a horse " * 25])
    seq, window = model.encode_text(batch)
    n = (batch["input_ids"] != 256).sum(dim=1)
    assert window.tolist() == [80, -(-int(n[1]) // 80) * 80] and window[1] > 80
    assert not seq[0, 80:].any() and seq[1, : window[1]].ne(0).any(dim=-1).all()
    seen = {}
    hook = model.transformer.register_forward_pre_hook(lambda m, a, kw: seen.update(kw), with_kwargs=True)
    try:
        model._predict(torch.randn(2, 16, 2, 2), torch.randn(2, 16, 2, 2), torch.rand(2), seq, window)
    finally:
        hook.remove()
    assert seen["encoder_hidden_states"].shape[1] == window[1] and seen["txt_ids"].shape == (int(window[1]), 4)


def test_the_prediction_is_the_velocity_the_pipeline_steps_with(tiny):
    """At the pipeline's first step (sigma 1: x_t is the noise), the velocity its scheduler steps with is our
    prediction at t = 1 (the transformer's inputs: packed tokens, the image ids scaled by 0.5, the text's on l), and the
    target is eps - x0."""
    model = tiny.model
    seq, window = model.encode_text(caption_batch(tiny, CAPTIONS[:1]))
    noise, x0 = torch.randn(1, 16, 2, 2), torch.randn(1, 16, 2, 2)
    pred, target, stepped = _first_step(model, tiny.tokenizers, noise, x0, seq, window, torch.ones(1))
    assert stepped["t"] == 1000.0
    torch.testing.assert_close(pred, stepped["v"])
    torch.testing.assert_close(target, (noise - x0).flatten(2).transpose(1, 2))
    assert stepped["img_ids"][3].tolist() == [0, 0.5, 0.5, 0]  # (t, h, w, l) of the token at row 1, column 1


def _first_step(model, tokenizers, noise, x0, seq, window, t):
    """(our prediction and target at ``t``, what the pipeline's first step had: the velocity "v" its scheduler steps
    with, the timestep "t", the transformer's image ids "img_ids")."""
    pipe = _unguided(model.pipeline(tokenizers))
    seen = {}
    hook = model.transformer.register_forward_pre_hook(
        lambda m, a, kw: None if "img_ids" in seen else seen.update(img_ids=kw["img_ids"]), with_kwargs=True
    )
    try:
        seen["v"], seen["t"] = first_step(
            pipe, prompt=CAPTIONS[0], latents=noise.clone(), num_inference_steps=2, height=32, width=32,
            max_sequence_length=model.text_length, output_type="pt",
        )  # fmt: skip
    finally:
        hook.remove()
    with torch.no_grad():
        pred, target = model._predict(x0, noise, t, seq, window)
    return pred, target, seen


def test_the_distilled_model_is_given_the_timestep_it_jumps_to():
    """flux3-distilled: the distilled pipeline's first of 2 steps jumps from sigma 1 to the next shifted sigma; with
    objective.flow_map_step that gap, our prediction at t = 1 is the velocity it steps with."""
    torch.manual_seed(0)
    s = 6.93
    gap = 1 - s * 0.5 / (1 + (s - 1) * 0.5)  # the second of linspace(1, 1/2, 2), shifted
    built = build_model("flux3-distilled-tiny", objective={"flow_map_step": gap})
    model = built.model
    assert type(model.pipeline(built.tokenizers)).__name__ == "Flux3DistilledModularPipeline"
    seq, window = model.encode_text(caption_batch(built, CAPTIONS[:1]))
    noise, x0 = torch.randn(1, 16, 2, 2), torch.randn(1, 16, 2, 2)
    pred, _, stepped = _first_step(model, built.tokenizers, noise, x0, seq, window, torch.ones(1))
    torch.testing.assert_close(pred, stepped["v"])


def test_timesteps_are_uniform_and_shifted_as_the_sampler_by_default_or_logit_normal():
    torch.manual_seed(0)
    objective = build_model("flux3-tiny").model.objective
    assert_shifted_uniform(sample_timesteps(objective, 20000, 16, "cpu"), 6.93)  # Flux3SetTimestepsStep's shift
    objective = {**objective, "timesteps": "logit_normal", "shift": 1.0}
    assert sample_timesteps(objective, 20000, 16, "cpu").median() == pytest.approx(0.5, abs=0.02)


def test_loss_falls_when_training_on_a_fixed_batch():
    """On stored states (the windows read back from their zero rows) and latents, as precompute stores them."""
    torch.manual_seed(0)
    built = build_model("flux3-tiny")
    losses = fixed_batch_losses(built.model, encoded_batch(built.model, caption_batch(built, CAPTIONS)), 30)
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5


@pytest.mark.parametrize("preset, params", [("flux3", 5.538e9), ("flux3-distilled", 5.549e9)])
def test_full_size_presets_are_the_published_sizes_and_their_flops_the_hand_count(preset, params):
    """Parameters (5 per-mode blocks for each of 3 modes and 28 joint blocks of 3072; the distilled one's target
    timestep embedder; Qwen3-VL-4B, 4.44B with its vision tower), and the traced training FLOPs of the transformer at
    1024 px (4096 image tokens, a 512-token window) equal to a count by hand: every token through 13 d^2 weights a
    block (attention 4 d^2, SwiGLU 9 d^2) in its mode's blocks (text, image) and the joint ones, its per-token
    modulations (two d x 3d), the image's output norm (d x 2d) and projections, 2 FLOPs a multiply-add, attention
    4 S^2 d a block over its sequence, x3 for forward and backward."""
    with torch.device("meta"):
        model = build_model(preset).model
    cfg = model.transformer.config
    assert sum(p.numel() for p in model.transformer.parameters()) == pytest.approx(params, rel=0.001)
    assert sum(p.numel() for p in model.text_encoder.parameters()) == pytest.approx(4.438e9, rel=0.001)
    d, mode, joint = cfg.num_attention_heads * cfg.attention_head_dim, cfg.num_layers, cfg.num_single_layers
    image, text = (1024 // 16) ** 2, 512
    tokens = image + text
    forward = (
        2 * 13 * d * d * (mode * tokens + joint * tokens)
        + 4 * d * (mode * (image**2 + text**2) + joint * tokens**2)
        + 2 * 6 * d * d * tokens  # the early and joint modulations, per token
        + 2 * 2 * d * d * image  # norm_out
        + 2 * cfg.joint_attention_dim * d * text
        + 2 * 2 * cfg.in_channels * d * image  # x_embedders.image, proj_out
    )
    assert model.flops_per_sample(1024, online=False)["denoiser"] == pytest.approx(3 * forward, rel=0.01)


@pytest.mark.parametrize("preset, family", [("flux3-tiny", "flux3"), ("flux3-distilled-tiny", "flux3-distilled")])
def test_benchmark_results_line_has_traced_flops(preset, family, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (rec,) = synthetic_benchmark(preset)
    assert (rec["family"], rec["prediction_type"]) == (family, "flow")
    assert rec["tflop_per_image"] > rec["tflop_per_image_denoiser"] > 0


@pytest.mark.parametrize(
    "preset, family", [("flux3-tiny", Flux3), ("flux3-distilled-tiny", Flux3Distilled)], ids=["base", "distilled"]
)
def test_export_loads_with_the_modular_pipelines_loader_and_samples(preset, family, tmp_path):
    """export.py writes the modular pipeline's folder (modular_model_index.json); diffusers' ModularPipeline loader
    reads it back as its pipeline class (with the family's blocks: no prompt upsampler) and samples; build_model reads
    it as a model of its family, keeping its caption length; generate.py samples it, two prompts, one a call."""
    import diffusers
    from diffusers import ModularPipeline

    out = tmp_path / "flux3"
    assert export.main([preset, str(out)]) == 0
    assert (out / "modular_model_index.json").is_file() and not (out / "model_index.json").exists()
    assert type(ModularPipeline.from_pretrained(str(out))).__name__ == family.PIPELINE
    pipe = getattr(diffusers, family.PIPELINE)(blocks=family.blocks(), pretrained_model_name_or_path=str(out))
    pipe.load_components()
    assert type(pipe.tokenizer).__name__ == "Qwen3VLProcessor" and pipe.tokenizer.tokenizer.model_max_length == 80
    assert _unguided(pipe)(prompt="a red 3", num_inference_steps=2, height=64, width=64).images[0].size == (64, 64)
    model = build_model(str(out)).model
    assert type(model) is family and model.objective["max_sequence_length"] == 80
    argv = [str(out), "--prompt", "a red 3", "--prompt", "two", "--steps", "2", "--out", str(tmp_path / "g")]
    assert generate.main(argv) == 0
    assert (tmp_path / "g" / "00000-a-red-3.png").exists() and (tmp_path / "g" / "00001-two.png").exists()


def test_a_flow_map_transformer_in_the_base_family_is_one_line():
    """The families' transformers differ by flow_map: the other one's is refused, naming the family to use."""
    from diffusion.errors import UsageError

    parts = build_model("flux3-distilled-tiny").model
    with pytest.raises(
        UsageError,
        match="flow_map=True: it is a step-distilled FLUX.3 model, not a FLUX.3 model; build it as the flux3-distilled",
    ):
        Flux3(transformer=parts.transformer, vae=parts.vae, text_encoder=parts.text_encoder)


def test_a_lora_exports_for_the_pipelines_load_lora_weights_and_generate(tmp_path, monkeypatch, capsys):
    """benchmark.py trains rank-4 adapters on an exported pipeline folder; export.py writes them; the modular
    pipeline's own load_lora_weights on the base samples the checkpoint's images, which differ from the base's;
    generate.py --lora samples with them. A FLUX.3 adapter on a FLUX.2 [klein] base is one line, exit 2."""
    monkeypatch.chdir(tmp_path)
    assert export.main(["flux3-tiny", "base"]) == 0
    lora_run("base")
    pipe = Flux3.open_pipeline("base")
    pipe.load_lora_weights("lora", weight_name=WEIGHTS)
    adapters_sample_as_trained(pipe, "base")
    assert export.main(["flux2-tiny", "klein"]) == 0
    foreign_adapters_are_one_line("klein", capsys)


def test_precompute_stores_each_captions_window_and_training_reads_it_back(mds_images, tmp_path):
    """data.py precompute stores each caption's states over its window (one of 80 tokens here) and the VAE moments, no
    pooled embedding; benchmark.py trains on them (the encoders' FLOPs not counted)."""
    from diffusion.precompute import precompute

    out = tmp_path / "latents"
    report = precompute(
        str(mds_images), str(out), model_name="flux3-tiny", image_size=64, batch_size=8, num_workers=0, progress=False
    )
    assert report["written"] == 32 and report["columns"]["text_embeds"].endswith(":80,256")
    row = read_mds(out)[0]
    assert row["latent_moments"].shape == (8, 8, 8) and "pooled_text_embeds" not in row
    assert (np.abs(row["text_embeds"]).sum(-1) > 0).all()  # a short caption's whole window: its padding's states too
    args = ["--model_name", "flux3-tiny", "--local", str(out), "--precomputed_latents", "--batch_size", "4"]
    (rec,) = synthetic_benchmark_args(tmp_path, args)
    assert rec["precomputed_latents"] and rec["tflop_per_image"] == rec["tflop_per_image_denoiser"] > 0


@pytest.mark.parametrize("block", ["image.0", "single.1"])
def test_repa_aligns_an_image_mode_block_or_a_joint_block(block, tmp_path):
    """REPA's hooks on the image mode's blocks (their output) and the joint blocks (their second output, the image's
    tokens): a run trains with either and records it."""
    args = ["--use_synth_data", "--model_name", "flux3-tiny", "--batch_size", "4", "--repa_block", block]
    (rec,) = synthetic_benchmark_args(tmp_path, [*args, "--repa_encoder", tiny_clip_vision(tmp_path / "enc")])
    assert rec["repa"]["block"] == block


def synthetic_benchmark_args(folder, args: list[str]) -> list[dict]:
    """benchmark.py with ``args`` for 2 batches, no loader workers; its results lines."""
    results = folder / "r.jsonl"
    assert benchmark.main([*args, "--num_workers", "0", "--max_duration", "2ba", "--results", str(results)]) == 0
    return read_results(results)


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--model_name", "flux3-tiny", "--objective", "flow_map_step=0.0625"],
            "--objective flow_map_step applies to the step-distilled FLUX.3 (flux3-distilled, a flow map); "
            "flux3-tiny is a FLUX.3 model: drop it",
        ),
        (["--model_name", "flux3-tiny", "--objective", "guidance=3"], "unknown FLUX.3 objective key(s) ['guidance']"),
        (["--model_name", "flux3-tiny", "--objective", "shift=auto"], "shift"),
        (["--model_name", "flux3-tiny", "--prediction_type", "v_prediction"], "applies to SD models"),
        (["--model_name", "flux3-tiny", "--routing_share", "0.5"], "routing"),
    ],
)
def test_bad_input_is_one_line(argv, message, capsys):
    assert message in benchmark_error(argv, capsys)
