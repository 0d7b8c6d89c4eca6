"""The config layer: schema, composition, validation, parameter and memory estimates, layout search.

Pure Python over hydra/omegaconf: never imports torch, ray, transformers or vllm."""
