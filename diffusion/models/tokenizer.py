"""Tokenizers that need no download.

Presets train from scratch, so any fixed tokenizer works; the byte-level one here maps each UTF-8 byte
to one id (0-255), adds ``<|startoftext|>`` (256) and ``<|endoftext|>`` (257, also the padding) and so
fits any text encoder with a vocabulary of at least 258. To train with CLIP's BPE instead, pass a local
tokenizer directory (``--tokenizer DIR``) or a local diffusers pipeline as the model.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

BOS, EOS = "<|startoftext|>", "<|endoftext|>"


def byte_tokenizer(max_length: int = 77) -> PreTrainedTokenizerFast:
    """A byte-level tokenizer, built in memory (no training, no files)."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins for the raw bytes
    byte_to_char = sorted(alphabet, key=lambda c: _BYTE_OF[c])
    vocab = {ch: i for i, ch in enumerate(byte_to_char)}
    vocab[BOS], vocab[EOS] = 256, 257
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A {EOS}", special_tokens=[(BOS, 256), (EOS, 257)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=EOS, model_max_length=max_length
    )


def _byte_of_char() -> dict[str, int]:
    # GPT-2's reversible byte -> unicode map, which ByteLevel uses.
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, n = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars)}


_BYTE_OF = _byte_of_char()


def build_tokenizer(spec: dict):
    """Tokenizer from a preset's ``tokenizer`` entry."""
    if spec.get("kind") == "byte":
        return byte_tokenizer(spec.get("max_length", 77))
    raise ValueError(f"unknown tokenizer kind {spec.get('kind')!r} in preset (expected 'byte')")
