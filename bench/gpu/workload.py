"""The GRPO workload the GPU benchmarks share (qwen35rl's overrides; TRL reads the same composed config): a random-init
Qwen3.5 architecture with a byte-level tokenizer, prompts of an exact length behind a fixed system prompt."""
from __future__ import annotations

from typing import List, Optional

PROMPTS, N, PROMPT_LEN, RESPONSE_LEN = 16, 8, 256, 512


def system_prompt(prompt_len: int) -> str:
    """Byte tokens: system prompt + "\n\n" + "7 3 9 =" make a prompt of exactly prompt_len tokens."""
    return ("reply with the last digit before the equals sign " * 64)[:prompt_len - len("\n\n7 3 9 =")]


def card_memory_gb(hw: str) -> Optional[int]:
    """The GPU's memory in the vendor's GB (10^9 bytes) as torch reads it from the device (an H100 80GB says 85, an
    H200 150), for `hw.memory_gb`; None on CPU or without CUDA."""
    if hw == "cpu":
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.get_device_properties(0).total_memory / 1e9)


def workload(model: str = "qwen3_5_0_8b", hw: str = "gpu_1x", devices: int = 1, micro: int = 16, ckpt: bool = False,
             kl: bool = True, backend: str = "fsdp", prompts: int = PROMPTS, n: int = N, prompt_len: int = PROMPT_LEN,
             response_len: int = RESPONSE_LEN, steps: int = 4, peak_tflops: Optional[float] = None,
             memory_gb: Optional[float] = None, data: str = "synthetic") -> List[str]:
    """Hydra overrides of the workload (qwen35rl side; the TRL side reads the same composed config). `data`: another
    data config (e.g. geo3k: its files are more overrides) keeps its own system prompt. `memory_gb`: the card's
    (`card_memory_gb`), None: the hw preset's."""
    prompt = [f"data.system_prompt='{system_prompt(prompt_len)}'"] if data == "synthetic" else []
    o = [f"model={model}", "model.init=random", "model.tokenizer=byte", f"hw={hw}", f"hw.devices_per_node={devices}",
         f"backend={backend}", "rollout=hf", f"data={data}", *prompt,
         f"data.max_prompt_length={prompt_len}", f"data.max_response_length={response_len}",
         f"data.train_batch_size={prompts}", f"rollout.n={n}", f"algorithm.mini_batch_size={prompts}",
         f"backend.micro_batch_size_per_device={micro}", f"backend.gradient_checkpointing={str(ckpt).lower()}",
         f"algorithm.use_kl_loss={str(kl).lower()}", "algorithm.kl_loss_coef=0.001", "algorithm.kl_loss_type=low_var_kl",
         "backend.lr=1e-6", "backend.weight_decay=0.01", "backend.grad_clip=1.0", "backend.lr_scheduler=constant",
         "rollout.temperature=1.0", "rollout.top_p=1.0", "rollout.top_k=-1", f"trainer.total_steps={steps}",
         "trainer.export_hf=false", "trainer.test_freq=-1", "trainer.resume=never", "trainer.trackers=[console,jsonl]", "trainer.seed=1"]
    if memory_gb is not None and hw != "cpu":
        o.append(f"hw.memory_gb={memory_gb}")
    if peak_tflops:
        o.append(f"hw.peak_tflops={peak_tflops:.1f}")
    return o
