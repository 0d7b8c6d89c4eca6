"""Named validation rules: everything knowable before launch.

Each rule is a small pure function `(cfg, layout) -> list[Problem]` registered with the part of the config it
reads (its scope):
- `config`: the config alone (enums, ranges, batch sizes vs lengths, version facts, pass-through dicts);
- `train`: the training layout (TP/PP/CP/EP/ETP, FSDP size, SP, DP-dependent batch arithmetic);
- `rollout`: the rollout layout (rollout TP/DP/EP);
- `colocated`: both layouts at once (the rollout phase's memory depends on what the trainer keeps).
`check_all` runs them all; the layout search runs each scope where it changes. Problems carry a stable code (the
rule's name), the key to change, a message with the numbers and a hint with a valid alternative.

The modules, by what their rules check (each rule is also importable from here):
- `registry`: `rule`, `RULES` and the helpers every rule shares (no rules);
- `declared`: ranges and values the schema declares beside its fields (no rules);
- `parallelism`: the engines, the parallel degrees and the training layout against the world, heads and layers;
- `engines`: what the training engine builds (capabilities, megatron-core's expert-gradient fact);
- `rollout`: the rollout layout;
- `batches`: batch arithmetic, sequence lengths, image data, the MoE dispatcher;
- `launch`: the launcher, placement=split and staleness;
- `choices`: enum-like fields and value ranges;
- `versions`: vLLM and megatron-core versions and what they load;
- `passthrough`: engine_kwargs, transformer_overrides, compile_decode, platform quirks;
- `architecture`: the model's heads, experts, rotary sections and vocabulary;
- `memory_fit`: the training, log-prob and rollout peaks;
- `paths`: names, paths and packages on this machine;
- `runner`: `gate_problems`, `run_rules`, `check_all`.
"""
from __future__ import annotations

# The rule modules are imported in the order their rules run and report (cheap arithmetic first, memory late).
from qwen35rl.config.rules.registry import RULES, SCOPES, Rule, _divisors, rule, val
from qwen35rl.config.rules.declared import DEGREES, _in_span, declared_fields, declared_ranges
from qwen35rl.config.rules.parallelism import (AXIS_DEFAULTS, degrees_match_backend, degrees_positive,
                                               engine_known, ep_divides_experts, ep_etp_divide_stage_world,
                                               fsdp_size_divides_world, pipeline_splits_layers, sp_divides_heads,
                                               tp_cp_divide_gdn_heads, tp_divides_attention_heads, tp_fits_kv_heads,
                                               world_size_matches_devices)
from qwen35rl.config.rules.engines import engine_builds_setting, expert_grads_need_ep_or_etp_equal_tp
from qwen35rl.config.rules.rollout import (placeholder_weights_need_a_sync, rollout_engine_parallelism,
                                           rollout_ep_divides_experts, rollout_ep_matches_tp_dp,
                                           rollout_replicas_cover_devices, rollout_tp_divides_heads,
                                           rollout_tp_within_node)
from qwen35rl.config.rules.batches import (batch_divisible_by_dp_micro, batch_divisible_by_mini_batch,
                                           dynamic_batch_holds_a_sequence, images_need_vision_model,
                                           megatron_dispatcher_takes_variable_lengths, mini_batch_divisible_by_dp,
                                           mini_batch_divisible_by_micro, mini_batch_within_batch,
                                           overlong_buffer_within_response, rollout_n_at_least_2,
                                           sequence_within_max_model_len, sequence_within_max_position)
from qwen35rl.config.rules.launch import (local_launcher_runs_on_this_host, rollout_devices_needs_split,
                                          rollout_is_weights_are_one, split_needs_ray, split_offload_pointless,
                                          split_pool_sizes, split_rollout_needs_hf, staleness_needs_split)
from qwen35rl.config.rules.choices import CHOICES, known_choice, value_in_range
from qwen35rl.config.rules.versions import (megatron_core_version_valid, vllm_loads_rollout_checkpoint,
                                            vllm_prefix_caching_on_gdn, vllm_version_valid)
from qwen35rl.config.rules.passthrough import (compile_decode_is_hf_only, engine_kwargs_known,
                                               engine_kwargs_not_owned, quirk_overridden, transformer_overrides_known,
                                               transformer_overrides_not_owned)
from qwen35rl.config.rules.architecture import architecture_consistent, tokenizer_size
from qwen35rl.config.rules.memory_fit import (log_prob_memory_fits, rollout_memory_fits, rollout_memory_problems,
                                              train_memory_fits, train_memory_problems)
from qwen35rl.config.rules.paths import (BUILTIN_TOKENIZERS, NAME_MAX, RAY_ADDRESS, TRACKER_PACKAGES, data_unusable,
                                         is_local_run, model_path_missing, names_valid, path_findings, paths_exist)
from qwen35rl.config.rules.runner import GATES, check_all, gate_problems, run_rules
