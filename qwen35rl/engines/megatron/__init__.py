"""The Megatron training backend: megatron-core models of Qwen3.5 (GDN hybrid, dense and MoE) behind TrainEngine.

`mapping` (HF <-> Megatron parameter layout, TP/EP sharding) and `version` import only torch; `engine` and
`model` need megatron-core (`pip install 'qwen35rl[gpu]'`), `ascend` adapts it to NPUs through MindSpeed.
"""
