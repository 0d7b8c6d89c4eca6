"""qwen35rl: compose, check and launch GRPO post-training of Qwen3.5 models on GPU and Ascend NPU clusters."""

__version__ = "0.1.0"
