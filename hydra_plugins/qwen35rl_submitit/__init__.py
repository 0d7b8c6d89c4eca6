"""qwen35rl's submitit launchers: `hydra/launcher=submitit_local` and `hydra/launcher=submitit_slurm` for
`qwen35rl-train -m` (see launcher.py)."""
