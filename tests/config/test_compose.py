"""Composition: every group option composes, the reference runs fall out of model x hw x backend, and every
config mistake becomes a ConfigError that names the key, the value and what is allowed."""
import pytest
from omegaconf import OmegaConf

from qwen35rl.config.compose import ConfigError, available_options, check_sweep, compose
from qwen35rl.config.layout import derive_layout

MODELS = ["qwen3_5_0_8b", "qwen3_5_2b", "qwen3_5_4b", "qwen3_5_9b", "qwen3_5_27b", "qwen3_5_35b_a3b",
          "qwen3_5_122b_a10b", "qwen3_5_397b_a17b", "qwen3_5_tiny", "qwen3_5_tiny_moe", "qwen3_5_tiny_vl"]
HWS = ["cpu", "gpu_1x", "gpu_1node", "h200_1node", "h20_4node", "gpu_16node", "a2_1node", "a3_1node", "a3_4node",
       "a3_16node"]

# The ten reference runs of reference_runs.md: (model, backend, hw) -> train layout, DP, rollout layout.
REFERENCE_RUNS = [
    ("qwen3_5_27b", "fsdp", "gpu_1node", dict(fsdp_size=8, sp=1), 8, dict(tp=4, dp=2, ep=1)),
    ("qwen3_5_27b", "fsdp", "a3_1node", dict(fsdp_size=16), 16, dict(tp=4, dp=4, ep=1)),
    ("qwen3_5_35b_a3b", "fsdp", "gpu_1node", dict(fsdp_size=8), 8, dict(tp=4, dp=2, ep=1)),
    ("qwen3_5_35b_a3b", "fsdp", "a3_1node", dict(fsdp_size=16), 16, dict(tp=4, dp=4, ep=1)),
    ("qwen3_5_35b_a3b", "megatron", "gpu_1node", dict(tp=2, pp=1, cp=1, ep=8, etp=1), 4, dict(tp=8, dp=1, ep=1)),
    ("qwen3_5_35b_a3b", "megatron", "a3_1node", dict(tp=2, pp=2, cp=1, ep=8, etp=1), 4, dict(tp=8, dp=2, ep=1)),
    ("qwen3_5_122b_a10b", "megatron", "h20_4node", dict(tp=2, pp=2, cp=1, ep=8, etp=1), 8, dict(tp=8, dp=4, ep=1)),
    ("qwen3_5_122b_a10b", "megatron", "a3_4node", dict(tp=2, pp=4, cp=1, ep=16, etp=1), 8, dict(tp=16, dp=4, ep=1)),
    ("qwen3_5_397b_a17b", "megatron", "gpu_16node", dict(tp=2, pp=2, cp=1, ep=64, etp=1), 32,
     dict(tp=8, dp=16, ep=128)),
    ("qwen3_5_397b_a17b", "megatron", "a3_16node", dict(tp=2, pp=4, cp=1, ep=64, etp=1), 32,
     dict(tp=16, dp=16, ep=256)),
]


def test_default_is_tiny_on_cpu_with_hf_rollout():
    cfg = compose([])
    assert (cfg.model.name, cfg.hw.name, cfg.backend.name, cfg.rollout.engine, cfg.data.name) == (
        "qwen3_5_tiny", "cpu", "fsdp", "hf", "synthetic")
    assert cfg.hw.collective_backend == "gloo" and cfg.hw.ray_resource == "CPU"
    assert cfg.trainer.run_name == "qwen3_5_tiny-synthetic-grpo-fsdp2-cpu"


@pytest.mark.parametrize("group,expected", [("model", MODELS), ("hw", HWS)])
def test_group_options_are_complete(group, expected):
    assert set(expected) <= set(available_options(group))


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_every_model_composes_with_every_backend(model, backend):
    cfg = compose([f"model={model}", f"backend={backend}", "hw=gpu_1node"])
    assert cfg.model.name == model and cfg.backend.name == backend
    assert cfg.model.num_hidden_layers % cfg.model.full_attention_interval == 0  # last layer is full attention


@pytest.mark.parametrize("hw", HWS)
def test_every_hw_composes(hw):
    cfg = compose([f"hw={hw}", "model=qwen3_5_27b", "backend=fsdp"])
    assert cfg.hw.device in ("cpu", "cuda", "npu")
    expected = {"cpu": ("CPU", "gloo", "hf"), "cuda": ("GPU", "nccl", "vllm"), "npu": ("NPU", "hccl", "vllm")}
    assert (cfg.hw.ray_resource, cfg.hw.collective_backend, cfg.rollout.engine) == expected[cfg.hw.device]


@pytest.mark.parametrize("model,backend,hw,train,dp,rollout", REFERENCE_RUNS,
                         ids=[f"{m}-{b}-{h}" for m, b, h, *_ in REFERENCE_RUNS])
def test_reference_run_layout(model, backend, hw, train, dp, rollout):
    cfg = compose([f"model={model}", f"backend={backend}", f"hw={hw}"])
    layout = derive_layout(cfg)
    assert {k: getattr(layout, k) for k in train} == train
    assert layout.dp == dp
    assert layout.rollout_dict() == rollout
    # Shared by all five core scripts.
    assert cfg.rollout.engine == "vllm" and cfg.backend.lr == 1e-6 and cfg.backend.micro_batch_size_per_device == 1
    assert cfg.algorithm.kl_loss_type == "low_var_kl" and cfg.algorithm.entropy_coef == 0
    assert cfg.data.filter_overlong_prompts and cfg.trainer.total_epochs == 15


def test_reference_run_model_specific_settings():
    c = compose(["model=qwen3_5_122b_a10b", "backend=megatron", "hw=h20_4node"])
    assert (c.data.train_batch_size, c.algorithm.mini_batch_size, c.backend.max_tokens_per_device) == (128, 64, 8192)
    assert (c.rollout.n, c.data.max_prompt_length, c.data.max_response_length, c.data.truncation) == (6, 3240, 4096, "right")
    assert not c.algorithm.use_kl_loss and c.backend.use_torch_compile and c.backend.dist_timeout_s == 10800
    assert (c.rollout.max_model_len, c.rollout.gpu_memory_utilization, c.rollout.weight_sync_bucket_mb) == (15768, 0.66, 4096)
    npu = compose(["model=qwen3_5_122b_a10b", "backend=megatron", "hw=a3_4node"])
    assert (npu.rollout.max_model_len, npu.rollout.gpu_memory_utilization) == (8192, 0.6)
    assert npu.hw.env.HCCL_CONNECT_TIMEOUT == "5400"
    big = compose(["model=qwen3_5_397b_a17b", "backend=megatron", "hw=gpu_16node"])
    assert big.rollout.cudagraph_mode == "FULL_DECODE_ONLY" and list(big.rollout.cudagraph_capture_sizes) == [4, 12, 24, 48, 64]
    assert big.rollout.weight_sync_bucket_mb == 1024 and big.data.train_batch_size == 64
    fsdp = compose(["model=qwen3_5_27b", "backend=fsdp", "hw=gpu_1node"])
    assert (fsdp.data.train_batch_size, fsdp.algorithm.mini_batch_size, fsdp.rollout.weight_sync_bucket_mb) == (64, 16, 6144)
    assert fsdp.backend.param_offload and fsdp.backend.optimizer_offload
    assert fsdp.backend.remove_padding is None  # packs where fla runs, as the reference runs' use_remove_padding=True
    assert fsdp.rollout.enable_chunked_prefill and fsdp.rollout.max_num_batched_tokens == 8192
    assert not fsdp.rollout.enable_prefix_caching and fsdp.rollout.free_cache_engine


def test_hardware_deltas():
    npu = compose(["model=qwen3_5_35b_a3b", "backend=megatron", "hw=a3_1node"])
    assert npu.backend.remove_padding and npu.backend.dynamic_batch_size  # MindSpeed packs GDN sequences (TND)
    assert npu.hw.env.NDEVICES_PER_NODE == "16" and npu.hw.env.HCCL_CONNECT_TIMEOUT == "1500"
    assert npu.hw.megatron_quirks.moe_token_dispatcher_type == "alltoall"
    assert npu.hw.vllm_quirks[0].key == "mm_processor_cache_gb"
    gpu = compose(["model=qwen3_5_35b_a3b", "backend=megatron", "hw=gpu_1node"])
    assert not gpu.backend.remove_padding and not gpu.backend.dynamic_batch_size
    assert gpu.backend.env.CUDA_DEVICE_MAX_CONNECTIONS == "1" and gpu.hw.env.VLLM_USE_V1 == "1"
    h200 = compose(["model=qwen3_5_35b_a3b", "backend=megatron", "hw=h200_1node"])
    assert derive_layout(h200).train_dict() == derive_layout(gpu).train_dict()


def test_geo3k_reproduces_reference_data():
    cfg = compose(["model=qwen3_5_27b", "backend=fsdp", "hw=gpu_1node", "data=geo3k"])
    assert cfg.data.has_images and cfg.data.kind == "multimodal"


def test_untested_layout_falls_back_to_generic_default():
    cfg = compose(["model=qwen3_5_4b", "backend=megatron", "hw=gpu_1node"])  # TP1 fits: no layout file
    assert cfg.parallelism.name == "default" and cfg.parallelism.tp == 1
    cfg = compose(["model=qwen3_5_9b", "backend=megatron", "hw=gpu_1node"])  # it does not: a searched layout file
    assert cfg.parallelism.name == "megatron/qwen3_5_9b@gpu_1node" and cfg.parallelism.tp == 2


def test_model_architecture_facts():
    m = compose(["model=qwen3_5_397b_a17b"]).model
    assert (m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size, m.num_hidden_layers) == (512, 10, 1024, 60)
    assert m.vision.out_hidden_size == m.hidden_size == 4096 and m.vocab_size == 248320
    tiny = compose(["model=qwen3_5_tiny"]).model
    assert tiny.init == "random" and tiny.tokenizer == "byte" and tiny.vision is None
    assert sum(tiny.mrope_section) == tiny.head_dim * tiny.partial_rotary_factor / 2
    assert tiny.linear_key_head_dim in (64, 128) and tiny.linear_value_head_dim in (64, 128)


@pytest.mark.parametrize("overrides,key,fragment", [
    (["model=qwen3_5_27"], "model", "did you mean 'qwen3_5_27b'"),
    (["hw=a3_16nodes"], "hw", "did you mean 'a3_16node'"),
    (["backend=megatorn"], "backend", "did you mean 'megatron'"),
    (["hw.nodez=2"], "hw.nodez", "did you mean 'nodes'"),
    (["trainer.resum=never"], "trainer.resum", "did you mean 'resume'"),
    (["backend=megatron", "backend.megatron_core_versio=0.18.0"], "backend.megatron_core_versio",
     "did you mean 'megatron_core_version'"),
    (["rollout.engine_kwargs.enforce_eager=true"], "rollout.engine_kwargs.enforce_eager", "+rollout.engine_kwargs"),
])
def test_typos_get_did_you_mean(overrides, key, fragment):
    with pytest.raises(ConfigError) as e:
        compose(overrides)
    assert e.value.key == key
    assert fragment in e.value.hint


def test_wrong_type_names_key_and_value():
    with pytest.raises(ConfigError) as e:
        compose(["hw.nodes=four"])
    assert e.value.key == "hw.nodes" and e.value.value == "four" and e.value.code == "wrong_type"


def test_unknown_group_lists_allowed_options():
    with pytest.raises(ConfigError) as e:
        compose(["algorithm=ppo"])
    assert {"grpo", "dr_grpo", "dapo"} <= set(e.value.allowed)


def test_sweep_values_checked_before_anything_runs():
    check_sweep(["parallelism.tp=1,2,4", "model=qwen3_5_27b,qwen3_5_9b"])
    with pytest.raises(ConfigError) as e:
        check_sweep(["model=qwen3_5_27b,qwen3_5_9"])
    assert e.value.key == "model"
    with pytest.raises(ConfigError) as e:
        check_sweep(["parallelism.tp=1,two"])
    assert e.value.key == "parallelism.tp"


def test_overlay_directories_from_environment(tmp_path, monkeypatch):
    (tmp_path / "cluster").mkdir()
    (tmp_path / "cluster" / "mylab.yaml").write_text(
        "# @package _global_\nhw:\n  nodes: 3\n  env:\n    NCCL_SOCKET_IFNAME: ib0\ntrainer:\n  output_root: /data/runs\n")
    monkeypatch.setenv("QWEN35RL_CONFIG_PATH", str(tmp_path))
    cfg = compose(["hw=gpu_1node", "cluster=mylab"])
    assert cfg.hw.nodes == 3 and cfg.hw.env.NCCL_SOCKET_IFNAME == "ib0" and cfg.trainer.output_root == "/data/runs"
    monkeypatch.setenv("QWEN35RL_CONFIG_PATH", str(tmp_path / "missing"))
    with pytest.raises(ConfigError) as e:
        compose([])
    assert e.value.key == "QWEN35RL_CONFIG_PATH"


def test_example_cluster_overlay():
    cfg = compose(["cluster=example"])
    assert cfg.ray_address == "auto" and cfg.hw.env.GLOO_SOCKET_IFNAME == "eth0"


def test_resolved_config_has_no_interpolations():
    cfg = compose(["model=qwen3_5_0_8b", "hw=a3_1node"])
    text = OmegaConf.to_yaml(cfg)
    assert "${" not in text


def test_a_config_that_crossed_a_process_boundary_is_typed_again():
    from omegaconf import OmegaConf

    from qwen35rl.config.schema import MegatronConfig, typed

    cfg = compose(["backend=megatron", "model=qwen3_5_tiny_vl", "data=geo3k", "backend.lr=3"])
    plain = OmegaConf.to_container(cfg, resolve=True)
    back = typed(plain)
    assert OmegaConf.to_container(back) == plain
    assert OmegaConf.get_type(back.backend) is MegatronConfig
    assert isinstance(back.backend.lr, float) and back.backend.lr == 3.0  # "3" on the command line, a float here
    with pytest.raises(Exception):
        back.backend.no_such_key = 1  # keys stay closed
    plain["backend"]["lr"] = "fast"
    with pytest.raises(Exception):
        typed(plain)


def test_a_verl_key_gets_the_qwen35rl_key_with_the_value_converted():
    from qwen35rl.config.compose import verl_hint

    assert verl_hint("actor_rollout_ref.actor.megatron.dtype", "bfloat16").endswith("try backend.bf16=true")
    assert verl_hint("actor_rollout_ref.rollout.n", "8").endswith("try rollout.n=8")
    assert verl_hint("actor_rollout_ref.actor.optim.lr_warmup_steps", "-1").endswith("try backend.lr_warmup_steps=0")
    assert verl_hint("actor_rollout_ref.rollout.n").endswith("try rollout.n=...")
