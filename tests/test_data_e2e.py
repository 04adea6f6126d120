"""From img2dataset output to training, as the README shows it: one command to convert, one to precompute
(also split over 2 ranks), benchmark.py trains from both; and a Composer checkpoint resumes mid-epoch."""

import numpy as np
import pytest
from conftest import composer, img2dataset_dir, read_mds, read_results, release_streaming_memory, write_images

import benchmark
import data


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    img2dataset_dir(root / "laion", shards=2, n=8, corrupt=[1])
    assert data.main(["convert", str(root / "laion"), str(root / "mds")]) == 0
    return root


def test_convert_precompute_train(converted, tmp_path):
    mds, lat = converted / "mds", converted / "lat"
    assert len(read_mds(mds)) == 15  # 16 written by "img2dataset", one corrupt
    assert (
        data.main(
            ["precompute", str(mds), str(lat), "--model_name", "sd-tiny", "--batch_size", "4", "--num_workers", "0"]
        )
        == 0
    )
    stored = read_mds(lat)
    moments = stored[0]["latent_moments"]
    assert len(stored) == 15 and moments.shape == (8, 8, 8) and moments.dtype == np.float16
    assert stored[0]["text_embeds"].shape == (77, 32) and "pwatermark" in stored[0] and "image" not in stored[0]
    release_streaming_memory()
    common = [
        "--model_name",
        "sd-tiny",
        "--batch_size",
        "4",
        "--max_duration",
        "2ba",
        "--num_workers",
        "0",
        "--image_size",
        "64",
        "--results",
        str(tmp_path / "r.jsonl"),
    ]
    assert benchmark.main(["--local", str(mds), *common]) == 0
    assert benchmark.main(["--local", str(lat), "--precomputed_latents", *common]) == 0
    online, precomputed = read_results(tmp_path / "r.jsonl")
    assert not online["synthetic"] and not online["precomputed_latents"] and precomputed["precomputed_latents"]
    assert precomputed["tflop_per_image"] == precomputed["tflop_per_image_denoiser"] < online["tflop_per_image"]


@pytest.mark.slow
def test_precompute_splits_parts_over_ranks_and_flux_stores_pooled_embeddings(converted, tmp_path):
    mds = converted / "mds"
    proc = composer(
        2,
        "data.py",
        "precompute",
        str(mds),
        str(tmp_path / "two"),
        "--model_name",
        "sd-tiny",
        "--part_size",
        "4",
        "--batch_size",
        "4",
        "--num_workers",
        "0",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == ["index.json", *[f"part-{i:05d}" for i in range(4)]]
    assert "precompute: 15 samples encoded with sd-tiny at 64 px" in proc.stdout
    from diffusion.precompute import precompute

    precompute(
        str(mds), str(tmp_path / "one"), model_name="sd-tiny", batch_size=4, num_workers=0, part_size=4, progress=False
    )
    for a, b in zip(read_mds(tmp_path / "two"), read_mds(tmp_path / "one"), strict=True):
        assert a["key"] == b["key"]  # the same encoders (seeded preset weights) on every rank
        np.testing.assert_allclose(a["latent_moments"], b["latent_moments"], atol=1e-3)
        np.testing.assert_allclose(a["text_embeds"], b["text_embeds"], atol=1e-3)
    report = precompute(str(mds), str(tmp_path / "flux"), model_name="flux-tiny", num_workers=0, progress=False)
    assert report["columns"]["pooled_text_embeds"].startswith("ndarray:float16:")
    from diffusion.data.streaming import StreamingLatentsDataset
    from diffusion.models import build_model

    expected = build_model("flux-tiny").model.batch_shapes(64, True)
    sample = StreamingLatentsDataset(local=str(tmp_path / "flux"), expected=expected, image_size=64)[0]
    assert {k: tuple(v.shape) for k, v in sample.items()} == {k: s for k, (s, _, _) in expected.items()}


def test_composer_checkpoint_resumes_mid_epoch_with_the_same_samples(tmp_path, mds_latents):
    from composer.core import Callback

    from diffusion.config import TrainConfig
    from diffusion.trainer import build_trainer

    class Seen(Callback):
        def __init__(self):
            self.batches = []

        def after_dataloader(self, state, logger):
            self.batches.append(state.batch["text_embeds"][:, 0, 0].tolist())

    def fit(cache, duration, **kw):
        release_streaming_memory()
        cfg = TrainConfig(
            model_name="sd-tiny",
            remote=str(mds_latents),
            local=str(tmp_path / cache),
            precomputed_latents=True,
            batch_size=4,
            num_workers=0,
            max_duration=duration,
            image_size=64,
            **kw,
        )
        trainer = build_trainer(cfg)
        seen = Seen()
        trainer.state.callbacks.append(seen)
        trainer.fit()
        trainer.close()
        return seen.batches

    full = fit("a", "6ba")
    fit("b", "3ba", save_folder=str(tmp_path / "ck"), save_interval="3ba")
    rest = fit("c", "6ba", load_path=str(tmp_path / "ck" / "ep0-ba3-rank0.pt"))
    assert len(full) == 6 and rest == full[3:] and len({x for b in full for x in b}) == 24


def test_precompute_skips_and_counts_images_that_do_not_decode(tmp_path, capsys):
    from diffusion.precompute import precompute

    src = write_images(tmp_path / "src", 10, bad={2, 7})
    report = precompute(src, str(tmp_path / "lat"), model_name="sd-tiny", batch_size=4, num_workers=0, progress=False)
    assert (report["written"], report["skipped"]) == (8, 2)
    assert [s["key"] for s in read_mds(tmp_path / "lat")] == [f"k{i}" for i in range(10) if i not in (2, 7)]
    assert "(2 skipped: images that do not decode;" in capsys.readouterr().out
