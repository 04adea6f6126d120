"""optimizer=muon (diffusion/techniques/muon/optimizer.py): the step is torch.optim.Muon's where torch has one, the update's RMS matches
AdamW's, the families' hidden matrices are split from their input/output layers, and runs train and resume
bitwise on one rank and under FSDP2 (the sharded matrix orthogonalised whole; under DDP every rank steps on the
same all-reduced gradients, the one-rank step)."""

import sys

import pytest
import torch
from conftest import FAST, REPO, composer, final_state, run

from diffusion.techniques.muon.optimizer import MuonWithAdamW, orthogonalise, split_for_muon


def _params(*shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in shapes]


def _steps(params, opt, n=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="this torch has no torch.optim.Muon (torch < 2.9)")
def test_muon_steps_as_torchs_muon_matched_to_adamw():
    ours, theirs = _params((32, 48), (64, 16)), _params((32, 48), (64, 16))
    _steps(ours, MuonWithAdamW(ours, [], lr=0.01, weight_decay=0.1, betas=(0.9, 0.999), momentum=0.9))
    ref = torch.optim.Muon(theirs, lr=0.01, weight_decay=0.1, momentum=0.9, adjust_lr_fn="match_rms_adamw")
    _steps(theirs, ref)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b)


def test_the_rest_steps_as_torchs_adamw():
    ours, theirs = _params((7,), (3, 5)), _params((7,), (3, 5))
    _steps(ours, MuonWithAdamW([], ours, lr=0.01, weight_decay=0.1, betas=(0.8, 0.95)))
    _steps(theirs, torch.optim.AdamW(theirs, lr=0.01, weight_decay=0.1, betas=(0.8, 0.95), foreach=False))
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b)


def test_update_is_near_orthogonal_with_adamw_like_rms():
    (w,) = _params((96, 40))
    o = orthogonalise(w.detach()).float()
    s = torch.linalg.svdvals(o)
    assert 0.5 < s.min() and s.max() < 1.5, s  # Newton-Schulz's quintic: singular values near 1, not exactly
    (p,) = _params((96, 40))
    before = p.detach().clone()
    p.grad = torch.randn(96, 40)
    MuonWithAdamW([p], [], lr=1.0, weight_decay=0.0, betas=(0.9, 0.999), momentum=0.0).step()
    rms = (p.detach() - before).square().mean().sqrt().item()
    assert 0.14 < rms < 0.26, rms  # AdamW's update RMS is about 0.2 lr (Moonlight); an unscaled one would be 0.1


@pytest.mark.parametrize(
    "name, kept_with_adamw",
    [
        ("sd-tiny", {"unet.conv_in.weight", "unet.conv_out.weight", "unet.time_embedding.linear_1.weight"}),
        ("sdxl-tiny", {"unet.conv_in.weight", "unet.add_embedding.linear_1.weight"}),
        ("flux-tiny", {"transformer.x_embedder.weight", "transformer.context_embedder.weight", "transformer.proj_out.weight"}),
    ],
)  # fmt: skip
def test_hidden_matrices_go_to_muon_the_rest_to_adamw(name, kept_with_adamw):
    from diffusion.models import build_model

    model = build_model(name).model
    matrices, others = split_for_muon(model)
    names = {id(p): n for n, p in model.named_parameters()}
    muon, adamw = {names[id(p)] for p in matrices}, {names[id(p)] for p in others}
    assert kept_with_adamw <= adamw and not kept_with_adamw & muon
    assert all(p.ndim >= 2 for p in matrices) and all(p.requires_grad for p in matrices + others)
    assert any("attn" in n and n.endswith("to_q.weight") for n in muon)
    assert not any(n.endswith(".bias") or "norm" in n.split(".")[-2] for n in muon)
    assert len(matrices) + len(others) == sum(p.requires_grad for p in model.parameters())


def test_one_rank_trains_and_resumes_bitwise(tmp_path, monkeypatch):
    import train

    monkeypatch.chdir(tmp_path)
    args = [str(REPO / "yamls" / "sd-tiny-cpu.yaml"), *FAST, "optimizer=muon", "save_interval=2ba", "lr=1e-3"]
    assert train.main([*args, f"save_folder={tmp_path / 'a'}", "max_duration=4ba"]) == 0
    assert train.main([*args, f"save_folder={tmp_path / 'b'}", "max_duration=2ba"]) == 0
    assert train.main([*args, f"save_folder={tmp_path / 'b'}", "max_duration=4ba", "autoresume=true"]) == 0
    a, b = final_state(tmp_path / "a"), final_state(tmp_path / "b")
    assert a["batch"] == b["batch"] == 4
    assert all(torch.equal(a["model"][n], b["model"][n]) for n in a["model"])


def test_a_family_without_named_matrices_refuses_muon_in_one_line(tmp_path):
    proc = run(
        [sys.executable, str(REPO / "benchmark.py"), "--use_synth_data", "--model_name", "vae-tiny", "--optimizer",
         "muon", "--max_duration", "1ba", "--num_workers", "0"], cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "muon: an autoencoder has no hidden weight matrices" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_fsdp2_orthogonalises_whole_matrices_and_resumes_bitwise(tmp_path):
    proc = composer(2, "tests/muon_fsdp_worker.py", str(tmp_path / "ck"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "MUON-FSDP-OK" in proc.stdout + proc.stderr
