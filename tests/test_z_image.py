"""Z-Image (diffusion/models/z_image.py): its text states and latents are the pipeline's and its diffusers script's, its
prediction the velocity the pipeline steps with (the transformer's output negated, its timestep 1 - t), its timestep
draw, the full-size preset's sizes and traced FLOPs against a hand count, the tiny preset through benchmark.py (FLOPs
in the results line; 2 ranks, FSDP2 + EMA, autoresume: test_family_resume.py), export and sampling, a LoRA exported
for diffusers' load_lora_weights, and bad input as one line. Its preset export is test_export_presets.py's too."""

import copy

import numpy as np
import pytest
import torch
from conftest import VISION, fixed_batch_losses, read_results, save_encoder, synthetic_batch, synthetic_benchmark
from transformers import Dinov2Config, Dinov2Model

import benchmark
import export
import generate
from diffusion.batch import IMAGE, LATENT_MOMENTS, REPA_FEATURES
from diffusion.config import TrainConfig
from diffusion.eval.sampling import load_pipeline, sample
from diffusion.models import build_model
from diffusion.models.chat_text import qwen_length
from diffusion.models.rectified_flow import sample_timesteps
from diffusion.models.z_image import ZImage
from diffusion.techniques import Repa, Routing
from diffusion.techniques.lora.adapters import WEIGHTS
from diffusion.techniques.repa.alignment import PROJECTOR
from diffusion.techniques.routing.tokens import route_tokens
from diffusion.trainer import check_before_build

CAPTIONS = ["a red 3", "two cats sitting on a long mat"]


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return build_model("z-image-tiny")


def _batch(tiny, captions=CAPTIONS):
    ids = tiny.tokenizers["input_ids"](
        list(captions), padding="max_length", truncation=True, max_length=tiny.model.text_length, return_tensors="pt"
    ).input_ids
    return {"image": torch.rand(len(captions), 3, 64, 64) * 2 - 1, "input_ids": ids}


def test_text_states_and_latents_are_the_pipelines(tiny):
    """Captions go through the chat template (thinking on: no think block), and each caption's Qwen3 states before
    the last layer, its own tokens only, are the pipeline's prompt embeddings; stored zero-padded, they give the same
    lengths back. The latents are the diffusers script's: (the posterior's mode - shift) * scale."""
    model, batch = tiny.model, _batch(tiny)
    pipe = model.pipeline(tiny.tokenizers)
    assert pipe.tokenizer.decode(batch["input_ids"][0][:1]) == "<|im_start|>"
    assert "<think>" not in pipe.tokenizer.decode(batch["input_ids"][0])
    theirs = pipe._encode_prompt(list(CAPTIONS), device="cpu", max_sequence_length=model.text_length)
    seq, lengths = model.encode_text(batch)
    assert lengths.tolist() == [len(t) for t in theirs] and lengths[0] < lengths[1] < model.text_length
    for states, n, their in zip(seq, lengths, theirs):
        torch.testing.assert_close(states[:n], their)
        assert not states[n:].any()
    assert model.encode_text({"text_embeds": seq})[1].tolist() == lengths.tolist()
    vae = model.vae
    mode = vae.encode(batch["image"]).latent_dist.mode()
    torch.testing.assert_close(
        model.encode_latents(batch), (mode - vae.config.shift_factor) * vae.config.scaling_factor
    )


def test_the_prediction_is_the_velocity_the_pipeline_steps_with(tiny):
    """At the pipeline's first step (sigma 1: x_t is the noise), the velocity its scheduler steps with is our
    prediction at t = 1, and the target is eps - x0."""
    model = tiny.model
    seq, lengths = model.encode_text(_batch(tiny, CAPTIONS[:1]))
    noise, x0 = torch.randn(1, 4, 8, 8), torch.randn(1, 4, 8, 8)
    pipe = model.pipeline(tiny.tokenizers)
    stepped = {}
    step = pipe.scheduler.step

    def capture(model_output, timestep, sample, **kw):
        stepped.setdefault("v", model_output.clone())
        stepped.setdefault("t", float(timestep))
        return step(model_output, timestep, sample, **kw)

    pipe.scheduler.step = capture
    with torch.no_grad():
        pipe(prompt_embeds=[seq[0, : lengths[0]]], latents=noise.clone(), guidance_scale=0.0, num_inference_steps=2,
             height=64, width=64, output_type="latent")  # fmt: skip
        pred, target = model._predict(x0, noise, torch.ones(1), seq, lengths)
    assert stepped["t"] == 1000.0
    torch.testing.assert_close(pred, stepped["v"])
    torch.testing.assert_close(target, noise - x0)


def test_timesteps_are_uniform_and_shifted_by_default_or_logit_normal():
    torch.manual_seed(0)
    t = sample_timesteps(build_model("z-image-tiny").model.objective, 20000, 16, "cpu")
    u = t / (3 - 2 * t)  # the shift s t / (1 + (s - 1) t) undone, s = 3 (Z-Image-Turbo's scheduler)
    assert 0 <= t.min() and t.max() <= 1 and abs(u.mean() - 0.5) < 0.01 and abs((u < 0.1).float().mean() - 0.1) < 0.01
    logit = build_model("z-image-tiny", objective={"timesteps": "logit_normal", "shift": 1.0}).model
    assert sample_timesteps(logit.objective, 20000, 16, "cpu").median() == pytest.approx(0.5, abs=0.02)


def test_loss_falls_when_training_on_a_fixed_batch():
    torch.manual_seed(0)
    built = build_model("z-image-tiny")
    model, batch = built.model, _batch(built)
    with torch.no_grad():  # the encoders run once; the precomputed path (lengths from the zero rows) trains
        batch = {"latent_moments": model.posterior_moments(batch), "text_embeds": model.encode_text(batch)[0]}
    losses = fixed_batch_losses(model, batch, steps=20)
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5


def test_the_preset_is_the_published_size_and_its_flops_the_hand_count():
    """Parameters: the 6.15B transformer, Qwen3-4B (4.02B); the traced training FLOPs of the transformer at 1024 px
    equal a count by hand: every token through 12 d^2 weights per block (attention 4 d^2, SwiGLU of 8/3 d: 8 d^2),
    2 FLOPs a multiply-add, attention 4 S^2 d per block; the 2 noise-refiner blocks over the image tokens, the 2
    context-refiner blocks over the caption's, the 30 main blocks over both; the embedders and the final layer; x3
    for forward and backward."""
    with torch.device("meta"):
        model = build_model("z-image").model
    assert sum(p.numel() for p in model.transformer.parameters()) == pytest.approx(6.155e9, rel=0.001)
    assert sum(p.numel() for p in model.text_encoder.parameters()) == pytest.approx(4.02e9, rel=0.005)
    cfg = model.transformer.config
    d, image, text = cfg.dim, (1024 // 16) ** 2, 512
    tokens = image + text
    forward = (
        2 * 12 * d * d * (cfg.n_layers * tokens + cfg.n_refiner_layers * (image + text))
        + 4 * d * (cfg.n_layers * tokens**2 + cfg.n_refiner_layers * (image**2 + text**2))
        + 2 * d * (64 * image + cfg.cap_feat_dim * text + 64 * tokens)
    )
    assert model.flops_per_sample(1024, online=False)["denoiser"] == pytest.approx(3 * forward, rel=0.01)


def test_benchmark_results_line_has_traced_flops(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (rec,) = synthetic_benchmark("z-image-tiny")
    assert rec["family"] == "z-image" and rec["prediction_type"] == "flow"
    assert rec["tflop_per_image"] > rec["tflop_per_image_denoiser"] > 0


def test_export_loads_as_the_z_image_pipeline_and_samples(tmp_path):
    from diffusers import DiffusionPipeline

    out = tmp_path / "zimage"
    assert export.main(["z-image-tiny", str(out)]) == 0
    pipe = DiffusionPipeline.from_pretrained(out, local_files_only=True)
    assert type(pipe).__name__ == "ZImagePipeline" and qwen_length(pipe.tokenizer) == 64
    assert type(pipe.text_encoder).__name__ == "Qwen3Model" and pipe.scheduler.config.shift == 3.0
    assert build_model(str(out)).model.objective["max_sequence_length"] == 64  # the folder keeps its caption length
    config = out / "scheduler" / "scheduler_config.json"
    config.write_text(config.read_text().replace('"shift": 3.0', '"shift": 6.0'))  # Z-Image's (base) scheduler
    assert build_model(str(out)).model.objective["shift"] == 6.0  # t is shifted as the folder's scheduler shifts
    assert build_model(str(out), objective={"shift": 2.0}).model.objective["shift"] == 2.0
    assert generate.main([str(out), "--prompt", "a red 3", "--steps", "2", "--out", str(tmp_path / "gen")]) == 0
    assert (tmp_path / "gen" / "00000-a-red-3.png").exists()


def _images(pipe) -> np.ndarray:
    return np.stack([np.asarray(im, dtype=np.int16) for im in sample(pipe, ["a red cube", "two cats"], steps=3)])


def test_a_lora_exports_for_diffusers_load_lora_weights_and_generate(tmp_path, monkeypatch, capsys):
    """benchmark.py trains rank-4 adapters on a pipeline folder; export.py writes them; diffusers' own
    load_lora_weights on the base samples the checkpoint's images, which differ from the base's; generate.py --lora
    samples with them. A Z-Image adapter on a FLUX.2 [klein] base is one line, exit 2."""
    from diffusers import DiffusionPipeline

    monkeypatch.chdir(tmp_path)
    assert export.main(["z-image-tiny", "base"]) == 0
    args = ["--use_synth_data", "--model_name", "base", "--lora_rank", "4", "--lr", "0.05", "--batch_size", "4"]
    args += ["--num_workers", "0", "--max_duration", "3ba", "--save_folder", "L", "--save_interval", "1ba"]
    assert benchmark.main(args) == 0
    assert export.main(["L/latest-rank0.pt", "lora"]) == 0
    pipe = DiffusionPipeline.from_pretrained("base", local_files_only=True)
    pipe.load_lora_weights("lora", weight_name=WEIGHTS)
    pipe.set_progress_bar_config(disable=True)
    trained = _images(load_pipeline("L/latest-rank0.pt"))
    assert np.array_equal(_images(pipe), trained)
    assert np.abs(_images(load_pipeline("base")) - trained).mean() > 0.01, "the adapters did not change the samples"
    assert generate.main(["base", "--lora", "lora", "--prompt", "a red 3", "--steps", "2", "--out", "gen"]) == 0
    assert (tmp_path / "gen" / "00000-a-red-3.png").exists()
    assert export.main(["flux2-tiny", "klein"]) == 0
    (tmp_path / "lora" / "lora_base.json").unlink()  # adapters from elsewhere: no record of their base
    capsys.readouterr()
    assert generate.main(["klein", "--lora", "lora", "--prompt", "a", "--steps", "1", "--out", "gen2"]) == 2
    err = capsys.readouterr().err
    (line,) = [line for line in err.splitlines() if line.startswith("generate.py: error:")]
    assert "made for another model family" in line and "Traceback" not in err, err


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--model_name", "z-image-tiny", "--objective", "guidance=3"],
            "unknown Z-Image objective key(s) ['guidance']",
        ),
        (["--model_name", "z-image-tiny", "--objective", "shift=auto"], "shift"),
        (["--model_name", "z-image-tiny", "--prediction_type", "v_prediction"], "applies to SD models"),
        (
            ["--model_name", "z-image-tiny", "--routing_share", "0.5", "--routing_first", "noise_refiner.0"],
            "--routing_first noise_refiner.0: z-image-tiny has no such block; its blocks: layers.0 to layers.1",
        ),
        (
            ["--model_name", "z-image-tiny", "--repa_block", "context_refiner.0", "--repa_encoder", "ENC"],
            "--repa_block context_refiner.0: z-image-tiny has no such block; its blocks: noise_refiner.0, layers.0 to "
            "layers.1",
        ),
    ],
)
def test_a_key_of_another_family_is_one_line(argv, message, capsys):
    assert benchmark.main(["--use_synth_data", "--batch_size", "4", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_precompute_from_captioned_images_then_train_on_the_result(mds_images, tmp_path):
    """data.py precompute stores each caption's states first and zeros after (no pooled embedding) and the VAE
    moments; training reads the captions' lengths back from them."""
    from conftest import read_mds

    from diffusion.precompute import precompute

    out = tmp_path / "latents"
    report = precompute(
        str(mds_images), str(out), model_name="z-image-tiny", image_size=64, batch_size=8, num_workers=0, progress=False
    )
    assert report["written"] == 32 and report["columns"]["text_embeds"].endswith(":64,32")
    row = read_mds(out)[0]
    assert row["latent_moments"].shape == (8, 8, 8) and "pooled_text_embeds" not in row
    kept = np.abs(row["text_embeds"]).sum(-1) > 0
    assert 0 < kept.sum() < 64 and kept[: kept.sum()].all()  # the caption's tokens first, zeros after
    results = tmp_path / "r.jsonl"
    args = ["--model_name", "z-image-tiny", "--local", str(out), "--precomputed_latents", "--batch_size", "4"]
    args += ["--num_workers", "0", "--max_duration", "2ba", "--results", str(results)]
    assert benchmark.main(args) == 0
    (rec,) = read_results(results)
    assert rec["precomputed_latents"] and rec["tflop_per_image"] == rec["tflop_per_image_denoiser"] > 0


@pytest.fixture(scope="module")
def dino(tmp_path_factory):
    """A tiny DINOv2 (16 px, 4 px patches, 32 wide), random weights, ImageNet's normalisation."""
    torch.manual_seed(0)
    return save_encoder(Dinov2Model(Dinov2Config(**VISION)), tmp_path_factory.mktemp("dino"), mean=None)


def _with_repa(dino, **keys):
    cfg = TrainConfig(model_name="z-image-tiny", repa_encoder=dino, **keys)
    check_before_build(cfg, world_size=1, on_gpu=False)
    model = build_model("z-image-tiny").model
    if cfg.routing_share is not None:
        Routing.install(cfg, model)
    (alignment,) = Repa.install(cfg, model)
    alignment.active = True
    model.train()
    return model, alignment, cfg


@pytest.mark.parametrize("size", [64, (32, 64)])
def test_repa_takes_the_image_patches_alone_row_by_row(dino, size):
    """The noise refiner's block made to pass its input on, and the patch embedding made to give each token its
    patch's first latent value: the projector takes exactly the image's patches, row by row (as the encoder's grid
    is flattened), not the pad tokens that fill the refiner's sequence up to 32 (64 px: 16 patches; 32x64: 8)."""
    model, alignment, _ = _with_repa(dino, repa_block="noise_refiner.0")
    t = model.transformer
    with torch.no_grad():
        embed = t.all_x_embedder["2-1"]
        embed.weight.zero_(), embed.bias.zero_(), embed.weight[0, 0].fill_(1)
    t.noise_refiner[0].register_forward_hook(lambda block, args, output: args[0], prepend=True)
    taken = []
    getattr(model, PROJECTOR).register_forward_pre_hook(lambda projector, args: taken.append(args[0]))
    batch = synthetic_batch("z-image-tiny", model, image_size=size)
    x0 = model.encode_latents(batch)
    seq, lengths = model.encode_text(batch)
    model._predict(x0, torch.randn_like(x0), torch.zeros(len(x0)), seq, lengths)  # t = 0: x_t is x0
    assert alignment.captured[0].shape[1] == 32  # the refiner's sequence, padded
    loss = alignment.loss(batch)
    (tokens,) = taken
    torch.testing.assert_close(tokens[..., 0], x0[:, 0, ::2, ::2].flatten(1))
    assert tokens.shape[1] == x0.shape[2] * x0.shape[3] // 4 < 32 and 0 < loss.item() < 2


def test_repa_on_a_main_block_aligns_its_image_tokens_and_stored_features_give_the_online_loss(dino):
    """By default the block a third of the way in (layers.0 of noise_refiner.0, layers.0, layers.1): its sequence holds
    the caption too, the projector its 16 image tokens; the loss alone reaches the projector and the blocks up to
    the aligned one, not the next block or the final layer. The features precompute stores (on the latents' grid)
    give the loss the encoder gives online."""
    model, alignment, cfg = _with_repa(dino)
    assert cfg.repa_block == "layers.0"
    taken = []
    getattr(model, PROJECTOR).register_forward_pre_hook(lambda projector, args: taken.append(args[0].shape))
    batch = synthetic_batch("z-image-tiny", model)
    model(batch)
    assert alignment.captured[0].shape[1] == 32 + 64  # the image's 16 tokens padded to 32, the caption's 64
    loss = alignment.loss(batch)
    assert taken == [(2, 16, 32)] and 0 < loss.item() < 2
    stored = {
        LATENT_MOMENTS: model.posterior_moments(batch),
        REPA_FEATURES: alignment.encoder.maps(batch[IMAGE]).half().float(),
    }
    torch.testing.assert_close(alignment.loss(stored), loss, atol=2e-3, rtol=0)
    loss.backward()
    t = model.transformer
    assert getattr(model, PROJECTOR)[0].weight.grad.abs().sum() > 0
    assert all(b.attention.to_q.weight.grad.abs().sum() > 0 for b in (t.layers[0], t.noise_refiner[0]))
    assert all(p.grad is None for p in t.layers[1].parameters())
    assert all(p.grad is None for p in t.all_final_layer.parameters())


def test_repa_loss_falls_while_training_and_a_run_records_it(dino, tmp_path, monkeypatch):
    """Twenty AdamW steps on a fixed batch with fixed noise, the diffusion loss plus REPA's: the REPA loss stays
    finite and falls; benchmark.py trains with it and records the block and its FLOPs."""
    model, alignment, _ = _with_repa(dino)
    torch.manual_seed(0)
    batch = synthetic_batch("z-image-tiny", model, n=4)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for _ in range(20):
        torch.manual_seed(1)  # the same t and noise every step
        diffusion = model.loss(model(batch), batch)
        repa = alignment.loss(batch)
        opt.zero_grad()
        (diffusion + 0.5 * repa).backward()
        opt.step()
        losses.append(repa.item())
    assert all(np.isfinite(losses)) and sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5, losses
    monkeypatch.chdir(tmp_path)
    args = ["--use_synth_data", "--model_name", "z-image-tiny", "--batch_size", "4", "--max_duration", "2ba"]
    args += ["--num_workers", "0", "--repa_encoder", dino]
    assert benchmark.main([*args, "--results", "r.jsonl"]) == 0
    span = ["--routing_share", "0.5", "--routing_first", "layers.0", "--routing_last", "layers.1"]
    assert benchmark.main([*args, *span, "--results", "r.jsonl"]) == 0
    plain, routed = read_results(tmp_path / "r.jsonl")
    assert plain["repa"]["block"] == routed["repa"]["block"] == "layers.0" and plain["tflop_per_image_repa"] > 0
    assert routed["routing"] == {"share": 0.5, "first": "layers.0", "last": "layers.1"}
    assert routed["tflop_per_image_denoiser"] < plain["tflop_per_image_denoiser"]


def _route(share=0.5):
    torch.manual_seed(0)
    t = build_model("z-image-tiny").model.transformer
    plain = copy.deepcopy(t)
    router = route_tokens(
        t, stacks=ZImage.ROUTING, share=share, first="layers.0", last="layers.1", layout=ZImage.ROUTING_LAYOUT
    )
    return t.train(), plain, router


def _inputs(n=3):
    """n latents of 8 x 8 (16 image tokens, padded to 32) and captions of 10, 40, ... states (padded to 32 and 64:
    the main blocks' sequences differ in length, so they take an attention mask)."""
    g = torch.Generator().manual_seed(1)
    latents = [torch.randn(4, 1, 8, 8, generator=g) for _ in range(n)]
    return latents, torch.rand(n, generator=g), [torch.randn(10 + 30 * (i % 2), 32, generator=g) for i in range(n)]


def test_routing_sends_each_samples_kept_image_tokens_through_the_main_blocks():
    """The span's output equals, per sample, diffusers' own blocks run on that sample's kept image tokens, then its
    pad and caption tokens, with the attention mask and rotary table cut alike; the routed image tokens leave the span
    as they came. Evaluation, and no gradient, route nothing."""
    t, plain, router = _route()
    seen = {}
    t.layers[0].register_forward_pre_hook(lambda m, args: seen.update(args=args), prepend=True)
    t.layers[1].register_forward_hook(lambda m, args, out: seen.update(out=out))
    t(*_inputs(), return_dict=False)
    (x, mask, freqs, adaln, *_), out, kept = seen["args"], seen["out"], router.kept
    n, image = len(x), 16
    assert kept.shape == (n, 8) and len({tuple(k.tolist()) for k in kept}) == n and mask is not None
    routed = torch.ones(n, image, dtype=torch.bool).scatter(1, kept, False)
    assert torch.equal(out[:, :image][routed], x[:, :image][routed])
    for i in range(n):
        h, m, f = (torch.cat([v[i, kept[i]], v[i, image:]])[None] for v in (x, mask, freqs))
        for block in plain.layers:
            h = block(h, m, f, adaln[i : i + 1])
        torch.testing.assert_close(out[i, kept[i]], h[0, :8], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out[i, image:], h[0, 8:], rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(t(*_inputs(), return_dict=False)[0], plain(*_inputs(), return_dict=False)[0])
    t.eval()
    torch.testing.assert_close(t(*_inputs(), return_dict=False)[0], plain(*_inputs(), return_dict=False)[0])


def test_routing_under_gradient_checkpointing_recomputes_the_same_tokens():
    grads = []
    for checkpointing in (False, True):
        t, _, _ = _route()
        if checkpointing:
            t.enable_gradient_checkpointing()
        torch.manual_seed(3)
        sum(o.square().sum() for o in t(*_inputs(), return_dict=False)[0]).backward()
        grads.append({n: p.grad for n, p in t.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_repa_in_the_routed_span_aligns_the_kept_image_tokens_at_their_places(dino):
    model, alignment, _ = _with_repa(dino, routing_share=0.5, routing_first="layers.0", routing_last="layers.1")
    batch = synthetic_batch("z-image-tiny", model)  # 64 px: 16 image tokens
    model(batch)
    hidden, kept, _, _ = alignment.captured
    assert kept.shape == (2, 8) and hidden.shape[1] == 8 + 16 + 64  # the kept ones, the pad, the caption
    target = alignment.features(batch["image"], (4, 4))
    projected = getattr(model, PROJECTOR)(hidden[:, :8])
    by_hand = torch.stack([target[i, kept[i]] for i in range(2)])
    loss = 1 - torch.nn.functional.cosine_similarity(projected, by_hand, dim=-1).mean()
    torch.testing.assert_close(alignment.loss(batch), loss)
