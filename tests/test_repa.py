"""REPA (diffusion/techniques/repa/alignment.py): the keys and their one-line errors, the encoders it takes, the loss on SD's
feature maps and FLUX's tokens (routed ones included), what its gradient reaches, when it stops, FLOPs, resume,
export and sampling; DDP and FSDP2 on two ranks."""

import pytest
import torch
from conftest import FAST, REPO, VISION, composer, final_state, read_results, synthetic_batch, tiny_clip_vision
from conftest import save_encoder as _save
from transformers import CLIPConfig, CLIPModel, CLIPTextConfig, CLIPTextModel, Dinov2Config, Dinov2Model

import benchmark
import generate
import train
from diffusion.config import TrainConfig
from diffusion.models import build_model
from diffusion.techniques import Repa, Routing
from diffusion.techniques.repa.alignment import PROJECTOR, RepaLoss, encoder_spec

BENCH = ["--model_name", "flux-tiny", "--use_synth_data", "--batch_size", "4", "--num_workers", "0"]


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    """A tiny CLIP vision tower (16 px, 4 px patches, 32 wide), as the digits chain keeps one."""
    return tiny_clip_vision(tmp_path_factory.mktemp("clip-vision"))


def _installed(model_name: str, encoder: str, **keys):
    cfg = TrainConfig(model_name=model_name, repa_encoder=encoder, **keys)
    from diffusion.trainer import check_before_build

    check_before_build(cfg, world_size=1, on_gpu=False)
    model = build_model(model_name).model
    if cfg.routing_share is not None:
        Routing.install(cfg, model)
    (alignment,) = Repa.install(cfg, model)
    return model, alignment, cfg


def _loss(model, alignment, batch):
    """The REPA loss of one training forward (what the algorithm adds after the model's own loss)."""
    alignment.active = True
    model.train()
    model(batch)
    return alignment.loss(batch)


@pytest.mark.parametrize(
    "argv,message",
    [
        (
            ["--repa_block", "single.9"],
            "--repa_block single.9: flux-tiny has no such block; its blocks: double.0, single",
        ),
        (["--repa_block", "mid"], "--repa_block mid: flux-tiny has no such block"),
        (["--repa_weight", "0"], "--repa_weight 0.0 must be a positive number"),
        (["--repa_until", "0.5dur"], "--repa_until '0.5dur' is not a training time"),
        (["--repa_projector_width", "0"], "--repa_projector_width 0 must be"),
        (
            ["--model_name", "vae-tiny"],
            "vae-tiny is an autoencoder, which has none it names for alignment (REPA is for SD",
        ),
        (["--model_name", "sd-tiny", "--repa_block", "double.0"], "sd-tiny has no such block; its blocks: down.0 to"),
        (["--repa_encoder", "/nonexistent/dino"], "--repa_encoder /nonexistent/dino is not a directory"),
    ],
)
def test_bad_values_are_one_line(argv, message, encoder, capsys):
    args = [*BENCH, "--repa_encoder", encoder, *argv] if "--repa_encoder" not in argv else [*BENCH, *argv]
    assert benchmark.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("benchmark.py: error: ") and message in err[0], err


def test_a_key_without_the_encoder_and_a_folder_of_the_wrong_kind_are_one_line(tmp_path, capsys):
    assert benchmark.main([*BENCH, "--repa_weight", "1"]) == 2
    assert "--repa_weight is set but --repa_encoder is not" in capsys.readouterr().err
    text = _save(CLIPTextModel(CLIPTextConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                              num_attention_heads=4)), tmp_path / "text", mean=None)  # fmt: skip
    assert benchmark.main([*BENCH, "--repa_encoder", text]) == 2
    err = capsys.readouterr().err.strip()
    assert "holds a 'clip_text_model' model, not a vision model that yields patch tokens" in err, err


def test_dinov2_and_a_whole_clip_model_are_read_for_their_patch_tokens(tmp_path):
    """A Dinov2Model (ImageNet normalisation when its folder names none) and a CLIP image-text model (its vision
    tower): each gives one feature per denoiser token, on square and wide images."""
    dino = _save(Dinov2Model(Dinov2Config(**VISION)), tmp_path / "dino", mean=None)
    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)
    clip = _save(CLIPModel(CLIPConfig(text_config=text, vision_config=VISION, projection_dim=32)), tmp_path / "clip")
    assert encoder_spec(clip).cls == "CLIPVisionModel" and encoder_spec(dino).cls == "AutoModel"
    for folder in (dino, clip):
        model, alignment, _ = _installed("flux-tiny", folder)
        assert alignment.encoder.mean == ((0.485, 0.456, 0.406) if folder == dino else (0.5, 0.5, 0.5))
        for image, grid in (((2, 3, 32, 32), (4, 4)), ((2, 3, 32, 64), (4, 8)), ((1, 3, 48, 16), (6, 2))):
            assert alignment.features(torch.rand(image) * 2 - 1, grid).shape == (image[0], grid[0] * grid[1], 32)


def test_flux_tokens_are_aligned_and_the_gradient_stops_at_the_aligned_block(encoder):
    """The loss is 1 - cosine similarity in [0, 2]; alone, its gradient reaches the projector and the blocks up to
    the aligned one, not the blocks after it or the output projection."""
    model, alignment, cfg = _installed("flux-tiny", encoder, repa_block="double.0")
    assert cfg.repa_block == "double.0" and getattr(model, PROJECTOR)[0].in_features == 32
    loss = _loss(model, alignment, synthetic_batch("flux-tiny", model, image_size=32))
    assert 0 < loss.item() < 2
    loss.backward()
    t = model.transformer
    assert getattr(model, PROJECTOR)[0].weight.grad.abs().sum() > 0
    assert t.transformer_blocks[0].attn.to_q.weight.grad.abs().sum() > 0 and t.x_embedder.weight.grad is not None
    assert all(p.grad is None for p in t.single_transformer_blocks.parameters())
    assert t.proj_out.weight.grad is None


def test_sd_feature_maps_are_read_as_tokens_on_their_grid(encoder):
    model, alignment, cfg = _installed("sd-tiny", encoder)
    assert cfg.repa_block == "mid"
    alignment.active = True
    model.train()
    batch = synthetic_batch("sd-tiny", model, image_size=(32, 64))
    model(batch)
    hidden, kept, grid, tokens = alignment.captured
    assert kept is None and hidden.shape[1] == grid[0] * grid[1] == tokens and grid[1] == 2 * grid[0]
    loss = alignment.loss(batch)
    assert 0 < loss.item() < 2


def test_a_routed_block_aligns_its_kept_tokens_with_the_features_at_their_places(encoder):
    model, alignment, _ = _installed(
        "flux-tiny",
        encoder,
        repa_block="single.0",
        routing_share=0.5,
        routing_first="double.0",
        routing_last="single.1",
    )
    batch = synthetic_batch("flux-tiny", model)  # 64 px: 16 image tokens
    alignment.active = True
    model.train()
    model(batch)
    hidden, kept, _, tokens = alignment.captured
    assert kept is not None and hidden.shape[1] == kept.shape[1] == 8 and tokens == 16
    target = alignment.features(batch["image"], (4, 4))
    projected = getattr(model, PROJECTOR)(hidden)
    by_hand = (
        1
        - torch.nn.functional.cosine_similarity(
            projected, torch.stack([target[i, kept[i]] for i in range(len(kept))]), dim=-1
        ).mean()
    )
    torch.testing.assert_close(alignment.loss(batch), by_hand)


def test_benchmark_records_repa_and_counts_its_flops_over_buckets(encoder, tmp_path):
    out = tmp_path / "r.jsonl"
    args = ["--repa_encoder", encoder, "--synthetic_buckets", "1x1,1x2", "--max_duration", "3ba"]
    assert benchmark.main([*BENCH, *args, "--results", str(out)]) == 0
    (rec,) = read_results(out)
    assert rec["repa"] == {"encoder": encoder, "block": "single.0", "weight": 0.5, "until": None}
    model, alignment, _ = _installed("flux-tiny", encoder)
    assert rec["tflop_per_image_repa"] == pytest.approx(alignment.flops(64) / 1e12) and rec["tflop_per_image_repa"] > 0
    plain = build_model("flux-tiny").model.flops_per_sample(64)["total"]
    assert rec["tflop_per_image"] == pytest.approx((plain + alignment.flops(64)) / 1e12)


def test_resumes_bitwise_stops_when_told_and_changes_the_training(encoder, tmp_path, monkeypatch):
    """Killed-and-resumed equals straight, projector included; after repa_until the projector stays as it was and
    the denoiser trains on; without REPA the weights differ."""
    monkeypatch.chdir(tmp_path)
    args = [str(REPO / "yamls/sd-tiny-cpu.yaml"), *FAST, "batch_size=4", "save_interval=1ba", "use_ema=false",
            "save_num_checkpoints_to_keep=-1"]  # fmt: skip
    repa = [*args, f"repa_encoder={encoder}", "repa_until=2ba"]
    assert train.main([*repa, f"save_folder={tmp_path / 'a'}", "max_duration=4ba"]) == 0
    assert train.main([*repa, f"save_folder={tmp_path / 'b'}", "max_duration=3ba"]) == 0
    assert train.main([*repa, f"save_folder={tmp_path / 'b'}", "max_duration=4ba", "autoresume=true"]) == 0
    assert train.main([*args, f"save_folder={tmp_path / 'c'}", "max_duration=4ba"]) == 0
    a, b, c = (final_state(tmp_path / x)["model"] for x in "abc")
    assert any(k.startswith(PROJECTOR) for k in a) and not any(k.startswith(PROJECTOR) for k in c)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not all(torch.equal(a[n], c[n]) for n in c)
    at_stop = final_state(tmp_path / "a", "ep0-ba2-rank0.pt")["model"]
    for name in (n for n in a if n.startswith((PROJECTOR, "unet."))):
        assert torch.equal(a[name], at_stop[name]) == name.startswith(PROJECTOR), name


def test_export_and_generate_from_a_repa_and_routing_checkpoint_leave_the_projector_out(encoder, tmp_path, monkeypatch):
    from diffusion.eval.trained_model import load_trained

    monkeypatch.chdir(tmp_path)
    run = [str(REPO / "yamls/flux-tiny-cpu.yaml"), *FAST, "batch_size=4", "max_duration=2ba", "save_interval=2ba"]
    assert train.main([*run, f"repa_encoder={encoder}", "routing_share=0.5", f"save_folder={tmp_path / 'ck'}"]) == 0
    ckpt = str(tmp_path / "ck" / "latest-rank0.pt")
    built, config, ema = load_trained(ckpt)
    assert config["repa_encoder"] == encoder and ema and not hasattr(built.model, PROJECTOR)
    assert generate.main([ckpt, "--prompt", "a cube", "--steps", "2", "--out", str(tmp_path / "s")]) == 0
    assert (tmp_path / "s" / "00000-a-cube.png").exists()


def test_the_algorithm_leaves_evaluation_alone(encoder):
    model, alignment, _ = _installed("flux-tiny", encoder)
    alignment.active = True
    model.eval()
    with torch.no_grad():
        model.eval_forward(synthetic_batch("flux-tiny", model, image_size=32))
    assert alignment.captured is None and isinstance(alignment, RepaLoss)


@pytest.mark.slow
def test_ddp_two_ranks_train_with_repa_past_its_stop(encoder, tmp_path):
    """DDP with repa_until: once REPA stops the projector is not used, and DDP, which expects a gradient of every
    parameter, gets zeros for it."""
    args = ["--model_name", "sd-tiny", "--use_synth_data", "--batch_size", "4", "--num_workers", "0"]
    args += ["--repa_encoder", encoder, "--repa_until", "1ba", "--max_duration", "3ba", "--results", "r.jsonl"]
    proc = composer(2, "benchmark.py", *args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (rec,) = read_results(tmp_path / "r.jsonl")
    assert rec["world_size"] == 2 and rec["repa"]["until"] == "1ba" and rec["repa"]["block"] == "mid"


@pytest.mark.slow
def test_fsdp2_aligns_routed_tokens_and_resumes_bitwise(encoder, tmp_path):
    proc = composer(2, "tests/repa_fsdp_worker.py", str(tmp_path / "ck"), encoder, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "REPA-FSDP-OK" in proc.stdout + proc.stderr
