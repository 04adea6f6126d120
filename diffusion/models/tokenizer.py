"""Tokenizers that need no download.

Presets train from scratch, so any fixed tokenizer works; the byte-level one here maps each UTF-8 byte
to one id (0-255), adds ``<|startoftext|>`` (256) and ``<|endoftext|>`` (257, also the padding) and so
fits any text encoder with a vocabulary of at least 258. To train with CLIP's BPE instead, pass a local
tokenizer directory (``--tokenizer DIR``) or a local diffusers pipeline as the model. The chat kind is the same
byte-level vocabulary as a ``Qwen2TokenizerFast`` with Qwen3's chat tokens and a chat template that formats a user
message as Qwen3's does (FLUX.2 [klein]'s pipeline formats every caption so). The qwen-image kind adds to it the
words of Qwen-Image's prompt template as whole tokens, so that the template's prefix is as many tokens as Qwen's own
tokenizer makes of it (the 34 QwenImagePipeline drops from the text states).
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast, Qwen2TokenizerFast

BOS, EOS = "<|startoftext|>", "<|endoftext|>"


def _bytes_model(tokens: tuple[str, ...]) -> Tokenizer:
    """Byte-level BPE with no merges: each UTF-8 byte is one id, 0-255, then ``tokens`` from 256 on."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins for the raw bytes
    byte_to_char = sorted(alphabet, key=lambda c: _BYTE_OF[c])
    vocab = {ch: i for i, ch in enumerate([*byte_to_char, *tokens])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def byte_tokenizer(max_length: int = 77) -> PreTrainedTokenizerFast:
    """A byte-level tokenizer, built in memory (no training, no files)."""
    tok = _bytes_model((BOS, EOS))  # 256, 257
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


# Qwen3's special tokens, from 256 on: <|endoftext|> pads (256), as Qwen's tokenizers pad
CHAT_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")
# what Qwen3's chat template writes for user messages, with add_generation_prompt and enable_thinking=False
CHAT_TEMPLATE = (
    "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}"
)


def chat_tokenizer(max_length: int = 512) -> Qwen2TokenizerFast:
    """A byte-level Qwen2TokenizerFast with Qwen3's chat tokens and template, built in memory."""
    tok = _bytes_model(CHAT_TOKENS)
    tok.add_special_tokens(list(CHAT_TOKENS))  # matched whole in the formatted caption, never split into bytes
    return Qwen2TokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token=None,
        model_max_length=max_length, chat_template=CHAT_TEMPLATE,
    )  # fmt: skip


# QwenImagePipeline's prompt template, cut as Qwen2.5's tokenizer cuts it: "system", "user" and "assistant", and each
# word of the system prompt with its leading space (the rest are single bytes or chat tokens): its prefix 34 tokens
QWEN_IMAGE_WORDS = (
    "system", "user", "assistant", "Describe", *(f" {w}" for w in (
        "the image by detailing color shape size texture quantity text spatial relationships of objects and "
        "background"
    ).split()),
)  # fmt: skip


def qwen_image_tokenizer(max_length: int = 512) -> Qwen2TokenizerFast:
    """The chat tokenizer with the words of Qwen-Image's prompt template as tokens (after the chat tokens)."""
    tok = chat_tokenizer(max_length)
    tok.add_tokens(list(dict.fromkeys(QWEN_IMAGE_WORDS)))
    return tok


def build_tokenizer(spec: dict):
    """Tokenizer from a preset's ``tokenizer`` entry."""
    if spec.get("kind") == "byte":
        return byte_tokenizer(spec.get("max_length", 77))
    if spec.get("kind") == "chat":
        return chat_tokenizer(spec.get("max_length", 512))
    if spec.get("kind") == "qwen-image":
        return qwen_image_tokenizer(spec.get("max_length", 512))
    raise ValueError(f"unknown tokenizer kind {spec.get('kind')!r} in preset (expected 'byte', 'chat' or 'qwen-image')")
