"""The real vLLM engine on CPU (`-m vllm`). Runs where vLLM is installed: `tests/vllm_env.sh` builds .venv-vllm, then
`.venv-vllm/bin/pytest tests/real_vllm -m vllm`. Anywhere else (the main .venv) nothing here is collected."""
import importlib.util
import os

import pytest

# With tests/ on sys.path this very directory is a namespace package named `vllm`: only a real one counts.
_spec = importlib.util.find_spec("vllm")
collect_ignore_glob = [] if _spec is not None and _spec.origin is not None else ["test_*.py"]

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """`make(model_name, seed, overrides, state)` -> (checkpoint dir, cfg, fp32 transformers model): a tiny Qwen3.5
    built in code (with the weights of `state`, a state dict, when given) and saved in the HF layout;
    `qwen3_5_tiny_vl` gives a Qwen3_5ForConditionalGeneration checkpoint with its processor, as the runtime exports
    one for image data."""
    from qwen35rl.config.compose import compose
    from qwen35rl.models.build import build_model, save_hf
    from qwen35rl.models.processor import build_processor
    from qwen35rl.models.tokenizer import build_tokenizer

    def make(model_name: str, seed: int = 0, overrides=(), state=None):
        # the engines here generate from the checkpoint's weights before any sync (rollout.load_format=auto)
        cfg = compose([f"model={model_name}", "hw=cpu", "rollout=vllm", "data.max_prompt_length=32",
                       "data.max_response_length=32", "rollout.enforce_eager=true", "rollout.load_format=auto",
                       *overrides])
        model = build_model(cfg.model, dtype="float32", seed=seed, text_only=cfg.model.vision is None).eval()
        if state is not None:
            model.load_state_dict(state)
        out = tmp_path_factory.mktemp(f"{model_name}_seed{seed}")
        tokenizer = build_tokenizer(cfg.model)
        processor = None if cfg.model.vision is None else build_processor(cfg.model, tokenizer)
        save_hf(model, tokenizer, str(out), processor=processor)
        return str(out), cfg, model

    return make
