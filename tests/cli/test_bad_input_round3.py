"""Issue 37's corpus of bad inputs, through the console scripts: overlays, values that look like secrets or
interpolations, architectures, versions, sweeps, rewards, data files and the other tools. Each ends in exit code 2
with one block naming the key or file and the fix, no traceback, nothing written."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
ENV.pop("QWEN35RL_CONFIG_PATH", None)


def script(cmd, *args, cwd, env=None, timeout=180):
    return subprocess.run([str(BIN / cmd), *map(str, args)], capture_output=True, text=True, cwd=cwd,
                          env={**ENV, **(env or {})}, timeout=timeout)


def refused(r, *fragments):
    text = r.stdout + r.stderr
    assert r.returncode == 2, text
    assert "Traceback" not in text, text
    for f in fragments:
        assert f in text, (f, text)


# ------------------------------------------------------------------------------------------------ overlays
def _overlay(root: Path, rel: str, text: str) -> Path:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


_CALLBACK = """# @package _global_
hydra:
  callbacks:
    pwn:
      _target_: os.system
      command: "touch {mark}"
"""
_SUMMARY_SWAPPED = """# @package _global_
hydra:
  callbacks:
    sweep_summary:
      _target_: builtins.print
"""


@pytest.mark.parametrize("argv", [["cluster=evil"], ["-m", "cluster=evil", "rollout.n=2,4"]])
def test_overlay_callbacks_are_refused(tmp_path, argv):
    mark = tmp_path / "PWNED"
    path = _overlay(tmp_path / "conf", "cluster/evil.yaml", _CALLBACK.format(mark=mark))
    runs = tmp_path / "runs"
    r = script("qwen35rl-plan", *argv, f"trainer.output_root={runs}", cwd=tmp_path,
               env={"QWEN35RL_CONFIG_PATH": str(tmp_path / "conf")})
    refused(r, "hydra.callbacks.pwn", str(path), "remove hydra.callbacks")
    assert not mark.exists() and not runs.exists()


def test_overlay_may_not_swap_the_packaged_callback(tmp_path):
    path = _overlay(tmp_path / "conf", "cluster/swap.yaml", _SUMMARY_SWAPPED)
    r = script("qwen35rl-train", "-m", "cluster=swap", "rollout.n=2,4", f"trainer.output_root={tmp_path / 'runs'}",
               cwd=tmp_path, env={"QWEN35RL_CONFIG_PATH": str(tmp_path / "conf")})
    refused(r, "hydra.callbacks.sweep_summary", str(path))
    assert not (tmp_path / "runs").exists()


def test_packaged_callback_still_runs(tmp_path):
    r = script("qwen35rl-plan", "-m", "rollout.n=4,8", f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path)
    assert "Traceback" not in r.stderr, r.stderr
    assert any((tmp_path / "sweep").glob("*summary*")), list((tmp_path / "sweep").iterdir())


# ------------------------------------------------------------------------------------- URL passwords, `\${`
_URLS = ["ray_address=ray://user:hunter22@head:10001", "data.system_prompt=see https://u:sekret99@hf.co/x"]


@pytest.mark.parametrize("fmt", ["text", "json", "verl"])
def test_url_passwords_never_print(tmp_path, fmt):
    r = script("qwen35rl-plan", *_URLS, f"format={fmt}", cwd=tmp_path)
    text = r.stdout + r.stderr
    assert "Traceback" not in text and "REDACTED" in text, text
    assert "hunter22" not in text and "sekret99" not in text, text


def test_url_password_in_valid_verl_export(tmp_path):
    r = script("qwen35rl-plan", _URLS[1], "format=verl", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "https://u:REDACTED@hf.co/x" in r.stdout and "sekret99" not in r.stdout + r.stderr


def test_train_problems_hide_url_passwords(tmp_path):
    r = script("qwen35rl-train", _URLS[0], f"trainer.output_root={tmp_path / 'runs'}", cwd=tmp_path)
    refused(r, "ray_address", "REDACTED")
    assert "hunter22" not in r.stdout + r.stderr and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("fmt", ["text", "json", "verl"])
def test_literal_interpolation_text_stays_literal(tmp_path, fmt):
    r = script("qwen35rl-plan", r"data.system_prompt=cost \${x} ok", f"format={fmt}", cwd=tmp_path)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr


def test_literal_interpolation_text_in_a_sweep(tmp_path):
    r = script("qwen35rl-plan", "-m", r"data.system_prompt=cost \${x} ok", "rollout.n=4,8",
               f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path)
    assert "Traceback" not in r.stderr and "InterpolationKeyError" not in r.stderr, r.stderr


def test_resolved_config_keeps_the_literal():
    from omegaconf import OmegaConf

    from qwen35rl.config.compose import _escaped, compose

    cfg = compose([r"data.system_prompt=a \${x} ok", "data.val_size=4"])
    assert cfg.data.system_prompt == r"a ${x} ok"
    assert OmegaConf.to_container(cfg, resolve=True)["data"]["system_prompt"] == r"a ${x} ok"
    for text in (r"${a}", r"x\${b}", "\\\\${c} ${d}"):  # backslashes before the ${ come back too
        assert OmegaConf.create({"v": _escaped(text)}).v == text


# ---------------------------------------------------------------------------------- architectures, versions
ARCH = [  # (overrides, key the error names)
    ("model=qwen3_5_tiny_moe model.num_experts_per_tok=9", "model.num_experts_per_tok"),
    ("model=qwen3_5_tiny_moe model.num_experts_per_tok=0", "model.num_experts_per_tok"),
    ("model=qwen3_5_tiny_moe model.num_experts=0", "model.num_experts"),
    ("model.num_key_value_heads=3", "model.num_key_value_heads"),
    ("model.linear_num_value_heads=3", "model.linear_num_value_heads"),
    ("model.mrope_section=[3,3,3]", "model.mrope_section"), ("model.mrope_section=[2,2]", "model.mrope_section"),
    ("model=qwen3_5_tiny_vl model.mrope_section=[4,0,1]", "model.mrope_section"),
    ("model.partial_rotary_factor=0.3", "model.partial_rotary_factor"),
    ("model.vocab_size=100", "model.vocab_size"), ("model=qwen3_5_0_8b model.tokenizer=qwen model.vocab_size=1000",
                                                  "model.vocab_size"),
    ("backend=megatron +backend.transformer_overrides.linear_attention_freq=[1,0,1]",
     "backend.transformer_overrides.linear_attention_freq"),
    ("backend=megatron model=qwen3_5_tiny_moe +backend.transformer_overrides.moe_layer_freq=[1,0,1]",
     "backend.transformer_overrides.moe_layer_freq"),
    ("backend=megatron model=qwen3_5_tiny_vl +backend.transformer_overrides.mrope_section=[1,1]",
     "backend.transformer_overrides.mrope_section"),
]


VERSIONS = [(f"backend=megatron backend.megatron_core_version={v}", "backend.megatron_core_version")
            for v in ("banana", "", "99", "-1", "0.15.0", "latest")]


@pytest.mark.parametrize("line,key", ARCH + VERSIONS, ids=[a for a, _ in ARCH + VERSIONS])
def test_impossible_architectures_are_refused(line, key, capsys):
    from qwen35rl.cli.plan import main

    assert main(line.split(" ")) == 2
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err and f"{key}:" in out + err, out + err
    assert "hint:" in out + err


def test_vocab_below_a_tokenizer_directory(tmp_path, capsys):
    import json

    from qwen35rl.cli.plan import main

    vocab = {f"t{i}": i for i in range(300)}
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"vocab": vocab}, "added_tokens": [{"id": 400}]}))
    assert main([f"model.tokenizer={tmp_path}", "model.vocab_size=320"]) == 2
    assert "try model.vocab_size=401" in capsys.readouterr().out


def test_train_refuses_an_impossible_architecture(tmp_path):
    r = script("qwen35rl-train", "model.num_key_value_heads=3", f"trainer.output_root={tmp_path / 'runs'}",
               cwd=tmp_path)
    refused(r, "model.num_key_value_heads", "try model.num_key_value_heads=4")
    assert not (tmp_path / "runs").exists()


# ------------------------------------------------------------------------ overlays: mandatory fields, bad YAML
_HW = {"name": "mine", "device": "cuda", "nodes": 1, "devices_per_node": 8, "memory_gb": 80, "peak_tflops": 989,
       "ray_resource": "GPU", "collective_backend": "nccl"}


@pytest.mark.parametrize("missing", sorted(_HW))
def test_hw_overlay_missing_a_mandatory_field(tmp_path, missing, capsys, monkeypatch):
    from qwen35rl.cli.plan import main

    if missing in ("nodes", "devices_per_node"):  # these have defaults
        return
    path = _overlay(tmp_path, "hw/mine.yaml", "".join(f"{k}: {v}\n" for k, v in _HW.items() if k != missing))
    monkeypatch.setenv("QWEN35RL_CONFIG_PATH", str(tmp_path))
    assert main(["hw=mine"]) == 2
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err and "MissingMandatoryValue" not in err
    assert f"config error at 'hw.{missing}'" in err and str(path) in err and f"add `{missing}: ...`" in err


def test_train_with_an_overlay_missing_a_field(tmp_path):
    _overlay(tmp_path / "conf", "hw/mine.yaml", "".join(f"{k}: {v}\n" for k, v in _HW.items() if k != "device"))
    r = script("qwen35rl-train", "hw=mine", f"trainer.output_root={tmp_path / 'runs'}", cwd=tmp_path,
               env={"QWEN35RL_CONFIG_PATH": str(tmp_path / "conf")})
    refused(r, "hw.device", "hw/mine.yaml")
    assert not (tmp_path / "runs").exists()


MALFORMED = [  # (file text, what the error says)
    ("ray_address: auto\ntrainer:\n  output_root: [unclosed\n", ":4': not valid YAML at line 4"),
    ("ray_address: auto\n  bad_indent: 1\n", ":2': not valid YAML at line 2, column 13"),
    ("hw: {nodes: 2\n", ":2': not valid YAML at line 2"),
    ("\t\0junk", "not a YAML text file"),
    (b"a: \xff\xfe\n", "not a UTF-8 text file"),
]


@pytest.mark.parametrize("text,says", MALFORMED, ids=range(len(MALFORMED)))
@pytest.mark.parametrize("sweep", [False, True])
def test_malformed_overlay_names_file_and_line(tmp_path, text, says, sweep, capsys, monkeypatch):
    from qwen35rl.cli.plan import main

    path = tmp_path / "cluster" / "bad.yaml"
    path.parent.mkdir()
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    monkeypatch.setenv("QWEN35RL_CONFIG_PATH", str(tmp_path))
    assert main(["-m", "cluster=bad", "rollout.n=2,4"] if sweep else ["cluster=bad"]) == 2
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err and "error at '?'" not in err, err
    assert str(path) in err and says in err, err


# ---------------------------------------------------------------------------------------------------- sweeps
SWEEPS = [  # (argv after -m, key, what the error says)
    ("rollout.n=range(0)", "rollout.n", "has no values"), ("rollout.n=range(8,2)", "rollout.n", "has no values"),
    ("rollout.n=range(2,8,0)", "rollout.n", "non-zero step"), ("rollout.n=glob(*)", "rollout.n", "not a group"),
    ("model=glob(nothing*)", "model", "matches no option"),
]


@pytest.mark.parametrize("line,key,says", SWEEPS, ids=[s[0] for s in SWEEPS])
@pytest.mark.parametrize("cmd", ["plan", "train"])
def test_bad_sweeps_are_refused(line, key, says, cmd, tmp_path, capsys):
    from qwen35rl.cli.plan import main as plan_main
    from qwen35rl.cli.train import main as train_main

    main = plan_main if cmd == "plan" else train_main
    assert main(["-m", line, f"trainer.output_root={tmp_path / 'runs'}"]) == 2
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err and f"config error at '{key}'" in err and says in err, err
    assert not (tmp_path / "runs").exists()


def test_glob_sweep_over_a_group_plans(tmp_path):
    r = script("qwen35rl-plan", "-m", "model=glob(qwen3_5_tiny_vl*)", f"hydra.sweep.dir={tmp_path / 'sweep'}",
               cwd=tmp_path)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "model=qwen3_5_tiny_vl " in r.stderr and "model=qwen3_5_tiny_vl_moe" in r.stderr


@pytest.mark.parametrize("cmd,argv,key", [
    ("qwen35rl-plan", ["-m", "rollout.n=4,8", "hydra.sweep.dir={file}/x"], "hydra.sweep.dir"),
    ("qwen35rl-plan", ["-m", "rollout.n=4,8", "trainer.output_root={file}"], "trainer.output_root"),
    ("qwen35rl-train", ["-m", "rollout.n=4,8", "trainer.output_root={file}/deeper"], "trainer.output_root"),
    ("qwen35rl-train", ["hydra.run.dir={file}/x"], "hydra.run.dir"),
])
def test_output_directory_under_a_file(tmp_path, cmd, argv, key):
    file = tmp_path / "a_file"
    file.write_text("")
    r = script(cmd, *[a.format(file=file) for a in argv], cwd=tmp_path)
    refused(r, f"config error at '{key}'", f"{file} is not a directory")
    assert file.read_text() == "" and sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]


# --------------------------------------------------------------------------------------------------- rewards
_SCORE = "def score(response, answer, example):\n    return 1.0 if answer in response else 0.0\n"


def test_reward_from_a_file_trains_as_the_plan_says(tmp_path):
    reward = tmp_path / "my_reward.py"
    reward.write_text(_SCORE)
    argv = [f"data.reward={reward}:score", f"trainer.output_root={tmp_path / 'runs'}"]
    assert script("qwen35rl-plan", *argv, cwd=tmp_path).returncode == 0
    r = script("qwen35rl-train", *argv, "trainer.total_steps=1", "trainer.test_freq=-1", "trainer.save_freq=-1",
               cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    metrics = [line for p in (tmp_path / "runs").rglob("metrics.jsonl") for line in p.read_text().splitlines()]
    assert metrics and '"reward/failed": 0.0' in metrics[0]  # the scoring workers loaded the file too


@pytest.mark.parametrize("body,says", [
    ("import sys\nsys.exit(0)\n" + _SCORE, "called sys.exit(0) while being imported"),
    ("raise RuntimeError('boom')\n", "RuntimeError: boom"),
    (_SCORE.replace("def score", "def other"), "has no attribute 'score'"),
])
@pytest.mark.parametrize("as_module", [False, True])
def test_reward_that_does_not_load_is_refused_before_anything(tmp_path, body, says, as_module):
    (tmp_path / "bad_reward_mod.py").write_text(body)
    name = "bad_reward_mod:score" if as_module else f"{tmp_path / 'bad_reward_mod.py'}:score"
    r = script("qwen35rl-train", f"data.reward={name}", f"trainer.output_root={tmp_path / 'runs'}", cwd=tmp_path,
               env={"PYTHONPATH": str(tmp_path)})
    refused(r, "reward_not_loadable", "data.reward", says)
    assert not (tmp_path / "runs").exists()


# ------------------------------------------------------------------------------------------------ other tools
VERL_FIXTURE = Path(__file__).resolve().parents[1] / "config" / "verl" / "fixtures" / "fsdp_27b.sh"


@pytest.mark.parametrize("argv,key,says", [
    (["--name", "../../escaped"], None, None),  # the name is a file name: written inside --out
    (["--name", ".."], "--name", "has no letter or digit"),
    (["--name", ""], "--name", "has no letter or digit"),
    (["--out", "{file}"], "--out", "is not a directory"),
    (["--out", "{file}/deeper"], "--out", "is not a directory"),
])
def test_import_names_and_out(tmp_path, argv, key, says):
    file = tmp_path / "a_file"
    file.write_text("")
    out = tmp_path / "out"
    argv = [a.format(file=file) for a in argv]
    r = script("qwen35rl-import", "verl", VERL_FIXTURE, *(argv if "--out" in argv else [*argv, "--out", out]),
               cwd=tmp_path)
    written = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    if key is None:
        assert "Traceback" not in r.stderr, r.stderr
        assert written == ["a_file", "out/experiment/escaped.yaml"], written
        return
    refused(r, f"cannot import '{key}'", says)
    assert written == ["a_file"] and file.read_text() == ""


def _gsm8k_copy(root: Path, broken: bool = False) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    (root / "main").mkdir(parents=True)
    for split in ("train", "test"):
        path = root / "main" / f"{split}-00000-of-00001.parquet"
        if broken and split == "train":
            path.write_text("question,answer\nq,4\n")  # a CSV under a parquet name
        else:
            pq.write_table(pa.table({"question": ["q"], "answer": ["so\n#### 4"]}), path)
    return root


@pytest.mark.parametrize("flag,value,says", [
    ("--out", "{file}", "is not a directory"), ("--out", "{file}/deeper", "is not a directory"),
    ("--cache-dir", "{file}", "is not a directory"), ("--source", None, "is not a parquet file"),
])
def test_data_prepare_bad_places(tmp_path, flag, value, says):
    file = tmp_path / "a_file"
    file.write_text("")
    source = _gsm8k_copy(tmp_path / "src", broken=value is None)
    args = {"--out": str(tmp_path / "out"), "--source": str(source), "--cache-dir": str(tmp_path / "cache")}
    if value is not None:
        args[flag] = value.format(file=file)
    r = script("qwen35rl-data", "prepare", "gsm8k", *[x for kv in args.items() for x in kv], cwd=tmp_path)
    refused(r, f"error: {flag}", says)
    assert not (tmp_path / "out").exists() and file.read_text() == ""


# ------------------------------------------------------------------------------------------ split placement
@pytest.mark.parametrize("line", ["placement=split placement.rollout_devices=2",
                                  "placement=split hw.devices_per_node=4 placement.rollout_devices=5",
                                  "placement=split hw.devices_per_node=4 parallelism=auto placement.rollout_devices=4"])
@pytest.mark.parametrize("fmt", ["text", "json", "verl"])
def test_split_pool_as_large_as_the_world(line, fmt, capsys):
    from qwen35rl.cli.plan import main

    assert main([*line.split(" "), f"format={fmt}"]) == 2  # as train refuses it
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err and "placement.rollout_devices" in out + err, out + err


# ------------------------------------------------------------------------------------------------ data files
def _jsonl(path: Path, rows) -> Path:
    import json

    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


_GOOD = [{"question": f"q{i}", "answer": str(i)} for i in range(16)]
TEXT_DATA = [  # (file name, rows or raw text, what the refusal says)
    ("nocol.jsonl", [{"quest": "q", "answer": "1"}] * 16, "no column 'question' (data.prompt_key)"),
    ("null.jsonl", _GOOD[:3] + [{"question": "q", "answer": None}], "row 3: the answer (answer) is null"),
    ("nan.jsonl", _GOOD[:3] + [{"question": "q", "answer": float("nan")}], "is NaN"),
    ("list.jsonl", _GOOD[:3] + [{"question": "q", "answer": [1, 2]}], "is list"),
    ("empty.jsonl", "", "holds no rows"), ("csv.jsonl", "question,answer\nq,1\n", "cannot be read as a data file"),
    ("fake.parquet", "not parquet\n", "cannot be read as a data file"),
]


@pytest.mark.parametrize("name,rows,says", TEXT_DATA, ids=[t[0] for t in TEXT_DATA])
def test_text_data_refused_before_anything_trains(tmp_path, name, rows, says):
    bad = tmp_path / name
    bad.write_text(rows) if isinstance(rows, str) else _jsonl(bad, rows)
    good = _jsonl(tmp_path / "good.jsonl", _GOOD)
    r = script("qwen35rl-train", "data=gsm8k", f"data.train_files=[{bad}]", f"data.val_files=[{good}]",
               "data.max_prompt_length=256", f"trainer.output_root={tmp_path / 'runs'}", cwd=tmp_path)
    refused(r, "data_unusable", str(bad), says)
    assert not list((tmp_path / "runs").rglob("checkpoints/*"))


def _png() -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 10, 10)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize("row,says", [
    ({"problem": "<image> a", "answer": "1", "images": [{"bytes": b"not a png", "path": None}]}, "UnidentifiedImageError"),
    ({"problem": "<image> <image> a", "answer": "1", "images": [{"bytes": "PNG", "path": None}]},
     "2 <image> placeholders but the row has 1 image(s)"),
    ({"problem": "a", "answer": "1", "images": []}, "are an empty list"),
    ({"problem": "a", "answer": "1", "images": None}, "are null"),
])
def test_image_rows_refused(tmp_path, row, says):
    from omegaconf import OmegaConf

    from qwen35rl.config.compose import compose
    from qwen35rl.data import DataError, build_dataset

    import pyarrow as pa
    import pyarrow.parquet as pq

    good = {"problem": "<image> ok", "answer": "2", "images": [{"bytes": _png(), "path": None}]}
    if row["images"]:
        row = {**row, "images": [{**im, "bytes": _png() if im["bytes"] == "PNG" else im["bytes"]} for im in row["images"]]}
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([good, row]), path)
    cfg = compose(["model=qwen3_5_tiny_vl", "data=geo3k", f"data.train_files=[{path}]"])
    with pytest.raises(DataError, match="row 1") as e:
        build_dataset(OmegaConf.create(OmegaConf.to_container(cfg.data)), None, "train")
    assert says in str(e.value) and str(path) in str(e.value)
