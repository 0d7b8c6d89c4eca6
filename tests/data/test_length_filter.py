"""Prompts dropped by data.filter_overlong_prompts: counted and named (row, token count) in the log; when every
prompt of a split is dropped, a DataError says they were filtered, why, their lengths and what to change; through
qwen35rl-train that message reaches the user before anything starts."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from qwen35rl.config.schema import DataConfig
from qwen35rl.data import DataError, build_dataset

_SCRIPT = Path(sys.executable).parent / "qwen35rl-train"
TRAIN = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "qwen35rl.cli.train"]


class ByteTokenizer:
    """One id per byte: a prompt's length is its UTF-8 length (plus the visible template)."""

    def encode(self, text, add_special_tokens=False):
        return list(text.encode("utf-8"))

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        return "".join(f"<{m['role']}>{m['content']}|" for m in messages) + "<a>"


def _cfg(tmp_path, prompts, **overrides):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "answer": str(i)}) + "\n" for i, p in enumerate(prompts)))
    base = OmegaConf.structured(DataConfig(name="t", kind="text"))
    values = dict(train_files=[str(path)], val_files=[str(path)], use_chat_template=False,
                  filter_overlong_prompts=True)
    return OmegaConf.merge(base, {**values, **overrides}), path


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "dropped" in r.getMessage()]


def test_dropped_prompts_are_counted_and_named_in_the_log(tmp_path, caplog):
    cfg, _ = _cfg(tmp_path, ["abc", "0123456789", "xy", "abcdefg"], max_prompt_length=5)
    with caplog.at_level(logging.WARNING, logger="qwen35rl.data.dataset"):
        kept = build_dataset(cfg, ByteTokenizer(), "train")
    assert [(e.index, e.prompt_text) for e in kept] == [(0, "abc"), (2, "xy")]
    assert _warnings(caplog) == ["dropped 2 of 4 train prompts longer than data.max_prompt_length=5 tokens "
                                 "(data.filter_overlong_prompts=true): rows 1 (10 tokens), 3 (7 tokens)"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="qwen35rl.data.dataset"):
        assert len(build_dataset(cfg, ByteTokenizer(), "val")) == 2
    assert _warnings(caplog)[0].startswith("dropped 2 of 4 val prompts")


def test_many_dropped_prompts_name_the_first_ten(tmp_path, caplog):
    cfg, _ = _cfg(tmp_path, ["ok"] + [f"long prompt {i:02d}" for i in range(13)], max_prompt_length=4)
    with caplog.at_level(logging.WARNING, logger="qwen35rl.data.dataset"):
        assert len(build_dataset(cfg, ByteTokenizer(), "train")) == 1
    (msg,) = _warnings(caplog)
    assert msg.startswith("dropped 13 of 14 train prompts") and msg.endswith("10 (14 tokens) and 3 more")
    assert "rows 1 (14 tokens), 2 (14 tokens)" in msg and " 11 (" not in msg


def test_nothing_dropped_logs_nothing(tmp_path, caplog):
    cfg, _ = _cfg(tmp_path, ["abc", "de"], max_prompt_length=5)
    with caplog.at_level(logging.WARNING, logger="qwen35rl.data.dataset"):
        assert len(build_dataset(cfg, ByteTokenizer(), "train")) == 2
    assert _warnings(caplog) == []


def test_all_dropped_says_they_were_filtered_why_and_what_to_change(tmp_path):
    cfg, path = _cfg(tmp_path, ["abcdef", "0123456789", "abcde"], max_prompt_length=4, system_prompt="S")
    with pytest.raises(DataError) as err:
        build_dataset(cfg, ByteTokenizer(), "train")
    msg = str(err.value)
    assert isinstance(err.value, ValueError)
    assert msg.startswith(f"all 3 train prompts (data.train_files=[{path}]) were filtered out for length: "
                          "data.filter_overlong_prompts=true drops every prompt longer than "
                          "data.max_prompt_length=4 tokens")
    # "S\n\n" + the prompt: 8, 13 and 7 tokens
    assert "these have 8 (shortest) to 13 (longest) tokens, the system prompt included" in msg
    assert "Raise data.max_prompt_length to at least 8 (13 keeps them all)" in msg
    assert "data.filter_overlong_prompts=false with data.truncation=left" in msg and "data.truncation=right" in msg
    with pytest.raises(DataError, match=r"all 3 val prompts \(data\.val_files=\["):
        build_dataset(cfg, ByteTokenizer(), "val")


def test_all_dropped_with_the_chat_template_and_synthetic_prompts(tmp_path):
    cfg, _ = _cfg(tmp_path, ["a", "b"], max_prompt_length=6, use_chat_template=True)
    with pytest.raises(DataError, match=r"and each has 11 tokens, the chat template and system prompt included\. "
                                        r"Raise data\.max_prompt_length to at least 11;"):
        build_dataset(cfg, ByteTokenizer(), "train")
    synthetic = OmegaConf.merge(OmegaConf.structured(DataConfig(name="s", kind="synthetic")),
                                dict(synthetic_size=5, max_prompt_length=2, use_chat_template=False))
    with pytest.raises(DataError, match=r"all 5 train prompts \(data\.synthetic_task=copy_digit\) were filtered"):
        build_dataset(synthetic, ByteTokenizer(), "train")


def test_train_reports_all_prompts_filtered_before_starting(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"question": f"What is {i} plus {i}?", "answer": str(2 * i)}) + "\n"
                            for i in range(8)))
    run = subprocess.run(
        [*TRAIN, f"hydra.run.dir={tmp_path / 'run'}", "data=gsm8k", f"data.train_files=[{rows}]",
         f"data.val_files=[{rows}]", "data.max_prompt_length=16", "data.train_batch_size=4", "trainer.total_steps=1"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=dict(os.environ))
    assert run.returncode == 2, run.stderr[-3000:]  # the config's problem, said before anything starts
    assert "Traceback" not in run.stderr and "[data_unusable]" in run.stderr
    assert f"all 8 train prompts (data.train_files=[{rows}]) were filtered out for length" in run.stderr, \
        run.stderr[-3000:]
    assert "data.max_prompt_length=16" in run.stderr and "Raise data.max_prompt_length to at least" in run.stderr
