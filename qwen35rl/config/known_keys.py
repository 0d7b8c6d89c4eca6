"""Names the pass-through dicts may use, checked before launch so a typo fails on the login node, not after the
cluster has started.

- `rollout.engine_kwargs` goes to `vllm.LLM(**kwargs)`, which forwards them to `vllm.engine.arg_utils.EngineArgs`:
  the field names of that dataclass (the union of vLLM 0.11 - 0.18, 0.26 and 0.32), minus the ones qwen35rl sets
  itself. This frozen list is the fallback where no vLLM is installed: the plan checks against the installed
  vLLM's own `EngineArgs` when there is one (`vllm_facts.engine_arg_names`).
- `backend.transformer_overrides` goes to megatron-core's `TransformerConfig` (which includes `ModelParallelConfig`
  and the MoE fields), minus the ones qwen35rl derives from its own config.

Keys qwen35rl owns map to the config key to set instead (each fact is stated once).
"""
from __future__ import annotations

from typing import Dict, FrozenSet

VLLM_ENGINE_ARGS: FrozenSet[str] = frozenset("""
model served_model_name tokenizer hf_config_path runner convert task skip_tokenizer_init enable_prompt_embeds
tokenizer_mode trust_remote_code allowed_local_media_path allowed_media_domains download_dir
safetensors_load_strategy load_format config_format dtype kv_cache_dtype seed max_model_len cuda_graph_sizes
cudagraph_capture_sizes max_cudagraph_capture_size distributed_executor_backend pipeline_parallel_size
master_addr master_port nnodes node_rank tensor_parallel_size prefill_context_parallel_size
decode_context_parallel_size dcp_kv_cache_interleave_size cp_kv_cache_interleave_size data_parallel_size
data_parallel_rank data_parallel_start_rank data_parallel_size_local data_parallel_address data_parallel_rpc_port
data_parallel_hybrid_lb data_parallel_external_lb data_parallel_backend enable_expert_parallel all2all_backend
enable_dbo ubatch_size dbo_decode_token_threshold dbo_prefill_token_threshold disable_nccl_for_dp_synchronization
eplb_config enable_eplb expert_placement_strategy num_redundant_experts eplb_window_size eplb_step_interval
eplb_log_balancedness max_parallel_loading_workers block_size enable_prefix_caching prefix_caching_hash_algo
disable_sliding_window disable_cascade_attn swap_space cpu_offload_gb gpu_memory_utilization kv_cache_memory_bytes
max_num_batched_tokens max_num_partial_prefills max_long_partial_prefills long_prefill_token_threshold max_num_seqs
max_logprobs logprobs_mode disable_log_stats aggregate_engine_logging revision code_revision rope_scaling rope_theta
hf_token hf_overrides tokenizer_revision quantization allow_deprecated_quantization enforce_eager
disable_custom_all_reduce limit_mm_per_prompt enable_mm_embeds interleave_mm_strings media_io_kwargs
mm_processor_kwargs disable_mm_preprocessor_cache mm_processor_cache_gb mm_processor_cache_type
mm_shm_cache_max_object_size_mb mm_encoder_only mm_encoder_tp_mode mm_encoder_attn_backend io_processor_plugin
skip_mm_profiling video_pruning_rate enable_lora max_loras max_lora_rank default_mm_loras fully_sharded_loras
max_cpu_loras lora_dtype lora_extra_vocab_size enable_tower_connector_lora specialize_active_lora
ray_workers_use_nsight num_gpu_blocks_override num_lookahead_slots model_loader_extra_config ignore_patterns
enable_chunked_prefill disable_chunked_mm_input disable_hybrid_kv_cache_manager structured_outputs_config
reasoning_parser reasoning_parser_plugin guided_decoding_backend guided_decoding_disable_fallback
guided_decoding_disable_any_whitespace guided_decoding_disable_additional_properties logits_processor_pattern
speculative_config show_hidden_metrics_for_version otlp_traces_endpoint collect_detailed_traces kv_cache_metrics
kv_cache_metrics_sample cudagraph_metrics enable_layerwise_nvtx_tracing enable_mfu_metrics
enable_logging_iteration_details enable_mm_processor_stats scheduling_policy scheduler_cls pooler_config
override_pooler_config compilation_config attention_config worker_cls worker_extension_cls profiler_config
kv_transfer_config kv_events_config ec_transfer_config generation_config enable_sleep_mode
override_generation_config model_impl override_attention_dtype attention_backend calculate_kv_scales
mamba_cache_dtype mamba_ssm_cache_dtype mamba_block_size mamba_cache_mode additional_config use_tqdm_on_load
pt_load_map_location enable_multimodal_encoder_data_parallel logits_processors async_scheduling stream_interval
kv_sharing_fast_prefill optimization_level kv_offloading_size kv_offloading_backend tokens_only
weight_transfer_config
aux_output_config cpu_distributed_timeout_seconds cpu_offload_params custom_histogram_buckets
data_parallel_multi_port_external_lb dcp_comm_backend dcp_q_replicate device_ids diffusion_config
distributed_timeout_seconds dp_sync_interval ec_manager_config elastic_ep_max_dp_size enable_batch_sharded_sampling
enable_bf16x3_router_gemm enable_cumem_allocator enable_elastic_ep enable_ep_weight_filter enable_fault_tolerance
enable_flashinfer_autotune enable_hc_sp enable_mamba_cache_stochastic_rounding enable_mamba_shared_prefix_checkpoint
enable_mixed_moe_lora_format enable_moe_shared_loras enable_nccl_comm_suspend enable_return_routed_experts
enable_shm_tensor_arena enable_trace_replay engram_config fail_on_environ_validation fault_tolerance_config
gdn_prefill_backend ir_op_priority jit_monitor_mode jit_monitor_verbose kda_decode_backend kda_prefill_backend
kernel_config kv_cache_dtype_skip_layers language_model_only linear_backend log_config_file log_level logging_config
long_prefill_token_threshold_adaptive lora_target_modules mamba_backend mamba_cache_philox_rounds mamba_config
mamba_ssu_algorithm max_lora_cls_labels max_num_active_seqs max_num_queued_reqs max_num_queued_tokens
max_num_scheduled_tokens mm_device_do_normalize mm_encoder_attn_dtype mm_encoder_fp8_scale_path
mm_encoder_fp8_scale_save_margin mm_encoder_fp8_scale_save_path mm_hasher_algorithm mm_ipc_gpu_memory_gb
mm_processor_device mm_tensor_ipc model_class_overrides model_weights moe_backend numa_bind numa_bind_cpus
numa_bind_nodes offload_backend offload_group_size offload_num_in_group offload_params offload_prefetch_step
per_request_spec_decode_metrics performance_mode prefill_schedule_interval prefix_cache_retention_interval
prefix_match_unit quantization_config reasoning_config renderer_num_workers replayssm_buffer_len return_sampling_mask
safetensors_prefetch_block_size safetensors_prefetch_num_threads scheduler_reserve_full_isl shutdown_timeout
sleep_mode_offload_cudagraph sleep_preserve_parameter_names sparse_indexer_topk_backend spec_method spec_model
spec_tokens swa_bounded_replay use_fp64_gumbel use_replayssm video_pruning_method watermark watermark_config
""".split())

# EngineArgs fields qwen35rl sets from its own config: the key to set instead.
VLLM_OWNED: Dict[str, str] = {
    "model": "model.path",
    "tokenizer": "model.tokenizer",
    "trust_remote_code": "model.trust_remote_code",
    "dtype": "model.dtype",
    "seed": "trainer.seed",
    "logprobs_mode": "nothing (the rollout returns the log-probs of the sampled distribution)",
    "distributed_executor_backend": "nothing (derived from parallelism.rollout)",
    "tensor_parallel_size": "parallelism.rollout.tp",
    "data_parallel_size": "parallelism.rollout.dp",
    "enable_expert_parallel": "parallelism.rollout.ep",
    "gpu_memory_utilization": "rollout.gpu_memory_utilization",
    "max_model_len": "rollout.max_model_len",
    "max_num_batched_tokens": "rollout.max_num_batched_tokens",
    "max_num_seqs": "rollout.max_num_seqs",
    "enable_chunked_prefill": "rollout.enable_chunked_prefill",
    "enable_prefix_caching": "rollout.enable_prefix_caching",
    "enforce_eager": "rollout.enforce_eager",
    "load_format": "rollout.load_format",
    "enable_sleep_mode": "rollout.free_cache_engine",
    "cudagraph_capture_sizes": "rollout.cudagraph_capture_sizes",
    "cuda_graph_sizes": "rollout.cudagraph_capture_sizes",
}

MEGATRON_TRANSFORMER_CONFIG: FrozenSet[str] = frozenset("""
tensor_model_parallel_size pipeline_model_parallel_size virtual_pipeline_model_parallel_size sequence_parallel
context_parallel_size hierarchical_context_parallel_sizes expert_model_parallel_size expert_tensor_parallel_size
moe_extended_tp perform_initialization use_cpu_initialization fp16 bf16 params_dtype timers finalize_model_grads_func
grad_scale_func no_sync_func grad_sync_func param_sync_func deterministic_mode enable_autocast autocast_dtype
num_microbatches_with_partial_activation_checkpoints gradient_accumulation_fusion
async_tensor_model_parallel_allreduce use_te_rng_tracker tp_comm_overlap tp_comm_bulk_wgrad tp_comm_bulk_dgrad
tp_comm_overlap_ag tp_comm_overlap_rs tp_comm_overlap_rs_dgrad tp_comm_split_ag tp_comm_atomic_ag tp_comm_split_rs
tp_comm_atomic_rs cross_entropy_loss_fusion cross_entropy_fusion_impl tp_comm_overlap_disable_qkv
tp_comm_overlap_disable_fc1 tp_comm_bootstrap_backend pipeline_dtype variable_seq_lengths overlap_p2p_comm
batch_p2p_comm batch_p2p_sync use_ring_exchange_p2p deallocate_pipeline_outputs defer_embedding_wgrad_compute
wgrad_deferral_limit pipeline_model_parallel_split_rank overlap_moe_expert_parallel_comm delay_wgrad_compute
cpu_offloading cpu_offloading_num_layers cpu_offloading_activations cpu_offloading_weights
cpu_offloading_double_buffering barrier_with_L1_time microbatch_group_size_per_vp_stage
num_layers mtp_num_layers mtp_loss_scaling_factor num_layers_in_first_pipeline_stage
num_layers_in_last_pipeline_stage pipeline_model_parallel_layout account_for_embedding_in_pipeline_split
account_for_loss_in_pipeline_split hidden_size num_attention_heads attention_backend softmax_scale softmax_type
num_query_groups ffn_hidden_size kv_channels hidden_dropout attention_dropout fp32_residual_connection
apply_residual_connection_post_layernorm layernorm_epsilon layernorm_zero_centered_gamma add_bias_linear
add_qkv_bias gated_linear_unit activation_func activation_func_fp8_input_store glu_linear_offset
activation_func_clamp_value num_moe_experts rotary_interleaved window_size window_attn_skip_freq normalization
qk_layernorm qk_l2_norm qk_clip qk_clip_alpha qk_clip_threshold log_max_attention_logit attention_output_gate
test_mode calculate_per_token_loss multi_latent_attention no_rope_freq experimental_attention_variant
linear_attention_type linear_attention_freq linear_conv_kernel_dim linear_key_head_dim linear_value_head_dim
linear_num_key_heads linear_num_value_heads init_method output_layer_init_method init_method_std
embedding_init_method embedding_init_method_std init_model_with_meta_device apply_query_key_layer_scaling
attention_softmax_in_fp32 disable_bf16_reduced_precision_matmul bias_activation_fusion masked_softmax_fusion
persist_layer_norm memory_efficient_layer_norm bias_dropout_fusion apply_rope_fusion
use_fused_weighted_squared_relu fused_single_qkv_rope recompute_granularity recompute_method recompute_num_layers
distribute_saved_activations recompute_modules fp8 fp8_recipe fp8_param fp8_margin fp8_interval
fp8_amax_history_len fp8_amax_compute_algo fp8_wgrad fp8_dot_product_attention fp8_multi_head_attention
tp_only_amax_red first_last_layers_bf16 num_layers_at_start_in_bf16 num_layers_at_end_in_bf16 use_kitchen
fp4 fp4_recipe fp4_param moe_shared_expert_intermediate_size moe_shared_expert_gate moe_shared_expert_overlap
moe_layer_freq moe_ffn_hidden_size moe_router_load_balancing_type moe_router_topk moe_enable_routing_replay
moe_router_topk_limited_devices moe_router_padding_for_quantization moe_router_padding_for_fp8
moe_router_num_groups moe_router_group_topk moe_router_pre_softmax moe_router_topk_scaling_factor
moe_router_score_function moe_router_dtype moe_router_enable_expert_bias moe_router_bias_update_rate
moe_router_force_load_balancing moe_grouped_gemm moe_use_legacy_grouped_gemm moe_aux_loss_coeff moe_z_loss_coeff
moe_input_jitter_eps moe_token_dropping moe_token_dispatcher_type moe_enable_deepep moe_flex_dispatcher_backend
moe_deepep_num_sms moe_hybridep_num_sms moe_per_layer_logging moe_expert_capacity_factor
moe_pad_expert_input_to_capacity moe_token_drop_policy moe_layer_recompute moe_permute_fusion moe_router_fusion
moe_apply_probs_on_input moe_use_upcycling moe_upcycling_granularity cp_comm_type enable_cuda_graph
cuda_graph_use_single_mempool cuda_graph_retain_backward_graph cuda_graph_warmup_steps external_cuda_graph
cuda_graph_impl cuda_graph_scope clone_scatter_output_in_embedding disable_parameter_transpose_cache
config_logger_dir flash_decode batch_invariant_mode use_te_activation_func inference_rng_tracker
inference_sampling_seed symmetric_ar_type mrope_section mrope_interleaved is_hybrid_model heterogeneous_block_specs
hetereogenous_dist_checkpoint quant_recipe transformer_impl fallback_to_eager_attn
fine_grained_activation_offloading offload_modules min_offloaded_tensor_size
""".split())

# TransformerConfig fields qwen35rl derives (architecture from model.*, layout from parallelism.*, engine knobs
# from backend.*): the key to set instead.
MEGATRON_OWNED: Dict[str, str] = {
    "tensor_model_parallel_size": "parallelism.tp",
    "pipeline_model_parallel_size": "parallelism.pp",
    "virtual_pipeline_model_parallel_size": "parallelism.vpp",
    "context_parallel_size": "parallelism.cp",
    "expert_model_parallel_size": "parallelism.ep",
    "expert_tensor_parallel_size": "parallelism.etp",
    "pipeline_model_parallel_layout": "parallelism.pipeline_layout",
    "bf16": "backend.bf16",
    "recompute_granularity": "backend.recompute_granularity",
    "recompute_method": "backend.recompute_method",
    "recompute_num_layers": "backend.recompute_num_layers",
    "moe_grouped_gemm": "backend.moe_grouped_gemm",
    "moe_permute_fusion": "backend.moe_permute_fusion",
    "moe_aux_loss_coeff": "backend.moe_aux_loss_coeff",
    "moe_z_loss_coeff": "backend.moe_z_loss_coeff",
    "moe_token_dispatcher_type": "backend.moe_token_dispatcher_type",
    "num_layers": "model.num_hidden_layers",
    "hidden_size": "model.hidden_size",
    "num_attention_heads": "model.num_attention_heads",
    "num_query_groups": "model.num_key_value_heads",
    "kv_channels": "model.head_dim",
    "ffn_hidden_size": "model.intermediate_size",
    "num_moe_experts": "model.num_experts",
    "moe_router_topk": "model.num_experts_per_tok",
    "moe_ffn_hidden_size": "model.moe_intermediate_size",
    "moe_shared_expert_intermediate_size": "model.shared_expert_intermediate_size",
    "linear_num_key_heads": "model.linear_num_key_heads",
    "linear_num_value_heads": "model.linear_num_value_heads",
    "linear_key_head_dim": "model.linear_key_head_dim",
    "linear_value_head_dim": "model.linear_value_head_dim",
    "linear_conv_kernel_dim": "model.linear_conv_kernel_dim",
    "layernorm_epsilon": "model.rms_norm_eps",
    "mtp_num_layers": "model.mtp_num_hidden_layers",
    "linear_attention_freq": "model.full_attention_interval",  # the layer pattern, one entry per layer
    "moe_layer_freq": "every layer of a Qwen3.5 MoE model is an MoE layer",
    "mrope_section": "model.mrope_section",
    "attention_output_gate": "model.attn_output_gate",
}
