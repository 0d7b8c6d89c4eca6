import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

from qwen35rl.config.layout import derive_layout
from qwen35rl.config.compose import compose
from qwen35rl.engines.base import RolloutRequest
from qwen35rl.engines.fsdp_engine import FsdpTrainEngine
from qwen35rl.engines import hf_rollout
from qwen35rl.engines.hf_rollout import EAGER_STEPS_BEFORE_CAPTURE, HfRolloutEngine
from qwen35rl.models.build import build_model
from qwen35rl.config.special_tokens import BYTE_SPECIAL_IDS
from qwen35rl.models.tokenizer import build_tokenizer
from qwen35rl.runtime.batching import Sequences, build_batch, response_values

PAD, IM_END, EOS = BYTE_SPECIAL_IDS["pad"], BYTE_SPECIAL_IDS["im_end"], BYTE_SPECIAL_IDS["eos"]


def _cfg(*overrides):
    return compose(["model=qwen3_5_tiny", "hw=cpu", "hw.devices_per_node=1", "backend.gradient_checkpointing=false",
                    *overrides])


def _rollout(cfg, seed=0):
    model = build_model(cfg.model, dtype=torch.float32, seed=seed)
    return HfRolloutEngine(model, build_tokenizer(cfg.model), device="cpu", pad_token_id=PAD, eos_token_id=[IM_END, EOS])


def _prompts(tok):
    texts = ["2+2=", "hello there, how are you", "q"]
    return [tok.encode(t, add_special_tokens=False) for t in texts]


def test_shapes_order_and_seed():
    cfg = _cfg()
    eng = _rollout(cfg)
    prompts = _prompts(eng.tokenizer)
    req = RolloutRequest(prompt_ids=prompts, n=3, temperature=1.0, max_new_tokens=10, seed=7)
    a = eng.generate(req)
    assert len(a.response_ids) == len(a.log_probs) == len(a.finish_reasons) == 9
    for ids, lps, fin in zip(a.response_ids, a.log_probs, a.finish_reasons):
        assert len(ids) == len(lps) and 1 <= len(ids) <= 10
        assert fin == ("stop" if ids[-1] in (IM_END, EOS) else "length")
        assert fin == "stop" or len(ids) == 10
        assert all(lp <= 0 for lp in lps)
    assert a.response_ids == eng.generate(req).response_ids  # same seed, same samples
    b = eng.generate(RolloutRequest(prompt_ids=prompts, n=3, temperature=1.0, max_new_tokens=10, seed=8))
    assert a.response_ids != b.response_ids


def test_greedy_is_deterministic_and_matches_argmax():
    cfg = _cfg()
    eng = _rollout(cfg)
    prompts = _prompts(eng.tokenizer)
    out = eng.generate(RolloutRequest(prompt_ids=prompts, n=2, temperature=0.0, max_new_tokens=6))
    assert out.response_ids[0] == out.response_ids[1] and out.response_ids[2] == out.response_ids[3]
    # greedy continuation of the first prompt, step by step without cache or padding
    ids = list(prompts[0])
    for _ in range(len(out.response_ids[0])):
        with torch.no_grad():
            ids.append(int(eng.model(torch.tensor([ids])).logits[0, -1].argmax()))
    assert ids[len(prompts[0]):] == out.response_ids[0]


def test_eos_stops_and_finish_reason():
    cfg = _cfg()
    eng = _rollout(cfg)
    bias = torch.zeros(cfg.model.vocab_size)  # make <|im_end|> certain at every step
    bias[IM_END] = 1e4
    eng.model.lm_head.register_forward_hook(lambda m, i, o: o + bias)
    out = eng.generate(RolloutRequest(prompt_ids=_prompts(eng.tokenizer), n=1, temperature=1.0, max_new_tokens=5, seed=0))
    assert out.response_ids == [[IM_END]] * 3 and out.finish_reasons == ["stop"] * 3


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_rollout_log_probs_match_train_engine_recompute(temperature):
    cfg = _cfg(f"rollout.temperature={temperature}")
    train = FsdpTrainEngine(cfg, layout=derive_layout(cfg), rank=0, world_size=1, device="cpu")
    eng = _rollout(cfg, seed=123)  # different init: the weight sync below must make them agree
    eng.load_weights(train.export_weights(bucket_mb=1))
    prompts = _prompts(eng.tokenizer)
    out = eng.generate(RolloutRequest(prompt_ids=prompts, n=2, temperature=temperature, max_new_tokens=12, seed=1))
    seqs = Sequences([p for p in prompts for _ in range(2)], out.response_ids)
    batch = build_batch(seqs, PAD)
    recomputed = response_values(train.compute_log_probs(batch)[0], batch)
    for r, (a, b) in enumerate(zip(out.log_probs, recomputed)):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-4, atol=1e-4, msg=f"row {r}")


def test_load_weights_checks_names_and_shapes():
    eng = _rollout(_cfg())
    with pytest.raises(KeyError, match="no tensor named"):
        eng.load_weights(iter([[("model.nope.weight", torch.zeros(1))]]))
    with pytest.raises(ValueError, match="shape"):
        eng.load_weights(iter([[("model.norm.weight", torch.zeros(3))]]))
    # the tied lm_head follows the embedding
    emb = torch.randn(320, 128)
    eng.load_weights(iter([[("model.embed_tokens.weight", emb)]]))
    assert torch.equal(eng.model.lm_head.weight, emb)


@pytest.mark.parametrize("top", [dict(top_k=1), dict(top_p=1e-6)])
def test_top_k_1_and_tiny_top_p_sample_the_greedy_tokens(top):
    """Sampling restricted to the most likely token is greedy decoding; the log-probs stay those of the full
    tempered distribution (what the trainer recomputes)."""
    eng = _rollout(_cfg())
    prompts = _prompts(eng.tokenizer)
    greedy = eng.generate(RolloutRequest(prompt_ids=prompts, n=1, temperature=0.0, max_new_tokens=6))
    sampled = eng.generate(RolloutRequest(prompt_ids=prompts, n=1, temperature=1.0, max_new_tokens=6, seed=3, **top))
    assert sampled.response_ids == greedy.response_ids
    assert all(lp < 0 for row in sampled.log_probs for lp in row)


def test_cuda_graph_is_on_by_default_and_never_tried_off_cuda(monkeypatch):
    """The engine's default asks for the graph; a CPU decode long enough to reach the capture runs eagerly, and its
    stats say so (an empty request leaves stats of nothing decoded)."""
    tried = []

    class Recording(hf_rollout.StepRunner):
        def __init__(self, step, cuda_graphs):
            tried.append(cuda_graphs)
            super().__init__(step, cuda_graphs)

    monkeypatch.setattr(hf_rollout, "StepRunner", Recording)
    eng = _rollout(_cfg())
    assert eng.cuda_graphs
    eng.generate(RolloutRequest(prompt_ids=_prompts(eng.tokenizer), n=2, temperature=1.0,
                                max_new_tokens=EAGER_STEPS_BEFORE_CAPTURE + 3, seed=1))
    assert tried == [False]
    assert (eng.stats.rows, eng.stats.cuda_graph, eng.stats.graph_error) == (6, False, "")
    eng.generate(RolloutRequest(prompt_ids=[], n=2))
    assert eng.stats.rows == 0


def test_compile_decode_null_compiles_on_cuda_only():
    from qwen35rl.config.capabilities import compiles_decode
    from qwen35rl.config.compose import compose

    assert compose(["model=qwen3_5_tiny", "hw=cpu"]).rollout.compile_decode is None
    assert compiles_decode(None, "cuda") and not compiles_decode(None, "cpu") and not compiles_decode(None, "npu")
    assert compiles_decode(True, "cpu") and not compiles_decode(False, "cuda")


def test_compiled_decode_step_samples_as_eager_and_compiles_once_per_row_count():
    """rollout.compile_decode: the decode step through torch.compile gives the eager tokens and log-probs, a new
    prompt width (a new cache length) reuses the compiled step, and a weight sync reaches it."""
    from torch._dynamo.utils import counters

    cfg = _cfg()
    model = build_model(cfg.model, dtype=torch.float32, seed=0)
    eager = HfRolloutEngine(model, None, device="cpu", pad_token_id=PAD, eos_token_id=[IM_END, EOS])
    compiled = HfRolloutEngine(model, None, device="cpu", pad_token_id=PAD, eos_token_id=[IM_END, EOS],
                               compile_decode=True)
    graphs = counters["stats"]["unique_graphs"]
    for i, prompts in enumerate(([[5, 6, 7], [9]], [[5, 6, 7, 8, 9, 10], [9, 4]])):
        if i:  # new weights in place, as a sync writes them
            with torch.no_grad():
                model.lm_head.weight.mul_(1.5)
        req = RolloutRequest(prompt_ids=prompts, n=2, temperature=1.0, max_new_tokens=5, seed=3)
        a, b = eager.generate(req), compiled.generate(req)
        assert a.response_ids == b.response_ids
        for x, y in zip(a.log_probs, b.log_probs):
            assert x == pytest.approx(y, abs=1e-5)
    assert counters["stats"]["unique_graphs"] - graphs == 1
    assert eager._compiled_decoder is None


def test_a_decode_step_that_cannot_compile_decodes_eagerly(monkeypatch, caplog):
    """A compilation error (dynamo or its backend, e.g. no compiler for Triton's launcher) turns rollout.compile_decode
    off for the engine with a warning: the generation gives the eager tokens, and later ones do not try again."""
    from torch._dynamo.exc import TorchDynamoException

    attempts = []

    def failing_compile(fn, **kwargs):
        def compiled(**kw):
            attempts.append(1)
            raise TorchDynamoException("backend compiler failed: no C compiler")
        return compiled

    cfg = _cfg()
    model = build_model(cfg.model, dtype=torch.float32, seed=0)
    eager = HfRolloutEngine(model, None, device="cpu", pad_token_id=PAD, eos_token_id=[IM_END, EOS])
    engine = HfRolloutEngine(model, None, device="cpu", pad_token_id=PAD, eos_token_id=[IM_END, EOS],
                             compile_decode=True)
    monkeypatch.setattr(torch, "compile", failing_compile)
    req = RolloutRequest(prompt_ids=[[5, 6, 7], [9]], n=2, temperature=1.0, max_new_tokens=5, seed=3)
    with caplog.at_level("WARNING", logger="qwen35rl.engines.hf_rollout"):
        got = engine.generate(req)
    want = eager.generate(req)
    assert got.response_ids == want.response_ids and got.log_probs == want.log_probs
    assert engine.compile_decode is False and "no C compiler" in engine.compile_error
    assert "could not be compiled" in caplog.text and len(attempts) == 1
    engine.generate(req)
    assert len(attempts) == 1
