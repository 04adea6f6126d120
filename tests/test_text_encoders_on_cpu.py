"""text_encoders_on_cpu (issue 52): a precomputed run keeps its frozen text encoders in host memory when the model
moves (the GPU saving is the lent GPU's to measure: docs/performance.md); sampling during the run brings them over
and back; the model's parameter order and state dict are as without it; a run on images is refused in one line."""

import torch
from conftest import REPO, read_results

import benchmark
import train
from diffusion.models import build_model
from diffusion.trainer import hold_text_encoders


def test_the_text_encoders_stay_where_they_are_when_the_model_moves():
    torch.manual_seed(0)
    model = build_model("flux-tiny").model
    keys, names = list(model.state_dict()), [n for n, _ in model.named_parameters()]
    hold_text_encoders(model)
    assert model.held == ("text_encoder", "text_encoder_2")
    model.to("meta")
    assert next(model.transformer.parameters()).is_meta and next(model.vae.parameters()).is_meta
    for name in model.held:
        assert all(p.device.type == "cpu" for p in getattr(model, name).parameters())
    assert list(model.state_dict()) == keys and [n for n, _ in model.named_parameters()] == names
    ignored = set(model._ddp_params_and_buffers_to_ignore)  # DDP's start-up broadcast leaves them out
    assert ignored == {k for k in keys if k.startswith(("text_encoder.", "text_encoder_2."))}


def test_a_precomputed_run_trains_and_samples_with_them_held(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = ["--use_synth_data", "--model_name", "flux-tiny", "--precomputed_latents", "--batch_size", "4"]
    argv += ["--num_workers", "0", "--max_duration", "2ba", "--results", "r.jsonl", "--text_encoders_on_cpu"]
    assert benchmark.main(argv) == 0
    (record,) = read_results(tmp_path / "r.jsonl")
    assert record["text_encoders_on_cpu"] and record["precomputed_latents"]
    run = [
        str(REPO / "yamls/flux-tiny-cpu.yaml"),
        "use_synth_data=true",
        "precomputed_latents=true",
        "text_encoders_on_cpu=true",
    ]
    run += ["batch_size=4", "max_duration=2ba", "eval_interval=null", "autoresume=false", "save_interval=2ba"]
    run += [f"save_folder={tmp_path / 'ck'}", "sample_interval=2ba", "sample_prompts=[a red cube]", "sample_steps=2"]
    assert train.main([*run, f"sample_folder={tmp_path / 'samples'}"]) == 0
    assert (tmp_path / "samples" / "ba2" / "00000-a-red-cube.png").is_file()


def test_a_run_on_images_is_refused_in_one_line(capsys):
    argv = ["--use_synth_data", "--model_name", "flux-tiny", "--batch_size", "4", "--text_encoders_on_cpu"]
    assert benchmark.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "--text_encoders_on_cpu: a run on images encodes every caption" in err and len(err.splitlines()) == 1
