"""The vLLM engine's arguments, built from composed configs (no vLLM needed), and its error without vLLM."""
import sys
import types

import pytest
import torch
from omegaconf import OmegaConf

from qwen35rl.config.compose import compose
from qwen35rl.config.layout import derive_layout
from qwen35rl.engines.base import RolloutRequest
from qwen35rl.engines.vllm_rollout import (
    VllmNotInstalledError,
    VllmRolloutEngine,
    collapse_image_runs,
    engine_args_from_config,
    engine_env,
    renamed_weights,
    sampling_kwargs,
    stop_token_ids,
    vllm_prompt,
    vllm_weight_name,
)


def args_for(*overrides: str) -> dict:
    cfg = compose(list(overrides))
    return engine_args_from_config(cfg, derive_layout(cfg), "/ckpt")


def test_397b_on_16_gpu_nodes_is_one_dp_ep_engine_with_decode_cuda_graphs():
    a = args_for("model=qwen3_5_397b_a17b", "hw=gpu_16node", "backend=megatron")
    assert (a["tensor_parallel_size"], a["data_parallel_size"], a["enable_expert_parallel"]) == (8, 16, True)
    assert a["distributed_executor_backend"] == "external_launcher"
    assert a["compilation_config"] == {"cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [4, 12, 24, 48, 64]}
    assert a["enable_sleep_mode"] is True and a["dtype"] == "bfloat16" and a["model"] == "/ckpt"
    assert "mm_processor_cache_gb" not in a  # a GPU config: the NPU quirk does not apply


def test_122b_on_npu_gets_its_max_model_len_and_the_mm_cache_quirk():
    a = args_for("model=qwen3_5_122b_a10b", "hw=a3_4node", "backend=megatron")
    assert a["max_model_len"] == 8192 and a["gpu_memory_utilization"] == 0.6
    assert a["mm_processor_cache_gb"] == 0
    assert a["tensor_parallel_size"] == 16 and "data_parallel_size" not in a and "enable_expert_parallel" not in a
    assert "compilation_config" not in a
    gpu = args_for("model=qwen3_5_122b_a10b", "hw=h20_4node", "backend=megatron")
    assert (gpu["max_model_len"], gpu["gpu_memory_utilization"], gpu["tensor_parallel_size"]) == (15768, 0.66, 8)


def test_npu_quirk_lifts_with_a_fixed_vllm():
    assert "mm_processor_cache_gb" not in args_for("model=qwen3_5_122b_a10b", "hw=a3_4node", "backend=megatron",
                                                   "rollout.vllm_version=0.22.0")
    assert args_for("hw=a2_1node", "rollout.vllm_version=0.21.3")["mm_processor_cache_gb"] == 0


def test_tiny_cpu_engine_defaults():
    a = args_for("model=qwen3_5_tiny", "hw=cpu", "rollout=vllm", "data.max_prompt_length=48",
                 "data.max_response_length=80")
    assert a["max_model_len"] == 128  # null: prompt + response
    assert a["dtype"] == "bfloat16"  # vLLM's CPU GDN kernels, whatever model.dtype says
    assert a["enable_sleep_mode"] is False  # vLLM refuses it on CPU
    assert a["tensor_parallel_size"] == 1 and "distributed_executor_backend" not in a
    assert a["limit_mm_per_prompt"] == {"image": 0, "video": 0}
    assert a["logprobs_mode"] == "processed_logprobs"
    assert a["load_format"] == "dummy"  # the first weight sync, before any generation, brings the policy's
    for key in ("max_num_batched_tokens", "max_num_seqs", "enable_chunked_prefill", "enable_prefix_caching",
                "enforce_eager", "gpu_memory_utilization"):
        assert key in a
    assert engine_env(compose(["hw=cpu"]))["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert "VLLM_CPU_KVCACHE_SPACE" not in engine_env(compose(["hw=gpu_1node"]))


def test_every_rollout_knob_reaches_the_args():
    a = args_for("hw=gpu_1x", "rollout=vllm", "rollout.max_model_len=4096", "rollout.max_num_batched_tokens=2048",
                 "rollout.max_num_seqs=64", "rollout.enable_chunked_prefill=false", "rollout.enable_prefix_caching=true",
                 "rollout.enforce_eager=true", "rollout.gpu_memory_utilization=0.4", "rollout.free_cache_engine=false",
                 "rollout.cudagraph_mode=PIECEWISE", "trainer.seed=17", "model.dtype=float16",
                 "rollout.load_format=auto")
    assert (a["max_model_len"], a["max_num_batched_tokens"], a["max_num_seqs"]) == (4096, 2048, 64)
    assert (a["enable_chunked_prefill"], a["enable_prefix_caching"], a["enforce_eager"]) == (False, True, True)
    assert (a["gpu_memory_utilization"], a["seed"], a["dtype"]) == (0.4, 17, "float16")
    assert a["enable_sleep_mode"] is False and a["compilation_config"] == {"cudagraph_mode": "PIECEWISE"}
    assert a["load_format"] == "auto"


def test_placeholder_weights_on_text_data_where_they_have_run_the_checkpoints_elsewhere():
    text = args_for("model=qwen3_5_tiny", "hw=cpu", "rollout=vllm", "data=gsm8k")
    images = args_for("model=qwen3_5_tiny_vl", "hw=cpu", "rollout=vllm", "data=geo3k")
    assert (text["load_format"], images["load_format"]) == ("dummy", "auto")
    assert args_for("model=qwen3_5_tiny", "hw=cpu", "rollout=vllm", "data=gsm8k",
                    "rollout.load_format=auto")["load_format"] == "auto"
    # run on CUDA too (vLLM 0.26, H100); not yet on an NPU: the checkpoint by default, placeholders when asked for
    assert args_for("model=qwen3_5_0_8b", "hw=gpu_1x", "rollout=vllm", "data=gsm8k")["load_format"] == "dummy"
    assert args_for("model=qwen3_5_0_8b", "hw=a2_1node", "rollout=vllm", "data=gsm8k")["load_format"] == "auto"
    assert args_for("model=qwen3_5_0_8b", "hw=a2_1node", "rollout=vllm", "data=gsm8k",
                    "rollout.load_format=dummy")["load_format"] == "dummy"


def test_image_data_keeps_an_image_budget_from_the_data_and_no_video():
    a = args_for("model=qwen3_5_tiny_vl", "data=geo3k", "data.max_prompt_length=1024")
    assert a["limit_mm_per_prompt"] == {"image": 341, "video": 0}  # each image takes >= 3 of the prompt's tokens
    assert args_for("model=qwen3_5_tiny_vl", "data=geo3k", "data.max_prompt_length=2")["limit_mm_per_prompt"]["image"] == 1
    user = args_for("model=qwen3_5_tiny_vl", "data=geo3k", "+rollout.engine_kwargs.limit_mm_per_prompt={image: 2}")
    assert user["limit_mm_per_prompt"] == {"image": 2}  # the user's engine_kwargs win


def test_image_prompts_reach_vllm_with_one_placeholder_per_image():
    IMG = 262
    expanded = [257, 10, 260, IMG, IMG, IMG, 261, 260, IMG, IMG, 261, 104, 258]  # two images of 3 and 2 tokens
    assert collapse_image_runs(expanded, IMG) == [257, 10, 260, IMG, 261, 260, IMG, 261, 104, 258]
    images = ["a", "b"]
    assert vllm_prompt(expanded, images, IMG) == {"prompt_token_ids": collapse_image_runs(expanded, IMG),
                                                  "multi_modal_data": {"image": images}}
    assert vllm_prompt([1, IMG, IMG], [], IMG) == {"prompt_token_ids": [1, IMG, IMG]}  # no images: ids as they are
    assert vllm_prompt([1, 2], None, None) == {"prompt_token_ids": [1, 2]}
    with pytest.raises(ValueError, match="vision checkpoint"):
        vllm_prompt(expanded, images, None)


def test_engine_kwargs_pass_through_and_win():
    a = args_for("hw=a3_1node", "+rollout.engine_kwargs.mm_processor_cache_gb=4", "+rollout.engine_kwargs.max_logprobs=3")
    assert a["mm_processor_cache_gb"] == 4 and a["max_logprobs"] == 3


def test_args_are_a_pure_function_of_the_config():
    cfg = compose(["model=qwen3_5_397b_a17b", "hw=a3_16node", "backend=megatron"])
    layout = derive_layout(cfg)
    a = engine_args_from_config(cfg, layout, "/ckpt")
    assert a == engine_args_from_config(OmegaConf.to_container(cfg, resolve=True), layout, "/ckpt")
    assert all(not OmegaConf.is_config(v) for v in a.values())  # plain values: vLLM checks argument types


def test_sampling_kwargs():
    stops = stop_token_ids(compose(["model=qwen3_5_tiny"]))
    assert stops == [258, 256]  # byte tokenizer: <|im_end|>, <|endoftext|>
    assert stop_token_ids(compose(["model=qwen3_5_9b"])) == [248046, 248044]
    req = RolloutRequest(prompt_ids=[[1], [2]], n=4, temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=33, seed=10)
    s = sampling_kwargs(req, stops, prompt_index=1)
    assert (s["n"], s["temperature"], s["top_p"], s["top_k"], s["max_tokens"]) == (4, 0.7, 0.9, 20, 33)
    assert s["stop_token_ids"] == stops and s["logprobs"] == 0 and s["detokenize"] is False
    assert s["seed"] == 14 and sampling_kwargs(req, stops, 0)["seed"] == 10
    assert sampling_kwargs(RolloutRequest(prompt_ids=[[1]], n=2), stops)["seed"] is None


@pytest.mark.parametrize("name, multimodal, expected", [
    ("model.layers.0.mlp.up_proj.weight", True, "model.language_model.layers.0.mlp.up_proj.weight"),
    ("model.language_model.norm.weight", True, "model.language_model.norm.weight"),
    ("model.visual.blocks.0.attn.qkv.weight", True, "model.visual.blocks.0.attn.qkv.weight"),
    ("lm_head.weight", True, "lm_head.weight"),
    ("model.language_model.layers.3.self_attn.q_proj.weight", False, "model.layers.3.self_attn.q_proj.weight"),
    ("model.embed_tokens.weight", False, "model.embed_tokens.weight"),
    ("model.visual.merger.linear_fc1.weight", False, None),
    ("lm_head.weight", False, "lm_head.weight"),
])
def test_weight_names_follow_the_checkpoint_layout(name, multimodal, expected):
    assert vllm_weight_name(name, multimodal) == expected


def test_weights_stream_bucket_by_bucket_renamed_and_cast():
    drawn = []

    def buckets():
        for k in range(3):
            drawn.append(k)
            yield [(f"model.layers.{k}.linear_attn.A_log", torch.ones(2)),
                   (f"model.layers.{k}.mlp.up_proj.weight", torch.full((2, 2), 1 / 3)),
                   ("model.visual.patch_embed.proj.weight", torch.ones(1))]

    stream = renamed_weights(buckets(), multimodal=False, dtype=torch.bfloat16, keep_dtype={"A_log"})
    assert drawn == []
    first = [next(stream), next(stream)]
    assert drawn == [0]  # the next bucket is not fetched before this one is consumed
    assert [n for n, _ in first] == ["model.layers.0.linear_attn.A_log", "model.layers.0.mlp.up_proj.weight"]
    assert first[0][1].dtype == torch.float32 and first[1][1].dtype == torch.bfloat16
    rest = list(stream)
    assert drawn == [0, 1, 2] and len(rest) == 4  # the vision tower is not part of a text-only engine
    ints = list(renamed_weights([[("model.x", torch.arange(3))]], multimodal=True, dtype=torch.bfloat16))
    assert ints[0][0] == "model.language_model.x" and ints[0][1].dtype == torch.int64


@pytest.mark.parametrize("multimodal", [False, True])
def test_a_tied_lm_head_follows_the_embedding(multimodal):
    emb, head = torch.randn(4, 2), torch.randn(4, 2)
    trainer = [[("model.embed_tokens.weight", emb), ("model.norm.weight", torch.ones(2))], [("lm_head.weight", head)]]
    tied = list(renamed_weights(trainer, multimodal, tied_lm_head=True))
    prefix = "model.language_model." if multimodal else "model."
    assert [n for n, _ in tied] == [prefix + "embed_tokens.weight", "lm_head.weight", prefix + "norm.weight"]
    assert tied[1][1] is emb  # the embedding, also when the trainer sends a copy of it as lm_head
    untied = dict(renamed_weights(trainer, multimodal))
    assert untied["lm_head.weight"] is head and len(untied) == 3


def test_without_vllm_the_engine_names_the_extra_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError, installed or not
    cfg = compose(["hw=gpu_1x"])
    for key in engine_env(cfg):
        monkeypatch.delenv(key, raising=False)  # restores this process's env after the engine sets its own
    with pytest.raises(VllmNotInstalledError) as e:
        VllmRolloutEngine(cfg, str(tmp_path), derive_layout(cfg))
    assert "pip install 'qwen35rl[gpu]'" in str(e.value) and "vllm-ascend" in str(e.value)
    assert isinstance(e.value, ImportError)


def test_a_directory_named_vllm_is_not_vllm(monkeypatch, tmp_path):
    namespace = types.ModuleType("vllm")
    namespace.__path__ = [str(tmp_path)]  # what `import vllm` gives when tests/ (holding a folder named vllm) is on sys.path
    monkeypatch.setitem(sys.modules, "vllm", namespace)
    cfg = compose(["hw=gpu_1x"])
    for key in engine_env(cfg):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(VllmNotInstalledError, match="namespace"):
        VllmRolloutEngine(cfg, str(tmp_path), derive_layout(cfg))
