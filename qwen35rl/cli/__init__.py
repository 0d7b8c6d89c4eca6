"""Console entry points: `qwen35rl-plan` and `qwen35rl-train`."""
