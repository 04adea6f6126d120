"""Tokenizers that need no download.

Presets train from scratch, so any fixed tokenizer works; each kind here is built in memory, fits the tiny presets'
vocabulary of 512, and is saved (export) as the files its family's tokenizer classes read, slow and fast alike.

The clip kind (the CLIP slots) is CLIP's BPE with no merges: ``CLIPTokenizer``'s rules (lowercase, CLIP's word
split, a word's last symbol marked ``</w>``) over the 243 bytes UTF-8 text can hold (all but 0xC0, 0xC1, 0xF5-0xFF),
each a symbol (ids 0-242) and a last symbol (243-485), then ``<|startoftext|>`` (486) and ``<|endoftext|>`` (487, the
padding and the unknown, as CLIP's are). Saved as vocab.json + merges.txt + tokenizer.json, which ``CLIPTokenizer``
(slow) and ``CLIPTokenizerFast`` read to the same ids. The t5 kind (the T5 slots) is T5's own tokenizer, as
transformers 5 builds it (a Unigram model, whitespace split, ``▁`` for a space, ``</s>`` after the text), over
``<pad>`` ``</s>`` ``<unk>`` (0, 1, 2, as T5's), ``▁`` and the printable characters of Latin-1, one piece each (any other
character is ``<unk>``); saved as tokenizer.json, which ``T5TokenizerFast`` (FluxPipeline's and SD3's class, and
diffusers' FLUX and SD3 scripts') and ``AutoTokenizer`` read to the same ids: transformers 5 takes only a Unigram
model's vocabulary from that file and builds the rest itself. The byte tokenizer (each UTF-8 byte one id) is the
tests' plain tokenizer.
To train with CLIP's own BPE instead, pass a local tokenizer directory (``--tokenizer DIR``) or a local diffusers
pipeline as the model. The chat kind is the same byte-level vocabulary as a ``Qwen2TokenizerFast`` (NFC-normalised,
as Qwen's are) with Qwen3's chat tokens and a chat template that formats a user message as Qwen3's does (FLUX.2
[klein]'s pipeline formats every caption so); saved with vocab.json + merges.txt, which the slow ``Qwen2Tokenizer``
reads to the same ids. The qwen-image kind adds to it the words of Qwen-Image's prompt template as whole tokens, so
that the template's prefix is as many tokens as Qwen's own tokenizer makes of it (the 34 QwenImagePipeline drops from
the text states). The mistral kind is FLUX.2 [dev]'s: a ``PixtralProcessor`` (Flux2Pipeline's tokenizer) around the byte
vocabulary with Mistral's control tokens (``<s>``, ``[INST]``, ``[SYSTEM_PROMPT]``, the image tokens, ``<pad>``) and
a chat template that writes a system and a user message as Mistral Small 3.1's does, the words of Flux2Pipeline's
system message whole tokens (so its prefix is tens of tokens, not hundreds of bytes). The qwen-image-21 kind is
Qwen-Image 2.1's: a ``Qwen3VLProcessor`` (QwenImage21Pipeline's processor) around the chat vocabulary with Qwen3-VL's
vision tokens and a chat template that writes text and image blocks as Qwen3-VL's does, the words of the pipeline's
system prompt whole tokens (its system message, whose states the pipeline drops, 12 tokens).
"""

from __future__ import annotations

import copy
import inspect
import json
import os
import tempfile

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from transformers import (
    CLIPTokenizerFast,
    PixtralImageProcessor,
    PixtralProcessor,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen2TokenizerFast,
    Qwen2VLImageProcessor,
    Qwen3VLProcessor,
    T5TokenizerFast,
)

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
    return PreTrainedTokenizerFast(  # unk_token, extra_ids=0: T5TokenizerFast reading the folder adds no <unk>, <extra_id_N>
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=EOS, unk_token=EOS, extra_ids=0,
        model_max_length=max_length,
    )  # fmt: skip


# T5's pieces: its special tokens first (the ids every T5 config names: pad 0, eos 1), then the word-start mark and the
# printable characters of Latin-1 (ASCII's 94, then U+00A1-U+00FF less the soft hyphen), equally likely
T5_SPECIALS = ("<pad>", "</s>", "<unk>")
T5_PIECES = ("▁", *(chr(c) for c in (*range(0x21, 0x7F), *range(0xA1, 0x100)) if c != 0xAD))


def t5_tokenizer(max_length: int = 256) -> T5TokenizerFast:
    """T5's tokenizer class over the pieces above, built in memory (transformers 5's T5 pipeline, no extra ids)."""
    vocab = [(piece, 0.0) for piece in T5_SPECIALS] + [(piece, -1.0) for piece in T5_PIECES]
    return T5TokenizerFast(vocab=vocab, extra_ids=0, model_max_length=max_length)


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
_CHAR_OF = {b: c for c, b in _BYTE_OF.items()}
# the bytes UTF-8 text holds: never 0xC0, 0xC1 (overlong) nor 0xF5-0xFF (beyond U+10FFFF)
TEXT_BYTES = [b for b in range(0xF5) if b not in (0xC0, 0xC1)]


def clip_tokenizer(max_length: int = 77) -> CLIPTokenizerFast:
    """CLIP's tokenizer over UTF-8 bytes with no merges: each byte a symbol, a word's last one with ``</w>``. Read from
    the vocab.json and merges.txt the slow CLIPTokenizer reads (a temporary folder), so the fast form is
    transformers' own conversion of the slow one."""
    symbols = [_CHAR_OF[b] for b in TEXT_BYTES]
    vocab = [*symbols, *(s + "</w>" for s in symbols), BOS, EOS]  # CLIP's order; 488 ids
    with tempfile.TemporaryDirectory() as folder:
        with open(os.path.join(folder, "vocab.json"), "w", encoding="utf-8") as f:
            json.dump({token: i for i, token in enumerate(vocab)}, f, ensure_ascii=False)
        with open(os.path.join(folder, "merges.txt"), "w", encoding="utf-8") as f:
            f.write("#version: 0.2\n")  # no merges
        with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
            json.dump({"tokenizer_class": "CLIPTokenizer"}, f)  # else transformers guesses the class, and warns
        return CLIPTokenizerFast.from_pretrained(folder, model_max_length=max_length)


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
    tok.normalizer = normalizers.NFC()  # as Qwen2Tokenizer (slow) and Qwen's own fast tokenizers normalise
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


# Mistral's control tokens, from 256 on (Mistral Small 3.1's tokenizer has them first, and more)
MISTRAL_TOKENS = (
    "<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[IMG]", "[IMG_BREAK]",
    "[IMG_END]", "<pad>",
)  # fmt: skip
# Mistral Small 3.1's chat template for what Flux2Pipeline writes (a system message, then user messages of text and
# image blocks) and its replies: bos, [SYSTEM_PROMPT]...[/SYSTEM_PROMPT], [INST]...[/INST]
MISTRAL_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}"
    "{%- if message['content'] is string %}{%- set blocks = [{'type': 'text', 'text': message['content']}] %}"
    "{%- else %}{%- set blocks = message['content'] %}{%- endif %}"
    "{%- if message['role'] == 'system' %}{{- '[SYSTEM_PROMPT]' + blocks[0]['text'] + '[/SYSTEM_PROMPT]' }}"
    "{%- elif message['role'] == 'user' %}{{- '[INST]' }}{%- for block in blocks %}"
    "{%- if block['type'] == 'text' %}{{- block['text'] }}{%- else %}{{- '[IMG]' }}{%- endif %}{%- endfor %}"
    "{{- '[/INST]' }}{%- else %}{{- blocks[0]['text'] + eos_token }}{%- endif %}{%- endfor %}"
)


def mistral_processor(max_length: int = 512) -> PixtralProcessor:
    """A PixtralProcessor around a byte-level tokenizer with Mistral's control tokens and chat template, and
    Flux2Pipeline's system message's words as tokens (after the control tokens), built in memory."""
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

    tok = _bytes_model(MISTRAL_TOKENS)
    tok.add_special_tokens(list(MISTRAL_TOKENS))
    words = SYSTEM_MESSAGE.replace(",", " ").replace(".", " ").split()
    tok.add_tokens(list(dict.fromkeys([words[0], *(f" {w}" for w in words[1:])])))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>",
        model_max_length=max_length, chat_template=MISTRAL_TEMPLATE,
    )  # fmt: skip
    images = PixtralImageProcessor(size={"longest_edge": 64}, patch_size={"height": 8, "width": 8})
    return PixtralProcessor(images, tokenizer, patch_size=8, spatial_merge_size=2, chat_template=MISTRAL_TEMPLATE)


# Qwen3-VL's vision tokens (after the chat tokens) and its chat template for the messages QwenImage21Pipeline writes
# (a system message of one text block, to count the tokens it drops): text blocks as they are, an image block as
# the vision tokens around one image pad
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
QWEN3_VL_TEMPLATE = (
    "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{ message['content'] }}{%- else %}{%- for block in message['content'] %}"
    "{%- if block['type'] == 'text' %}{{ block['text'] }}"
    "{%- else %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}{%- endif %}{%- endfor %}{%- endif %}"
    "{{ '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
QWEN_IMAGE_21_WORDS = ("system", "user", "assistant", "Comprehend", " and", " analyze", " the", " provided", " prompt")


def qwen_image21_processor(max_length: int = 512) -> Qwen3VLProcessor:
    """A Qwen3VLProcessor around the chat tokenizer with Qwen3-VL's vision tokens and chat template and the words of
    QwenImage21Pipeline's system prompt as tokens, built in memory (its image and video processors the defaults)."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    tok = _bytes_model(CHAT_TOKENS + VISION_TOKENS)
    tok.normalizer = normalizers.NFC()
    tok.add_special_tokens(list(CHAT_TOKENS + VISION_TOKENS))
    tokenizer = Qwen2TokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token=None,
        model_max_length=max_length, chat_template=QWEN3_VL_TEMPLATE,
    )  # fmt: skip
    tokenizer.add_tokens(list(QWEN_IMAGE_21_WORDS))
    video = Qwen3VLVideoProcessor()
    return Qwen3VLProcessor(Qwen2VLImageProcessor(), tokenizer, video, chat_template=QWEN3_VL_TEMPLATE)


def build_tokenizer(spec: dict):
    """Tokenizer from a preset's ``tokenizer`` entry."""
    if spec.get("kind") == "t5":
        return t5_tokenizer(spec.get("max_length", 256))
    if spec.get("kind") == "clip":
        return clip_tokenizer(spec.get("max_length", 77))
    if spec.get("kind") == "chat":
        return chat_tokenizer(spec.get("max_length", 512))
    if spec.get("kind") == "qwen-image":
        return qwen_image_tokenizer(spec.get("max_length", 512))
    if spec.get("kind") == "mistral":
        return mistral_processor(spec.get("max_length", 512))
    if spec.get("kind") == "qwen-image-21":
        return qwen_image21_processor(spec.get("max_length", 512))
    raise ValueError(
        f"unknown tokenizer kind {spec.get('kind')!r} in preset (expected 'clip', 't5', 'chat', 'qwen-image', "
        "'mistral' or 'qwen-image-21')"
    )


def finish_export(out: str, pipeline) -> None:
    """After ``pipeline.save_pretrained(out)``: each tokenizer folder holds vocab.json + merges.txt where its class reads
    them (transformers 5 saves tokenizer.json alone), and model_index.json names the pipeline's own tokenizer class
    (CLIPTokenizer, Qwen2Tokenizer: its ``__init__``'s annotation) where the one saved is that class's fast form."""
    own = inspect.signature(type(pipeline).__init__).parameters
    with open(os.path.join(out, "model_index.json")) as f:
        index = json.load(f)
    for folder, tok in pipeline.components.items():
        if not isinstance(tok, PreTrainedTokenizerBase):
            continue
        if "merges_file" in tok.vocab_files_names and not os.path.isfile(os.path.join(out, folder, "merges.txt")):
            tok.backend_tokenizer.model.save(os.path.join(out, folder))
        cls = own[folder].annotation if folder in own else None
        if isinstance(cls, type) and index[folder][1] == f"{cls.__name__}Fast":
            index[folder][1] = cls.__name__
    with open(os.path.join(out, "model_index.json"), "w") as f:
        f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")


def padded_to(tokenizer, length: int):
    """``tokenizer`` padding captions to ``length`` (a run's caption length: the pipeline, and an exported folder, pad
    as the run trains): a copy when its model_max_length is another, else the tokenizer itself."""
    if tokenizer.model_max_length == length:
        return tokenizer
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.model_max_length = length
    return tokenizer
