"""A model family is one file plus its registry entry (issue 65): a copy of this repository gets tests/data/toy_family.py
as diffusion/models/auraflow.py (AuraFlow's transformer on the rectified-flow objective, sampled by diffusers'
AuraFlowPipeline) and two lines in build.py (its import and its FAMILIES entry), nothing else; then, from a pipeline
folder of that family with random weights, benchmark.py trains it and writes its results line, a 2-rank FSDP2 run
saved after one batch resumes bitwise, export.py writes the whole model from the sharded checkpoint, generate.py
samples the exported folder and the checkpoint, and a LoRA run's adapters, exported, load in diffusers'
AuraFlowPipeline and sample with generate.py --lora. A family whose denoiser or pipeline has no diffusers LoRA
support is refused lora_rank in one line (test_lora.py)."""

import difflib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import composer_launcher

REPO = Path(__file__).resolve().parents[1]
ENTRY_POINTS = ("benchmark.py", "train.py", "export.py", "generate.py")


def copy_with_the_family(root: Path) -> None:
    """The repository's code at ``root``, with the toy family added as a user adds one."""
    shutil.copytree(REPO / "diffusion", root / "diffusion", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ENTRY_POINTS:
        shutil.copy(REPO / name, root / name)
    (root / "tests").mkdir()
    shutil.copy(REPO / "tests" / "fsdp_resume.py", root / "tests" / "fsdp_resume.py")
    shutil.copy(REPO / "tests" / "data" / "toy_family.py", root / "diffusion" / "models" / "auraflow.py")
    build = root / "diffusion" / "models" / "build.py"
    text = build.read_text()
    text = text.replace(
        "from diffusion.models.presets", "from diffusion.models.auraflow import AuraFlow\nfrom diffusion.models.presets"
    )
    text = text.replace("        Flux2Dev,\n", "        Flux2Dev,\n        AuraFlow,\n")
    build.write_text(text)


def diff_stat(root: Path) -> dict[str, tuple[int, int]]:
    """Each file of diffusion/ that differs from this checkout's: (lines added, lines removed)."""
    changed = {}
    for path in sorted((root / "diffusion").rglob("*.py")):
        name = path.relative_to(root)
        old = (REPO / name).read_text().splitlines() if (REPO / name).exists() else []
        new = path.read_text().splitlines()
        if old != new:
            lines = list(difflib.unified_diff(old, new, lineterm="", n=0))[2:]
            changed[str(name)] = (sum(x.startswith("+") for x in lines), sum(x.startswith("-") for x in lines))
    return changed


def toy_pipeline(out: Path) -> None:
    """An AuraFlowPipeline folder with random weights: 1 MMDiT + 1 single-stream block of width 16, SD's tiny
    autoencoder, a UMT5 of FLUX's tiny T5's size and its offline tokenizer, flow-matching Euler."""
    from diffusers import AuraFlowPipeline, AuraFlowTransformer2DModel, AutoencoderKL, FlowMatchEulerDiscreteScheduler
    from transformers import UMT5Config, UMT5EncoderModel

    from diffusion.models.presets import PRESETS
    from diffusion.models.tokenizer import t5_tokenizer

    torch.manual_seed(0)
    t5 = PRESETS["flux-tiny"]["text_encoder_2"]
    transformer = AuraFlowTransformer2DModel(
        sample_size=4, patch_size=2, in_channels=4, out_channels=4, num_mmdit_layers=1, num_single_dit_layers=1,
        attention_head_dim=8, num_attention_heads=2, joint_attention_dim=t5["d_model"], caption_projection_dim=16,
        pos_embed_max_size=64,
    )  # fmt: skip
    AuraFlowPipeline(
        tokenizer=t5_tokenizer(32),
        text_encoder=UMT5EncoderModel(UMT5Config(**t5)),
        vae=AutoencoderKL(**PRESETS["sd-tiny"]["vae"]),
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(),
    ).save_pretrained(out)


FSDP_WORKER = '''"""Under composer -n 2: the toy family, fsdp=true, resumes bitwise (fsdp_resume.py)."""
import sys
from fsdp_resume import worker

if __name__ == "__main__":
    sys.exit(worker("toy_fsdp_worker.py", "TOY-FSDP-OK", lambda argv: {"model_name": argv[0]}))
'''


@pytest.mark.slow
def test_a_new_family_is_one_file_and_its_registry_entry(tmp_path):
    root = tmp_path / "repo"
    copy_with_the_family(root)
    assert diff_stat(root) == {"diffusion/models/auraflow.py": (len((REPO / "tests/data/toy_family.py").read_text().splitlines()), 0),
                               "diffusion/models/build.py": (2, 0)}  # fmt: skip
    (root / "tests" / "toy_fsdp_worker.py").write_text(FSDP_WORKER)
    toy_pipeline(tmp_path / "toy")
    env = dict(os.environ, PYTHONPATH=str(root), PYTHONUNBUFFERED="1")

    def run(*cmd: str, code: int = 0) -> str:
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == code, f"{cmd}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        return proc.stdout + proc.stderr

    toy, py = str(tmp_path / "toy"), sys.executable
    run(py, "benchmark.py", "--model_name", toy, "--use_synth_data", "--batch_size", "2", "--max_duration", "3ba",
        "--num_workers", "0", "--results", str(tmp_path / "r.jsonl"))  # fmt: skip
    (line,) = [json.loads(x) for x in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert line["family"] == "auraflow" and line["images_per_sec"] > 0 and line["tflop_per_image_denoiser"] > 0
    out = run(composer_launcher(), "-n", "2", "tests/toy_fsdp_worker.py", str(tmp_path / "ck"), toy)
    assert "TOY-FSDP-OK" in out
    (sharded,) = [m.parent for m in sorted((tmp_path / "ck" / "resumed").glob("*/.metadata"))][-1:]
    run(py, "export.py", str(sharded), str(tmp_path / "exported"))
    lora = tmp_path / "lora"
    run(py, "train.py", f"model_name={toy}", "use_synth_data=true", "lora_rank=4", "batch_size=2", "num_workers=0",
        "max_duration=2ba", "eval_interval=null", f"save_folder={tmp_path / 'L'}", "save_interval=2ba")  # fmt: skip
    run(py, "export.py", str(tmp_path / "L" / "latest-rank0.pt"), str(lora))
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(toy, local_files_only=True)
    pipe.load_lora_weights(lora, weight_name="pytorch_lora_weights.safetensors", adapter_name="toy")
    assert [n for n, _ in pipe.transformer.named_modules() if n.endswith("to_q.lora_A.toy")]
    run(py, "generate.py", toy, "--lora", str(lora), "--prompt", "a red square", "--steps", "2", "--image_size", "32",
        "--out", str(tmp_path / "samples" / "lora"))  # fmt: skip
    assert len(list((tmp_path / "samples" / "lora").glob("0000*.png"))) == 1
    for source in (tmp_path / "exported", sharded):
        run(py, "generate.py", str(source), "--prompt", "a red square", "--steps", "2", "--image_size", "32",
            "--out", str(tmp_path / "samples" / source.name))  # fmt: skip
        assert len(list((tmp_path / "samples" / source.name).glob("0000*.png"))) == 1
