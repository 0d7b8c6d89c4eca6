"""`qwen35rl-data prepare`: local copies laid out as the hub serves openai/gsm8k and hiyouga/geometry3k (parquet
shards written by `datasets`, images as encoded PNG), loaded through the `datasets` library (no network), written
where the data configs read them and read back by qwen35rl's own dataset builder; the refusals (exit 2); the plan's
hint for missing data files names the command."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import io
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

datasets = pytest.importorskip("datasets")
from PIL import Image  # noqa: E402

from qwen35rl.cli import data as data_cli  # noqa: E402
from qwen35rl.config import rules  # noqa: E402
from qwen35rl.config.compose import compose  # noqa: E402
from qwen35rl.data import build_dataset  # noqa: E402
from qwen35rl.data.prepare import PrepareError, final_answer, prepare  # noqa: E402

_SCRIPT = Path(sys.executable).parent / "qwen35rl-data"
DATA_CMD = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "qwen35rl.cli.data"]

GSM8K = {
    "train": [("Tom has 3 apples and buys 4 more. How many apples?", "3 + 4 = <<3+4=7>>7\n#### 7"),
              ("A farm sells 250 eggs a day for 4 days. How many eggs?", "250 * 4 = <<250*4=1000>>1000\n#### 1,000"),
              ("Half of 9 is?", "9 / 2 = 4.5\n#### 4.5")],
    "test": [("What is 12 minus 5?", "12 - 5 = 7\n#### 7"), ("Double 21?", "21 * 2 = 42\n#### 42")],
}
COLORS = [(200, 10, 10), (10, 200, 10), (10, 10, 200)]


def _env(tmp_path, **extra):
    """No hub, and the `datasets` cache inside the test's directory."""
    return dict(os.environ, HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", **extra)


@pytest.fixture(scope="module")
def gsm8k_hub(tmp_path_factory):
    """openai/gsm8k as the hub repository holds it: main/ and socratic/ configs, one shard per split."""
    root = tmp_path_factory.mktemp("openai_gsm8k")
    for config in ("main", "socratic"):
        (root / config).mkdir()
        for split, rows in GSM8K.items():
            questions = [q if config == "main" else f"Socratic: {q}" for q, _ in rows]
            datasets.Dataset.from_dict({"question": questions, "answer": [a for _, a in rows]}).to_parquet(
                str(root / config / f"{split}-00000-of-00001.parquet"))
    return root


def _png(color, size=(9, 7)):
    return Image.new("RGB", size, color)


@pytest.fixture(scope="module")
def geo3k_hub(tmp_path_factory):
    """hiyouga/geometry3k as the hub repository holds it: data/<split>-00000-of-00001.parquet with features
    images (a list of Image), problem (with <image>), answer."""
    root = tmp_path_factory.mktemp("hiyouga_geometry3k")
    (root / "data").mkdir()
    image_list = getattr(datasets, "List", None) or datasets.Sequence
    features = datasets.Features({"images": image_list(datasets.Image()), "problem": datasets.Value("string"),
                                  "answer": datasets.Value("string")})
    for s, split in enumerate(("train", "validation", "test")):
        rows = {"images": [[_png(c, (9 + s, 7))] for c in COLORS],
                "problem": [f"<image>Find x in figure {split} {i}." for i in range(3)],
                "answer": [f"{s}{i}" if i else "2 \\sqrt { 221 }" for i in range(3)]}
        datasets.Dataset.from_dict(rows, features=features).to_parquet(
            str(root / "data" / f"{split}-00000-of-00001.parquet"))
    return root


# ------------------------------------------------------------------------------------------------------ gsm8k
def test_final_answer_of_a_gsm8k_solution():
    assert final_answer("a\nb <<1+1=2>>2\n#### 2") == "2"
    assert final_answer("#### 1,234,567") == "1234567"
    assert final_answer("#### -3.5 ") == "-3.5"
    assert final_answer("no final line") is None and final_answer("x ####  ") is None


def test_gsm8k_from_the_hub_layout_reads_back_as_prompts_with_final_answers(tmp_path, gsm8k_hub):
    from qwen35rl.models.tokenizer import build_tokenizer
    from qwen35rl.rewards.builtin import math_reward

    written = prepare("gsm8k", out=str(tmp_path / "data"), source=str(gsm8k_hub), cache_dir=str(tmp_path / "c"))
    assert [(w.split, w.path, w.rows) for w in written] == [
        ("train", tmp_path / "data/gsm8k/train.parquet", 3), ("test", tmp_path / "data/gsm8k/test.parquet", 2)]
    table = pq.read_table(tmp_path / "data/gsm8k/train.parquet")
    assert table.column_names == ["question", "answer", "solution"]
    assert table.column("answer").to_pylist() == ["7", "1000", "4.5"]
    assert table.column("solution").to_pylist() == [a for _, a in GSM8K["train"]]

    cfg = compose(["data=gsm8k", "data.max_prompt_length=256",  # the tiny recipe's 32 is too short for these
                   f"data.train_files=[{tmp_path}/data/gsm8k/train.parquet]",
                   f"data.val_files=[{tmp_path}/data/gsm8k/test.parquet]"])
    tok = build_tokenizer(cfg.model)
    train, val = build_dataset(cfg.data, tok, "train"), build_dataset(cfg.data, tok, "val")
    assert [(e.messages[-1]["content"], e.answer) for e in val] == [(q, a.rsplit(" ", 1)[1]) for q, a in GSM8K["test"]]
    assert [e.answer for e in train] == ["7", "1000", "4.5"]
    ex = train[1]
    assert ex.messages == [{"role": "system", "content": cfg.data.system_prompt},
                           {"role": "user", "content": GSM8K["train"][1][0]}]  # the main config, not socratic
    assert tok.decode(ex.prompt_ids).endswith("<|im_start|>assistant\n") and ex.prompt_ids
    # data.reward=math scores a boxed final answer against the written answer
    assert math_reward("250 x 4 eggs: \\boxed{1000}", ex.answer) == 1.0
    assert math_reward("\\boxed{1,000}", ex.answer) == 1.0 and math_reward("\\boxed{999}", ex.answer) == 0.0


def test_gsm8k_answer_without_a_final_line_is_refused_and_nothing_is_written(tmp_path):
    (tmp_path / "src/main").mkdir(parents=True)
    for split in ("train", "test"):
        datasets.Dataset.from_dict({"question": ["q"], "answer": ["no final line"]}).to_parquet(
            str(tmp_path / f"src/main/{split}-00000-of-00001.parquet"))
    with pytest.raises(PrepareError, match=r"gsm8k train row 0: its answer has no '#### <final answer>' line"):
        prepare("gsm8k", out=str(tmp_path / "out"), source=str(tmp_path / "src"), cache_dir=str(tmp_path / "c"))
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------------------ geo3k
def test_geo3k_from_the_hub_layout_reads_back_with_its_images(tmp_path, geo3k_hub):
    written = prepare("geo3k", out=str(tmp_path / "data"), source=str(geo3k_hub),
                      splits=["train", "validation", "test"], cache_dir=str(tmp_path / "c"))
    assert sorted(p.name for p in (tmp_path / "data/geo3k").iterdir()) == \
        ["test.parquet", "train.parquet", "validation.parquet"]
    assert [w.rows for w in written] == [3, 3, 3]
    table = pq.read_table(tmp_path / "data/geo3k/train.parquet")
    assert table.column_names == ["problem", "answer", "images"]
    stored = table.column("images").to_pylist()[0][0]
    assert stored["bytes"].startswith(b"\x89PNG")  # the encoded file, as the hub stores it

    cfg = compose(["data=geo3k", "model=qwen3_5_tiny_vl", f"data.train_files=[{tmp_path}/data/geo3k/train.parquet]",
                   f"data.val_files=[{tmp_path}/data/geo3k/validation.parquet]"])
    train, val = build_dataset(cfg.data, None, "train"), build_dataset(cfg.data, None, "val")
    assert [e.answer for e in train] == ["2 \\sqrt { 221 }", "01", "02"]
    assert [e.answer for e in val] == ["2 \\sqrt { 221 }", "11", "12"]
    for i, ex in enumerate(train):
        (img,) = ex.images
        assert img.size == (9, 7) and img.getpixel((3, 3)) == COLORS[i]  # PNG: the pixels come back exactly
        assert ex.prompt_text == f"Find x in figure train {i}."
        assert ex.messages[-1] == {"role": "user", "content": [{"type": "image"},
                                                               {"type": "text", "text": ex.prompt_text}]}
    assert val[0].images[0].size == (10, 7)
    # the written files load with `datasets` too, images as images (verl-style readers)
    back = datasets.load_dataset("parquet", data_files=str(tmp_path / "data/geo3k/test.parquet"), split="train",
                                 cache_dir=str(tmp_path / "c2"))
    assert back[0]["images"][0].size == (11, 7)


# ---------------------------------------------------------------------------------------------------- refusals
def _cli(capsys, *argv):
    code = data_cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_refusals_exit_2_with_the_way_out(tmp_path, capsys, gsm8k_hub, geo3k_hub):
    code, _, err = _cli(capsys, "prepare", "gsm8", "--out", str(tmp_path))
    assert code == 2 and "unknown dataset 'gsm8'" in err and "gsm8k or geo3k" in err and "did you mean 'gsm8k'" in err
    code, _, err = _cli(capsys, "prepare", "gsm8k", "--out", str(tmp_path), "--splits", "train,validation")
    assert code == 2 and "gsm8k has no split 'validation'" in err and "train, test" in err
    code, _, err = _cli(capsys, "prepare", "geo3k", "--out", str(tmp_path), "--source", str(gsm8k_hub))
    assert code == 2 and f"{gsm8k_hub}/data/train-*.parquet" in err and "data/ folder" in err
    code, _, err = _cli(capsys, "prepare", "gsm8k", "--out", str(tmp_path), "--source", str(tmp_path / "nope"))
    assert code == 2 and "no such directory" in err
    assert not (tmp_path / "gsm8k").exists() and not (tmp_path / "geo3k").exists()

    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "gsm8k/notes.txt").write_text("mine")
    code, _, err = _cli(capsys, "prepare", "gsm8k", "--out", str(tmp_path), "--source", str(gsm8k_hub),
                        "--cache-dir", str(tmp_path / "c"))
    assert code == 2 and "exists and is not empty (notes.txt)" in err and "--force" in err
    assert sorted(p.name for p in (tmp_path / "gsm8k").iterdir()) == ["notes.txt"]
    code, out, _ = _cli(capsys, "prepare", "gsm8k", "--out", str(tmp_path), "--source", str(gsm8k_hub),
                        "--cache-dir", str(tmp_path / "c"), "--splits", "test", "--force")
    assert code == 0 and f"wrote {tmp_path}/gsm8k/test.parquet (2 rows: question, answer, solution)" in out
    assert sorted(p.name for p in (tmp_path / "gsm8k").iterdir()) == ["notes.txt", "test.parquet"]


def test_console_script_writes_the_files_and_names_the_train_command(tmp_path, gsm8k_hub):
    run = subprocess.run([*DATA_CMD, "prepare", "gsm8k", "--out", "data", "--source", str(gsm8k_hub)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120, env=_env(tmp_path))
    assert run.returncode == 0, run.stderr[-3000:]
    assert "wrote data/gsm8k/train.parquet (3 rows" in run.stdout
    assert "wrote data/gsm8k/test.parquet (2 rows" in run.stdout
    assert "train with: qwen35rl-train data=gsm8k\n" in run.stdout  # the config's own paths: nothing to override
    assert pq.read_table(tmp_path / "data/gsm8k/test.parquet").column("answer").to_pylist() == ["7", "42"]


def test_unreachable_hub_says_to_use_source(tmp_path):
    run = subprocess.run([*DATA_CMD, "prepare", "geo3k", "--out", str(tmp_path / "data")], capture_output=True,
                         text=True, timeout=120, env=_env(tmp_path))
    assert run.returncode == 2, run.stderr[-3000:]
    err = run.stderr
    assert "could not load hiyouga/geometry3k from the Hugging Face hub" in err and "not reachable" in err
    assert "--source DIR" in err and "data/ folder: train-00000-of-00001.parquet" in err
    assert "Traceback" not in err and not (tmp_path / "data").exists()


def test_an_unreachable_hub_is_said_at_once_without_retries(tmp_path):
    """Not offline, but nothing answers at the hub's address: one quick connection says so (datasets alone retried
    for half a minute first)."""
    env = {k: v for k, v in _env(tmp_path).items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    env["HF_ENDPOINT"] = "http://127.0.0.1:9"  # the discard port: nothing listens there
    run = subprocess.run([*DATA_CMD, "prepare", "gsm8k", "--out", str(tmp_path / "data")], capture_output=True,
                         text=True, timeout=120, env=env)
    assert run.returncode == 2, run.stderr[-3000:]
    assert "cannot connect to 127.0.0.1:9" in run.stderr and "--source DIR" in run.stderr
    assert "Traceback" not in run.stderr and not (tmp_path / "data").exists()


# ----------------------------------------------------------------------------------------- the plan's hint
def _missing(cfg):
    return [(key, hint) for code, key, _, hint in rules.path_findings(cfg) if code == "data_file_missing"]


def test_missing_data_files_hint_names_the_prepare_command(tmp_path, monkeypatch, gsm8k_hub):
    monkeypatch.chdir(tmp_path)
    hints = _missing(compose(["data=gsm8k"]))
    assert [k for k, _ in hints] == ["data.train_files", "data.val_files"]
    assert all("`qwen35rl-data prepare gsm8k --out data`" in h for _, h in hints)
    (_, geo), _ = _missing(compose(["data=geo3k", "model=qwen3_5_tiny_vl"]))
    assert "`qwen35rl-data prepare geo3k --out data`" in geo
    (_, elsewhere), _ = _missing(compose(["data=geo3k", "model=qwen3_5_tiny_vl", "data.train_files=[/x/y.parquet]"]))
    assert "`qwen35rl-data prepare geo3k --out DIR` writes DIR/geo3k/train.parquet" in elsewhere
    (_, other), = _missing(compose(["data=gsm8k", "data.name=mine", "data.train_files=[q.jsonl]",
                                    "data.val_files=[]"]))
    assert other.startswith("fix the path, or remove it from data.train_files;") and "gsm8k|geo3k" in other
    # the command the hint names makes the problem go away
    prepare("gsm8k", out="data", source=str(gsm8k_hub), cache_dir=str(tmp_path / "c"))
    assert _missing(compose(["data=gsm8k"])) == []
