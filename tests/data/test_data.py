import io
import json
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf
from PIL import Image

from qwen35rl.config.schema import DataConfig
from qwen35rl.data import DataError, PromptExample, PromptLoader, build_dataset
from qwen35rl.data.synthetic import digit_reward, make_prompts


class CharTokenizer:
    """Byte ids plus a visible chat template, enough to check what build_dataset feeds the tokenizer."""

    def encode(self, text, add_special_tokens=False):
        assert add_special_tokens is False
        return list(text.encode("utf-8"))

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        assert add_generation_prompt and not tokenize
        return "".join(f"<{m['role']}>{m['content']}|" for m in messages) + "<assistant>"


def data_cfg(**overrides):
    base = OmegaConf.structured(DataConfig(name="t", kind="text"))
    return OmegaConf.merge(base, overrides)


def write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


# ---------------------------------------------------------------------------------------------------- synthetic
def test_synthetic_prompts_are_deterministic_and_split():
    cfg = data_cfg(kind="synthetic", synthetic_size=50, val_size=20, use_chat_template=False, seed=7)
    train = build_dataset(cfg, CharTokenizer(), "train")
    val = build_dataset(cfg, CharTokenizer(), "val")
    assert len(train) == 50 and len(val) == 20
    assert [e.prompt_text for e in train] == [e.prompt_text for e in build_dataset(cfg, CharTokenizer(), "train")]
    assert [e.prompt_text for e in val] != [e.prompt_text for e in train[:20]]
    for e in train:
        digits = e.prompt_text.split(" ")
        assert len(digits) == 3 and all(len(d) == 1 and d.isdigit() for d in digits)  # "7 3 9"
        assert e.answer == digits[-1]  # copy_digit: the last digit
        assert e.prompt_ids == list(e.prompt_text.encode())
    assert [e.index for e in train] == list(range(50))


def test_sum_digits_task_and_unknown_task():
    for text, answer in make_prompts("sum_digits", 30, seed=3):
        assert int(answer) == sum(int(d) for d in text.split(" ")) % 10
    with pytest.raises(ValueError, match="data.synthetic_task"):
        make_prompts("nope", 1, 0)


def test_digit_reward_partial_credit():
    assert digit_reward("9", "9", None) == 1.0
    assert digit_reward(" 9 and more", "9", None) == 1.0
    assert digit_reward("x9", "9", None) == 0.3
    assert digit_reward("4xy", "9", None) == 0.1
    assert digit_reward("abc", "9", None) == 0.0
    assert digit_reward("", "9", None) == 0.0


def test_synthetic_with_composed_config_and_byte_tokenizer():
    tokmod = pytest.importorskip("qwen35rl.models.tokenizer")
    from qwen35rl.config.compose import compose

    cfg = compose(["model=qwen3_5_tiny", "hw=cpu"])
    tok = tokmod.build_tokenizer(cfg.model)
    train = build_dataset(cfg.data, tok, "train")
    assert len(train) == cfg.data.synthetic_size
    assert all(len(e.prompt_ids) <= cfg.data.max_prompt_length for e in train)
    assert tok.decode(train[0].prompt_ids) == train[0].prompt_text


# --------------------------------------------------------------------------------------------------------- text
def test_text_jsonl_through_chat_template_with_system_prompt(tmp_path):
    rows = [{"question": "1+1?", "extra": {"gt": 2}}, {"question": "2+3?", "extra": {"gt": 5}}]
    cfg = data_cfg(train_files=[write_jsonl(tmp_path / "a.jsonl", rows)], prompt_key="question",
                   answer_key="extra.gt", system_prompt="Box it.", max_prompt_length=100)
    out = build_dataset(cfg, CharTokenizer(), "train")
    assert [e.answer for e in out] == ["2", "5"]
    assert out[0].prompt_text == "<system>Box it.|<user>1+1?|<assistant>"
    assert out[0].prompt_ids == list(out[0].prompt_text.encode())
    assert out[1].messages == [{"role": "system", "content": "Box it."}, {"role": "user", "content": "2+3?"}]
    assert out[0].images is None


def test_text_parquet_with_chat_messages_and_no_template(tmp_path):
    path = tmp_path / "a.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": [{"role": "user", "content": "hi"}], "answer": "x"}]), path)
    cfg = data_cfg(train_files=[str(path)], val_files=[str(path)], use_chat_template=False)
    (ex,) = build_dataset(cfg, CharTokenizer(), "val")
    assert ex.prompt_text == "hi" and ex.answer == "x" and ex.prompt_ids == list(b"hi")


def test_missing_key_and_bad_extension(tmp_path):
    cfg = data_cfg(train_files=[write_jsonl(tmp_path / "a.jsonl", [{"q": "x", "answer": "1"}])])
    with pytest.raises(DataError, match="no column 'prompt' \\(data.prompt_key\\)"):  # exit 2 in train, not a traceback
        build_dataset(cfg, CharTokenizer(), "train")
    (tmp_path / "a.csv").write_text("q\n")
    with pytest.raises(ValueError, match=".parquet"):
        build_dataset(data_cfg(train_files=[str(tmp_path / "a.csv")]), CharTokenizer(), "train")


OVERLONG_ROWS = [{"prompt": "short", "answer": "a"}, {"prompt": "1234567890", "answer": "b"}, {"prompt": "end", "answer": "c"}]


@pytest.mark.parametrize("truncation, kept", [("left", "67890"), ("right", "12345")])
def test_truncation_cuts_to_max_prompt_length(tmp_path, truncation, kept):
    cfg = data_cfg(train_files=[write_jsonl(tmp_path / "a.jsonl", OVERLONG_ROWS)], use_chat_template=False,
                   max_prompt_length=5, truncation=truncation, filter_overlong_prompts=False)
    out = build_dataset(cfg, CharTokenizer(), "train")
    assert [e.prompt_text for e in out] == ["short", kept, "end"]
    assert out[1].prompt_ids == list(kept.encode())


def test_filter_overlong_prompts_drops_and_keeps_row_index(tmp_path):
    cfg = data_cfg(train_files=[write_jsonl(tmp_path / "a.jsonl", OVERLONG_ROWS)], use_chat_template=False,
                   max_prompt_length=5, truncation="error", filter_overlong_prompts=True)
    out = build_dataset(cfg, CharTokenizer(), "train")
    assert [(e.prompt_text, e.index) for e in out] == [("short", 0), ("end", 2)]


def test_truncation_error_names_the_key(tmp_path):
    cfg = data_cfg(train_files=[write_jsonl(tmp_path / "a.jsonl", OVERLONG_ROWS)], use_chat_template=False,
                   max_prompt_length=5, truncation="error", filter_overlong_prompts=False)
    with pytest.raises(ValueError, match=r"10 tokens > data\.max_prompt_length=5"):
        build_dataset(cfg, CharTokenizer(), "train")


# --------------------------------------------------------------------------------------------------- multimodal
def _png_bytes(color):
    buf = io.BytesIO()
    Image.new("RGB", (4, 3), color).save(buf, format="PNG")
    return buf.getvalue()


def test_multimodal_parquet_keeps_images_and_interleaves_messages(tmp_path):
    rows = [
        {"problem": "<image>Find x in <image>.", "answer": "3",
         "images": [{"bytes": _png_bytes("red"), "path": None}, {"bytes": _png_bytes("blue"), "path": None}]},
        {"problem": "No placeholder.", "answer": "4", "images": [{"bytes": _png_bytes("green"), "path": None}]},
    ]
    path = tmp_path / "mm.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    cfg = data_cfg(kind="multimodal", train_files=[str(path)], prompt_key="problem", system_prompt="Be brief.")
    a, b = build_dataset(cfg, None, "train")
    assert a.prompt_ids == [] and a.prompt_text == "Find x in ."
    assert [im.getpixel((0, 0)) for im in a.images] == [(255, 0, 0), (0, 0, 255)]
    assert a.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Find x in"}, {"type": "image"},
                                     {"type": "text", "text": "."}]},
    ]
    assert b.messages[1]["content"] == [{"type": "image"}, {"type": "text", "text": "No placeholder."}]
    assert b.images[0].size == (4, 3)


def test_text_data_needs_a_tokenizer(tmp_path):
    cfg = data_cfg(train_files=[write_jsonl(tmp_path / "a.jsonl", OVERLONG_ROWS)])
    with pytest.raises(ValueError, match="tokenizer"):
        build_dataset(cfg, None, "train")


# ------------------------------------------------------------------------------------------------------- loader
def _examples(n):
    return [PromptExample(prompt_ids=[i], prompt_text=str(i), answer="", index=i) for i in range(n)]


def _take(loader, k):
    return [[e.index for e in loader.next_batch()] for _ in range(k)]


def test_loader_epochs_are_permutations_with_drop_last():
    loader = PromptLoader(_examples(10), batch_size=3, seed=5)
    assert loader.batches_per_epoch == 3
    epoch0, epoch1 = _take(loader, 3), _take(loader, 3)
    assert all(len(b) == 3 for b in epoch0 + epoch1)
    for epoch in (epoch0, epoch1):
        flat = sum(epoch, [])
        assert len(set(flat)) == 9  # no repeats within an epoch; one prompt left out (drop last)
    assert epoch0 != epoch1 and loader.epoch == 1
    assert _take(PromptLoader(_examples(10), 3, seed=5), 3) == epoch0
    assert _take(PromptLoader(_examples(10), 3, seed=6), 3) != epoch0
    assert _take(PromptLoader(_examples(10), 3, seed=5, shuffle=False), 4) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [0, 1, 2]]


def test_loader_resume_sees_the_same_batches():
    reference = PromptLoader(_examples(10), 3, seed=1)
    expected = _take(reference, 8)
    for stop in (1, 3, 4, 7):
        first = PromptLoader(_examples(10), 3, seed=1)
        seen = _take(first, stop)
        state = json.loads(json.dumps(first.state_dict()))  # survives a checkpoint round trip
        resumed = PromptLoader(_examples(10), 3, seed=1)
        resumed.load_state_dict(state)
        assert seen + _take(resumed, 8 - stop) == expected


def test_loader_rejects_small_dataset_and_changed_dataset():
    with pytest.raises(ValueError, match="train_batch_size=4"):
        PromptLoader(_examples(3), 4, seed=0)
    state = PromptLoader(_examples(10), 3, seed=0).state_dict()
    with pytest.raises(ValueError, match="10 prompts"):
        PromptLoader(_examples(12), 3, seed=0).load_state_dict(state)


def test_rows_keep_data_source_and_extra_info(tmp_path):
    """What a verl-signature reward is given: the row's data_source and extra_info; a row without them gets the
    dataset's name and an empty dict."""
    path = tmp_path / "verl.parquet"
    rows = [{"data_source": "hiyouga/geometry3k", "prompt": [{"role": "user", "content": "hi"}],
             "reward_model": {"ground_truth": "3", "style": "rule"}, "extra_info": {"index": 7, "split": "train"}},
            {"data_source": None, "prompt": [{"role": "user", "content": "yo"}],
             "reward_model": {"ground_truth": "4", "style": "rule"}, "extra_info": None}]
    pq.write_table(pa.Table.from_pylist(rows), path)
    cfg = data_cfg(train_files=[str(path)], answer_key="reward_model.ground_truth", use_chat_template=False)
    first, second = build_dataset(cfg, CharTokenizer(), "train")
    assert (first.data_source, first.extra_info, first.answer) == ("hiyouga/geometry3k", {"index": 7, "split": "train"}, "3")
    assert (second.data_source, second.extra_info) == ("t", {})
    plain = data_cfg(train_files=[write_jsonl(tmp_path / "a.jsonl", [{"prompt": "x", "answer": "1"}])],
                     use_chat_template=False)
    (ex,) = build_dataset(plain, CharTokenizer(), "train")
    assert (ex.data_source, ex.extra_info) == ("t", {})
