"""A caption's token ids, padded and cut to a fixed length, as the loader asks for them once per sample.

``tokenizer(caption, padding="max_length", truncation=True, max_length=n, return_tensors="pt")`` is what the
models were trained with, and what this returns; per call it cost 226 us on the 2-core VM (transformers' argument
handling and BatchEncoding's tensor conversion around 40 us of Rust), 3.6 ms of a 16-image sd-tiny batch, ~3% of
its step (docs/performance.md, 2026-11-28). A fast tokenizer's own Rust tokenizer, set once to the same
padding and truncation, gives the same ids in 42 us: ``CaptionIds`` uses it, after checking that it agrees with
the full call on a probe caption (a tokenizer whose post-processing differs, or a slow one, keeps the full call).
"""

from __future__ import annotations

import copy

import torch

PROBE = "a probe caption, long enough to be cut: " + "words " * 600


class CaptionIds:
    """``ids(caption)``: (length,) int64 token ids of ``caption`` under ``tokenizer``, padded/truncated to
    ``length``."""

    def __init__(self, tokenizer, length: int):
        self.tokenizer, self.length = tokenizer, length
        self.fast = self._fast_path()

    def full(self, caption: str) -> torch.Tensor:
        return self.tokenizer(
            caption, padding="max_length", truncation=True, max_length=self.length, return_tensors="pt"
        ).input_ids[0]

    def _fast_path(self):
        backend = (
            getattr(self.tokenizer, "backend_tokenizer", None) if getattr(self.tokenizer, "is_fast", False) else None
        )
        if backend is None or self.tokenizer.pad_token is None:
            return None
        fast = copy.deepcopy(backend)  # the tokenizer's own stays as it was
        fast.enable_truncation(self.length)
        fast.enable_padding(
            length=self.length,
            pad_id=self.tokenizer.pad_token_id,
            pad_token=self.tokenizer.pad_token,
            direction=self.tokenizer.padding_side,
        )
        for probe in (PROBE, "", "a"):
            if fast.encode(probe).ids != self.full(probe).tolist():
                return None
        return fast

    def __call__(self, caption: str) -> torch.Tensor:
        if self.fast is None:
            return self.full(caption)
        return torch.tensor(self.fast.encode(caption).ids, dtype=torch.long)

    def __getstate__(self):  # loader workers (spawn) get the tokenizer and build their own fast path
        return {"tokenizer": self.tokenizer, "length": self.length}

    def __setstate__(self, state):
        self.__init__(state["tokenizer"], state["length"])
