import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO, composer, read_results, run

import benchmark
from diffusion.errors import UsageError


@pytest.mark.slow
def test_fsdp_ema_two_ranks_writes_a_result_line(tmp_path):
    """The issue's done-when command, verbatim."""
    proc = composer(
        2,
        "benchmark.py",
        "--use_synth_data",
        "--model_name",
        "sd-tiny",
        "--use_ema",
        "--fsdp",
        "--batch_size",
        "8",
        "--max_duration",
        "4ba",
        "--results",
        "r.jsonl",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (rec,) = read_results(tmp_path / "r.jsonl")
    assert rec["world_size"] == 2 and rec["fsdp"] and rec["ema"] and rec["model"] == "sd-tiny"
    assert rec["images_per_sec"] > 0 and rec["images_per_sec_per_gpu"] == pytest.approx(rec["images_per_sec"] / 2)
    assert rec["measured_batches"] == 2 and rec["resolution"] == 64 and rec["device_train_microbatch_size"] == 4
    assert rec["tflop_per_image"] > rec["tflop_per_image_denoiser"] > 0
    assert {"torch", "mosaicml", "diffusers", "transformers"} <= rec["versions"].keys()


@pytest.mark.slow
def test_ddp_two_ranks_streams_precomputed_latents(tmp_path, mds_latents):
    proc = composer(
        2,
        "benchmark.py",
        "--local",
        str(mds_latents),
        "--precomputed_latents",
        "--model_name",
        "sd-tiny",
        "--batch_size",
        "8",
        "--device_train_microbatch_size",
        "2",
        "--max_duration",
        "3ba",
        "--num_workers",
        "1",
        "--results",
        "r.jsonl",
        "--straggler_threshold",
        "0.5",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (rec,) = read_results(tmp_path / "r.jsonl")
    assert rec["world_size"] == 2 and not rec["fsdp"] and not rec["ema"] and rec["precomputed_latents"]
    assert rec["device_train_microbatch_size"] == 2 and rec["tflop_per_image"] == rec["tflop_per_image_denoiser"]
    # per-rank figures for both ranks. Whether a rank is named a straggler depends on the machine's load (two CPU
    # ranks on a busy shared 2-core VM once differed by 66% over three batches), so this test only checks that the
    # record and the warning agree; tests/test_stragglers.py slows one rank on purpose and checks it is named.
    assert rec["rank_split"] == "ddp_last_grad_bucket" and {r["rank"] for r in rec["slowest_ranks"]} == {0, 1}
    assert 0 < rec["rank_images_per_sec"]["min"] <= rec["rank_images_per_sec"]["max"]
    named = [f"rank {r['rank']} on " for r in rec["stragglers"]]
    assert all(n in proc.stderr for n in named) and bool(named) == ("straggler_threshold" in proc.stderr), proc.stderr


@pytest.mark.parametrize(
    "extra",
    [
        ["--use_synth_data", "--precomputed_latents", "--use_ema"],
        ["--use_synth_data", "--gradient_checkpointing", "--prediction_type", "v_prediction"],
    ],
)
def test_single_process_variants(tmp_path, extra):
    out = tmp_path / "r.jsonl"
    assert (
        benchmark.main(
            [
                "--model_name",
                "sd-tiny",
                "--batch_size",
                "4",
                "--max_duration",
                "3ba",
                "--num_workers",
                "0",
                "--results",
                str(out),
                *extra,
            ]
        )
        == 0
    )
    (rec,) = read_results(out)
    assert rec["world_size"] == 1 and rec["images_per_sec"] > 0


def test_channels_last_and_compile_apply_to_the_trainable_denoiser_unless_the_encoders_are_asked(tmp_path):
    from diffusion.config import TrainConfig
    from diffusion.models import build_model
    from diffusion.trainer import check_before_build, compile_model, configure_model

    model = build_model("sd-tiny").model
    cfg = TrainConfig(model_name="sd-tiny", channels_last=True, compile=True)
    configure_model(model, cfg)
    compile_model(model, cfg)
    conv = model.unet.conv_in.weight
    assert conv.is_contiguous(memory_format=torch.channels_last) and not conv.is_contiguous()
    assert model.vae.encoder.conv_in.weight.is_contiguous()  # frozen encoders stay as built
    assert model.unet._compiled_call_impl is not None and model.vae._compiled_call_impl is None
    encoders = build_model("sd-tiny").model  # compile_encoders: the frozen parts' submodules, the VAE channels-last
    cfg = TrainConfig(model_name="sd-tiny", channels_last=True, compile=True, compile_encoders=True)
    configure_model(encoders, cfg)
    compile_model(encoders, cfg)
    assert encoders.vae.encoder._compiled_call_impl is not None
    assert all(child._compiled_call_impl is not None for child in encoders.text_encoder.children())
    assert encoders.vae.encoder.conv_in.weight.is_contiguous(memory_format=torch.channels_last)
    for keys, says in (
        ({"compile_encoders": True}, "--compile_encoders shapes a compiled run: add --compile, or drop it"),
        ({"compile": True, "compile_encoders": True, "precomputed_latents": True}, "never calls its encoders"),
    ):
        with pytest.raises(UsageError, match=says):
            check_before_build(
                TrainConfig(model_name="sd-tiny", use_synth_data=True, **keys), world_size=1, on_gpu=False
            )
    import torch._dynamo.config as dynamo  # a graph per bucket shape, none falling back to eager

    assert getattr(dynamo, "recompile_limit", getattr(dynamo, "cache_size_limit", 0)) >= 15
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in build_model("sd-tiny").model.named_parameters()]
    out = tmp_path / "r.jsonl"  # and a run with it trains and says so in its results line
    assert (
        benchmark.main(
            [
                "--model_name",
                "sd-tiny",
                "--batch_size",
                "4",
                "--max_duration",
                "3ba",
                "--use_synth_data",
                "--num_workers",
                "0",
                "--channels_last",
                "--results",
                str(out),
            ]
        )
        == 0
    )
    (rec,) = read_results(out)
    assert rec["channels_last"] and not rec["compile"] and rec["images_per_sec"] > 0


def test_cudnn_benchmark_is_off_unless_asked_and_the_results_line_says_which(tmp_path, monkeypatch):
    from diffusion.config import TrainConfig
    from diffusion.models import build_model
    from diffusion.trainer import configure_model

    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)  # restored after the test: the switch is global
    configure_model(build_model("sd-tiny").model, TrainConfig(model_name="sd-tiny"))
    assert torch.backends.cudnn.benchmark is False  # the default, as before the setting: torch's own
    out = tmp_path / "r.jsonl"
    args = ["--model_name", "sd-tiny", "--batch_size", "2", "--max_duration", "1ba", "--use_synth_data"]
    assert benchmark.main([*args, "--num_workers", "0", "--cudnn_benchmark", "--results", str(out)]) == 0
    assert torch.backends.cudnn.benchmark is True
    (rec,) = read_results(out)
    assert rec["cudnn_benchmark"] is True


def test_streams_image_caption_shards(tmp_path, mds_images):
    out = tmp_path / "r.jsonl"
    assert (
        benchmark.main(
            [
                "--model_name",
                "sd-tiny",
                "--local",
                str(mds_images),
                "--batch_size",
                "4",
                "--max_duration",
                "3ba",
                "--num_workers",
                "0",
                "--results",
                str(out),
            ]
        )
        == 0
    )
    (rec,) = read_results(out)
    assert not rec["synthetic"] and rec["resolution"] == 64 and rec["tflop_per_image"] > rec["tflop_per_image_denoiser"]


BAD = [
    (["--model_name", "sd-huge"], "--model_name: 'sd-huge' is neither a preset"),
    (["--model_name", "./no/such/dir"], "--model_name: directory './no/such/dir' does not exist"),
    (["--model_name", "sd-tiny", "--image_size", "60"], "--image_size 60 must be a positive multiple of 16"),
    (
        ["--model_name", "sd-tiny", "--batch_size", "8", "--device_train_microbatch_size", "16"],
        "--device_train_microbatch_size 16 is larger than the per-rank batch 8",
    ),
    (["--model_name", "sd-tiny", "--batch_size", "8", "--fsdp"], "--fsdp needs at least 2 ranks"),
    (["--model_name", "sd-tiny", "--batch_size", "8", "--local", "/no/such/mds"], "--local: no MDS dataset at"),
    (
        ["--model_name", "sd-tiny", "--batch_size", "8", "--use_synth_data", "--device_train_microbatch_size", "auto"],
        "auto needs a GPU",
    ),
    (
        ["--model_name", "sd-tiny", "--batch_size", "8", "--use_synth_data", "--precision", "amp_bf16"],
        "--precision amp_bf16 needs a GPU",
    ),
    (
        ["--model_name", "sd-tiny", "--batch_size", "8", "--use_synth_data", "--attention", "xformers"],
        "--attention xformers",
    ),
    (
        ["--model_name", "sd-tiny", "--batch_size", "8", "--use_synth_data", "--tokenizer", "/no/tok"],
        "--tokenizer: directory '/no/tok' does not exist",
    ),
    (
        ["--model_name", "sd-tiny", "--batch_size", "8", "--use_synth_data", "--straggler_threshold", "1.5"],
        "--straggler_threshold 1.5 must be in (0, 1)",
    ),
]


@pytest.mark.parametrize("argv,message", BAD, ids=[m.split()[0] + str(i) for i, (_, m) in enumerate(BAD)])
def test_bad_input_is_one_line_naming_the_flag(argv, message, capsys):
    assert benchmark.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("benchmark.py: error: ") and message in err[0], err


def test_bad_input_exits_nonzero_without_traceback(tmp_path):
    proc = run([sys.executable, str(REPO / "benchmark.py"), "--model_name", "sd-huge"], cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("benchmark.py: error: --model_name")


def test_wandb_logs_offline_only_when_asked(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert (
        benchmark.main(
            [
                "--model_name",
                "sd-tiny",
                "--use_synth_data",
                "--batch_size",
                "4",
                "--max_duration",
                "3ba",
                "--num_workers",
                "0",
                "--wandb_project",
                "p",
                "--wandb_name",
                "tiny",
            ]
        )
        == 0
    )
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb"))


def test_the_docs_document_every_flag(capsys):
    """docs/benchmark.md's flag table and docs/settings.md (which that section links for the rest) are the
    user's reference: every benchmark.py flag has a row."""
    import re

    with pytest.raises(SystemExit):
        benchmark.parse_args(["--help"])
    flags = set(re.findall(r"(--[a-z_0-9]+)", capsys.readouterr().out)) - {"--help"}
    table = (REPO / "docs/benchmark.md").read_text().split("## benchmark.py flags", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"`(--[a-z_0-9]+)`", table + (REPO / "docs/settings.md").read_text()))
    assert "(settings.md)" in table
    assert len(flags) > 30 and not flags - documented, sorted(flags - documented)


def test_sdpa_kernels_set_torchs_switches_and_flux_leaves_out_cudnn(tmp_path):
    """sdpa_kernels (else the family's SDPA_KERNELS) decides which attention kernels PyTorch may pick: FLUX
    trains without cuDNN's (its backward gave NaN gradients and an illegal memory access on an H100), the UNets
    with all; the results line says which."""
    from diffusion.config import TrainConfig
    from diffusion.models import build_model
    from diffusion.trainer import configure_model

    switches = ("flash_sdp_enabled", "mem_efficient_sdp_enabled", "cudnn_sdp_enabled", "math_sdp_enabled")
    before = [getattr(torch.backends.cuda, s)() for s in switches]
    try:
        configure_model(build_model("flux-tiny").model, TrainConfig(model_name="flux-tiny"))
        assert [getattr(torch.backends.cuda, s)() for s in switches] == [True, True, False, True]
        configure_model(build_model("sd-tiny").model, TrainConfig(model_name="sd-tiny", sdpa_kernels="math"))
        assert [getattr(torch.backends.cuda, s)() for s in switches] == [False, False, False, True]
    finally:
        for s, on in zip(switches, before):
            getattr(torch.backends.cuda, "enable_" + s.replace("_enabled", ""))(on)
    out = tmp_path / "r.jsonl"
    args = ["--batch_size", "2", "--max_duration", "1ba", "--use_synth_data", "--num_workers", "0", "--results"]
    assert benchmark.main(["--model_name", "flux-tiny", *args, str(out)]) == 0
    assert benchmark.main(["--model_name", "sd-tiny", *args, str(out), "--sdpa_kernels", "flash,math"]) == 0
    assert [r["sdpa_kernels"] for r in read_results(out)] == ["flash,efficient,math", "flash,math"]


def test_compile_blocks_compiles_each_block_of_the_familys_stacks_and_is_refused_without_them():
    from diffusion.config import TrainConfig
    from diffusion.models import build_model
    from diffusion.trainer import check_before_build, compile_model

    model = build_model("flux-tiny").model
    compile_model(model, TrainConfig(model_name="flux-tiny", compile=True, compile_blocks=True))
    blocks = [*model.transformer.transformer_blocks, *model.transformer.single_transformer_blocks]
    assert blocks and all(b._compiled_call_impl is not None for b in blocks)
    assert model.transformer._compiled_call_impl is None  # the blocks, not the whole transformer
    sd3 = build_model("sd3-tiny").model  # a family whose blocks token routing cannot hook: compiled by its BLOCKS
    compile_model(sd3, TrainConfig(model_name="sd3-tiny", compile=True, compile_blocks=True))
    assert all(b._compiled_call_impl is not None for b in sd3.transformer.transformer_blocks)
    for name in ("sd3-tiny", "flux2-tiny"):
        check_before_build(
            TrainConfig(model_name=name, compile=True, compile_blocks=True, use_synth_data=True),
            world_size=1,
            on_gpu=False,
        )
    for cfg, says in (
        (TrainConfig(model_name="flux-tiny", compile_blocks=True, use_synth_data=True), "add --compile"),
        (TrainConfig(model_name="flux-tiny", compile_cache="c", use_synth_data=True), "add --compile"),
        (TrainConfig(model_name="sd-tiny", compile=True, compile_blocks=True, use_synth_data=True), "no block stacks"),
    ):
        with pytest.raises(UsageError, match=says):
            check_before_build(cfg, world_size=1, on_gpu=False)


CACHE_ROUND = """
import sys, torch
from torch._dynamo.utils import counters
from diffusion.callbacks import compile_cache
folder = sys.argv[1]
print(compile_cache.load(folder))
class Block(torch.nn.Module):  # dynamo leaves torch.nn's own modules, called at the top, to eager
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.linear(x).relu()

block = Block()
block.compile(dynamic=False)
block(torch.ones(2, 4)).sum().backward()  # a training step's graphs: forward and backward
print("hits", counters["inductor"]["fxgraph_cache_hit"])
compile_cache.CompileCache(folder).fit_end(None, None)
"""


def test_a_compile_cache_written_by_one_run_is_read_by_the_next(tmp_path):
    """compile_cache: the first process compiles and writes this torch and device's file; the next, with empty
    local caches of its own, reads it and finds its graph there instead of compiling it."""
    runs = []
    for i in range(2):
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / f"inductor{i}"), "PYTHONPATH": str(REPO)}
        done = subprocess.run(
            [sys.executable, "-c", CACHE_ROUND, str(tmp_path / "cache")], env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr[-2000:]
        runs.append(done.stdout)
    assert "none for this torch and device" in runs[0] and "hits 0" in runs[0] and "written to" in runs[0]
    assert "compiled graphs read from" in runs[1] and "hits 2" in runs[1], runs[1]
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [f"torch-{torch.__version__}-cpu.bin"]
