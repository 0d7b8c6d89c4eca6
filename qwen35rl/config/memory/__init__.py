"""Per-device memory of a run. Colocated: the trainer and the rollout engine take turns on the same devices.
With placement=split each pool holds only its own phase (`Layout.split`): the training pool's peak has no
rollout share (no sleeping engine), the rollout pool's is the engine alone (nothing kept by a trainer); each is
checked against the device's usable memory on its own.

Three phases peak separately:
- training: the trainer's weights and optimizer states, the reference model and whatever the sleeping rollout engine
  keeps, plus the larger of two moments: the backward (gradients of earlier micro batches, gathered FSDP units,
  saved activations, the log-prob head's or a recomputed layer's transient) and the optimizer step (every local
  gradient, the grad-norm and AdamW temporaries; `train/optimizer_step` is what it adds beyond the backward). On
  image data the policy and the reference include the vision tower (`trains_vision`): its weights, gradients and
  optimizer states follow each engine's rules for the text parameters (Megatron: on the first stage, replicated
  over TP), and its activations are `train/vision_activations`; `model.freeze_vision_tower` leaves weights only;
- log-probs: the old and the reference log-probs, forward-only passes in micro batches of their own
  (`backend.log_prob_*`): the trainer's resident states plus one pass's working set (`log_prob_activations_gib`);
- rollout: what the trainer keeps on the device between steps, plus the rollout engine (vLLM claims
  `gpu_memory_utilization` of the device for its weights, activations, KV cache and GDN state; the hf engine holds
  its weights, a static cache and one layer's prefill tensors).

Every term is a function in the modules below whose docstring states its assumption in one line; the training
peak is the sum of the `train/` terms and the rollout peak the sum of `rollout/kept_by_trainer` and the engine's
terms. Terms are GiB per device (the most loaded device: Megatron pipeline ranks are combined conservatively: the heaviest rank's
states, the first stage's in-flight activations and the last stage's log-prob head). capacity = (memory_gb*1e9/2^30 -
hw.reserve_gib) / (1 + hw.allocator_slack).

The FSDP and hf terms (transformers modules) were calibrated against `torch.cuda.max_memory_allocated` on an H200
(bench/results/h200.md, tests/config/test_memory_calibration.py); per-token activations were counted tensor by
tensor on the same modules. What a Gated DeltaNet layer keeps depends on its kernels (`gdn_kernels`; Megatron:
`megatron_gdn_kernels`). Megatron's per-token layer activations were counted with saved_tensors_hooks on
megatron-core 0.16.1's layers on CPU (tests/config/test_megatron_activations.py); its GDN layer on fla was read
off an H200 allocator history (megatron-core 0.19.2), and its training peaks at TP1 measured there (0.8B, 4B:
tests/config/test_memory_calibration.py). The vLLM terms are not measured.

The modules, by what they model (every name is also importable from here):
- `common`: byte sizes, GiB, the device's capacity, batch shapes and the config rules the terms branch on;
- `shard`: the trainer's parameters on the most loaded device (`TrainShard`, `train_shard`);
- `layers`: bytes a decoder layer keeps per token (transformers, megatron-core, vLLM's profile);
- `training`: the training terms (weights, gradients, optimizer, gathered units, activations, backward transient,
  optimizer step, reference model), FSDP and Megatron;
- `vision`: the vision tower's training activations;
- `log_prob`: the forward-only log-prob passes;
- `rollout`: the rollout engine's weights, sleep mode, what the trainer keeps, vLLM's pool, KV cache and GDN state;
- `hf_rollout`: the transformers-generate engine's cache and transients;
- `host`: host offload and the checkpoint on disk;
- `peaks`: `MemoryEstimate`, the phases' terms, `assemble` and `estimate`.
"""
from __future__ import annotations

from qwen35rl.config.memory.common import (BF16, FP32, FP64, GDN_CHUNK, GIB, _DTYPE_BYTES, _model_parallel,
                                           _offload_policy_on, as_tree, capacity_gib, compute_bytes, dtype_bytes,
                                           freezes_vision, gdn_kernels, gib, kl_on, micro_batch_tokens,
                                           micro_batches_per_mini_batch, sequence_length, trains_vision)
from qwen35rl.config.memory.shard import TrainShard, largest_parameter, pipeline_ranks, train_shard, vision_tower_params
from qwen35rl.config.memory.layers import (attention_bytes_per_token, compiles_layers, final_norm_bytes_per_token,
                                           gdn_bytes_per_token, hf_layer_bytes_per_token,
                                           layer_activation_elems_per_token, megatron_attention_bytes_per_token,
                                           megatron_gdn_bytes_per_token, megatron_gdn_kernels,
                                           megatron_layer_bytes_per_token, megatron_norm_mlp_bytes_per_token,
                                           norm_mlp_bytes_per_token)
from qwen35rl.config.memory.training import (activations_gib, backward_transient_gib, fsdp_gathered_params_gib,
                                             head_tokens_per_device, in_flight_micro_batches, logits_gib,
                                             optimizer_states_gib, optimizer_step_gib, recompute_groups,
                                             recomputed_layer_gib, reference_model_gib, response_tokens_per_device,
                                             tokens_per_device, train_grads_gib, train_weights_gib)
from qwen35rl.config.memory.vision import (_pixels_per_patch, image_tokens_per_micro_batch, vision_activations_gib,
                                           vision_block_bytes_per_patch, vision_patches_per_micro_batch,
                                           vision_recomputed, vision_stem_bytes_per_patch)
from qwen35rl.config.memory.log_prob import LOG_PROB_BESIDE, log_prob_activations_gib, log_prob_tree
from qwen35rl.config.memory.rollout import (AUTO, AUTO_POOL_HEADROOM, AUTO_POOL_MAX, auto_pool_gib,
                                            gdn_state_bytes_per_sequence, hf_engine_sleeps, kv_cache_bytes_per_token,
                                            nominal_gib, pool_is_auto, rollout_activations_gib, rollout_max_model_len,
                                            rollout_weights_params, sequence_cache_gib, sleeping_engine_gib,
                                            train_state_during_rollout_gib, vllm_pool_gib)
from qwen35rl.config.memory.hf_rollout import (hf_engine_sequences, hf_prefill_gib, hf_rollout_activations_gib,
                                               hf_sampler_gib, hf_static_cache_gib)
from qwen35rl.config.memory.host import checkpoint_gib, host_offloaded_gib
from qwen35rl.config.memory.peaks import (MemoryEstimate, assemble, auto_pool_fraction, estimate, rollout_terms,
                                          train_terms)
