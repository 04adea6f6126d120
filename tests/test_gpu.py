"""What only CUDA exercises (marked `gpu`, skipped in one line without a CUDA device): autocast in bf16 and fp16
through each family, the CUDA-event timing and peak-memory figures of the results line, fused AdamW, fused
SDPA kernels in the denoisers, torch.compile with the memory-layout and precision knobs, precomputed latents,
and a train -> checkpoint -> resume -> generate round trip. On the lent GPU machine: `bash .ci/gpu` (which
runs `python -m pytest -q tests -m gpu` among the rest)."""

import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import FAST, REPO, composer, read_results, run, synthetic_batch

pytestmark = pytest.mark.gpu


def _benchmark(tmp_path: Path, model: str, *flags: str, batches: int = 12) -> dict:
    results = tmp_path / f"{model}.jsonl"
    t0 = time.time()
    proc = composer(
        1, "benchmark.py", "--use_synth_data", "--model_name", model, "--use_ema", "--batch_size", "8",
        "--num_workers", "0", "--max_duration", f"{batches}ba", "--results", str(results), *flags, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (record,) = read_results(results)
    record["wall_s"] = time.time() - t0
    return record


@pytest.mark.parametrize("precision", ["amp_bf16", "amp_fp16"])
@pytest.mark.parametrize("model", ["sd-tiny", "sdxl-tiny", "flux-tiny"])
def test_each_family_trains_under_autocast_with_cuda_figures(tmp_path, model, precision):
    record = _benchmark(tmp_path, model, "--precision", precision)
    assert record["device"] == "gpu" and record["gpu_name"] and record["precision"] == precision
    assert record["peak_memory_kind"] == "cuda_max_allocated" and record["peak_memory_gib"] > 0
    assert record["images_per_sec"] > 0 and record["mfu"] is not None and 0 < record["mfu"] < 1
    # CUDA-event timing: the measured span is inside the process's wall time
    assert 0 < record["measured_seconds"] < record["wall_s"]


@pytest.mark.parametrize("model", ["sd-tiny", "sdxl-tiny", "flux-tiny"])
def test_compile_channels_last_bf16_encoders_and_checkpointing(tmp_path, model):
    flags = ["--compile", "--encoder_dtype", "bf16", "--gradient_checkpointing", "--measure_skip_batches", "6"]
    flags.append("--compile_encoders")  # an online run: the frozen VAE and text encoders compiled too
    if model != "flux-tiny":  # the UNets
        flags.append("--channels_last")
    record = _benchmark(tmp_path, model, *flags, batches=16)
    assert record["compile"] and record["gradient_checkpointing"] and record["images_per_sec"] > 0


@pytest.mark.parametrize("model", ["sd-tiny", "flux-tiny"])
def test_compile_with_repa_and_routing(tmp_path, model):
    """REPA's hook and projector (and FLUX's token routing: a fixed share keeps shapes static) under torch.compile,
    which the CPU suite leaves out (Inductor's CPU build of flux-tiny ran past 8 minutes on the 2-core VM)."""
    from conftest import tiny_clip_vision

    flags = ["--compile", "--repa_encoder", str(tiny_clip_vision(tmp_path / "vision")), "--measure_skip_batches", "6"]
    if model == "flux-tiny":
        flags += ["--routing_share", "0.5"]
    record = _benchmark(tmp_path, model, *flags, batches=16)
    assert record["compile"] and record["repa"] and record["images_per_sec"] > 0
    assert (record["routing"] is not None) == (model == "flux-tiny")


@pytest.mark.parametrize("model", ["sd-tiny", "flux-tiny"])
def test_lora_compiles_with_a_bf16_base_and_text_encoder_adapters(tmp_path, model):
    """PEFT's adapters (on the denoiser and the CLIP encoder) over a bf16 base under torch.compile and autocast:
    issue 36's "compile where PEFT allows it", which the CPU suite leaves out; the results line says what trained."""
    flags = ["--compile", "--lora_rank", "4", "--lora_text_encoder", "--lora_base_dtype", "bf16"]
    record = _benchmark(tmp_path, model, *flags, "--measure_skip_batches", "6", batches=16)
    assert record["compile"] and record["images_per_sec"] > 0
    assert record["lora"]["text_encoders"] == ["text_encoder"] and 0 < record["lora"]["trainable_share"] < 0.2


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_trains_the_block_linears(tmp_path, recipe):
    """torchao's float8 matmuls on the card (compute capability 8.9 or newer: the H100, H200), eager and compiled:
    what the CPU suite cannot run (tests/test_fp8.py checks the conversion there)."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip(f"{torch.cuda.get_device_name()} has no FP8 tensor cores")
    for flags in ([], ["--compile", "--measure_skip_batches", "6"]):
        record = _benchmark(tmp_path, "flux-tiny", "--fp8", recipe, *flags, batches=16)
        assert record["fp8"]["recipe"] == recipe and record["fp8"]["layers"] > 0 and record["images_per_sec"] > 0


def test_precomputed_latents_on_cuda(tmp_path):
    record = _benchmark(tmp_path, "sd-tiny", "--precomputed_latents")
    assert record["precomputed_latents"] and record["images_per_sec"] > 0


def test_text_encoders_on_cpu_train_and_sample_on_cuda(tmp_path):
    """A precomputed run keeps its text encoders in host memory (text_encoders_on_cpu), on one rank and on two under
    DDP (which must not broadcast them over NCCL), and samples with them brought over."""
    run = [str(REPO / "yamls/flux-tiny-cpu.yaml"), "use_synth_data=true", "precomputed_latents=true"]
    run += ["text_encoders_on_cpu=true", "batch_size=4", "max_duration=2ba", "eval_interval=null", "autoresume=false"]
    run += ["save_interval=2ba", "sample_interval=2ba", "sample_prompts=[a red cube]", "sample_steps=2"]
    for ranks in (1, 2) if torch.cuda.device_count() > 1 else (1,):
        out = tmp_path / str(ranks)
        proc = composer(
            ranks, "train.py", *run, f"save_folder={out / 'ck'}", f"sample_folder={out / 's'}", cwd=tmp_path
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert (out / "s" / "ba2" / "00000-a-red-cube.png").is_file()


def test_fused_adamw_steps_on_cuda():
    from diffusion.config import TrainConfig
    from diffusion.trainer import optimizer_and_schedule

    layer = torch.nn.Linear(64, 64).cuda()
    optimizer, _ = optimizer_and_schedule(TrainConfig(lr=1e-3), layer, on_gpu=True)
    assert optimizer.defaults["fused"] is True
    before = layer.weight.detach().clone()
    layer(torch.randn(8, 64, device="cuda")).square().mean().backward()
    optimizer.step()
    assert not torch.equal(before, layer.weight)


@pytest.mark.parametrize("model", ["sd-tiny", "sdxl-tiny", "flux-tiny"])
def test_denoiser_attention_runs_on_fused_sdpa_kernels(model):
    """With the math kernel ruled out, a bf16 training step of the denoiser still runs, with finite gradients: its
    attention shapes are ones flash / memory-efficient SDPA take (otherwise every step would fall back to the slow
    path). Precomputed batches: the frozen text encoders' masked attention is not the denoiser's and may need
    the math kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from diffusion.models.build import build_model

    net = build_model(model).model.cuda()
    batch = synthetic_batch(model, net, precomputed=True)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        with torch.autocast("cuda", torch.bfloat16):
            loss = net.loss(net(batch), batch)
        loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in net.parameters() if p.grad is not None)


def test_train_checkpoint_resume_and_generate_on_cuda(tmp_path):
    folder = tmp_path / "ck"
    args = [str(REPO / "yamls" / "sd-tiny-cpu.yaml"), *FAST, "save_interval=10ba", f"save_folder={folder}"]
    first = composer(1, "train.py", *args, "max_duration=10ba", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    again = composer(1, "train.py", *args, "max_duration=20ba", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert (folder / "ep0-ba20-rank0.pt").exists()
    out = tmp_path / "samples"
    gen = run(
        [sys.executable, str(REPO / "generate.py"), str(folder / "latest-rank0.pt"), "--prompt", "a red square",
         "--steps", "4", "--out", str(out)],
        cwd=tmp_path,
    )  # fmt: skip
    assert gen.returncode == 0, gen.stderr[-3000:]
    assert list(out.glob("*.png"))
