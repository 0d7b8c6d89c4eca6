"""Registers the schema with Hydra's ConfigStore (idempotent)."""
from __future__ import annotations

from hydra.core.config_store import ConfigStore

from qwen35rl.config import schema

_done = False


def register() -> None:
    global _done
    if _done:
        return
    from qwen35rl.config import batch_scale

    batch_scale.register()  # ${qwen35rl_batch:...}: the batch sizes' defaults
    from qwen35rl.config import run_name

    run_name.register()  # ${qwen35rl_layout:}, ${qwen35rl_hw:}: the default run name's parts
    cs = ConfigStore.instance()
    cs.store(name="schema", node=schema.RunConfig)
    cs.store(group="schema/backend", name="fsdp", node=schema.FsdpConfig)
    cs.store(group="schema/backend", name="megatron", node=schema.MegatronConfig)
    _done = True
