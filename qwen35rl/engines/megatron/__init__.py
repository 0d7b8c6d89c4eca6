"""The Megatron training backend: megatron-core models of Qwen3.5 (GDN hybrid, dense and MoE) behind TrainEngine.

`mapping` (HF <-> Megatron parameter layout, TP/EP sharding), `tokens`, `batches` and `checkpoint_state` import
only torch; `engine` imports megatron-core when constructed, `model` at import (`pip install 'qwen35rl[gpu]'`);
`ascend` adapts it to NPUs through MindSpeed. The version facts live in `config.megatron_versions`.
"""
