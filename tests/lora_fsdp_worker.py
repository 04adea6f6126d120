"""Run under `composer -n 2 tests/lora_fsdp_worker.py CHECKPOINT_DIR`: flux-tiny with LoRA adapters on its transformer
and its CLIP text encoder (lora_text_encoder), fsdp=true: the frozen base is sharded with the adapters (the CLIP
encoder too, which then trains) (a LoRA of a model too large for one device trains on several), the
sharded checkpoint folder holds the adapters and no base weight, and a run saved after 1 batch and resumed by a new
trainer to 2 ends bitwise where an uninterrupted 2-batch run ends. Exit code 0 and "LORA-FSDP-OK" on rank 0 mean it
held."""

import sys
from pathlib import Path

from fsdp_resume import worker
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.tensor import DTensor


def check_sharded(trainer) -> None:
    params = dict(trainer.state.model.named_parameters())
    for part in ("transformer.", "text_encoder."):
        frozen = [n for n, p in params.items() if not p.requires_grad and n.startswith(part)]
        assert frozen and all(isinstance(params[n], DTensor) for n in frozen), frozen[:3]
        adapters = [n for n, p in params.items() if p.requires_grad and n.startswith(part)]
        assert adapters and all(".lora_A." in n or ".lora_B." in n for n in adapters), adapters[:3]
    assert all(".lora_A." in n or ".lora_B." in n for n, p in params.items() if p.requires_grad)
    saved = sorted(Path(sys.argv[1], "resumed").glob("*/.metadata"))  # the resumed run's sharded folders
    keys = FileSystemReader(str(saved[-1].parent)).read_metadata().state_dict_metadata
    model_keys = [k for k in keys if k.startswith("state.model.")]
    assert model_keys and all("lora_" in k for k in model_keys), [k for k in model_keys if "lora_" not in k][:3]


def settings(argv):
    return {"model_name": "flux-tiny", "lora_rank": 4, "lora_text_encoder": True}


if __name__ == "__main__":
    sys.exit(worker("lora_fsdp_worker.py", "LORA-FSDP-OK", settings, inspect=check_sharded))
