"""The plan's first screen tells the whole run: name and directory, steps, checkpoint, data files with their row
counts, reward, algorithm settings; the JSON plan carries the same."""
import json

from qwen35rl.cli.plan import main as plan


def test_the_plan_tells_the_run(tmp_path, capsys):
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"question": f"{i}+1?", "answer": str(i + 1)}) + "\n" for i in range(40)))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"question": ["1+1?"] * 7, "answer": ["2"] * 7}), tmp_path / "test.parquet")
    args = ["data=gsm8k", f"data.train_files=[{train}]", f"data.val_files=[{tmp_path / 'test.parquet'}]",
            "model.init=random", "algorithm.use_kl_loss=true", "data.train_batch_size=8", "algorithm.mini_batch_size=8", "backend.lr=3e-6",
            "trainer.total_steps=null", "trainer.total_epochs=2", "trainer.run_name=mine", f"trainer.output_root={tmp_path}/runs"]
    assert plan(args) == 0
    out = capsys.readouterr().out
    assert f"run        mine -> {tmp_path}/runs/mine; 10 steps" in out  # 2 epochs of 40 rows // 8
    assert f"{train} (40 rows)" in out and "test.parquet (7 rows)" in out and "reward math" in out
    assert "lr 3e-06 constant" in out and "KL low_var_kl x 0.001 in the loss" in out and "checkpoint random init" in out
    assert plan([*args, "format=json"]) == 0
    run = json.loads(capsys.readouterr().out)["run"]
    assert run["total_steps"] == 10 and run["data"]["train_rows"] == 40 and run["algorithm"]["lr"] == 3e-6
    assert run["data"]["val_files"] == [{"path": str(tmp_path / "test.parquet"), "rows": 7}]


def test_a_synthetic_task_and_a_missing_file_are_told_as_such(tmp_path, capsys):
    assert plan([]) == 0
    assert "synthetic (copy_digit, generated in code)" in capsys.readouterr().out
    plan(["data=gsm8k", f"data.train_files=[{tmp_path}/none.parquet]", "model.init=random", "trainer.total_steps=null"])
    out = capsys.readouterr().out
    assert f"train {tmp_path}/none.parquet;" in out and "epoch(s) over the train files" in out


def test_a_hub_id_as_model_path_says_how_to_get_the_directory(capsys):
    assert plan(["model.init=pretrained", "model.path=Qwen/Qwen3.5-0.8B"]) == 2
    out = capsys.readouterr().out
    assert "[checkpoint_dir_missing]" in out
    assert "huggingface-cli download Qwen/Qwen3.5-0.8B --local-dir /shared/models/Qwen3.5-0.8B" in out
