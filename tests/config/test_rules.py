"""Every validation rule: a config that passes it, a config that fails it (code, key, severity, hint), and the
hint's suggested value actually clears the rule. The ten reference runs are valid."""
import copy
import os
import re

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest

from qwen35rl.config import capabilities, known_keys, quirks, rules
from qwen35rl.config.compose import compose
from qwen35rl.config.layout import derive_layout, even_pipeline_layout, format_pipeline_layout, parse_pipeline_layout
from qwen35rl.config.memory import as_tree
from qwen35rl.config.problems import ERROR, WARNING

BASES = {
    "tiny": [],
    "tiny_vl": ["model=qwen3_5_tiny_vl"],
    "tiny4": ["hw.devices_per_node=4"],
    "fsdp27": ["model=qwen3_5_27b", "hw=gpu_1node", "backend=fsdp"],
    "fsdp27_a3": ["model=qwen3_5_27b", "hw=a3_1node", "backend=fsdp"],
    "mg27": ["model=qwen3_5_27b", "hw=gpu_1node", "backend=megatron", "parallelism.tp=4",
             "parallelism.rollout.tp=4"],
    "mg35": ["model=qwen3_5_35b_a3b", "hw=gpu_1node", "backend=megatron"],
    "mg35_a3": ["model=qwen3_5_35b_a3b", "hw=a3_1node", "backend=megatron"],
    "mg_cpu": ["model=qwen3_5_tiny_moe", "backend=megatron", "backend.moe_permute_fusion=false",
               "backend.use_precision_aware_optimizer=false"],
    "mg122": ["model=qwen3_5_122b_a10b", "hw=h20_4node", "backend=megatron"],
    "mg397_a3": ["model=qwen3_5_397b_a17b", "hw=a3_16node", "backend=megatron"],
    "mg397_gpu": ["model=qwen3_5_397b_a17b", "hw=gpu_16node", "backend=megatron"],
    "split4": ["hw.devices_per_node=4", "placement=split", "placement.rollout_devices=2"],
    "mg_split": ["model=qwen3_5_tiny_moe", "backend=megatron", "backend.moe_permute_fusion=false",
                 "backend.use_precision_aware_optimizer=false", "hw.devices_per_node=4", "placement=split",
                 "placement.rollout_devices=2"],
}
_trees = {}


def tree(base, **updates):
    """A deep copy of a composed base config (plain dicts) with dotted-key updates (`a__b` spells `a.b`)."""
    if base not in _trees:
        _trees[base] = as_tree(compose(BASES[base]))
    t = copy.deepcopy(_trees[base])
    for dotted, value in updates.items():
        set_key(t, dotted.replace("__", "."), value)
    return t


def set_key(t, dotted, value):
    *parents, leaf = dotted.split(".")
    node = t
    for p in parents:
        node = node[p]
    node[leaf] = value


def problems(t):
    return rules.check_all(t, derive_layout(t))


def codes(t):
    return {p.code for p in problems(t)}


def by_code(t, code):
    return [p for p in problems(t) if p.code == code]


# (rule, base, updates that pass it, updates that fail it, expected key of the failure, severity)
CASES = [
    ("paths_exist", "tiny", {"trainer__resume": "never"}, {"trainer__resume": "bogus"}, "trainer.resume", ERROR),
    ("data_unusable", "tiny", {"data__kind": "text"}, {"data__kind": "text", "data__train_files": [__file__]},
     "data.train_files", ERROR),  # a .py file is no data file
    ("names_valid", "tiny", {"trainer__run_name": "a-b"}, {"trainer__run_name": "a/b"}, "trainer.run_name", ERROR),
    ("model_path_missing", "tiny", {}, {"model__init": "pretrained"}, "model.path", ERROR),
    ("engine_known", "tiny", {}, {"backend__name": "fsdp2"}, "backend.name", ERROR),
    ("degrees_positive", "mg35", {}, {"parallelism__pp": 0}, "parallelism.pp", ERROR),
    ("degrees_match_backend", "fsdp27", {}, {"parallelism__tp": 2}, "parallelism.tp", ERROR),
    ("world_size_matches_devices", "mg35", {"parallelism__pp": 2, "parallelism__ep": 4},
     {"parallelism__pp": 3}, "parallelism.tp", ERROR),
    ("tp_divides_attention_heads", "mg397_a3", {"parallelism__tp": 16, "parallelism__pp": 4},
     {"parallelism__tp": 64, "parallelism__pp": 4}, "parallelism.tp", ERROR),
    ("tp_fits_kv_heads", "mg27", {"parallelism__tp": 8}, {"parallelism__tp": 3}, "parallelism.tp", ERROR),
    ("tp_cp_divide_gdn_heads", "mg397_a3", {"backend__megatron_core_version": "0.18.0", "parallelism__cp": 8},
     {"backend__megatron_core_version": "0.18.0", "parallelism__cp": 16}, "parallelism.cp", ERROR),
    ("ep_divides_experts", "mg35", {"parallelism__ep": 4}, {"parallelism__ep": 3}, "parallelism.ep", ERROR),
    ("ep_etp_divide_stage_world", "mg35", {"parallelism__ep": 4, "parallelism__etp": 2},
     {"parallelism__ep": 16}, "parallelism.ep", ERROR),
    ("pipeline_splits_layers", "mg397_a3",
     {"parallelism__pp": 8, "parallelism__pipeline_layout": format_pipeline_layout(even_pipeline_layout(60, 8))},
     {"parallelism__pp": 8}, "parallelism.pp", ERROR),
    ("fsdp_size_divides_world", "fsdp27", {"parallelism__fsdp_size": 4}, {"parallelism__fsdp_size": 3},
     "parallelism.fsdp_size", ERROR),
    ("sp_requires_remove_padding", "fsdp27", {"parallelism__sp": 2},
     {"parallelism__sp": 2, "backend__remove_padding": False}, "backend.remove_padding", ERROR),
    ("sp_divides_heads", "fsdp27_a3", {"parallelism__sp": 8}, {"parallelism__sp": 16}, "parallelism.sp", ERROR),
    ("megatron_context_parallel", "mg397_a3", {}, {"parallelism__cp": 2, "backend__megatron_core_version": "0.18.0"},
     "parallelism.cp", ERROR),
    ("megatron_pads_sequences", "mg35", {}, {"backend__remove_padding": True}, "backend.remove_padding", WARNING),
    ("megatron_grouped_gemm", "mg35", {}, {"backend__moe_grouped_gemm": True}, "backend.moe_grouped_gemm", WARNING),
    ("megatron_permute_fusion_needs_te", "mg_cpu", {}, {"backend__moe_permute_fusion": True},
     "backend.moe_permute_fusion", WARNING),
    ("megatron_precision_aware_optimizer", "mg_cpu", {}, {"backend__use_precision_aware_optimizer": True},
     "backend.use_precision_aware_optimizer", WARNING),
    ("megatron_gdn_kernels_need_fla", "mg_cpu", {"backend__transformer_overrides": {"deterministic_mode": True}},
     {"backend__transformer_overrides": {"deterministic_mode": False}},
     "backend.transformer_overrides.deterministic_mode", ERROR),
    ("megatron_no_compile_layers", "mg27", {}, {"backend__compile_layers": True}, "backend.compile_layers", WARNING),
    ("megatron_own_checkpoints", "mg27", {}, {"backend__use_dist_checkpointing": True},
     "backend.use_dist_checkpointing", WARNING),
    ("fsdp_chunked_entropy", "tiny", {}, {"backend__entropy_from_logits_with_chunking": False},
     "backend.entropy_from_logits_with_chunking", WARNING),
    ("expert_grads_need_ep_or_etp_equal_tp", "mg35", {"parallelism__ep": 1, "parallelism__etp": 2},
     {"parallelism__ep": 1}, "parallelism.etp", ERROR),
    ("rollout_engine_parallelism", "tiny", {}, {"parallelism__rollout__tp": 2}, "parallelism.rollout.tp", ERROR),
    ("rollout_tp_divides_heads", "fsdp27_a3", {"parallelism__rollout__tp": 8}, {"parallelism__rollout__tp": 16},
     "parallelism.rollout.tp", ERROR),
    ("rollout_ep_matches_tp_dp", "mg397_a3", {}, {"parallelism__rollout__ep": 128}, "parallelism.rollout.ep", ERROR),
    ("rollout_ep_divides_experts", "mg27", {},
     {"parallelism__rollout__tp": 4, "parallelism__rollout__dp": 2, "parallelism__rollout__ep": 8},
     "parallelism.rollout.ep", ERROR),
    ("rollout_replicas_cover_devices", "mg35", {}, {"parallelism__rollout__dp": 2}, "parallelism.rollout.dp", ERROR),
    ("rollout_tp_within_node", "mg397_gpu",
     {"parallelism__rollout__tp": 16, "parallelism__rollout__dp": 8, "hw__multi_node_rollout_tp": True},
     {"parallelism__rollout__tp": 16, "parallelism__rollout__dp": 8}, "parallelism.rollout.tp", ERROR),
    ("placeholder_weights_need_a_sync", "mg35",
     {"rollout__engine_kwargs": {"speculative_config": {"method": "mtp"}}, "rollout__load_format": "auto"},
     {"rollout__engine_kwargs": {"speculative_config": {"method": "mtp"}}, "rollout__load_format": "dummy"},
     "rollout.load_format", ERROR),
    ("overlong_buffer_within_response", "tiny", {"algorithm__overlong_shaping__enable": True,
     "algorithm__overlong_shaping__buffer_len": 4}, {"algorithm__overlong_shaping__enable": True,
     "algorithm__overlong_shaping__buffer_len": 512}, "algorithm.overlong_shaping.buffer_len", ERROR),
    ("rollout_n_at_least_2", "tiny", {"rollout__n": 2}, {"rollout__n": 1}, "rollout.n", ERROR),
    ("mini_batch_within_batch", "tiny", {"algorithm__mini_batch_size": 8}, {"algorithm__mini_batch_size": 16},
     "algorithm.mini_batch_size", ERROR),
    ("batch_divisible_by_mini_batch", "tiny", {"algorithm__mini_batch_size": 4}, {"algorithm__mini_batch_size": 6},
     "algorithm.mini_batch_size", ERROR),
    ("batch_divisible_by_dp_micro", "mg35", {"data__train_batch_size": 36, "algorithm__mini_batch_size": 36},
     {"data__train_batch_size": 31, "algorithm__mini_batch_size": 31}, "data.train_batch_size", ERROR),
    ("mini_batch_divisible_by_dp", "mg35", {"data__train_batch_size": 64, "algorithm__mini_batch_size": 16},
     {"data__train_batch_size": 60, "algorithm__mini_batch_size": 30}, "algorithm.mini_batch_size", ERROR),
    ("mini_batch_divisible_by_micro", "mg35", {"backend__micro_batch_size_per_device": 2},
     {"backend__micro_batch_size_per_device": 3}, "backend.micro_batch_size_per_device", ERROR),
    ("sequence_within_max_position", "tiny", {"data__max_response_length": 2000}, {"data__max_response_length": 4000},
     "data.max_response_length", ERROR),
    ("sequence_within_max_model_len", "mg122", {"rollout__max_model_len": 8192}, {"rollout__max_model_len": 4096},
     "rollout.max_model_len", ERROR),
    ("dynamic_batch_holds_a_sequence", "mg35_a3", {"backend__max_tokens_per_device": 3072},
     {"backend__max_tokens_per_device": 2048}, "backend.max_tokens_per_device", ERROR),
    ("images_need_vision_model", "tiny_vl", {"data__has_images": True}, {"data__has_images": True, "model__vision": None},
     "model", ERROR),
    ("megatron_dispatcher_takes_variable_lengths", "mg35", {"backend__moe_token_dispatcher_type": "alltoall"},
     {"backend__moe_token_dispatcher_type": "allgather"}, "backend.moe_token_dispatcher_type", ERROR),
    ("local_launcher_runs_on_this_host", "tiny", {"trainer__launcher": "local"},
     {"trainer__launcher": "local", "hw__nodes": 2}, "trainer.launcher", ERROR),
    ("known_choice", "tiny", {"algorithm__loss_agg_mode": "seq-mean-token-sum"},
     {"algorithm__loss_agg_mode": "token_mean"}, "algorithm.loss_agg_mode", ERROR),
    ("value_in_range", "tiny", {"rollout__gpu_memory_utilization": 1.0}, {"rollout__gpu_memory_utilization": 1.5},
     "rollout.gpu_memory_utilization", ERROR),
    ("compile_decode_is_hf_only", "mg35", {}, {"rollout__compile_decode": True}, "rollout.compile_decode", WARNING),
    # prefix caching on GDN layers runs in vLLM's 'align' mode, which asserts chunked prefill at start-up
    ("vllm_prefix_caching_on_gdn", "tiny", {"rollout__engine": "vllm", "rollout__enable_prefix_caching": False,
     "rollout__enable_chunked_prefill": False},
     {"rollout__engine": "vllm", "rollout__enable_prefix_caching": True, "rollout__enable_chunked_prefill": False},
     "rollout.enable_prefix_caching", ERROR),
    ("engine_kwargs_known", "mg35", {"rollout__engine_kwargs": {"swap_space": 4}},
     {"rollout__engine_kwargs": {"swap_spce": 4}}, "rollout.engine_kwargs.swap_spce", ERROR),
    ("vllm_version_valid", "tiny", {"rollout__vllm_version": "0.26.0"}, {"rollout__vllm_version": "latest"},
     "rollout.vllm_version", ERROR),
    # vLLM 0.26 loads only the vision-language form of a Qwen3.5 checkpoint: the tiny text model has none
    ("vllm_loads_rollout_checkpoint", "tiny", {"rollout__engine": "vllm", "rollout__vllm_version": "0.27.0"},
     {"rollout__engine": "vllm", "rollout__vllm_version": "0.26.0"}, "model", ERROR),
    ("engine_kwargs_not_owned", "mg35", {"rollout__engine_kwargs": {"kv_cache_dtype": "auto"}},
     {"rollout__engine_kwargs": {"tensor_parallel_size": 2}}, "rollout.engine_kwargs.tensor_parallel_size", ERROR),
    ("transformer_overrides_known", "mg35", {"backend__transformer_overrides": {"moe_router_dtype": "fp32"}},
     {"backend__transformer_overrides": {"moe_router_dtyp": "fp32"}}, "backend.transformer_overrides.moe_router_dtyp",
     ERROR),
    ("transformer_overrides_not_owned", "mg35", {"backend__transformer_overrides": {"moe_router_dtype": "fp32"}},
     {"backend__transformer_overrides": {"tensor_model_parallel_size": 4}},
     "backend.transformer_overrides.tensor_model_parallel_size", ERROR),
    ("quirk_overridden", "mg35_a3",
     {"rollout__engine_kwargs": {"mm_processor_cache_gb": 4}, "rollout__vllm_version": "0.22.0"},
     {"rollout__engine_kwargs": {"mm_processor_cache_gb": 4}}, "rollout.engine_kwargs.mm_processor_cache_gb", WARNING),
    ("split_needs_ray", "split4", {}, {"trainer__launcher": "local"}, "trainer.launcher", ERROR),
    ("split_rollout_needs_hf", "split4", {}, {"rollout__engine": "vllm"}, "rollout.engine", ERROR),
    ("staleness_needs_split", "tiny", {"algorithm__max_staleness": 0}, {"algorithm__max_staleness": 1},
     "algorithm.max_staleness", ERROR),
    ("rollout_devices_needs_split", "tiny", {"placement__rollout_devices": None}, {"placement__rollout_devices": 1},
     "placement.rollout_devices", ERROR),
    ("split_pool_sizes", "split4", {"placement__rollout_devices": 3}, {"placement__rollout_devices": 4},
     "placement.rollout_devices", ERROR),
    ("split_offload_pointless", "mg_split", {"backend__optimizer_cpu_offload": True}, {"backend__param_offload": True},
     "backend.param_offload", ERROR),
    ("rollout_is_weights_are_one", "tiny", {"algorithm__rollout_is": "token"},
     {"algorithm__rollout_is": "token", "backend__use_rollout_log_probs": True}, "algorithm.rollout_is", WARNING),
    ("train_memory_fits", "mg35", {"backend__optimizer_cpu_offload": False, "parallelism__pp": 2},
     {"backend__optimizer_cpu_offload": False}, "parallelism", ERROR),
    ("log_prob_memory_fits", "mg35", {"backend__log_prob_micro_batch_size_per_device": 16},
     {"backend__log_prob_micro_batch_size_per_device": 512}, "backend.log_prob_micro_batch_size_per_device", ERROR),
    ("rollout_memory_fits", "mg35", {"rollout__gpu_memory_utilization": 0.3}, {"rollout__gpu_memory_utilization": 0.1},
     "rollout.gpu_memory_utilization", ERROR),
    ("megatron_core_version_valid", "mg35", {"backend__megatron_core_version": "0.19.2"},
     {"backend__megatron_core_version": "banana"}, "backend.megatron_core_version", ERROR),
    ("architecture_consistent", "tiny", {"model__num_key_value_heads": 1}, {"model__num_key_value_heads": 3},
     "model.num_key_value_heads", ERROR),
]


def test_every_rule_has_a_case():
    # the declaration of what the engines build is one rule with a code per entry
    expected = [fn.__name__ for _, fn in rules.RULES if fn is not rules.engine_builds_setting]
    expected += [e.code for e in capabilities.DECLARATION]
    assert sorted(c[0] for c in CASES) == sorted(expected)


FSDP_SP_CASES = [
    # 2 KV heads and 2 GDN key heads under SP4 are replicated; 6 query heads do not split over 4 ranks
    ("sp_divides_heads", "tiny4", {"parallelism__sp": 4}, {"parallelism__sp": 4, "model__num_attention_heads": 6,
     "model__num_key_value_heads": 3}, "parallelism.sp", ERROR),
    ("sp_divides_heads", "tiny4", {"parallelism__sp": 2}, {"parallelism__sp": 4, "model__linear_num_value_heads": 2},
     "parallelism.sp", ERROR),
    ("fsdp_size_divides_world", "tiny4", {"parallelism__fsdp_size": 2, "parallelism__sp": 2},
     {"parallelism__fsdp_size": 3, "parallelism__sp": 2}, "parallelism.fsdp_size", ERROR),
]


@pytest.mark.parametrize("code,base,ok,bad,key,severity", FSDP_SP_CASES,
                         ids=["replicated-kv-and-gdn-key-heads", "gdn-value-heads", "hsdp-with-sp"])
def test_fsdp_sp_rules_on_the_tiny_model(code, base, ok, bad, key, severity):
    test_rule_passes_and_fails(code, base, ok, bad, key, severity)


@pytest.mark.parametrize("code,base,ok,bad,key,severity", CASES, ids=[c[0] for c in CASES])
def test_rule_passes_and_fails(code, base, ok, bad, key, severity):
    assert code not in codes(tree(base)), "the base config must pass"
    assert code not in codes(tree(base, **ok))
    found = by_code(tree(base, **bad), code)
    assert found, f"{code} did not fire"
    p = found[0]
    assert p.key == key and p.severity == severity
    assert p.message and p.hint
    # The hint names a valid alternative: applying a suggested `try key=value` clears this rule.
    m = re.match(r"try ([\w.]+)=([\w.\-]+)", p.hint)
    if m and not isinstance(rules.val(tree(base), m.group(1)), dict):  # `try backend=fsdp` picks a group: skip
        value = m.group(2)
        parsed = None if value == "null" else {"true": True, "false": False}.get(value, value)
        if isinstance(parsed, str):
            for number in (int, float):
                try:
                    parsed = number(parsed)
                    break
                except ValueError:
                    pass
        fixed = tree(base, **bad)
        set_key(fixed, m.group(1), parsed)
        assert code not in codes(fixed), f"hint {p.hint!r} does not clear {code}"


REFERENCE_RUNS = [("qwen3_5_27b", "fsdp", "gpu_1node"), ("qwen3_5_27b", "fsdp", "a3_1node"),
                  ("qwen3_5_35b_a3b", "fsdp", "gpu_1node"), ("qwen3_5_35b_a3b", "fsdp", "a3_1node"),
                  ("qwen3_5_35b_a3b", "megatron", "gpu_1node"), ("qwen3_5_35b_a3b", "megatron", "a3_1node"),
                  ("qwen3_5_122b_a10b", "megatron", "h20_4node"), ("qwen3_5_122b_a10b", "megatron", "a3_4node"),
                  ("qwen3_5_397b_a17b", "megatron", "gpu_16node"), ("qwen3_5_397b_a17b", "megatron", "a3_16node")]


@pytest.mark.parametrize("model,backend,hw", REFERENCE_RUNS, ids=["-".join(r) for r in REFERENCE_RUNS])
def test_reference_runs_are_valid(model, backend, hw):
    for data in ("synthetic", "geo3k"):  # geo3k (image + text) is the reference runs' data, Megatron's included
        cfg = compose([f"model={model}", f"backend={backend}", f"hw={hw}", f"data={data}"])
        found = rules.check_all(cfg, derive_layout(cfg))
        # valid; a warning only where the run sets something its engine does not apply (e.g. TE options on Ascend)
        declared = {e.code for e in capabilities.DECLARATION if e.verdict == capabilities.NOT_APPLIED}
        # (and the geo3k files, which live on the cluster: a paths_exist warning on this machine; no model.path
        # given: a model_path_missing warning, which qwen35rl-train turns into an error)
        assert all(p.severity == WARNING and (p.code in declared or p.code in ("paths_exist", "model_path_missing"))
                   for p in found), \
            [p.render() for p in found]


def test_model_path_missing_warns_for_a_cluster_run():
    """Planned on a login node for a GPU cluster, a missing checkpoint is a warning (qwen35rl-train refuses it)."""
    found = by_code(tree("mg35"), "model_path_missing")
    assert [(p.key, p.severity) for p in found] == [("model.path", WARNING)]
    assert not by_code(tree("mg35", model__path="/ckpt"), "model_path_missing")


def test_default_and_tiny_variants_are_valid():
    for overrides in ([], ["model=qwen3_5_tiny_moe"], ["model=qwen3_5_tiny_vl", "data=geo3k"],
                      ["model=qwen3_5_tiny_vl_moe", "data=geo3k"]):
        cfg = compose(overrides)
        found = rules.check_all(cfg, derive_layout(cfg))
        # geo3k's parquet files are not in the checkout: the only problem is that they are missing here
        assert [p for p in found if not (p.code == "paths_exist" and p.key.startswith("data."))] == []


TINY_MEGATRON_CPU = ["backend=megatron", "hw=cpu", "hw.devices_per_node=2"]


@pytest.mark.parametrize("overrides", [
    ["model=qwen3_5_tiny", "parallelism.tp=2"],
    ["model=qwen3_5_tiny_vl", "data=geo3k", "parallelism.tp=2"],
    ["model=qwen3_5_tiny_vl", "data=geo3k", "parallelism.pp=2", "parallelism.vpp=2"],
    ["model=qwen3_5_tiny_vl_moe", "data=geo3k", "parallelism.ep=2"],
], ids=["tiny-tp2", "tiny_vl-tp2", "tiny_vl-pp2-vpp2", "tiny_vl_moe-ep2"])
def test_tiny_megatron_layouts_on_cpu_are_valid(overrides):
    """The layouts the Megatron CPU tests run, image data included (the vision tower on the first stage)."""
    cfg = compose(TINY_MEGATRON_CPU + overrides)
    # geo3k's parquet files are not in the checkout: missing here is the one other problem
    found = [p for p in rules.check_all(cfg, derive_layout(cfg))
             if not (p.code == "paths_exist" and p.key.startswith("data."))]
    assert {p.code for p in found} <= {"megatron_permute_fusion_needs_te", "megatron_precision_aware_optimizer"}
    assert all(p.severity == WARNING for p in found)


def test_image_data_needs_a_vision_model_on_either_backend():
    for backend in ("fsdp", "megatron"):
        cfg = compose(["model=qwen3_5_tiny", f"backend={backend}", "data=geo3k"])
        found = [p.code for p in rules.check_all(cfg, derive_layout(cfg)) if p.severity == ERROR
                 and not (p.code == "paths_exist" and p.key.startswith("data."))]  # geo3k files: not here
        assert found == ["images_need_vision_model"]


def test_megatron_reference_run_that_asks_for_packing_is_told_it_trains_padded():
    t = tree("mg35_a3")
    assert t["backend"]["remove_padding"] and t["backend"]["dynamic_batch_size"]
    found = [p for p in problems(t) if p.code == "megatron_pads_sequences"]
    assert [p.severity for p in found] == [WARNING] and "padded" in found[0].message
    assert not [p for p in problems(t) if p.severity == ERROR]


def test_check_all_accepts_dictconfig_and_plain_tree_alike():
    cfg = compose(BASES["mg35"] + ["parallelism.tp=3"])
    assert [p.to_dict() for p in rules.check_all(cfg, derive_layout(cfg))] == \
        [p.to_dict() for p in problems(as_tree(cfg))]


def test_nonpositive_degree_reports_once_without_crashing():
    found = problems(tree("mg35", parallelism__tp=0))
    assert [p.code for p in found if p.severity == ERROR] == ["degrees_positive"]


def test_pipeline_layout_mismatch_and_vpp_without_pp():
    bad = by_code(tree("mg397_a3", parallelism__pipeline_layout="Et*30|t*30L"), "pipeline_splits_layers")
    assert bad and "4 stages" in bad[0].message and "2 stages" in bad[0].message
    unreadable = by_code(tree("mg397_a3", parallelism__pipeline_layout="E|x*3"), "pipeline_splits_layers")
    assert unreadable and "cannot read" in unreadable[0].message
    assert by_code(tree("mg35", parallelism__vpp=2), "pipeline_splits_layers")[0].key == "parallelism.vpp"
    assert "pipeline_splits_layers" not in codes(tree("mg397_a3", parallelism__vpp=3))  # 60 = 4 x 3 x 5


def test_parse_pipeline_layout():
    assert parse_pipeline_layout("E|(tt|)*2,(t|)*4,mL") == [["E"], ["t", "t"], ["t", "t"], ["t"], ["t"], ["t"], ["t"],
                                                            ["m", "L"]]
    even = even_pipeline_layout(60, 8)
    assert [st.count("t") for st in even] == [7, 7, 7, 7, 8, 8, 8, 8] and even[0][0] == "E" and even[-1][-1] == "L"
    assert parse_pipeline_layout(format_pipeline_layout(even)) == even
    with pytest.raises(ValueError):
        parse_pipeline_layout("E|q*2")


def test_did_you_mean_hints():
    assert "token-mean" in by_code(tree("tiny", algorithm__loss_agg_mode="token_mean"), "known_choice")[0].hint
    assert "'vllm'" in by_code(tree("tiny", rollout__engine="vlm"), "engine_known")[0].hint
    reward = by_code(tree("tiny", data__reward="mathh"), "known_choice")[0]
    assert reward.key == "data.reward" and "'math'" in reward.hint
    assert "known_choice" not in codes(tree("tiny", data__reward="mypkg.rewards:score"))
    assert "gpu_memory_utilization" in by_code(tree("mg35", rollout__engine_kwargs={"gpu_mem_util": 0.5}),
                                               "engine_kwargs_known")[0].hint
    assert "'moe_router_dtype'" in by_code(tree("mg35", backend__transformer_overrides={"moe_router_dtyp": "fp32"}),
                                           "transformer_overrides_known")[0].hint


def test_known_key_lists_are_consistent():
    assert set(known_keys.VLLM_OWNED) <= known_keys.VLLM_ENGINE_ARGS
    assert set(known_keys.MEGATRON_OWNED) <= known_keys.MEGATRON_TRANSFORMER_CONFIG
    for name in ("gpu_memory_utilization", "mm_processor_cache_gb", "compilation_config", "enable_expert_parallel"):
        assert name in known_keys.VLLM_ENGINE_ARGS
    for name in ("moe_router_load_balancing_type", "recompute_granularity", "sequence_parallel", "attention_backend"):
        assert name in known_keys.MEGATRON_TRANSFORMER_CONFIG


def test_quirks_merge_into_engine_kwargs():
    npu = tree("mg35_a3")
    assert quirks.effective_engine_kwargs(npu) == {"mm_processor_cache_gb": 0}
    assert quirks.effective_engine_kwargs(tree("mg35_a3", rollout__vllm_version="0.22.0")) == {}
    user = tree("mg35_a3", rollout__engine_kwargs={"mm_processor_cache_gb": 2, "swap_space": 1})
    assert quirks.effective_engine_kwargs(user) == {"mm_processor_cache_gb": 2, "swap_space": 1}
    warning = by_code(user, "quirk_overridden")[0]
    assert "Expected a cached item for mm_hash" in warning.message  # says why the quirk exists
    assert quirks.effective_engine_kwargs(tree("mg35")) == {}  # no quirks on GPU
    always = tree("mg35", hw__vllm_quirks=[{"key": "enforce_eager", "value": True, "below_version": None, "why": "x"}])
    assert quirks.effective_engine_kwargs(always) == {"enforce_eager": True}


def test_version_parsing():
    assert quirks.version_tuple("0.18.0") == (0, 18, 0)
    assert quirks.version_tuple("0.11.0rc2") == (0, 11, 0)
    assert quirks.version_tuple("0.9.2+cpu") == (0, 9, 2)
    assert quirks.version_below("0.18.0", "0.22") and not quirks.version_below("0.22.0", "0.22")
    assert quirks.version_below("1.0", None)


def test_reward_names_match_the_reward_registry():
    from qwen35rl.names import REWARDS
    from qwen35rl.rewards import BUILTIN

    assert set(REWARDS) == set(BUILTIN)


def test_allocator_slack_cannot_be_negative():
    """A negative hw.allocator_slack would let the plan count more memory than the device has."""
    assert by_code(tree("tiny", hw__allocator_slack=0.0), "value_in_range") == []
    bad = by_code(tree("tiny", hw__allocator_slack=-0.5), "value_in_range")
    assert [p.key for p in bad] == ["hw.allocator_slack"]


def test_log_prob_token_budget_holds_a_sequence_and_fits():
    """With dynamic batch size the log-prob passes' own budget must hold a sequence, and is sized by the memory rule
    like the micro batch (the hint is the largest budget that fits)."""
    short = by_code(tree("mg35_a3", backend__log_prob_max_tokens_per_device=2048), "dynamic_batch_holds_a_sequence")
    assert [p.key for p in short] == ["backend.log_prob_max_tokens_per_device"]
    huge = tree("mg35_a3", backend__log_prob_max_tokens_per_device=10 ** 7)
    found = by_code(huge, "log_prob_memory_fits")
    assert found and found[0].key == "backend.log_prob_max_tokens_per_device"
    fit = int(re.match(r"try [\w.]+=(\d+)", found[0].hint).group(1))
    assert fit >= 3072 and not by_code(tree("mg35_a3", backend__log_prob_max_tokens_per_device=fit),
                                       "log_prob_memory_fits")
    assert by_code(tree("mg35_a3", backend__log_prob_max_tokens_per_device=fit + 1), "log_prob_memory_fits")


def test_verl_reward_file_and_function_are_checked_before_launch(tmp_path):
    """data.reward=verl:FILE.py:FUNCTION (verl's custom_reward_function): a missing file or a function the file
    does not define is a plan error naming data.reward and the fix, found without running the file."""
    good = tmp_path / "score.py"
    good.write_text("import torch_is_never_imported_here\n\ndef compute_score(data_source, solution_str, "
                    "ground_truth, extra_info=None):\n    return 0.0\n")
    assert by_code(tree("tiny", data__reward=f"verl:{good}:compute_score"), "paths_exist") == []
    assert by_code(tree("tiny", data__reward=f"verl:{good}"), "paths_exist") == []  # verl's default name
    missing = tmp_path / "nope.py"
    (p,) = by_code(tree("tiny", data__reward=f"verl:{missing}:compute_score"), "paths_exist")
    assert p.key == "data.reward" and p.severity == ERROR and "does not exist" in p.message and str(missing) in p.message
    assert "custom_reward_function.path" in p.message and "verl:path/to/file.py:compute_score" in p.hint
    (p,) = by_code(tree("tiny", data__reward=f"verl:{good}:score"), "paths_exist")
    assert p.key == "data.reward" and p.severity == ERROR and "defines no function 'score'" in p.message
    assert "compute_score" in p.hint
    # a cluster run: its nodes' preflight checks the file there
    (p,) = by_code(tree("tiny", data__reward=f"verl:{missing}", ray_address="10.0.0.1:6379"), "paths_exist")
    assert p.severity == WARNING
