import pytest

from diffusion.bench import fit, measured, perf, step_memory
from diffusion.cli import run

CARDS = {"H100-80GB": 79.6, "H200": 139.0}


@pytest.fixture(scope="module")
def counted():
    return {}


def _count(counted: dict, target: str) -> step_memory.Count:
    if target not in counted:
        counted[target] = step_memory.count(perf.config(target))
    return counted[target]


def test_the_count_agrees_with_every_peak_a_lent_gpu_measured(counted):
    """The count on the meta device against CUDA's max_allocated of every eager run in docs/measured/: within 2%
    (SD2-base at 256 and 512 px, precomputed and online, on an H100 and an H200; flux-mid at 256 px), and every run
    that ran out of memory predicted over the card."""
    checked = set()
    for rec in measured.read(measured.MEASURED):
        name, mb = rec.get("perf_target"), rec.get("device_train_microbatch_size")
        if name not in perf.TARGETS or rec.get("compile") or rec["status"] not in ("ok", "oom"):
            continue
        predicted = _count(counted, name).peak_gib(mb)
        if rec["status"] == "ok":
            assert abs(predicted / rec["peak_memory_gib"] - 1) <= 0.02, (name, mb, predicted, rec["peak_memory_gib"])
        else:
            assert predicted > CARDS[measured.kind(rec)], (name, mb, predicted)
        checked.add((name, rec["status"]))
    assert {name for name, _ in checked} == {"sd2-512-latents", "sd2-256-latents", "sd2-512-online", "flux-mid-256"}
    assert ("sd2-512-latents", "oom") in checked and ("sd2-256-latents", "oom") in checked


def test_the_targets_no_gpu_ran_are_sized_by_their_count(counted):
    """fit.MEMORY's counted lines are the count of each target's own settings (LoRA on a bf16 base: the trained
    state is the adapters'; SD3.5 Medium's full fine-tune: 20 bytes a parameter), so .ci/gpu's --microbatch fit
    sizes the new families' first runs from them."""
    targets = [t for t, m in fit.MEMORY.items() if m.source.startswith("counted")]
    assert set(targets) == set(perf.FAMILIES)
    for target in targets:
        c, m = _count(counted, target), fit.MEMORY[target]
        assert abs(c.state_gib + c.step_gib - m.fixed) < 0.1 and abs(c.per_image_gib - m.per_image) < 0.01, target
    assert 2.2e9 * 20 / 2**30 < _count(counted, "sd35-medium-512").state_gib - 9  # its trained 2.24B, then encoders
    assert [fit.microbatch(t, 79.6) for t in perf.FAMILIES] == [8, 2, 4, 1]
    assert [fit.microbatch(t, 139.0) for t in perf.FAMILIES] == [16, 16, 8, 4]


def test_checkpointing_keeps_the_block_inputs_and_gives_the_model_back_as_it_was():
    cfg = step_memory.config(["--model_name", "sd-tiny", "--image_size", "64", "--use_ema"])
    eager = step_memory.count(cfg)
    cfg.gradient_checkpointing = True
    checkpointed = step_memory.count(cfg)
    assert 0 < checkpointed.per_image_gib < eager.per_image_gib / 2 and checkpointed.state_gib == eager.state_gib


def test_the_command_prints_the_fit_on_each_card(capsys):
    argv = ["--model_name", "sd-tiny", "--image_size", "64", "--device_train_microbatch_size", "4"]
    assert step_memory.main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("sd-tiny at 64 px: ") and "H100 80 GB: microbatch " in out and "; microbatch 4: " in out
    assert step_memory.main([*argv, "--memory_gib", "0.0001"]) == 0
    assert "not microbatch 1 fits under 90% of 0.0 GiB" in capsys.readouterr().out
    assert run("diffusion.bench.step_memory", step_memory.main, ["--model_name", "sd-tinny"]) == 2
    assert "sd-tinny" in capsys.readouterr().err
    # checked as a run is, before anything is built: one line
    assert run("diffusion.bench.step_memory", step_memory.main, [*argv, "--routing_share", "0.5"]) == 2
    err = capsys.readouterr().err
    assert "error: --routing_share: token routing needs block stacks" in err and len(err.splitlines()) == 1


def test_a_technique_installed_on_the_model_is_counted():
    """Token routing carries half the tokens around flux-small's middle blocks: fewer saved per image."""
    flags = ["--model_name", "flux-small", "--image_size", "64", "--precomputed_latents"]
    whole = step_memory.count(step_memory.config(flags))
    routed = step_memory.count(step_memory.config([*flags, "--routing_share", "0.5"]))
    assert routed.state_gib == whole.state_gib and 0 < routed.per_image_gib < 0.95 * whole.per_image_gib


def test_fsdp_shards_what_trains_over_the_gpus_and_keeps_the_frozen_parts_whole():
    import torch

    from diffusion.models import build_model

    flags = ["--model_name", "flux-small", "--image_size", "64", "--use_ema"]
    whole = step_memory.count(step_memory.config(flags))
    two, four = (step_memory.count(step_memory.config([*flags, "--fsdp"]), gpus) for gpus in (2, 4))
    with torch.device("meta"):
        transformer = build_model("flux-small", init_device="meta").model.transformer
    trained = step_memory._state_bytes(transformer.parameters(), True) + sum(b.nbytes for b in transformer.buffers())
    assert two.state_gib - four.state_gib == pytest.approx(trained / 4 / step_memory.GIB, rel=1e-6)
    assert whole.state_gib > two.state_gib > four.state_gib and two.per_image_gib == whole.per_image_gib
