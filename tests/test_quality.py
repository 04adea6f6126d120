"""FID and CLIP score (diffusion.eval.quality, evaluate.py, callbacks.QualityEval): tiny offline weights.

A random tiny CLIPModel with the byte tokenizer stands in for ViT-H/14, a randomly initialised Inception v3
saved as a weights file stands in for the FID weights (64-wide features keep it fast), and a pooling
module stands in for Inception where only the FID arithmetic is under test.
"""

import json
from unittest import mock

import numpy as np
import pytest
import torch
from conftest import REPO, composer
from PIL import Image

import evaluate

CAPTIONS = [
    "a red cube",
    "two cats on a sofa",
    "a bowl of fruit",
    "a city at night",
    "a dog in the snow",
    "a boat on a lake",
    "a green field",
    "a train at a station",
]


class PooledPixels(torch.nn.Module):
    """uint8 (N, 3, H, W) -> (N, 12): channel means over a 2x2 grid. A cheap stand-in for Inception."""

    def forward(self, x):
        return torch.nn.functional.adaptive_avg_pool2d(x.float() / 255, 2).flatten(1)


def random_images(n, seed, size=16, low=0, high=200):
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(low, high, (size, size, 3), dtype=np.uint8)) for _ in range(n)]


def frechet_numpy(mu1, s1, mu2, s2):
    """||mu1 - mu2||^2 + tr(s1 + s2 - 2 (s1 s2)^1/2), with tr (s1 s2)^1/2 = tr (s1^1/2 s2 s1^1/2)^1/2."""
    w, v = np.linalg.eigh(s1)
    root1 = v @ np.diag(np.sqrt(np.clip(w, 0, None))) @ v.T
    inner = np.linalg.eigvalsh(root1 @ s2 @ root1)
    return float(((mu1 - mu2) ** 2).sum() + np.trace(s1) + np.trace(s2) - 2 * np.sqrt(np.clip(inner, 0, None)).sum())


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """Tiny CLIP directory, random Inception weights file, 8 reference images, an MLPerf-layout prompts tsv."""
    import torch_fidelity.feature_extractor_inceptionv3 as fe
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel

    from diffusion.models.tokenizer import byte_tokenizer

    tmp = tmp_path_factory.mktemp("quality")
    cfg = CLIPConfig(
        text_config=dict(
            vocab_size=258,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=77,
            bos_token_id=256,
            eos_token_id=257,
            pad_token_id=257,
        ),
        vision_config=dict(
            image_size=32,
            patch_size=8,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
        ),
        projection_dim=16,
    )
    torch.manual_seed(0)
    CLIPModel(cfg).save_pretrained(tmp / "clip")
    byte_tokenizer().save_pretrained(tmp / "clip")
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(tmp / "clip")
    # torch-fidelity's Inception v3, randomly initialised (the real weights cannot be downloaded here), saved the
    # way the real file is: a state dict (fp16 halves its size; load_state_dict casts back to fp32)
    with (
        mock.patch.object(fe, "load_state_dict_from_url", lambda *a, **k: {}),
        mock.patch.object(fe.FeatureExtractorInceptionV3, "load_state_dict", lambda self, sd, *a, **k: None),
    ):
        net = fe.FeatureExtractorInceptionV3("inception-v3-compat", ["64"])
    torch.save(
        {k: v.half() if v.is_floating_point() else v for k, v in net.state_dict().items()}, tmp / "inception.pth"
    )
    (tmp / "ref").mkdir()
    for i, im in enumerate(random_images(8, seed=1, size=64)):
        im.save(tmp / "ref" / f"{i:03d}.png")
    rows = "".join(f"{i}\t{i}\t{c}\n" for i, c in enumerate(CAPTIONS))
    (tmp / "coco.tsv").write_text("image_id\tid\tcaption\n" + rows)
    return tmp


@pytest.fixture(scope="module")
def trained(assets):
    """train.py's run (yamls/sd-tiny-cpu.yaml, 2 batches, checkpoint at the end) with QualityEval every batch.
    No warm-up and a large learning rate, so the EMA weights (smoothing 0.99) differ visibly from the live ones."""
    from composer.loggers import LoggerDestination

    from diffusion.batch import INPUT_IDS
    from diffusion.callbacks.quality_eval import QualityEval
    from diffusion.config import load_config
    from diffusion.models.tokenizer import clip_tokenizer
    from diffusion.trainer import build_trainer

    class Recorder(LoggerDestination):
        def __init__(self):
            self.metrics = []

        def log_metrics(self, metrics, step=None):
            self.metrics.append((step, metrics))

    cfg = load_config(
        [str(REPO / "yamls/sd-tiny-cpu.yaml")],
        [
            "eval_interval=null",
            "batch_size=4",
            "max_duration=2ba",
            "autoresume=false",
            f"save_folder={assets / 'ckpt'}",
            "save_interval=2ba",
            "num_workers=0",
            "schedule=constant",
            "warmup=0ba",
            "lr=0.01",
        ],
    )
    trainer = build_trainer(cfg)
    callback = QualityEval(
        str(assets / "coco.tsv"),
        "1ba",
        {INPUT_IDS: clip_tokenizer()},  # sd-tiny's
        inception=str(assets / "inception.pth"),
        fid_features=64,
        clip=str(assets / "clip"),
        reference_images=str(assets / "ref"),
        num_samples=6,
        steps=2,
        batch_size=2,
    )
    recorder = Recorder()
    trainer.state.callbacks.append(callback)
    trainer.logger.destinations = (*trainer.logger.destinations, recorder)
    trainer.fit()
    trainer.close()
    return assets / "ckpt" / "latest-rank0.pt", callback, recorder


def test_batches_give_every_prompt_to_exactly_one_rank():
    from diffusion.eval.quality import batches

    for n, bs, world in [(10, 3, 2), (7, 4, 3), (2, 8, 4), (30000, 8, 8)]:
        spans = [s for r in range(world) for s in batches(n, bs, r, world)]
        assert sorted(i for a, b in spans for i in range(a, b)) == list(range(n))
    assert batches(10, 3, 1, 2) == [(3, 6), (9, 10)]


def test_fid_of_a_set_with_itself_is_zero_and_grows_with_a_shift():
    from diffusion.eval.fid import load_fid, to_uint8

    real = to_uint8(random_images(64, seed=0))
    fid = load_fid(PooledPixels())
    fid.update(real, real=True)
    fid.update(real, real=False)
    assert abs(float(fid.compute())) < 1e-4
    fid.reset()  # keeps the real set
    shifted = (real.int() + 40).clamp(max=255).to(torch.uint8)
    fid.update(shifted, real=False)
    value = float(fid.compute())
    feats_r, feats_s = PooledPixels()(real).double().numpy(), PooledPixels()(shifted).double().numpy()
    expected = frechet_numpy(
        feats_r.mean(0), np.cov(feats_r, rowvar=False), feats_s.mean(0), np.cov(feats_s, rowvar=False)
    )
    assert value > 0.05
    assert value == pytest.approx(expected, rel=1e-3)


def test_fid_from_npz_statistics_equals_fid_from_the_images(tmp_path):
    from diffusion.eval.fid import load_fid, read_stats, reference_stats, set_reference_stats, to_uint8

    real, fake = to_uint8(random_images(40, seed=2)), to_uint8(random_images(30, seed=3, low=30, high=255))
    from_images = load_fid(PooledPixels())
    from_images.update(real, real=True)
    from_images.update(fake, real=False)
    feats = PooledPixels()(real).double().numpy()
    np.savez(tmp_path / "stats.npz", mu=feats.mean(0), sigma=np.cov(feats, rowvar=False))
    from_stats = load_fid(PooledPixels())
    set_reference_stats(from_stats, *read_stats(str(tmp_path / "stats.npz")))
    from_stats.update(fake, real=False)
    assert float(from_stats.compute()) == pytest.approx(float(from_images.compute()), rel=1e-5)
    mu, sigma = reference_stats(from_images)  # what --save_reference_stats writes
    np.testing.assert_allclose(mu, feats.mean(0), rtol=1e-9)
    np.testing.assert_allclose(sigma, np.cov(feats, rowvar=False), rtol=1e-6, atol=1e-12)


def test_clip_score_is_torchmetrics_scale_and_its_cosine_is_mlperfs(assets):
    from diffusion.eval.clip_score import load_clip
    from diffusion.eval.quality import QualityMetrics

    images = random_images(5, seed=4, size=48)
    metrics = QualityMetrics(PooledPixels(), str(assets / "clip"))
    metrics.set_reference(stats=None, images=str(assets / "ref"))
    metrics.update(images[:3], CAPTIONS[:3])
    metrics.update(images[3:], CAPTIONS[3:5])
    result = metrics.compute()
    model, processor = load_clip(str(assets / "clip"))  # the cosine by hand, as MLPerf's CLIPEncoder computes it
    with torch.no_grad():
        img = model.get_image_features(processor(images=images)["pixel_values"])
        tokens = processor(text=CAPTIONS[:5])
        txt = model.get_text_features(tokens["input_ids"], tokens["attention_mask"])
    cosine = torch.nn.functional.cosine_similarity(img, txt).mean().item()
    assert result["num_samples"] == 5
    assert result["clip_score_cosine"] == pytest.approx(cosine, abs=1e-5)
    assert 0 <= result["clip_score"] <= 100
    assert result["clip_score"] == pytest.approx(max(0.0, 100 * cosine), abs=1e-3)


def test_training_callback_logs_fid_and_clip_score_with_the_ema_weights(trained):
    ckpt, callback, recorder = trained
    assert ckpt.exists()
    assert [h["batch"] for h in callback.history] == [1, 2]
    for h in callback.history:
        assert h["num_samples"] == 6 and np.isfinite(h["fid"]) and 0 <= h["clip_score"] <= 100
    logged = [m for _, m in recorder.metrics if "metrics/quality/FID" in m]
    assert len(logged) == 2
    assert logged[-1]["metrics/quality/FID"] == callback.history[-1]["fid"]
    assert set(logged[-1]) == {"metrics/quality/FID", "metrics/quality/CLIPScore", "metrics/quality/CLIP_cosine"}


@pytest.mark.slow
def test_evaluate_on_two_ranks_from_npz_stats_matches_one_rank_from_the_images(trained, assets, tmp_path, capsys):
    ckpt = str(trained[0])
    common = [
        "--prompts",
        str(assets / "coco.tsv"),
        "--inception",
        str(assets / "inception.pth"),
        "--fid_features",
        "64",
        "--clip",
        str(assets / "clip"),
        "--num_samples",
        "6",
        "--steps",
        "2",
        "--batch_size",
        "2",
    ]
    assert (
        evaluate.main(
            [
                ckpt,
                *common,
                "--reference_images",
                str(assets / "ref"),
                "--out",
                str(tmp_path / "one.json"),
                "--save_reference_stats",
                str(tmp_path / "ref.npz"),
                "--save_images",
                str(tmp_path / "img"),
            ]
        )
        == 0
    )
    assert "FID " in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "img").iterdir()) == [f"{i:05d}.png" for i in range(6)]
    assert (
        evaluate.main(
            [ckpt, *common, "--reference_images", str(assets / "ref"), "--no_ema", "--out", str(tmp_path / "live.json")]
        )
        == 0
    )
    # 2 ranks, 3 batches of 2 prompts: rank 0 samples prompts 0-1 and 4-5, rank 1 prompts 2-3; the reference is
    # the statistics of the same images, held by rank 0 only
    proc = composer(
        2,
        "evaluate.py",
        ckpt,
        *common,
        "--reference_stats",
        str(tmp_path / "ref.npz"),
        "--out",
        str(tmp_path / "two.json"),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, two, live = (json.loads((tmp_path / f"{k}.json").read_text()) for k in ("one", "two", "live"))
    # the training callback's last evaluation (same prompts, seeds and settings) used the EMA weights saved
    assert one["fid"] == pytest.approx(trained[1].history[-1]["fid"], rel=1e-6)
    assert one["clip_score_cosine"] == pytest.approx(trained[1].history[-1]["clip_score_cosine"], abs=1e-7)
    assert abs(live["clip_score_cosine"] - one["clip_score_cosine"]) > 1e-4
    assert (one["world_size"], two["world_size"], one["num_samples"], two["num_samples"]) == (1, 2, 6, 6)
    assert two["fid"] == pytest.approx(one["fid"], rel=1e-4)
    assert two["clip_score_cosine"] == pytest.approx(one["clip_score_cosine"], abs=1e-6)
    assert one["clip_score"] == pytest.approx(max(0.0, 100 * one["clip_score_cosine"]), abs=1e-4)
    assert one["mlperf"]["fid_max"] == 90 and one["mlperf"]["clip_score_cosine_min"] == 0.15


def test_evaluate_takes_a_checkpoint_in_object_storage(trained, assets, s3, tmp_path):
    """The same figures from the checkpoint's copy in an S3 bucket (conftest.s3) as from the file."""
    s3.client().upload_file(str(trained[0]), s3.bucket, "run/ep0-ba2-rank0.pt")
    argv = [f"s3://{s3.bucket}/run/ep0-ba2-rank0.pt", "--prompts", str(assets / "coco.tsv"), "--inception"]
    argv += [str(assets / "inception.pth"), "--fid_features", "64", "--clip", str(assets / "clip"), "--num_samples"]
    argv += ["6", "--steps", "2", "--batch_size", "2", "--reference_images", str(assets / "ref")]
    assert evaluate.main([*argv, "--out", str(tmp_path / "s3.json")]) == 0
    result = json.loads((tmp_path / "s3.json").read_text())
    assert result["fid"] == pytest.approx(trained[1].history[-1]["fid"], rel=1e-6)
    assert result["clip_score_cosine"] == pytest.approx(trained[1].history[-1]["clip_score_cosine"], abs=1e-7)


def test_reference_images_split_over_ranks_sum_to_the_whole_set(assets):
    from diffusion.eval.quality import QualityMetrics

    whole, *parts = (QualityMetrics(PooledPixels(), str(assets / "clip")) for _ in range(4))
    whole.set_reference(images=str(assets / "ref"))
    for rank, part in enumerate(parts):
        part.set_reference(images=str(assets / "ref"), rank=rank, world_size=3, batch_size=2)
    for state in ("real_features_sum", "real_features_cov_sum", "real_features_num_samples"):
        total = sum(getattr(p.fid, state) for p in parts)
        torch.testing.assert_close(total, getattr(whole.fid, state))


@pytest.mark.parametrize(
    "preset",
    [
        "sd3-tiny",
        "flux2-tiny",
        "flux2-dev-tiny",
        "qwen-image-tiny",
        "z-image-tiny",
        "krea2-tiny",
        "flux3-tiny",
        "qwen-image-21-tiny",
    ],
)
def test_evaluate_scores_each_transformer_familys_pipeline_folder(preset, assets, tmp_path):
    """evaluate.py on a pipeline folder of each family added for issues 51 and 53 (the preset exported with random
    weights): its pipeline samples as the family says (sampling_options) and FID and CLIP score come out finite."""
    import export

    assert export.main([preset, str(tmp_path / "folder")]) == 0
    args = [
        str(tmp_path / "folder"),
        "--prompts",
        str(assets / "coco.tsv"),
        "--inception",
        str(assets / "inception.pth"),
    ]
    # 2 steps: QwenImagePipeline's scheduler stretches its shifted sigmas to a terminal value, which 1 step divides by 0
    args += ["--fid_features", "64", "--clip", str(assets / "clip"), "--num_samples", "2", "--steps", "2"]
    args += ["--batch_size", "2", "--image_size", "32", "--reference_images", str(assets / "ref")]
    assert evaluate.main([*args, "--out", str(tmp_path / "q.json")]) == 0
    scores = json.loads((tmp_path / "q.json").read_text())
    assert np.isfinite(scores["fid"]) and np.isfinite(scores["clip_score"]), scores


def test_bad_inputs_are_one_line_errors(assets, tmp_path, capsys):
    np.savez(tmp_path / "bad.npz", mean=np.zeros(64))
    (tmp_path / "empty").mkdir()
    torch.save({"not": torch.zeros(1)}, tmp_path / "other.pth")
    ok = {
        "--prompts": str(assets / "coco.tsv"),
        "--inception": str(assets / "inception.pth"),
        "--clip": str(assets / "clip"),
        "--reference_images": str(assets / "ref"),
    }
    cases = [
        ({"--inception": str(tmp_path / "nope.pth")}, "--inception: weights file"),
        ({"--inception": str(tmp_path / "other.pth")}, "is not the FID Inception v3 weights"),
        ({"--clip": str(tmp_path / "noclip")}, "--clip:"),
        ({"--clip": str(tmp_path / "empty")}, "cannot load a CLIP model"),
        ({"--prompts": str(tmp_path / "nope.tsv")}, "--prompts: file"),
        ({"--reference_images": str(tmp_path / "empty")}, "holds no images"),
        ({"--reference_images": None, "--reference_stats": str(tmp_path / "bad.npz")}, "has no mu or sigma"),
        ({"--num_samples": "9"}, "more than the 8 prompts"),
    ]
    for change, message in cases:
        args = {**ok, "--fid_features": "64", **change}
        argv = [str(tmp_path / "no-checkpoint.pt")] + [x for k, v in args.items() if v is not None for x in (k, v)]
        assert evaluate.main(argv) == 2, change
        err = capsys.readouterr().err.strip()
        assert err.startswith("evaluate.py: error: ") and message in err and "\n" not in err, (change, err)


def test_training_callback_errors_name_the_config_keys(assets, tmp_path):
    from diffusion.callbacks.quality_eval import QualityEval
    from diffusion.errors import UsageError

    ok = dict(
        inception=str(assets / "inception.pth"),
        fid_features=64,
        clip=str(assets / "clip"),
        reference_images=str(assets / "ref"),
    )
    with pytest.raises(UsageError, match="^quality_inception: weights file"):
        QualityEval(str(assets / "coco.tsv"), "1ba", {}, **{**ok, "inception": str(tmp_path / "nope.pth")})
    with pytest.raises(UsageError, match="^quality_num_samples 20 must be between 2 and the 8 prompts"):
        QualityEval(str(assets / "coco.tsv"), "1ba", {}, num_samples=20, **ok)
    with pytest.raises(UsageError, match="^quality_interval 'soon' is not a training time"):
        QualityEval(str(assets / "coco.tsv"), "soon", {}, **ok)
