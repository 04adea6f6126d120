"""Tokenizers that need no download.

Presets train from scratch, so any fixed tokenizer works. Two are built here, each mapping a UTF-8 byte to one id
(0-255), with ``<|startoftext|>`` (256) and ``<|endoftext|>`` (257, also the padding): the byte-level one reads
every byte as it is (FLUX's T5 slot: 258 ids), and the CLIP one reads text by CLIP's rules (lower case, split
into words and punctuation, whitespace dropped, a word's last byte marked ``</w>``: 482 ids) with no merges, so
that it is a real CLIP tokenizer: an exported pipeline's folder holds the files both CLIPTokenizer (vocab.json,
merges.txt: what diffusers' training scripts load) and CLIPTokenizerFast (tokenizer.json) read, and the two give
the ids the run trained on. To train with CLIP's own BPE instead, pass a local tokenizer directory
(``--tokenizer DIR``) or a local diffusers pipeline as the model.
"""

from __future__ import annotations

import json
import os
import tempfile

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import CLIPTokenizerFast, PreTrainedTokenizerFast

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


# Bytes a CLIP word never holds: CLIP lower-cases the text, and whitespace splits words.
_NOT_IN_WORDS = {*range(ord("A"), ord("Z") + 1), *b" \t\n\x0b\x0c\r"}


def clip_vocab() -> dict[str, int]:
    """The CLIP tokenizer's vocabulary: each byte's stand-in (its id the byte), BOS 256, EOS 257, then each byte
    that may end a word with ``</w>`` (258-481)."""
    vocab = {ch: _BYTE_OF[ch] for ch in _BYTE_OF}
    vocab[BOS], vocab[EOS] = 256, 257
    ends = sorted((ch for ch in _BYTE_OF if _BYTE_OF[ch] not in _NOT_IN_WORDS), key=_BYTE_OF.get)
    vocab.update({f"{ch}</w>": 258 + i for i, ch in enumerate(ends)})
    return vocab


def clip_tokenizer(max_length: int = 77) -> CLIPTokenizerFast:
    """A CLIP tokenizer on a byte alphabet without merges (module docstring), built from its vocab.json and an empty
    merges.txt as transformers converts CLIP's own (the files are written to a temporary folder; no download)."""
    with tempfile.TemporaryDirectory() as folder:
        vocab, merges = os.path.join(folder, "vocab.json"), os.path.join(folder, "merges.txt")
        with open(vocab, "w", encoding="utf-8") as f:
            json.dump(clip_vocab(), f, ensure_ascii=False)
        with open(merges, "w", encoding="utf-8") as f:
            f.write("#version: 0.2\n")
        return CLIPTokenizerFast(vocab_file=vocab, merges_file=merges, model_max_length=max_length)


def build_tokenizer(spec: dict):
    """Tokenizer from a preset's ``tokenizer`` entry."""
    if spec.get("kind") == "byte":
        return byte_tokenizer(spec.get("max_length", 77))
    if spec.get("kind") == "clip":
        return clip_tokenizer(spec.get("max_length", 77))
    raise ValueError(f"unknown tokenizer kind {spec.get('kind')!r} in preset (expected 'byte' or 'clip')")
