"""A corpus of bad command lines: each exits 2 naming the key, without a traceback (in-process, plus a few real
subprocesses)."""
import glob
import json
import os
import re
import subprocess
import sys

import pytest

from qwen35rl.cli.plan import main

R = [  # (argv, key the error names)
    ("backend.micro_batch_size_per_device=0", "backend.micro_batch_size_per_device"),
    ("hw.nodes=0", "hw.nodes"), ("hw.nodes=-1", "hw.nodes"), ("hw.nodes=100000", "hw.nodes"),
    ("hw.devices_per_node=0", "hw.devices_per_node"), ("hw.devices_per_node=5000", "hw.devices_per_node"),
    ("data.train_batch_size=99999999999999999999999", "data.train_batch_size"),
    ("data.train_batch_size=0", "data.train_batch_size"), ("data.train_batch_size=-4", "data.train_batch_size"),
    ("data.val_batch_size=0", "data.val_batch_size"), ("data.max_prompt_length=0", "data.max_prompt_length"),
    ("data.max_response_length=0", "data.max_response_length"), ("data.reward_timeout_s=0", "data.reward_timeout_s"),
    ("data.synthetic_size=0", "data.synthetic_size"), ("data.val_size=-1", "data.val_size"), ("data.seed=-1", "data.seed"),
    ("rollout.top_k=-5", "rollout.top_k"), ("rollout.top_k=0", "rollout.top_k"), ("rollout.top_p=0", "rollout.top_p"),
    ("rollout.top_p=1.5", "rollout.top_p"), ("rollout.temperature=-1", "rollout.temperature"),
    ("rollout.temperature=nan", "rollout.temperature"), ("rollout.gpu_memory_utilization=0", "rollout.gpu_memory_utilization"),
    ("rollout.gpu_memory_utilization=1.01", "rollout.gpu_memory_utilization"), ("rollout.n=0", "rollout.n"),
    ("rollout.n=1", "rollout.n"), ("rollout.max_model_len=0", "rollout.max_model_len"),
    ("rollout.max_num_batched_tokens=0", "rollout.max_num_batched_tokens"), ("rollout.max_num_seqs=0", "rollout.max_num_seqs"),
    ("rollout.weight_sync_bucket_mb=0", "rollout.weight_sync_bucket_mb"), ("rollout.val_temperature=-0.1", "rollout.val_temperature"),
    ("trainer.total_steps=0", "trainer.total_steps"), ("trainer.total_steps=-3", "trainer.total_steps"),
    ("trainer.total_epochs=0", "trainer.total_epochs"), ("trainer.save_freq=0", "trainer.save_freq"),
    ("trainer.save_freq=-2", "trainer.save_freq"), ("trainer.test_freq=0", "trainer.test_freq"),
    ("trainer.max_keep_checkpoints=-1", "trainer.max_keep_checkpoints"), ("trainer.log_every=0", "trainer.log_every"),
    ("trainer.placement_timeout_s=-1", "trainer.placement_timeout_s"), ("trainer.seed=-1", "trainer.seed"),
    ("backend.weight_decay=-1", "backend.weight_decay"), ("backend.grad_clip=-1", "backend.grad_clip"),
    ("backend.lr_warmup_steps=-5", "backend.lr_warmup_steps"), ("backend.lr=0", "backend.lr"), ("backend.lr=-1e-6", "backend.lr"),
    ("backend.lr=inf", "backend.lr"), ("backend.lr=nan", "backend.lr"), ("backend.lr=5", "backend.lr"),
    ("backend.min_lr_ratio=2", "backend.min_lr_ratio"), ("backend.max_tokens_per_device=0", "backend.max_tokens_per_device"),
    ("backend.logprob_chunk_size=0", "backend.logprob_chunk_size"), ("backend.dist_timeout_s=0", "backend.dist_timeout_s"),
    ("backend.betas=[0.9]", "backend.betas"), ("backend.betas=[0.9,1.5]", "backend.betas"), ("backend.betas=[]", "backend.betas"),
    ("backend.betas=[0.9,0.99,0.999]", "backend.betas"),
    ("backend=megatron backend.recompute_num_layers=0", "backend.recompute_num_layers"),
    ("backend=megatron backend.optimizer_offload_fraction=1.5", "backend.optimizer_offload_fraction"),
    ("backend=megatron backend.moe_aux_loss_coeff=-1", "backend.moe_aux_loss_coeff"),
    ("backend=megatron parallelism.etp=3", "parallelism.etp"), ("backend=megatron parallelism.tp=3", "parallelism.tp"),
    ("backend=megatron parallelism.pp=0", "parallelism.pp"), ("parallelism.cp=0", "parallelism.cp"),
    ("parallelism.sp=0", "parallelism.sp"), ("parallelism.sp=3", "parallelism.sp"), ("parallelism.fsdp_size=0", "parallelism.fsdp_size"),
    ("parallelism.fsdp_size=3", "parallelism.fsdp_size"), ("parallelism.vpp=0", "parallelism.vpp"),
    ("parallelism.rollout.tp=0", "parallelism.rollout.tp"), ("parallelism.rollout.dp=0", "parallelism.rollout.dp"),
    ("parallelism.rollout.ep=0", "parallelism.rollout.ep"), ("parallelism=auto hw.nodes=0", "hw.nodes"),
    ("parallelism=auto backend.micro_batch_size_per_device=0", "backend.micro_batch_size_per_device"),
    ("model.num_attention_heads=0", "model.num_attention_heads"), ("model.num_key_value_heads=0", "model.num_key_value_heads"),
    ("model.num_hidden_layers=0", "model.num_hidden_layers"), ("model.hidden_size=-8", "model.hidden_size"),
    ("model.head_dim=0", "model.head_dim"), ("model.vocab_size=0", "model.vocab_size"),
    ("model.rms_norm_eps=0", "model.rms_norm_eps"), ("model.partial_rotary_factor=0", "model.partial_rotary_factor"),
    ("model.linear_num_value_heads=0", "model.linear_num_value_heads"), ("model.num_experts=-1", "model.num_experts"),
    ("model.max_position_embeddings=0", "model.max_position_embeddings"), ("model.rope_theta=0", "model.rope_theta"),
    ("hw.memory_gb=0", "hw.memory_gb"), ("hw.reserve_gib=-1", "hw.reserve_gib"), ("hw.allocator_slack=-0.5", "hw.allocator_slack"),
    ("hw.peak_tflops=0", "hw.peak_tflops"), ("algorithm.mini_batch_size=0", "algorithm.mini_batch_size"),
    ("algorithm.ppo_epochs=0", "algorithm.ppo_epochs"), ("algorithm.clip_ratio_low=1", "algorithm.clip_ratio_low"),
    ("algorithm.clip_ratio_c=1", "algorithm.clip_ratio_c"), ("algorithm.kl_loss_coef=-1", "algorithm.kl_loss_coef"),
    ("algorithm.entropy_coef=-0.1", "algorithm.entropy_coef"), ("algorithm.loss_scale_factor=0", "algorithm.loss_scale_factor"),
    ("algorithm.dynamic_sampling.max_rounds=-1", "algorithm.dynamic_sampling.max_rounds"),
    ("algorithm.overlong_shaping.buffer_len=0", "algorithm.overlong_shaping.buffer_len"),
    ("algorithm.mini_batch_size=3", "algorithm.mini_batch_size"),
    ("data.max_prompt_length=300000", "data.max_prompt_length"),
    ("trainer.trackers=[console,wandbb]", "trainer.trackers"), ("trainer.resume=bogus", "trainer.resume"),
    ("model.tokenizer=/nonexistent", "model.tokenizer"), ("trainer.output_root=/etc/passwd", "trainer.output_root"),
    ("trainer.run_name=" + "x" * 5000, "trainer.run_name"), ("trainer.run_name=a/b", "trainer.run_name"),
    ("model.init=pretrained model.path=/nonexistent", "model.path"), ("data.reward=nosuchpkg.mod:fn", "data.reward"),
    ("data.reward=/no/such/file.py:score", "data.reward"), ("data.reward=exact_matc", "data.reward"),
    ("ray_address=not_a_url", "ray_address"), ("ray_address=ray://h:99999", "ray_address"),
    ("hw.nodes=four", "hw.nodes"), ("rollout.n=two", "rollout.n"), ("backend.lr=fast", "backend.lr"),
    ("hw.nodez=4", "hw.nodez"), ("model=qwen3_5_27", "model"), ("rollout.engine=vlm", "rollout.engine"),
    ("data.truncation=middle", "data.truncation"), ("trainer.launcher=slurm", "trainer.launcher"),
    ("trainer.launcher=local hw.nodes=2", "trainer.launcher"), ("trainer.launcher=local hw=gpu_1node", "trainer.launcher"),
    ("model.name=qwen\u0417", "model.name"),
    # parse errors: the key and the reason
    ("trainer.trackers=[console,jsonl", "trainer.trackers"), ("trainer.trackers=[console,jsonl]]", "trainer.trackers"),
    ("data.train_batch_size=\u0663\u0662", "data.train_batch_size"),  # Arabic-Indic digits
    ("data.train_batch_size=\uff13\uff12", "data.train_batch_size"),  # fullwidth digits
    ("model=qwen3_5_tin\u0443", "model"), ("model=qwen3_5_35b_\u04303b", "model"),  # Cyrillic u, a
    ("=", "'='"), ("~model", "model"), ("~hw", "hw"), ("trainr.total_steps=3", "trainer.total_steps"),
    ("trainer.run_name='abc", "trainer.run_name"), ('trainer.run_name="abc', "trainer.run_name"),
    ("hw.nodes==4", "hw.nodes"), (["hw .nodes=4"], "hw .nodes"), ([""], "empty override"), ("+", "'+'"),
    ("++=", "'++='"), ("hw.nodes", "hw.nodes"), ("+++hw.nodes=4", "hw.nodes"),
    # a hint stays inside the field's range; plan-time model.path
    ("data.train_batch_size=2147483647", "data.train_batch_size"), ("model=qwen3_5_0_8b", "model.path"),
    ("hw.env.WANDB_API_KEY=x", "hw.env.WANDB_API_KEY"),
]
CASES = [(a if isinstance(a, list) else a.split(" ") if not a.startswith("trainer.run_name=x") else [a], k)
         for a, k in R if k]


def test_corpus_has_at_least_100_lines():
    assert len(CASES) >= 100


def _hint_values_in_range(text):
    """Every `try key=value` hint in `text` whose key declares a range proposes a value inside it."""
    from qwen35rl.config.rules import _in_span, declared_ranges

    for key, raw in re.findall(r"hint:\s+try ([\w.]+)=(\S+)", text):
        if key not in declared_ranges():
            continue
        span, also, nullable, _ = declared_ranges()[key]
        if raw == "null":
            assert nullable, (key, raw)
            continue
        v = float(raw)
        assert v in also or _in_span(v, span), f"hint proposes {key}={raw}, outside its range {span}"


@pytest.mark.parametrize("argv,key", CASES, ids=[" ".join(a)[:60] for a, _ in CASES])
def test_plan_refuses(argv, key, capsys):
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    assert key in out + err
    _hint_values_in_range(out + err)


def test_hint_near_the_limit_stays_in_range(capsys):
    assert main(["data.train_batch_size=2147483647"]) == 2
    out, err = capsys.readouterr()
    assert "try data.train_batch_size=2147483646" in out + err  # n=16 over DP2 x micro 16: a multiple of 2
    _hint_values_in_range(out + err)


def test_parse_errors_say_why(capsys):
    cases = {
        "trainer.trackers=[console,jsonl": ["'trainer.trackers'", "'[' is never closed"],
        "data.train_batch_size=\u0663\u0662": ["ARABIC-INDIC DIGIT THREE", "data.train_batch_size=32"],
        "data.train_batch_size=\uff13\uff12": ["FULLWIDTH DIGIT THREE", "data.train_batch_size=32"],
        "model=qwen3_5_tin\u0443": ["CYRILLIC SMALL LETTER U", "did you mean 'qwen3_5_tiny'", "position 18"],
        "=": ["no key before '='"], "~model": ["deletes the required group 'model'"],
        "trainr.total_steps=3": ["did you mean trainer.total_steps?", "unknown top-level key 'trainr'"],
        "hw.nodes==4": ["try hw.nodes=4"], "": ["empty string"], "+": ["'+' alone names no key"],
    }
    for override, fragments in cases.items():
        assert main([override]) == 2, override
        out, err = capsys.readouterr()
        assert "Traceback" not in out + err and "config error at '?'" not in err and "error at '['" not in err, err
        for f in fragments:
            assert f in err, (override, f, err)


def test_config_error_never_echoes_a_secret(capsys):
    for argv in (["hw.env.WANDB_API_KEY=x"], ["hw.env.WANDB_API_KEY=abc123secret"],
                 ["+hw.env.HF_TOKEN=hf_secretvalue", "hw.nodez=4"], ["hw.env.WANDB_API_KEY=abc123secret", "format=json"]):
        assert main(argv) == 2
        out, err = capsys.readouterr()
        secret = argv[0].split("=", 1)[1]
        assert "hw.env" in err and "REDACTED" in err + out or "hw.nodez" in err
        assert f"value:   {secret}" not in err and f"={secret}" not in out + err
        if len(secret) > 3:
            assert secret not in out + err


TRAIN_SAMPLE = [  # a parse error, a range error, a path error, a layout error, an unknown key/option, model.path
    ("trainer.trackers=[console,jsonl", "trainer.trackers"), ("rollout.top_p=1.5", "rollout.top_p"),
    ("model.tokenizer=/nonexistent", "model.tokenizer"), ("backend=megatron parallelism.tp=3", "parallelism.tp"),
    ("hw.nodez=4", "hw.nodez"), ("model=qwen3_5_27", "model"), ("trainr.total_steps=3", "trainer.total_steps"),
    ("model=qwen3_5_0_8b", "model.path"),
]
_TRAIN_PROBE = """
import contextlib, io, json, sys
from qwen35rl.cli.train import main
out = []
for argv in json.loads(sys.argv[1]):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        rc = main(argv)
    out.append({"rc": rc, "text": buf.getvalue(), "ray": sorted(m for m in sys.modules if m.split('.')[0] == 'ray')})
print(json.dumps(out))
"""


def test_train_refuses_a_sample_before_ray_starts(tmp_path):
    sessions = set(glob.glob("/tmp/ray/session_*"))
    argvs = [a.split(" ") for a, _ in TRAIN_SAMPLE]
    env = {**os.environ, "RAY_TMPDIR": str(tmp_path / "ray")}
    r = subprocess.run([sys.executable, "-c", _TRAIN_PROBE, json.dumps(argvs)], capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    for (line, key), res in zip(TRAIN_SAMPLE, json.loads(r.stdout.strip().splitlines()[-1])):
        assert res["rc"] == 2, (line, res["text"])
        assert key in res["text"] and "Traceback" not in res["text"], (line, res["text"])
        assert res["ray"] == [], (line, res["ray"])  # Ray never imported, let alone started
    assert set(glob.glob("/tmp/ray/session_*")) == sessions and not (tmp_path / "ray").exists()


@pytest.mark.parametrize("argv,key", CASES[:: max(len(CASES) // 4, 1)][:4])
def test_plan_subprocess_refuses(argv, key):
    r = subprocess.run([sys.executable, "-m", "qwen35rl.cli.plan", *argv], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr and key in r.stdout + r.stderr
