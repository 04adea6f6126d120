"""Aspect-ratio buckets (diffusion/data/buckets.py, bucket_split.py): the table, the split of an MDS dataset
into one dataset per bucket, and training on it with every batch one bucket's shape."""

import json
import math

import pytest
import torch
from conftest import REPO, read_results, write_mds_aspects

import data
import train
from diffusion.batch import IMAGE
from diffusion.data import buckets
from diffusion.data.shared_memory import registering
from diffusion.errors import UsageError


def test_bucket_table_sizes_are_multiples_with_about_the_target_pixels():
    for aspect in buckets.ASPECTS:
        for resolution, factor in ((256, 16), (512, 16), (1024, 32), (64, 16)):
            h, w = buckets.bucket_size(aspect, resolution, factor)
            assert h % factor == 0 and w % factor == 0 and h > 0 and w > 0
            if resolution >= 256:
                assert 0.8 < h * w / resolution**2 < 1.2, (aspect, resolution, h, w)
                assert abs(math.log(w / h) - math.log(aspect[0] / aspect[1])) < 0.15
    assert buckets.bucket_size((1, 1), 512, 16) == (512, 512)


@pytest.mark.parametrize(
    "size,aspect", [((100, 100), (1, 1)), ((1920, 1080), (7, 4)), ((1080, 1920), (4, 7)), ((4000, 900), (4, 1))]
)
def test_each_image_goes_to_the_bucket_nearest_its_ratio(size, aspect):
    assert buckets.nearest_aspect(*size) == aspect


def test_split_writes_one_dataset_per_bucket_and_is_done_once(tmp_path, capsys):
    src = write_mds_aspects(tmp_path / "mds")
    out = tmp_path / "buckets"
    assert data.main(["bucket", str(src), str(out)]) == 0
    printed = capsys.readouterr().out
    assert "32 samples in 4 buckets" in printed and "  2x1         8  25.0%" in printed
    meta = json.loads((out / "buckets.json").read_text())
    assert meta["samples"] == {"1x2": 8, "1x1": 8, "4x3": 8, "2x1": 8}
    assert all((out / name / "index.json").is_file() for name in meta["buckets"])
    assert data.main(["bucket", str(src), str(out)]) == 0
    assert "already bucketed" in capsys.readouterr().out


def _cfg(root, **kw):
    from diffusion.config import TrainConfig

    return TrainConfig(model_name="sd-tiny", local=str(root), image_size=64, num_workers=0, batch_size=4, **kw)


def test_every_batch_is_one_bucket_and_every_bucket_is_seen(mds_buckets, sd_tiny):
    from diffusion.data import DataSettings, build_train_dataloader

    loader = build_train_dataloader(DataSettings.of(_cfg(mds_buckets)), sd_tiny.model, sd_tiny.tokenizers, 4).dataloader
    shapes = [tuple(batch[IMAGE].shape) for batch in loader]
    factor = sd_tiny.model.size_multiple
    expected = {(4, 3, *buckets.bucket_size(a, 64, factor)) for a in ((1, 1), (2, 1), (1, 2), (4, 3))}
    assert len(shapes) == 8 and set(shapes) == expected, shapes


@pytest.mark.parametrize("model", ["sd-tiny", "flux-tiny"])
def test_training_on_a_bucketed_dataset(model, mds_buckets, tmp_path):
    args = [
        str(REPO / "yamls/sd-tiny-cpu.yaml"),
        f"model_name={model}",
        "use_synth_data=false",
        f"local={mds_buckets}",
        "max_duration=8ba",
        "eval_interval=null",
        "autoresume=false",
        f"save_folder={tmp_path / 'ck'}",
        "save_interval=8ba",
        f"results={tmp_path / 'r.jsonl'}",
        "batch_size=4",
    ]
    assert train.main(args) == 0
    record = json.loads((tmp_path / "r.jsonl").read_text().splitlines()[-1])
    assert record["images_per_sec"] > 0


def test_flops_of_a_bucket_follow_its_pixels(sd_tiny):
    model = sd_tiny.model
    square = model.flops_per_sample(64)["denoiser"]
    wide = model.flops_per_sample((48, 96))["denoiser"]
    assert 0.9 < wide / (square * 48 * 96 / 64**2) < 1.1
    batch = {IMAGE: torch.zeros(2, 3, 48, 96)}
    assert model.flops_per_batch(batch) == 2 * model.flops_per_sample((48, 96))["total"]


@pytest.mark.parametrize("model", ["sd-tiny", "flux-tiny"])
def test_sampling_at_a_bucket_shape(model):
    from diffusion.eval.sampling import sample
    from diffusion.models import build_model

    built = build_model(model)
    pipe = built.model.pipeline(built.tokenizers)
    (image,) = sample(pipe, ["a red square"], steps=2, image_size=(48, 96))
    assert image.size == (96, 48)  # PIL: (width, height)


def test_sd_sampling_at_sides_not_multiples_of_8_is_one_line():
    from diffusion.eval.sampling import sample
    from diffusion.models import build_model

    built = build_model("sd-tiny")
    with pytest.raises(UsageError, match="24x12 .w x h.: diffusers' StableDiffusionPipeline samples only sides"):
        sample(built.model.pipeline(built.tokenizers), ["a red square"], steps=2, image_size=(12, 24))


def test_generate_takes_width_and_height_together(capsys):
    import generate

    assert generate.main(["somewhere", "--prompt", "a", "--width", "96"]) == 2
    assert "give --width and --height together" in capsys.readouterr().err


def test_inspect_shows_the_bucket_histogram(mds_buckets, tmp_path, capsys):
    assert data.main(["inspect", str(mds_buckets)]) == 0
    out = capsys.readouterr().out
    assert "aspect-ratio buckets (data.py bucket), 32 samples in 4" in out and "  1x2         8  25.0%" in out
    assert data.main(["inspect", str(write_mds_aspects(tmp_path / "plain"))]) == 0
    out = capsys.readouterr().out
    assert "aspect-ratio buckets of all 32 samples" in out and "  4x3         8  25.0%" in out


def test_a_bucket_smaller_than_a_batch_is_one_line(mds_buckets, tmp_path, capsys):
    args = [str(REPO / "yamls/sd-tiny-cpu.yaml"), "use_synth_data=false", f"local={mds_buckets}", "batch_size=16"]
    assert train.main([*args, "autoresume=false", f"save_folder={tmp_path}", "eval_interval=null"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("train.py: error: ") and "no bucket can: every epoch would be empty" in err[-1], err[-1]
    assert "bucket 1x1 (8 samples)" in err[-1] and "whole global batch of 16 (1 node x 1 rank x " in err[-1]


def test_a_bucket_that_gives_no_whole_global_batch_is_left_out_in_one_line(tmp_path, capsys, monkeypatch):
    """Streaming's per_stream batching raised on a bucket it could make no whole global batch of: on 3 or more nodes
    a numpy error ("could not broadcast input array from shape (1,0)"), for buckets not all smaller than a global
    batch (3 and 5 samples on 4 nodes of one rank, batch 1). Such a bucket is left out before Streaming sees it, in
    one line naming it; Streaming's arrangement of the rest then gives every rank the same whole batches. The one
    node case (a real training run) and none left (an error): the tests above."""
    from streaming import MDSWriter, Stream, StreamingDataset
    from streaming.base.batching import generate_work
    from streaming.base.world import World

    from diffusion.data import loaders

    counts = {(1, 1): 40, (2, 1): 3, (1, 2): 5}
    for aspect, n in counts.items():
        with MDSWriter(out=str(tmp_path / buckets.name(aspect)), columns={"i": "int"}) as w:
            for i in range(n):
                w.write({"i": i})
    buckets.write_buckets_file(str(tmp_path), counts)
    for name, value in (("get_world_size", 4), ("get_local_world_size", 1), ("get_global_rank", 0)):
        monkeypatch.setattr(loaders.dist, name, lambda value=value: value)
    samples = buckets.read_index(str(tmp_path))["samples"]
    kept = loaders._with_whole_batches(samples, list(counts), "local X", 2, {"batch_size": 1, "num_canonical_nodes": 1})
    assert kept == [(1, 1)]
    line = capsys.readouterr().err.strip()
    assert line.startswith("buckets: local X: bucket 2x1 (3 samples), bucket 1x2 (5 samples) cannot fill one whole "
                           "global batch of 4 (4 nodes x 1 rank x ") and "left out of this run" in line, line  # fmt: skip

    def arrangement(aspects):
        streams = [Stream(local=str(tmp_path / buckets.name(a))) for a in aspects]
        with registering():  # as the project makes its datasets: another test process may be making one
            dataset = StreamingDataset(
                streams=streams, batching_method="per_stream", batch_size=1, num_canonical_nodes=1, shuffle=True,
                shuffle_seed=7, shuffle_block_size=1 << 18,
            )  # fmt: skip
        return generate_work(
            "per_stream", dataset, World(num_nodes=4, ranks_per_node=1, workers_per_rank=2, worker=0), 0, 0
        )

    with pytest.raises(ValueError, match="could not broadcast"):
        arrangement(list(counts))
    full = (arrangement(kept) >= 0).all(axis=-1).sum(axis=(2, 3)).ravel()
    assert len(set(full)) == 1 and full[0] == 10, full  # 40 samples, 4 ranks: 10 whole batches each


def test_precompute_writes_latents_per_bucket_and_training_reads_them(mds_buckets, tmp_path):
    out = tmp_path / "latents"
    assert data.main(["precompute", str(mds_buckets), str(out), "--model_name", "sd-tiny", "--num_workers", "0"]) == 0
    meta = json.loads((out / "buckets.json").read_text())
    assert meta["samples"] == {"1x2": 8, "1x1": 8, "4x3": 8, "2x1": 8}
    index = json.loads((out / "2x1" / "index.json").read_text())
    moments = index["shards"][0]["column_encodings"][index["shards"][0]["column_names"].index("latent_moments")]
    assert moments.endswith(":8,6,12")  # 2x1 at 64 px for sd-tiny: 96x48 px, 12x6 latents, mean + log-variance
    args = [
        str(REPO / "yamls/sd-tiny-cpu.yaml"),
        "use_synth_data=false",
        "precomputed_latents=true",
        f"local={out}",
        "max_duration=4ba",
        "eval_interval=null",
        "autoresume=false",
        f"save_folder={tmp_path / 'ck'}",
        "batch_size=4",
    ]
    assert train.main(args) == 0
    _bench_reads_buckets(out, "latents", tmp_path)


def _bench_reads_buckets(dataset, kind: str, tmp_path) -> None:
    """data.py bench times a bucketed dataset as training reads it (a bucket per batch, each at its size)."""
    results = tmp_path / f"bench-{kind}.jsonl"
    args = ["bench", str(dataset), "--image_size", "64", "--batch_size", "4", "--batches", "4", "--warmup", "1"]
    assert data.main([*args, "--num_workers", "0", "--results", str(results)]) == 0
    (row,) = read_results(results)
    assert row["kind"] == kind and row["buckets"] == 4 and row["samples_timed"] == 16


def test_bench_times_a_bucketed_image_dataset(mds_buckets, tmp_path):
    _bench_reads_buckets(mds_buckets, "images", tmp_path)


def test_benchmark_draws_synthetic_buckets_and_reports_each_shape(tmp_path, capsys):
    import benchmark

    results = tmp_path / "r.jsonl"
    base = ["--model_name", "sd-tiny", "--use_synth_data", "--batch_size", "4", "--num_workers", "0"]
    args = [*base, "--synthetic_buckets", "1x1,2x1,1x2", "--max_duration", "14ba", "--results", str(results)]
    assert benchmark.main(args) == 0
    record = json.loads(results.read_text().splitlines()[-1])
    shapes = record["per_shape"]
    assert set(shapes) <= {"64x64", "96x48", "48x96"} and len(shapes) >= 2, shapes
    assert sum(s["batches"] for s in shapes.values()) == record["measured_batches"] == 12
    assert all(s["images_per_sec"] > 0 and s["first_batch_seconds"] > 0 for s in shapes.values())
    assert all(s["other_batch_seconds"] > 0 for s in shapes.values() if s["batches"] > 1)
    assert benchmark.main([*base, "--synthetic_buckets", "5x5"]) == 2
    assert "--synthetic_buckets '5x5' is not 'all' or a comma list of buckets" in capsys.readouterr().err


def test_synthetic_buckets_give_every_rank_the_same_bucket_per_batch():
    from diffusion.data.synthetic import RankSlices, SyntheticBuckets

    layouts = [{IMAGE: ((3, h, w), torch.float32, None)} for h, w in ((64, 64), (48, 96), (96, 48))]
    data = SyntheticBuckets(layouts, global_batch=6, num_samples=60, seed=3)
    per_rank = [[tuple(data[i][IMAGE].shape) for i in RankSlices(data, rank, 2)] for rank in range(3)]
    assert all(len(shapes) == 20 for shapes in per_rank)  # 10 global batches of 6, 2 samples per rank each
    kth = [{shape for shapes in per_rank for shape in shapes[2 * k : 2 * k + 2]} for k in range(10)]
    assert all(len(shapes) == 1 for shapes in kth)  # global batch k: one shape on every rank
    assert len({next(iter(shapes)) for shapes in kth}) > 1  # and more than one bucket drawn over the run


def test_per_stream_batching_gives_every_rank_the_same_whole_batches_on_any_nodes(tmp_path):
    """Streaming's arrangement of an epoch for the streams a bucketed dataset is read as (loaders._bucket_streams:
    ``per_stream``), buckets no global batch divides, on 1 to 8 nodes of 1 or 8 ranks with 1 to 3 loader workers,
    from an epoch's start and from a resume inside it: every rank gets the same number of batches, each whole
    (a -1 in Streaming's arrangement is a sample left out; a batch is one worker's ``batch_size`` in a row). An
    uneven count is the NCCL hang at an epoch's end that ``device_per_stream`` gives (Photoroom's PRX patches
    it); the same on the real 2-node Slurm with training, killing and resuming: tests/test_slurm_buckets.py."""
    import itertools

    from streaming import MDSWriter, StreamingDataset
    from streaming.base.batching import generate_work
    from streaming.base.world import World

    from diffusion.data.loaders import _bucket_streams

    aspects = [(1, 1), (2, 1), (1, 2)]
    for aspect, n in zip(aspects, (301, 263, 259)):  # 256 (the largest global batch here) + 45, + 7, + 3
        with MDSWriter(out=str(tmp_path / buckets.name(aspect)), columns={"i": "int"}) as w:
            for i in range(n):
                w.write({"i": i})
    for nodes, ranks, workers, batch in itertools.product((1, 2, 4, 8), (1, 8), (1, 2, 3), (1, 4)):
        streams = _bucket_streams(None, str(tmp_path), aspects, 64, 8)  # Streaming fills in each stream: new ones
        with registering():
            dataset = StreamingDataset(
                streams=streams["streams"], batching_method=streams["batching_method"], batch_size=batch,
                num_canonical_nodes=1, shuffle=True, shuffle_seed=7, shuffle_block_size=1 << 18,
            )  # fmt: skip
        world = World(num_nodes=nodes, ranks_per_node=ranks, workers_per_rank=workers, worker=0)
        global_batch = nodes * ranks * batch
        for epoch, resume in ((0, 0), (1, 0), (1, global_batch)):
            # (nodes, ranks, workers, batches, batch): sample indices, -1 where none
            work = generate_work(streams["batching_method"], dataset, world, epoch, resume)
            full, empty = (work >= 0).all(axis=-1), (work < 0).all(axis=-1)
            assert (full | empty).all(), (nodes, ranks, workers, batch, epoch, resume)
            per_rank = full.sum(axis=(2, 3)).ravel()
            assert len(set(per_rank)) == 1 and per_rank[0] > 0, (nodes, ranks, workers, batch, per_rank)
