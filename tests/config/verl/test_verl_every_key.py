"""verl -> qwen35rl -> verl for every key of the table: one launch per backend sets each key `keys.py` carries (and
each key qwen35rl answers by what it always does) to a value written here by hand, unlike verl's default where the
key allows; the import's overlay is composed, exported and composed again in verl 0.9.1's tree, and every key comes
back with the launch's value. A key added to the table without a value here fails `test_launch_covers_the_table`."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List

import pytest

from qwen35rl.config.compose import compose
from qwen35rl.config.paths import ENV_CONFIG_PATH
from qwen35rl.config.verl.exporter import export, hydra_value
from qwen35rl.config.verl.importer import command, import_launch, read_launch, write_overlay
from qwen35rl.config.verl.keys import ACTOR, FIXED, MODEL, OVERRIDE_OPT, OVERRIDE_TC, REF, ROLLOUT, get, keys_for
from tests.config.verl.test_verl_real_scripts import SAME_SETTING, UNORDERED, _equal, _files
from tests.config.verl.verl_tree import compose_verl

COMMON = {
    "trainer.nnodes": 1, "trainer.n_gpus_per_node": 8, "trainer.device": "cuda",
    "data.train_files": "/data/geo3k/train.parquet", "data.val_files": "/data/geo3k/test.parquet",
    "data.prompt_key": "question", "data.image_key": "pics", "data.train_batch_size": 96, "data.val_batch_size": 32,
    "data.max_prompt_length": 700, "data.max_response_length": 1500, "data.truncation": "left",
    "data.filter_overlong_prompts": False, "data.seed": 7, "data.shuffle": False,
    "reward.custom_reward_function.path": "/rewards/geo3k boxed.py", "reward.custom_reward_function.name": "score_it",
    f"{ACTOR}.freeze_vision_tower": True, f"{MODEL}.trust_remote_code": True, "data.trust_remote_code": True,
    "ray_kwargs.ray_init.runtime_env.py_executable": "uv run --frozen --extra vllm python3",
    f"{ROLLOUT}.name": "vllm", f"{ROLLOUT}.n": 6, f"{ROLLOUT}.temperature": 0.8, f"{ROLLOUT}.top_p": 0.95,
    f"{ROLLOUT}.top_k": 50, f"{ROLLOUT}.gpu_memory_utilization": 0.45, f"{ROLLOUT}.max_model_len": 2400,
    f"{ROLLOUT}.max_num_batched_tokens": 4096, f"{ROLLOUT}.max_num_seqs": 64,
    f"{ROLLOUT}.enable_chunked_prefill": False, f"{ROLLOUT}.enable_prefix_caching": False,
    f"{ROLLOUT}.enforce_eager": True, f"{ROLLOUT}.free_cache_engine": False,
    f"{ROLLOUT}.cudagraph_capture_sizes": [1, 2, 4, 8], f"{ROLLOUT}.dtype": "bfloat16",
    f"+{ROLLOUT}.engine_kwargs.vllm.compilation_config.cudagraph_mode": "PIECEWISE",
    f"{ROLLOUT}.val_kwargs.temperature": 0.3,
    f"{ROLLOUT}.checkpoint_engine.update_weights_bucket_megabytes": 1024,
    f"{ACTOR}.ppo_mini_batch_size": 24, f"{ACTOR}.ppo_micro_batch_size_per_gpu": 3, f"{ACTOR}.use_dynamic_bsz": True,
    f"{ACTOR}.ppo_max_token_len_per_gpu": 6000,
    f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu": 6, f"{REF}.log_prob_micro_batch_size_per_gpu": 6,
    f"{ROLLOUT}.log_prob_max_token_len_per_gpu": 12000, f"{REF}.log_prob_max_token_len_per_gpu": 12000,
    "algorithm.adv_estimator": "grpo", "algorithm.norm_adv_by_std_in_grpo": False, "algorithm.use_kl_in_reward": True,
    "algorithm.filter_groups.enable": True, "algorithm.filter_groups.max_num_gen_batches": 4,
    "algorithm.filter_groups.metric": "reward",
    f"{ACTOR}.ppo_epochs": 2, f"{ACTOR}.shuffle": True, f"{ACTOR}.clip_ratio_low": 0.15,
    f"{ACTOR}.clip_ratio_high": 0.3, f"{ACTOR}.clip_ratio_c": 2.5, f"{ACTOR}.loss_agg_mode": "seq-mean-token-mean",
    f"{ACTOR}.loss_scale_factor": 2048, f"{ACTOR}.entropy_coeff": 0.001, f"{ACTOR}.use_kl_loss": True,
    f"{ACTOR}.kl_loss_coef": 0.05, f"{ACTOR}.kl_loss_type": "mse",
    f"{ACTOR}.optim.lr": 3e-6, f"{ACTOR}.optim.lr_warmup_steps": 7, f"{ACTOR}.optim.weight_decay": 0.05,
    f"{ACTOR}.optim.betas": [0.9, 0.95], f"{ACTOR}.optim.clip_grad": 0.5,
    "actor_rollout_ref.nccl_timeout": 1200, f"{ACTOR}.use_torch_compile": False,
    "trainer.total_epochs": 3, "trainer.total_training_steps": 200, "trainer.save_freq": 25, "trainer.test_freq": 5,
    "trainer.val_before_train": False, "trainer.project_name": "every_key", "trainer.log_val_generations": 8,
    "trainer.logger": ["console", "tensorboard"], "trainer.max_actor_ckpt_to_keep": 3,
    "trainer.resume_mode": "resume_path", "trainer.resume_from_path": "/ckpt/every_key/step_50",
    "trainer.default_local_dir": "/ckpt/every_key", "trainer.balance_batch": False,
    # what qwen35rl always does
    f"{ACTOR}.checkpoint.save_contents": ["optimizer", "model", "extra"], "trainer.critic_warmup": 0,
    f"{ROLLOUT}.calculate_log_probs": True, "data.validation_shuffle": False,
    f"{ROLLOUT}.ignore_eos": False, f"{ROLLOUT}.mode": "async",
}
LAUNCHES: Dict[str, Dict[str, Any]] = {
    "fsdp": {
        **COMMON, f"{MODEL}.path": "/models/Qwen3.5-27B", "trainer.experiment_name": "every_key_fsdp",
        f"{ACTOR}.strategy": "fsdp2", f"{REF}.strategy": "fsdp2",
        f"{ROLLOUT}.tensor_model_parallel_size": 4, f"{ROLLOUT}.expert_parallel_size": 1,
        f"{ROLLOUT}.data_parallel_size": 1,
        "algorithm.rollout_correction.bypass_mode": True, "algorithm.rollout_correction.rollout_is": None,
        "algorithm.rollout_correction.rollout_is_threshold": 2.0,
        f"{ACTOR}.optim.lr_scheduler_type": "cosine", f"{ACTOR}.optim.min_lr_ratio": 0.1,
        f"{ACTOR}.fsdp_config.fsdp_size": 4, f"{ACTOR}.ulysses_sequence_parallel_size": 2,
        f"{ACTOR}.fsdp_config.param_offload": True, f"{ACTOR}.fsdp_config.optimizer_offload": True,
        f"{ACTOR}.fsdp_config.offload_policy": True, f"{ACTOR}.fsdp_config.reshard_after_forward": False,
        f"{MODEL}.use_remove_padding": False, f"{MODEL}.enable_gradient_checkpointing": False,
        f"{ACTOR}.entropy_from_logits_with_chunking": False,
    },
    "megatron": {
        **COMMON, "model_engine": "megatron", f"{MODEL}.path": "/models/Qwen3.5-35B-A3B",
        "trainer.experiment_name": "every_key_megatron", f"{ACTOR}.strategy": "megatron",
        f"{REF}.strategy": "megatron",
        f"{ACTOR}.megatron.use_mbridge": True,
        f"{ROLLOUT}.tensor_model_parallel_size": 4, f"{ROLLOUT}.expert_parallel_size": 8,
        f"{ROLLOUT}.data_parallel_size": 2,
        "algorithm.rollout_correction.bypass_mode": False, "algorithm.rollout_correction.rollout_is": "token",
        "algorithm.rollout_correction.rollout_is_threshold": 1.5,
        f"{ACTOR}.optim.lr_decay_style": "cosine", f"{ACTOR}.optim.min_lr": 3e-7,
        f"{ACTOR}.optim.use_precision_aware_optimizer": True,
        f"+{OVERRIDE_OPT}.optimizer_cpu_offload": True, f"+{OVERRIDE_OPT}.optimizer_offload_fraction": 0.5,
        f"+{OVERRIDE_OPT}.overlap_cpu_optimizer_d2h_h2d": True,
        f"{ACTOR}.megatron.tensor_model_parallel_size": 2, f"{ACTOR}.megatron.pipeline_model_parallel_size": 2,
        f"{ACTOR}.megatron.context_parallel_size": 2, f"{ACTOR}.megatron.expert_model_parallel_size": 4,
        f"{ACTOR}.megatron.expert_tensor_parallel_size": 1,
        f"{ACTOR}.megatron.virtual_pipeline_model_parallel_size": 2,
        f"{ACTOR}.megatron.param_offload": True, f"{ACTOR}.megatron.optimizer_offload": True,
        f"{ACTOR}.megatron.use_distributed_optimizer": False, f"{ACTOR}.megatron.use_dist_checkpointing": True,
        f"{ACTOR}.megatron.dtype": "bfloat16", f"{MODEL}.use_remove_padding": False,
        f"{OVERRIDE_TC}.recompute_granularity": "full", f"{OVERRIDE_TC}.recompute_method": "block",
        f"{OVERRIDE_TC}.recompute_num_layers": 2,
        f"+{OVERRIDE_TC}.moe_grouped_gemm": True, f"+{OVERRIDE_TC}.moe_permute_fusion": True,
        f"+{OVERRIDE_TC}.moe_aux_loss_coeff": 0.02, f"+{OVERRIDE_TC}.moe_z_loss_coeff": 0.001,
        f"+{OVERRIDE_TC}.moe_token_dispatcher_type": "allgather",
        f"+{OVERRIDE_TC}.use_flash_attn": True, f"+{OVERRIDE_TC}.use_naive_l2norm": True,
    },
}
"""One override per key (a `+` where verl 0.9.1's tree lacks the key)."""
MISSING = object()
_RUNS: Dict[str, Any] = {}


def _argv(backend: str) -> List[str]:
    return [f"{k}={hydra_value(v)}" for k, v in LAUNCHES[backend].items()]


def _run(backend: str, tmp_path_factory) -> Any:
    if backend not in _RUNS:
        argv = _argv(backend)
        imp = import_launch(argv, {}, device="gpu")
        out = tmp_path_factory.mktemp(f"every-{backend}")
        write_overlay(imp, out, "every key")
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(ENV_CONFIG_PATH, str(out))
            cfg = compose(command(imp)[1:])
        exported = export(cfg)
        _RUNS[backend] = (argv, imp, cfg, exported, compose_verl(exported["argv"]))
    return _RUNS[backend]


@pytest.mark.parametrize("backend", sorted(LAUNCHES))
def test_launch_covers_the_table(backend):
    """Every verl name the exporter writes for this backend, and every key answered by what qwen35rl always does,
    has a value in the launch."""
    keys = {k.lstrip("+") for k in LAUNCHES[backend]}
    table = {k.verl for k in keys_for(backend) if k.exported} | {f.verl for f in FIXED if backend in f.backends}
    assert not table - keys, sorted(table - keys)


@pytest.mark.parametrize("backend", sorted(LAUNCHES))
def test_every_key_carried(backend, tmp_path_factory):
    argv, imp, _, _, _ = _run(backend, tmp_path_factory)
    assert imp.not_carried == [] and imp.dropped == []
    keys = set(read_launch(argv).values)
    assert set(imp.carried) | set(imp.defaults) | set(imp.fixed) == keys
    # hand-picked values unlike qwen35rl's: most keys are carried into the overlay, not found already composed
    assert len(imp.carried) >= 0.75 * (len(keys) - len(imp.fixed)), sorted(imp.defaults)


@pytest.mark.parametrize("backend", sorted(LAUNCHES))
def test_every_key_comes_back_with_the_launchs_value(backend, tmp_path_factory):
    argv, imp, _, exported, tree = _run(backend, tmp_path_factory)
    values = read_launch(argv).values
    differ = {}
    for key, want in values.items():
        got = get(tree, SAME_SETTING.get(key, key), MISSING)
        if key in ("data.train_files", "data.val_files"):
            want, got = _files(want), _files(got)
        if key in UNORDERED:
            want, got = sorted(want), sorted(got)
        if got is MISSING or not _equal(want, got):
            differ[key] = (want, got)
    assert not differ, "verl key: (launch, after the round trip)\n" + "\n".join(f"  {k}: {v}" for k, v in differ.items())


def test_values_that_ask_for_something_else_are_not_carried():
    """The same keys with values qwen35rl does not run: each is reported not carried with a reason, and the overlay
    holds nothing for it."""
    other = {f"{ACTOR}.checkpoint.save_contents": ["model"], "trainer.critic_warmup": 5,
             f"{ROLLOUT}.calculate_log_probs": False, "data.validation_shuffle": True,
             f"{ROLLOUT}.ignore_eos": True, f"{REF}.strategy": "fsdp", f"{ACTOR}.megatron.use_mbridge": False,
             f"{ROLLOUT}.dtype": "float16", f"{ACTOR}.megatron.dtype": "float16"}
    launch = {**LAUNCHES["megatron"], **other}
    imp = import_launch([f"{k}={hydra_value(v)}" for k, v in launch.items()], {}, device="gpu")
    whys = {x["key"]: x["why"] for x in imp.not_carried}
    assert set(whys) == set(other)
    assert all(w.strip() for w in whys.values())
    assert not set(other) & set(imp.fixed)
    assert "model.dtype" not in imp.overlay and "backend.bf16" not in imp.overlay
    assert "model.dtype" in whys[f"{ROLLOUT}.dtype"]


def test_fp32_megatron_is_not_exported_as_a_verl_dtype():
    """verl's Megatron engine trains in bfloat16 or float16: backend.bf16=false is listed, not written."""
    groups = ["model=qwen3_5_35b_a3b", "backend=megatron", "hw=gpu_1node"]
    bf16 = export(compose(groups))
    assert f"{ACTOR}.megatron.dtype=bfloat16" in bf16["argv"]
    fp32 = export(compose(groups + ["backend.bf16=false"]))
    assert not [a for a in fp32["argv"] if a.startswith(f"{ACTOR}.megatron.dtype")]
    assert [x for x in fp32["not_exported"] if x["key"] == "backend.bf16" and "float16" in x["why"]]
    assert "trainer.balance_batch=False" in bf16["argv"]  # verl's default balances the ranks; qwen35rl's does not


def _imported(**changes: Any) -> Any:
    launch = {**LAUNCHES["megatron"], **changes}
    for k in [k for k, v in launch.items() if v is MISSING]:
        del launch[k]
    imp = import_launch([f"{k}={hydra_value(v)}" for k, v in launch.items()], {}, device="gpu")
    return imp, {x["key"]: x["why"] for x in imp.not_carried}


def test_log_prob_sizes_carry_one_value_for_the_rollout_and_the_reference():
    """verl sizes the old (rollout) and the reference log-prob passes apart, qwen35rl's log-prob setting is one: equal
    values carry (the actor's is qwen35rl's null), a reference value unlike the rollout's is not carried, named."""
    lp_micro, lp_tokens = "backend.log_prob_micro_batch_size_per_device", "backend.log_prob_max_tokens_per_device"
    same, whys = _imported(**{f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu": 3,
                              f"{REF}.log_prob_micro_batch_size_per_gpu": 3,
                              f"{ROLLOUT}.log_prob_max_token_len_per_gpu": 6000,
                              f"{REF}.log_prob_max_token_len_per_gpu": MISSING})
    assert lp_micro not in same.overlay and lp_tokens not in same.overlay and not whys  # the actor's: null
    differ, whys = _imported(**{f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu": 8,
                                f"{REF}.log_prob_micro_batch_size_per_gpu": 4})
    assert differ.overlay[lp_micro] == 8 and differ.carried[f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu"] == lp_micro
    assert set(whys) == {f"{REF}.log_prob_micro_batch_size_per_gpu"}
    assert "differs from" in whys[f"{REF}.log_prob_micro_batch_size_per_gpu"]
    # going back: one value for both passes; null is the training micro batch, and the budget follows verl's default
    groups = ["model=qwen3_5_35b_a3b", "backend=megatron", "hw=gpu_1node"]
    argv = export(compose(groups + [f"{lp_micro}=8", f"{lp_tokens}=20000"]))["argv"]
    for side in (ROLLOUT, REF):
        assert f"{side}.log_prob_micro_batch_size_per_gpu=8" in argv
        assert f"{side}.log_prob_max_token_len_per_gpu=20000" in argv
    plain = export(compose(groups))
    micro = compose(groups).backend.micro_batch_size_per_device
    assert f"{REF}.log_prob_micro_batch_size_per_gpu={micro}" in plain["argv"]
    assert not [a for a in plain["argv"] if "log_prob_max_token_len" in a]
    assert not [x for x in plain["not_exported"] if x["key"].startswith("backend.log_prob")]


def test_balance_batch_and_checkpoint_dir_round_trip():
    """trainer.balance_batch keeps verl's name (verl's default, True, is carried when a script leaves it unset);
    trainer.default_local_dir is trainer.checkpoint_dir, exported only when set."""
    unset, _ = _imported(**{"trainer.balance_batch": MISSING, "trainer.default_local_dir": "runs/ckpt dir"})
    assert unset.overlay["trainer.balance_batch"] is True and unset.verl_defaults["trainer.balance_batch"]
    assert unset.overlay["trainer.checkpoint_dir"] == "runs/ckpt dir"
    groups = ["model=qwen3_5_35b_a3b", "backend=megatron", "hw=gpu_1node"]
    plain = export(compose(groups))
    assert not [a for a in plain["argv"] if a.startswith("trainer.default_local_dir")]
    assert [x for x in plain["not_exported"] if x["key"] == "trainer.checkpoint_dir" and "verl" in x["why"]]
    argv = export(compose(groups + ["trainer.checkpoint_dir='/ckpt/my run'", "trainer.balance_batch=true"]))["argv"]
    assert "trainer.default_local_dir='/ckpt/my run'" in argv and "trainer.balance_batch=True" in argv
    assert compose_verl(argv)["trainer"]["default_local_dir"] == "/ckpt/my run"


def test_custom_reward_function_is_a_verl_signature_reward():
    """verl's custom_reward_function (0.9.1's reward. form, and the older top-level one that verl moves there) is
    data.reward=verl:PATH:NAME; without a name it is verl's default, compute_score. The export writes 0.9.1's form."""
    crf = "reward.custom_reward_function"
    unset = {f"{crf}.path": MISSING, f"{crf}.name": MISSING}
    legacy, whys = _imported(**unset, **{"custom_reward_function.path": "/r/boxed.py"})
    assert legacy.overlay["data.reward"] == "verl:/r/boxed.py:compute_score" and not whys
    assert legacy.carried["custom_reward_function.path"] == "data.reward"
    both, whys = _imported(**unset, **{"custom_reward_function.path": "/r/a.py", "custom_reward_function.name": "f"})
    assert both.overlay["data.reward"] == "verl:/r/a.py:f" and not whys
    assert both.carried["custom_reward_function.name"] == both.carried["custom_reward_function.path"] == "data.reward"
    name_only, whys = _imported(**{**unset, f"{crf}.name": "f", f"+{crf}.reward_kwargs.scale": 2})
    assert "data.reward" not in name_only.overlay
    assert set(whys) == {f"{crf}.name", f"{crf}.reward_kwargs.scale"}
    assert "path" in whys[f"{crf}.name"] and "keyword arguments" in whys[f"{crf}.reward_kwargs.scale"]
    groups = ["model=qwen3_5_35b_a3b", "backend=megatron", "hw=gpu_1node"]
    argv = export(compose(groups + ["data.reward='verl:/r/my rewards.py:score'"]))["argv"]
    assert compose_verl(argv)["reward"]["custom_reward_function"] == {"path": "/r/my rewards.py", "name": "score"}
    plain = export(compose(groups))
    assert not [a for a in plain["argv"] if "custom_reward_function" in a]
    assert [x for x in plain["not_exported"] if x["key"] == "data.reward" and "compute_score" in x["why"]]
