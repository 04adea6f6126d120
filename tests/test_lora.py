"""LoRA (diffusion/techniques/lora/adapters.py): the keys and their one-line errors, only the adapters train and only they are
saved (on the denoiser, and on the text encoders with lora_text_encoder), resume bitwise, a checkpoint or adapter
folder of another base refused, the FLOP count of a frozen base, the results line; export in diffusers' format loads
with ``load_lora_weights`` and samples as the checkpoint does (SD, SDXL, FLUX, SD3), merged or at a scale; DDP and FSDP2
on two ranks."""

import json

import numpy as np
import pytest
import torch
from conftest import FAST, REPO, composer, final_state, pretrained_folder, read_results, tiny_clip_vision

import benchmark
import export
import generate
import train
from diffusion.eval.sampling import load_pipeline, sample
from diffusion.models import build_model
from diffusion.techniques.lora.adapters import BASE, WEIGHTS, install_lora, lora_options

PRESETS = {"sd": ("sd-tiny", "sd-tiny-cpu.yaml"), "sdxl": ("sdxl-tiny", "sdxl-tiny-cpu.yaml"),
           "flux": ("flux-tiny", "flux-tiny-cpu.yaml"), "flux2": ("flux2-tiny", "flux2-tiny-cpu.yaml"),
           "sd3": ("sd3-tiny", "sd3-tiny-cpu.yaml"),
           "qwen-image": ("qwen-image-tiny", "qwen-image-tiny-cpu.yaml")}  # fmt: skip


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("bases")
    out = {family: pretrained_folder(root / family, preset) for family, (preset, _) in PRESETS.items()}
    out["other-sd"] = pretrained_folder(root / "other-sd", "sd-tiny", seed=1)
    return out


def _run(family: str, base: str, folder, *extra: str) -> list[str]:
    recipe = str(REPO / "yamls" / PRESETS[family][1])
    return [recipe, *FAST, f"model_name={base}", "lora_rank=4", "lr=0.05", "batch_size=4",
            f"save_folder={folder}", "save_interval=1ba", *extra]  # fmt: skip


BENCH = ["--use_synth_data", "--batch_size", "4", "--num_workers", "0", "--max_duration", "2ba"]


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--model_name", "sd-tiny", "--lora_rank", "0"], "--lora_rank 0 must be"),
        (["--model_name", "sd-tiny", "--lora_alpha", "8"], "--lora_alpha is a LoRA setting; give --lora_rank too"),
        (["--model_name", "vae-tiny", "--lora_rank", "4"], "LoRA adapts the denoiser of a text-to-image model"),
        (["--model_name", "flux-tiny", "--lora_rank", "4", "--optimizer", "muon"], "Muon orthogonalises"),
        (["--model_name", "sd-tiny", "--lora_rank", "4", "--lora_dropout", "1"], "--lora_dropout 1.0 must be"),
        (["--model_name", "sd-tiny", "--lora_rank", "4", "--lora_init", "pissa"], "--lora_init 'pissa' is not one of"),
        (["--model_name", "sd-tiny", "--lora_text_encoder"], "--lora_text_encoder is a LoRA setting; give --lora_rank"),
        (["--model_name", "sd-tiny", "--lora_base_dtype", "bf16"], "--lora_base_dtype is a LoRA setting"),
        (["--model_name", "sd-tiny", "--lora_rank", "4", "--lora_base_dtype", "fp8"], "--lora_base_dtype 'fp8' is not"),
        (
            ["--model_name", "flux-tiny", "--lora_rank", "4", "--lora_text_encoder", "--precomputed_latents"],
            "--lora_text_encoder trains adapters on the text encoder, and --precomputed_latents batches carry its "
            "outputs, computed without them",
        ),
        (
            ["--model_name", "sd-tiny", "--lora_rank", "4", "--lora_targets", "to_qq,to_v"],
            "--lora_targets: sd-tiny's denoiser has no Linear or Conv2d layer named 'to_qq' (or ending in .to_qq); "
            "did you mean 'to_q'?",
        ),
    ],
)
def test_bad_values_are_one_line(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert benchmark.main([*argv, *BENCH]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_a_bf16_base_under_fsdp_is_one_line():
    """(The launcher's world-size check comes first on one process; the rule itself, checked on the config.)"""
    from diffusion.config import TrainConfig
    from diffusion.errors import UsageError
    from diffusion.models.build import FAMILIES
    from diffusion.techniques import Lora

    cfg = TrainConfig(model_name="sd-tiny", lora_rank=4, lora_base_dtype="bf16", fsdp=True)
    with pytest.raises(UsageError, match="lora_base_dtype bf16 with --fsdp: FSDP2 .* shards one dtype per unit"):
        Lora.check(cfg, FAMILIES["sd"], {})


@pytest.mark.parametrize("text", [False, True], ids=["denoiser", "text-encoder-too"])
def test_only_the_adapters_train_are_saved_and_resume_bitwise(text, bases, tmp_path, monkeypatch):
    """The base's weights stay the folder's (the text encoder's too when it carries adapters); a checkpoint holds the
    adapters, their AdamW state and EMA and the base's record, nothing else; killed-and-resumed equals straight,
    adapters and EMA."""
    monkeypatch.chdir(tmp_path)
    run = [*_run("sd", bases["sd"], tmp_path / "a"), *(["lora_text_encoder=true"] if text else [])]
    assert train.main([*run, "max_duration=3ba"]) == 0
    run = [*_run("sd", bases["sd"], tmp_path / "b"), *(["lora_text_encoder=true"] if text else [])]
    assert train.main([*run, "max_duration=2ba"]) == 0
    assert train.main([*run, "max_duration=3ba", "autoresume=true"]) == 0
    a, b = final_state(tmp_path / "a"), final_state(tmp_path / "b")
    assert a["batch"] == b["batch"] == 3
    same = [torch.equal(v, b["model"][k]) if torch.is_tensor(v) else v == b["model"][k] for k, v in a["model"].items()]
    assert set(a["model"]) == set(b["model"]) and all(same)
    assert a["ema"] and all(torch.equal(a["ema"][k], b["ema"][k]) for k in a["ema"])
    adapters = {k for k in a["model"] if ".lora_A." in k or ".lora_B." in k}
    assert adapters and set(a["model"]) == adapters | {f"{BASE}._extra_state"}
    assert set(a["ema"]) == adapters
    state = torch.load(tmp_path / "a" / "latest-rank0.pt", weights_only=False)["state"]
    (optimizer,) = state["optimizers"].values()
    assert len(optimizer["state"]) == len(adapters)
    for part in ("unet", "text_encoder") if text else ("unet",):  # B started at 0 and trained
        assert any(v.abs().sum() > 0 for k, v in a["model"].items() if k.startswith(part) and ".lora_B." in k)
    assert any(k.startswith("text_encoder.") for k in adapters) == text
    # the base is untouched: the rebuilt model's base weights are the folder's
    from diffusion.eval.trained_model import load_trained

    built, _, _ = load_trained(str(tmp_path / "a" / "latest-rank0.pt"))
    folder = build_model(bases["sd"]).model
    for part in ("unet", "text_encoder"):
        plain = getattr(folder, part).state_dict()
        state = getattr(built.model, part).state_dict().items()
        adapted = {k.replace(".base_layer", ""): v for k, v in state if "lora_" not in k}
        assert adapted.keys() == plain.keys() and all(torch.equal(adapted[k], plain[k]) for k in plain)


def test_a_checkpoint_or_adapters_of_another_base_are_one_line(bases, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert train.main([*_run("sd", bases["sd"], tmp_path / "ck"), "max_duration=1ba"]) == 0
    capsys.readouterr()
    resumed = _run("sd", bases["other-sd"], tmp_path / "ck")
    assert train.main([*resumed, "max_duration=2ba", "autoresume=true"]) == 2  # another model_name: another run
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"model_name={bases['sd']} there, model_name={bases['other-sd']} now" in err[0], err
    assert train.main([*resumed, "max_duration=2ba", "autoresume=true", "resume_with_changes=true"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"these LoRA adapters were trained on '{bases['sd']}'" in err[0], err
    assert export.main([str(tmp_path / "ck" / "latest-rank0.pt"), str(tmp_path / "lora")]) == 0
    capsys.readouterr()
    argv = ["--prompt", "a cube", "--steps", "1", "--out", str(tmp_path / "s")]
    assert generate.main([bases["other-sd"], "--lora", str(tmp_path / "lora"), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert f"these adapters were trained on '{bases['sd']}', whose weights differ" in err, err
    assert generate.main([bases["sd"], "--lora", str(tmp_path), *argv]) == 2
    assert f"holds no {WEIGHTS}" in capsys.readouterr().err
    assert generate.main([str(tmp_path / "ck" / "latest-rank0.pt"), "--lora", str(tmp_path / "lora"), *argv]) == 2
    assert "takes the base pipeline folder" in capsys.readouterr().err
    assert export.main([bases["sd"] + "/../x.pt", str(tmp_path / "y"), "--merge"]) == 2


def _images(pipe, size: int | None = None) -> np.ndarray:
    images = sample(pipe, ["a red cube", "two cats"], steps=3, image_size=size)
    return np.stack([np.asarray(im, dtype=np.int16) for im in images])


TEXT_ENCODERS = {"sd": ["text_encoder"], "sdxl": ["text_encoder", "text_encoder_2"], "flux": ["text_encoder"],
                 "sd3": ["text_encoder", "text_encoder_2"]}  # fmt: skip


# the denoiser's adapters alone on SD; with the text encoders' too on SDXL (two encoders, the pooled one) and FLUX
# (a transformer's keys beside CLIP's): each path once, as CI's time allows
@pytest.mark.parametrize(
    "family, text",
    [("sd", False), ("sdxl", True), ("flux", True), ("flux2", False), ("sd3", True), ("qwen-image", False)],
    ids=[
        "sd-denoiser",
        "sdxl-text-encoders-too",
        "flux-text-encoder-too",
        "flux2-denoiser",
        "sd3-text-encoders-too",
        "qwen-image-denoiser",
    ],  # fmt: skip
)
def test_exported_adapters_load_in_diffusers_and_sample_as_the_checkpoint(family, text, bases, tmp_path, monkeypatch):
    """diffusers' own load_lora_weights on the exported folder samples the images the checkpoint samples (with
    lora_text_encoder, the text encoders' adapters in the same file, under their pipeline names); merged into a
    pipeline too; at scale 0 the base's; and the adapters change the images."""
    from diffusers import DiffusionPipeline
    from safetensors import safe_open

    monkeypatch.chdir(tmp_path)
    size = 64 if family == "qwen-image" else None  # a QwenImagePipeline folder records no size: 1024 px
    # live adapters: an EMA over 3 batches of adapters that start at 0 is still near 0
    run = [*_run(family, bases[family], tmp_path / "ck"), *(["lora_text_encoder=true"] if text else [])]
    assert train.main([*run, "max_duration=3ba", "use_ema=false"]) == 0
    ckpt = str(tmp_path / "ck" / "latest-rank0.pt")
    assert export.main([ckpt, str(tmp_path / "lora")]) == 0
    with safe_open(tmp_path / "lora" / WEIGHTS, "pt") as f:
        parts = {k.split(".", 1)[0] for k in f.keys()}
    assert parts == {"unet" if family in ("sd", "sdxl") else "transformer", *(TEXT_ENCODERS[family] if text else [])}
    assert export.main([ckpt, str(tmp_path / "merged"), "--merge"]) == 0
    metadata = json.loads((tmp_path / "lora" / "lora_base.json").read_text())
    assert metadata["model_name"] == bases[family]
    trained = _images(load_pipeline(ckpt), size)
    pipe = DiffusionPipeline.from_pretrained(bases[family], local_files_only=True)
    pipe.load_lora_weights(str(tmp_path / "lora"), weight_name=WEIGHTS)
    pipe.set_progress_bar_config(disable=True)
    assert np.array_equal(_images(pipe, size), trained)
    merged = _images(load_pipeline(str(tmp_path / "merged")), size)
    assert np.abs(merged - trained).max() <= 1
    base = _images(load_pipeline(bases[family]), size)
    # flux2-tiny's 3 batches move its 64 px samples less (a mean of 0.023 of 255 measured, 2026-11-28), qwen-image-tiny's
    # less still (0.0086 of 255, its random VAE's decoder flattening what changes; 2026-11-28)
    assert np.abs(base - trained).mean() > {"flux2": 0.01, "qwen-image": 0.004}.get(family, 0.05), (
        "the adapters did not change the samples"
    )
    assert np.array_equal(
        _images(load_pipeline(bases[family], lora=str(tmp_path / "lora"), lora_scale=0.0), size), base
    )


@pytest.mark.slow
def test_adapters_go_to_the_bucket_resume_from_it_and_export_from_it(bases, s3, tmp_path, monkeypatch, capsys):
    """save_folder=s3://...: a LoRA run stopped after batch 2 and run again resumes from the bucket's checkpoint
    and ends where a straight local run does, adapters and EMA bitwise; the object holds the adapters, not the
    base; export.py reads it from the bucket and writes the adapters diffusers loads (the same as from the local
    copy)."""
    monkeypatch.chdir(tmp_path)
    url = f"s3://{s3.bucket}/lora"
    assert train.main([*_run("flux", bases["flux"], tmp_path / "a"), "max_duration=3ba"]) == 0
    assert train.main([*_run("flux", bases["flux"], url), "max_duration=2ba"]) == 0
    capsys.readouterr()
    assert train.main([*_run("flux", bases["flux"], url), "max_duration=3ba", "autoresume=true"]) == 0
    assert f"autoresume: resuming from {url}/ep" in capsys.readouterr().err
    client = s3.client()
    key = client.get_object(Bucket=s3.bucket, Key="lora/latest-rank0.pt.symlink")["Body"].read().decode()
    (tmp_path / "b").mkdir()
    client.download_file(s3.bucket, key, str(tmp_path / "b" / "latest-rank0.pt"))
    a, b = final_state(tmp_path / "a"), final_state(tmp_path / "b")
    assert a["batch"] == b["batch"] == 3 and a["model"].keys() == b["model"].keys()
    assert all(
        torch.equal(v, b["model"][k]) if torch.is_tensor(v) else v == b["model"][k] for k, v in a["model"].items()
    )
    assert a["ema"] and all(torch.equal(a["ema"][k], b["ema"][k]) for k in a["ema"])
    assert all(".lora_A." in k or ".lora_B." in k for k in b["ema"])  # no base weight went up
    assert export.main([f"s3://{s3.bucket}/{key}", str(tmp_path / "from-bucket")]) == 0
    assert export.main([str(tmp_path / "b" / "latest-rank0.pt"), str(tmp_path / "from-copy")]) == 0
    from safetensors.torch import load_file

    exported, copied = (load_file(tmp_path / d / WEIGHTS) for d in ("from-bucket", "from-copy"))
    assert exported and exported.keys() == copied.keys()  # (the file's metadata names where it came from)
    assert all(torch.equal(exported[k], copied[k]) for k in exported)


def test_a_frozen_base_counts_no_weight_gradients_and_the_results_line_says_what_trains(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    full = build_model("sd-tiny").model.flops_per_sample(32)["denoiser"]
    model = build_model("sd-tiny").model
    install_lora(model, lora_options({"lora_rank": 4}), "sd-tiny")
    lora = model.flops_per_sample(32)["denoiser"]
    assert 0.6 * full < lora < 0.9 * full  # forward + input gradients, not the base's weight gradients
    # adapters on the text encoder too: its backward counts (about its forward again), the denoiser's is the same
    forward = model.text_encoder_flops("text_encoder", model.text_length)
    texts = build_model("sd-tiny").model
    install_lora(texts, lora_options({"lora_rank": 4, "lora_text_encoder": True}), "sd-tiny")
    assert texts.flops_per_sample(32)["denoiser"] == lora
    assert 1.5 * forward < texts.text_encoder_flops("text_encoder", texts.text_length) < 2.5 * forward
    assert benchmark.main(["--model_name", "sd-tiny", "--lora_rank", "4", *BENCH, "--results", "r.jsonl"]) == 0
    (rec,) = read_results(tmp_path / "r.jsonl")
    assert rec["lora"]["rank"] == 4 and rec["lora"]["targets"] == ["to_q", "to_k", "to_v", "to_out.0"]
    assert 0 < rec["lora"]["trainable_share"] < 0.05 and rec["peak_memory_gib"] > 0
    assert rec["lora"]["text_encoders"] == []


@pytest.mark.parametrize(
    "extra",
    [
        ["--model_name", "flux-tiny", "--gradient_checkpointing", "--synthetic_buckets", "1x1,1x2", "--use_ema"],
        ["--model_name", "sd-tiny", "--precomputed_latents", "--caption_dropout", "0.5"],
        ["--model_name", "flux-tiny", "--lora_base_dtype", "bf16", "--routing_share", "0.5", "--lora_text_encoder",
         "--encoder_dtype", "bf16", "--gradient_checkpointing"],
        ["--model_name", "flux-tiny", "--lora_base_dtype", "bf16", "--repa_encoder", "ENCODER"],
        ["--model_name", "sd-tiny", "--lora_base_dtype", "bf16", "--repa_encoder", "ENCODER", "--use_ema"],
    ],
    ids=["flux-checkpointing-buckets-ema", "sd-precomputed", "flux-bf16-base-routing-bf16-text-encoder",
         "flux-bf16-base-repa", "sd-bf16-base-repa-ema"],
)  # fmt: skip
def test_adapters_train_with_what_a_run_already_has(extra, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    if "ENCODER" in extra:
        extra = [tiny_clip_vision(tmp_path / "clip") if a == "ENCODER" else a for a in extra]
    assert benchmark.main([*extra, "--lora_rank", "4", *BENCH, "--max_duration", "3ba", "--results", "r.jsonl"]) == 0
    (rec,) = read_results(tmp_path / "r.jsonl")
    assert rec["lora"]["rank"] == 4


@pytest.mark.slow
def test_ddp_two_ranks_train_adapters(tmp_path):
    args = ["--model_name", "flux-tiny", "--lora_rank", "4", "--lora_text_encoder", *BENCH, "--results", "r.jsonl"]
    proc = composer(2, "benchmark.py", *args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (rec,) = read_results(tmp_path / "r.jsonl")
    assert rec["world_size"] == 2 and rec["lora"]["rank"] == 4 and rec["lora"]["text_encoders"] == ["text_encoder"]


@pytest.mark.slow
def test_fsdp2_shards_the_frozen_base_and_resumes_bitwise(tmp_path):
    proc = composer(2, "tests/lora_fsdp_worker.py", str(tmp_path / "ck"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "LORA-FSDP-OK" in proc.stdout + proc.stderr
    # export reads the adapters and the base's record from the sharded folder, no base weight from it
    (folder,) = [m.parent for m in sorted((tmp_path / "ck" / "resumed").glob("*/.metadata"))][-1:]
    assert export.main([str(folder), str(tmp_path / "lora")]) == 0
    assert (tmp_path / "lora" / WEIGHTS).stat().st_size < 200_000
    assert json.loads((tmp_path / "lora" / "lora_base.json").read_text())["model_name"] == "flux-tiny"


def test_a_bf16_base_trains_fp32_adapters_as_the_fp32_base_does(bases, tmp_path, monkeypatch):
    """lora_base_dtype=bf16: the frozen denoiser's weights in bf16 (half their bytes), the adapters fp32 and
    trained about as on the fp32 base (AdamW's steps, same seed and batches); the checkpoint's adapters export and
    sample on the base as stored. On SD (FLUX's bf16 base trains in test_adapters_train_with_what_a_run_already_has)."""
    family = "sd"
    model = build_model(bases[family]).model
    denoiser = model.unet
    fp32_bytes = sum(p.numel() * p.element_size() for p in denoiser.parameters())
    install_lora(model, lora_options({"lora_rank": 4, "lora_base_dtype": "bf16"}), bases[family])
    base = [p for p in denoiser.parameters() if not p.requires_grad]
    assert {p.dtype for p in base} == {torch.bfloat16} and sum(
        p.numel() * p.element_size() for p in base
    ) == fp32_bytes // 2
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
    monkeypatch.chdir(tmp_path)
    for dtype in ("fp32", "bf16"):
        run = [*_run(family, bases[family], tmp_path / dtype), "max_duration=2ba", "use_ema=false", "warmup=0ba"]
        assert train.main([*run, f"lora_base_dtype={dtype}"]) == 0
    a, b = final_state(tmp_path / "fp32")["model"], final_state(tmp_path / "bf16")["model"]
    adapters = [k for k in a if ".lora_" in k]
    assert adapters and a.keys() == b.keys() and all(b[k].dtype == torch.float32 for k in adapters)
    moved = torch.cat([a[k].flatten() for k in adapters if ".lora_B." in k])  # B: 0 before, AdamW's steps after
    differ = torch.cat([(a[k] - b[k]).flatten() for k in adapters if ".lora_B." in k])
    # the runs differ (the base computed in bf16), by a few percent of what AdamW moved (2.6% SD; FLUX's was 3.6%)
    assert moved.abs().mean() > 0 and 0 < differ.abs().mean() < 0.1 * moved.abs().mean()
    assert export.main([str(tmp_path / "bf16" / "latest-rank0.pt"), str(tmp_path / "lora")]) == 0
    assert len(_images(load_pipeline(bases[family], lora=str(tmp_path / "lora")))) == 2


def test_a_family_without_diffusers_lora_support_is_refused_in_one_line():
    """A family whose denoiser has no diffusers PEFT integration (PixArt-alpha's PixArtTransformer2DModel has no
    add_adapter in diffusers 0.42) and whose pipeline no LoRA loader (PixArtAlphaPipeline) is refused lora_rank in one
    line naming both, before any weight is built (the toy family of test_toy_family.py, AuraFlow, has both)."""
    from types import SimpleNamespace

    from diffusers import PixArtTransformer2DModel

    from diffusion.errors import UsageError
    from diffusion.models.base import LatentDiffusion
    from diffusion.techniques.lora import _check_peft

    class PixArt(LatentDiffusion):
        NAME, DESCRIPTION, PIPELINE = "pixart", "a PixArt model", "PixArtAlphaPipeline"
        PARTS = {"transformer": PixArtTransformer2DModel}

    with pytest.raises(UsageError) as refused:
        _check_peft(SimpleNamespace(model_name="/models/PixArt"), PixArt, {})
    line = str(refused.value)
    assert "its transformer (PixArtTransformer2DModel) takes no adapters" in line and "\n" not in line, line
    assert "its pipeline (PixArtAlphaPipeline) saves and loads no LoRA weights" in line, line
