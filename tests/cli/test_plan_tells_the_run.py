"""The plan tells the whole run, through the console scripts: the data files are read and checked before launch
(qwen35rl's columns and verl's preprocessed parquet, bad rows refused or skipped and counted), the default run name
names the data, algorithm and layout, `cluster=` overlays are plain YAML merged at the root (and may pick the
hardware preset), the hardware label follows the node counts, offload that stays on says whether it is needed, and
Megatron's context-parallel refusal gives the reason of the configured megatron-core release."""
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from qwen35rl.cli import plan as plan_cli
from qwen35rl.cli import train as train_cli

BIN = Path(sys.executable).parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def plan(capsys, *args):
    """(exit code, the JSON plan or None, stderr) of `qwen35rl-plan ... format=json`."""
    rc = plan_cli.main([*map(str, args), "format=json"])
    out, err = capsys.readouterr()
    return rc, (json.loads(out) if out.strip() else None), err


def plan_text(capsys, *args):
    rc = plan_cli.main([*map(str, args)])
    out, err = capsys.readouterr()
    return rc, out + err


def problems(p, code):
    return [x for x in p["problems"] if x["code"] == code]


# ------------------------------------------------------------------------------------------------- data files
def jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def parquet(path: Path, rows) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def png(color=(200, 10, 10)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (28, 28), color).save(buf, format="PNG")
    return buf.getvalue()


GOOD = [{"question": f"What is {i} plus {i}?", "answer": str(2 * i)} for i in range(40)]
INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."


def verl_text_rows(n=40):
    """Rows as verl's examples/data_preprocess/gsm8k.py writes them."""
    return [{"data_source": "openai/gsm8k", "prompt": [{"content": f"What is {i} plus {i}? {INSTRUCTION}",
                                                         "role": "user"}],
             "ability": "math", "reward_model": {"ground_truth": str(2 * i), "style": "rule"},
             "extra_info": {"index": i, "split": "train"}} for i in range(n)]


def verl_image_rows(n=8):
    """Rows as verl's examples/data_preprocess/geo3k.py writes them (images as {bytes, path} structs)."""
    return [{"data_source": "hiyouga/geometry3k", "prompt": [{"content": "<image>Find x. Put the final answer in "
                                                                          "\\boxed{}.", "role": "user"}],
             "images": [{"bytes": png((i * 20, 10, 10)), "path": None}], "ability": "math",
             "reward_model": {"ground_truth": str(i), "style": "rule"}, "extra_info": {"index": i}}
            for i in range(n)]


def _bad_text(tmp_path: Path, name: str):
    """(file, its row in the message or None, what the message says) for each kind of unusable text data."""
    p = tmp_path / name
    if name == "missing_column.jsonl":
        return jsonl(p, [{"quest": r["question"], "answer": r["answer"]} for r in GOOD]), 0, \
            "no column 'question' (data.prompt_key)"
    if name == "answer_list.jsonl":
        return jsonl(p, GOOD[:5] + [{"question": "q", "answer": [1, 2]}] + GOOD[6:]), 5, "the answer (answer) is list"
    if name == "prompt_number.jsonl":
        return jsonl(p, GOOD[:2] + [{"question": 7, "answer": "1"}] + GOOD[3:]), 2, "the prompt (question) is an int"
    if name == "null_answer.parquet":
        return parquet(p, GOOD[:3] + [{"question": "q", "answer": None}] + GOOD[4:]), 3, "the answer (answer) is null"
    if name == "nan_answer.jsonl":
        return jsonl(p, GOOD[:1] + [{"question": "q", "answer": float("nan")}] + GOOD[2:]), 1, "is NaN"
    if name == "empty.jsonl":
        p.write_text("")
        return p, None, "holds no rows"
    if name == "table.csv":
        p.write_text("question,answer\nq,1\n")
        return p, None, "is a .csv file; qwen35rl reads .parquet, or .jsonl"
    if name == "not_parquet.parquet":
        p.write_text("question,answer\nq,1\n")
        return p, None, "cannot be read as a data file: not parquet"
    if name == "binary.jsonl":
        p.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe" * 10)
        return p, None, "not UTF-8 text"
    if name == "a_directory.parquet":
        p.mkdir()
        return p, None, "is a directory"
    if name == "verl_without_answer.parquet":  # verl's prompt, but no reward_model: neither layout is complete
        rows = [{k: v for k, v in r.items() if k != "reward_model"} for r in verl_text_rows()]
        return parquet(p, rows), 0, "no column 'answer' (data.answer_key)"
    raise AssertionError(name)


BAD_TEXT = ["missing_column.jsonl", "answer_list.jsonl", "prompt_number.jsonl", "null_answer.parquet",
            "nan_answer.jsonl", "empty.jsonl", "table.csv", "not_parquet.parquet", "binary.jsonl",
            "a_directory.parquet", "verl_without_answer.parquet"]


@pytest.mark.parametrize("name", BAD_TEXT)
def test_unusable_text_data_is_refused_by_the_plan_and_train_before_anything_is_written(tmp_path, capsys, name):
    bad, row, says = _bad_text(tmp_path, name)
    good = jsonl(tmp_path / "good.jsonl", GOOD)
    args = ["data=gsm8k", f"data.train_files=[{bad}]", f"data.val_files=[{good}]", "data.max_prompt_length=256",
            f"trainer.output_root={tmp_path / 'runs'}"]
    rc, p, _ = plan(capsys, *args)
    assert rc == 2 and not p["valid"]
    [found] = problems(p, "data_unusable")
    assert found["key"] == "data.train_files" and str(bad) in found["message"] and says in found["message"], found
    if row is not None:
        assert f"row {row}" in found["message"], found
    assert found["hint"], found
    if name.startswith("verl"):
        assert "reward_model.ground_truth" in found["hint"]
    checked = {f["path"]: f for f in p["data_check"]["files"]}
    assert checked[str(good)]["bad_rows"] == [] and checked[str(good)]["rows_read"] == 32
    assert checked[str(bad)]["error"] or checked[str(bad)]["bad_rows"]
    assert train_cli.main(args) == 2
    err = capsys.readouterr().err
    assert "[data_unusable]" in err and str(bad) in err and says in err and "Traceback" not in err
    assert not (tmp_path / "runs").exists()  # nothing written


IMAGE_CASES = [  # (the bad row, its column, what the message says)
    ({"problem": "<image> a", "answer": "1", "images": [{"bytes": b"not a png", "path": None}]}, "images",
     "image 0 of 'images' does not decode"),
    ({"problem": "<image> <image> a", "answer": "1", "images": [{"bytes": "PNG", "path": None}]}, "problem",
     "2 <image> placeholders but the row has 1 image(s)"),
    ({"problem": "a", "answer": "1", "images": []}, "images", "are an empty list"),
    ({"problem": "a", "answer": "1", "images": None}, "images", "are null"),
    ({"problem": "a", "answer": "1"}, "images", "no column 'images' (data.image_key)"),
]


@pytest.mark.parametrize("row,column,says", IMAGE_CASES, ids=["undecodable", "placeholders", "empty", "null",
                                                               "no-column"])
def test_unusable_image_rows_are_refused_naming_file_row_and_column(tmp_path, capsys, row, column, says):
    good = {"problem": "<image> ok", "answer": "2", "images": [{"bytes": png(), "path": None}]}
    if row.get("images"):
        row = {**row, "images": [{**im, "bytes": png() if im["bytes"] == "PNG" else im["bytes"]}
                                 for im in row["images"]]}
    rows = [good, good, row, good] if "images" in row else [{k: v for k, v in r.items() if k != "images"}
                                                             for r in (good, good, row, good)]
    bad = parquet(tmp_path / "train.parquet", rows)
    good_file = parquet(tmp_path / "test.parquet", [good] * 4)
    args = ["model=qwen3_5_tiny_vl", "data=geo3k", f"data.train_files=[{bad}]", f"data.val_files=[{good_file}]"]
    rc, p, _ = plan(capsys, *args)
    assert rc == 2
    [found] = problems(p, "data_unusable")
    assert str(bad) in found["message"] and says in found["message"] and found["hint"], found
    assert "row 2" in found["message"] or "row 0" in found["message"]
    checked = next(f for f in p["data_check"]["files"] if f["path"] == str(bad))
    assert {b["column"] for b in checked["bad_rows"]} == {column}


def test_the_check_reads_only_the_first_rows_of_a_large_file(tmp_path, capsys):
    big = parquet(tmp_path / "big.parquet", GOOD * 250)  # 10,000 rows, one bad one past the rows read
    bad_late = parquet(tmp_path / "late.parquet", GOOD + [{"question": "q", "answer": None}])
    rc, p, _ = plan(capsys, "data=gsm8k", f"data.train_files=[{big}]", f"data.val_files=[{bad_late}]")
    assert rc == 0, p["problems"]
    train, val = p["data_check"]["files"]
    assert (train["rows"], train["rows_read"], train["format"]) == (10_000, 32, "qwen35rl")
    assert val["rows_read"] == 32 and val["bad_rows"] == []  # row 40 is the loader's to find (tests/data)


def test_validation_files_a_run_never_reads_are_not_refused(tmp_path, capsys):
    good = jsonl(tmp_path / "good.jsonl", GOOD)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    args = ["data=gsm8k", f"data.train_files=[{good}]", f"data.val_files=[{empty}]"]
    rc, p, _ = plan(capsys, *args, "trainer.test_freq=-1")
    assert rc == 0 and p["data_check"]["files"][1]["checked"] is False
    assert "does not validate" in p["data_check"]["files"][1]["why"]
    rc, p, _ = plan(capsys, *args, "trainer.test_freq=-1", "trainer.val_before_train=true")
    assert rc == 2 and "holds no rows" in problems(p, "data_unusable")[0]["message"]


def test_verl_preprocessed_parquet_is_read_by_the_plan_and_the_loader(tmp_path, capsys):
    from omegaconf import OmegaConf

    from qwen35rl.config.compose import compose
    from qwen35rl.data import build_dataset
    from qwen35rl.models.tokenizer import build_tokenizer

    text = parquet(tmp_path / "gsm8k_verl.parquet", verl_text_rows())
    args = ["data=gsm8k", f"data.train_files=[{text}]", f"data.val_files=[{text}]", "data.max_prompt_length=256"]
    rc, p, _ = plan(capsys, *args)
    assert rc == 0 and p["valid"], p["problems"]
    f = p["data_check"]["files"][0]
    assert f["format"] == "verl" and f["columns"] == {"prompt": "prompt", "answer": "reward_model.ground_truth",
                                                      "images": None}
    rc, out = plan_text(capsys, *args)
    assert f"  data check {text}: verl's preprocessed format (prompt=prompt, answer=reward_model.ground_truth" in out
    cfg = compose(args)
    assert cfg.data.system_prompt  # data=gsm8k has one; verl's rows carry their own instruction instead
    examples = build_dataset(OmegaConf.create(OmegaConf.to_container(cfg.data)), build_tokenizer(cfg.model), "train")
    assert len(examples) == 40 and [e.answer for e in examples[:3]] == ["0", "2", "4"]
    assert examples[1].messages == [{"role": "user", "content": f"What is 1 plus 1? {INSTRUCTION}"}]

    images = parquet(tmp_path / "geo3k_verl.parquet", verl_image_rows())
    args = ["model=qwen3_5_tiny_vl", "data=geo3k", f"data.train_files=[{images}]", f"data.val_files=[{images}]"]
    rc, p, _ = plan(capsys, *args)
    assert rc == 0 and p["data_check"]["files"][0]["format"] == "verl", p["problems"]
    cfg = compose(args)
    examples = build_dataset(OmegaConf.create(OmegaConf.to_container(cfg.data)), None, "val")
    assert [e.answer for e in examples[:2]] == ["0", "1"] and examples[3].images[0].size == (28, 28)
    assert examples[0].messages[0]["content"][0] == {"type": "image"}


def test_skip_bad_rows_warns_in_the_plan_and_refuses_a_file_without_a_usable_row(tmp_path, capsys):
    some = jsonl(tmp_path / "some.jsonl", GOOD[:3] + [{"question": "q", "answer": None}] + GOOD[4:])
    rc, p, _ = plan(capsys, "data=gsm8k", f"data.train_files=[{some}]", f"data.val_files=[{some}]",
                    "data.skip_bad_rows=true")
    assert rc == 0 and p["valid"] and p["data_check"]["skip_bad_rows"]
    warned = problems(p, "data_rows_skipped")
    assert warned and warned[0]["severity"] == "warning" and "row 3" in warned[0]["message"]
    none = jsonl(tmp_path / "none.jsonl", [{"question": "q", "answer": None}] * 5)
    rc, p, _ = plan(capsys, "data=gsm8k", f"data.train_files=[{none}]", f"data.val_files=[{some}]",
                    "data.skip_bad_rows=true")
    assert rc == 2 and "none of the 5 rows can make a prompt" in problems(p, "data_unusable")[0]["message"]


def test_train_skips_and_counts_bad_rows(tmp_path):
    rows = GOOD[:12]
    rows[5] = {"question": "q", "answer": None}
    rows[7] = {"quest": "q", "answer": "1"}
    train = jsonl(tmp_path / "train.jsonl", rows)
    run = subprocess.run(
        [str(BIN / "qwen35rl-train"), "trainer.launcher=local", "hw.devices_per_node=1", "data=gsm8k",
         f"data.train_files=[{train}]", f"data.val_files=[{train}]", "data.skip_bad_rows=true",
         "data.train_batch_size=4", "algorithm.mini_batch_size=4", "data.max_prompt_length=256",
         "trainer.total_steps=1", "trainer.test_freq=-1", "trainer.trackers=[console,jsonl]",
         "trainer.export_hf=false", f"hydra.run.dir={tmp_path / 'run'}"],
        capture_output=True, text=True, cwd=tmp_path, env=ENV, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "10 train prompts" in run.stderr and "(2 bad row(s) skipped: data.skip_bad_rows=true)" in run.stderr
    assert "row 5: the answer (answer) is null" in run.stderr and "row 7: no column 'question'" in run.stderr
    assert "data:        2 train row(s) skipped while loading (data.skip_bad_rows=true" in run.stderr
    last = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["data/skipped_rows/train"] == 2 and last["data/skipped_rows/val"] == 0  # no validation here


VERL_SCRIPT = """\
#!/bin/bash
python3 -m verl.trainer.main_ppo \\
    algorithm.adv_estimator=grpo \\
    data.train_files={data} data.val_files={data} \\
    data.train_batch_size=4 data.max_prompt_length=256 data.max_response_length=8 \\
    actor_rollout_ref.model.path=Qwen/Qwen3.5-0.8B \\
    actor_rollout_ref.actor.ppo_mini_batch_size=4 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \\
    actor_rollout_ref.rollout.name=hf actor_rollout_ref.rollout.n=2 \\
    actor_rollout_ref.rollout.tensor_model_parallel_size=1 \\
    trainer.logger=[console] trainer.experiment_name=verl_gsm8k \\
    trainer.n_gpus_per_node=1 trainer.nnodes=1 trainer.total_training_steps=1
"""


def test_an_imported_verl_launch_on_verl_parquet_plans_valid_and_trains(tmp_path):
    data = parquet(tmp_path / "gsm8k_verl.parquet", verl_text_rows(16))
    script = tmp_path / "run.sh"
    script.write_text(VERL_SCRIPT.format(data=data))
    env = {k: v for k, v in ENV.items() if k != "QWEN35RL_CONFIG_PATH"}
    imp = subprocess.run([str(BIN / "qwen35rl-import"), "verl", str(script), "--model", "qwen3_5_tiny", "--hw", "cpu",
                          "--format", "json"], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert imp.returncode == 0, imp.stdout[-2000:] + imp.stderr[-2000:]
    r = json.loads(imp.stdout)
    overlay = Path(r["overlay"]).read_text()
    assert "answer_key: reward_model.ground_truth" in overlay and str(data) in overlay
    env = {**env, **r["command_env"]}
    planned = subprocess.run([str(BIN / "qwen35rl-plan"), *r["command"][1:], "format=json"], capture_output=True,
                             text=True, cwd=tmp_path, env=env, timeout=300)
    assert planned.returncode == 0, planned.stdout[-3000:]
    p = json.loads(planned.stdout)
    assert p["valid"] and {f["format"] for f in p["data_check"]["files"]} == {"verl"}
    run = subprocess.run([str(BIN / "qwen35rl-train"), *r["command"][1:], "trainer.launcher=local",
                          "hw.devices_per_node=1", "trainer.val_before_train=false", "trainer.export_hf=false",
                          f"trainer.output_root={tmp_path / 'runs'}"],
                         capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "16 train prompts" in run.stderr and "done: step 1 of 1" in run.stderr
    assert (tmp_path / "runs" / "verl_gsm8k" / "metrics.jsonl").is_file()


# -------------------------------------------------------------------------------------------------- run names
def test_the_default_run_name_names_data_algorithm_and_layout(capsys):
    base = ["model=qwen3_5_4b", "hw=gpu_1node"]
    dirs = {}
    for algorithm in ("grpo", "dapo", "dr_grpo"):
        rc, p, _ = plan(capsys, *base, f"algorithm={algorithm}")
        assert rc == 0
        dirs[algorithm] = p["output_dir"]
    assert dirs == {a: f"runs/qwen3_5_4b-synthetic-{a}-fsdp8-gpu_1node" for a in ("grpo", "dapo", "dr_grpo")}
    cases = {  # overrides -> the default run name
        "backend=megatron parallelism.tp=2": "qwen3_5_4b-synthetic-grpo-megatron-tp2-dp4-gpu_1node",
        "parallelism.fsdp_size=4 parallelism.sp=2": "qwen3_5_4b-synthetic-grpo-fsdp4x2-sp2-gpu_1node",
        "parallelism=auto": "qwen3_5_4b-synthetic-grpo-fsdp-auto-gpu_1node",
        "hw.nodes=4": "qwen3_5_4b-synthetic-grpo-fsdp32-gpu_4x8",
        "data=gsm8k algorithm=dapo": "qwen3_5_4b-gsm8k-dapo-fsdp8-gpu_1node",
        "trainer.run_name=mine": "mine",  # the user's own name is kept as it is
    }
    for overrides, name in cases.items():
        rc, p, _ = plan(capsys, *base, *overrides.split())
        assert p["run"]["name"] == name and p["output_dir"] == f"runs/{name}", overrides


def test_the_embedded_default_run_directory():
    from qwen35rl.config.compose import compose

    assert compose([]).trainer.run_name == "qwen3_5_tiny-synthetic-grpo-fsdp2-cpu"
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert "runs/qwen3_5_tiny-synthetic-grpo-fsdp2-cpu/" in readme and "qwen3_5_tiny-fsdp-cpu" not in readme


# ------------------------------------------------------------------------------------------- cluster overlays
@pytest.fixture
def overlays(tmp_path, monkeypatch):
    root = tmp_path / "team_conf"
    files = {
        "cluster/mylab.yaml": "ray_address: null\nhw:\n  nodes: 4\n",  # plain YAML: no package header
        "cluster/headed.yaml": "# @package _global_\nray_address: auto\nhw:\n  nodes: 2\n  devices_per_node: 1\n",
        "cluster/npu_lab.yaml": "defaults:\n  - override /hw: a3_4node\n\nray_address: null\nhw:\n  nodes: 8\n",
        "cluster/typo.yaml": "hw:\n  nodez: 4\n",
        "cluster/wide.yaml": "hw:\n  nodes: 4\nparallelism:\n  fsdp_size: 32\n",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    monkeypatch.setenv("QWEN35RL_CONFIG_PATH", str(root))
    return root


def test_a_plain_cluster_overlay_merges_at_the_root(overlays, capsys):
    for choice in ("cluster=mylab", "+cluster=mylab"):
        rc, p, _ = plan(capsys, "model=qwen3_5_4b", "hw=gpu_1node", choice)
        assert rc == 0 and p["nodes"] == 4 and p["world_size"] == 32, choice
        assert (p["hw"], p["hw_preset"]) == ("gpu_4x8", "gpu_1node")
        assert p["run"]["name"].endswith("-fsdp32-gpu_4x8")
    rc, text = plan_text(capsys, "model=qwen3_5_4b", "hw=gpu_1node", "cluster=mylab")
    head = text.splitlines()[0]
    assert "on gpu_4x8 (hw=gpu_1node with other node / device counts)" in head and "on gpu_1node " not in head
    assert "  hardware   4 node(s) x 8 cuda = world 32" in text
    rc, p, _ = plan(capsys, "cluster=headed")  # an overlay with the header, as before
    assert rc == 0 and p["nodes"] == 2 and p["hw"] == "cpu_2x1"
    rc, p, _ = plan(capsys, "model=qwen3_5_4b", "hw=gpu_1node", "cluster=example")  # the packaged example
    assert rc == 0 and p["hw"] == "gpu_1node" and p["worker_env"]["NCCL_SOCKET_IFNAME"] == "eth0"
    for none in ("cluster=null", "~cluster"):
        rc, p, _ = plan(capsys, none)
        assert rc == 0 and p["nodes"] == 1, none


def test_a_cluster_overlay_picks_the_hardware_preset_and_the_command_line_wins(overlays, capsys):
    rc, p, _ = plan(capsys, "model=qwen3_5_122b_a10b", "backend=megatron", "cluster=npu_lab")
    assert rc == 0 and p["device"] == "npu" and p["hw_preset"] == "a3_4node" and p["nodes"] == 8
    assert p["hw"] == "a3_8x16" and p["layout_name"].endswith("@a3_4node")  # the preset's tested layout
    rc, p, _ = plan(capsys, "model=qwen3_5_4b", "hw=gpu_1node", "cluster=npu_lab")
    assert rc == 0 and p["device"] == "cuda" and p["hw_preset"] == "gpu_1node" and p["nodes"] == 8


def test_a_plain_cluster_overlay_with_a_typo_is_refused_naming_the_file(overlays, capsys):
    rc, _, err = plan(capsys, "cluster=typo")
    assert rc == 2 and "hw.nodez" in err and str(overlays / "cluster" / "typo.yaml") in err and "'nodes'" in err


def test_offload_that_stays_on_is_visible_with_whether_it_is_needed(overlays, capsys):
    # the 27B recipe turns FSDP offload on for one node; an overlay with four nodes and a wider shard keeps it on
    rc, p, _ = plan(capsys, "model=qwen3_5_27b", "hw=gpu_1node", "cluster=wide")
    assert rc == 0 and p["offload"]["offload_policy"]
    without = p["offload"]["without"]
    assert without["fits"] and "backend.offload_policy=false" in without["keys"]
    assert max(without["train_peak_gib"], without["rollout_peak_gib"]) <= p["memory_gib"]["capacity"]
    rc, text = plan_text(capsys, "model=qwen3_5_27b", "hw=gpu_1node", "cluster=wide")
    offload = next(line for line in text.splitlines() if line.startswith("  offload"))
    assert "FSDP CPU offload policy" in offload and "not needed here: without it train peak" in offload
    assert "backend.param_offload=false backend.optimizer_offload=false backend.offload_policy=false" in offload
    rc, p, _ = plan(capsys, "model=qwen3_5_27b", "hw=gpu_1node")  # on its own node it is needed
    assert p["offload"]["without"]["fits"] is False
    rc, p, _ = plan(capsys)
    assert "without" not in p["offload"]  # nothing offloaded, nothing to say


# ------------------------------------------------------------------------------------ Megatron CP and GDN
@pytest.mark.parametrize("version,says", [
    ("0.16.0", "megatron-core 0.16.0's Gated DeltaNet has no context parallelism"),
    ("0.17.1", "megatron-core 0.17.1's Gated DeltaNet has no context parallelism"),
    ("0.18.0", "megatron-core 0.18.0 runs the Gated DeltaNet layers with context parallelism"),
    ("0.19.2", "megatron-core 0.19.2 runs the Gated DeltaNet layers with context parallelism"),
])
def test_the_context_parallel_refusal_follows_the_megatron_core_release(capsys, version, says):
    rc, p, _ = plan(capsys, "model=qwen3_5_35b_a3b", "hw=gpu_1node", "backend=megatron", "parallelism.cp=2",
                    "parallelism.ep=4", f"backend.megatron_core_version={version}")
    assert rc == 2
    [found] = problems(p, "megatron_context_parallel")
    assert says in found["message"] and "torch SDPA, which has no CP" in found["message"], found
    assert found["hint"].startswith("try parallelism.cp=1")
    old = version < "0.18"
    assert ("needs megatron-core >= 0.18" in found["hint"]) == old
    assert ("0.18.0" in found["message"]) and (("PR #2642" in found["message"]) == old)


def test_the_engine_check_gives_the_installed_release_reason():
    from qwen35rl.config import megatron_versions as mv

    with pytest.raises(RuntimeError, match=r"megatron-core 0\.17\.1's Gated DeltaNet has no context parallelism"):
        mv.capabilities("0.17.1", has_te=True).check_layout(cp=2, packed=False)
    with pytest.raises(RuntimeError, match="needs Transformer Engine attention"):
        mv.capabilities("0.18.0", has_te=False).check_layout(cp=2, packed=False)
    mv.capabilities("0.18.0", has_te=True).check_layout(cp=2, packed=False)  # GDN and TE attention both have CP


def test_the_shipped_example_overlay_is_plain_yaml():
    example = (Path(__file__).resolve().parents[2] / "conf" / "cluster" / "example.yaml").read_text()
    assert "# @package" not in example and "override /hw" in example  # (commented: how to pick a preset)
