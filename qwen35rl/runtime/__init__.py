"""Ray workers, the GRPO loop and what runs around it: checkpoints, tracking, preflight, run identity."""
