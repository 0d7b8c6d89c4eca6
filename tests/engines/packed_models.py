"""Tiny Qwen3.5 models called the way the FSDP engine calls them with packed rows (`fsdp_engine.packed_call_kwargs`),
for the packing tests of tests/engines/test_packed_gdn.py and test_packed_attention.py."""
import torch
import torch.nn.functional as F

from qwen35rl.config.compose import compose
from qwen35rl.engines.fsdp_engine import packed_call_kwargs
from qwen35rl.engines.packed_attention import use_packed_attention
from qwen35rl.models.build import build_model

ROW_LENGTHS = [9, 2, 1, 70, 3]  # a 1-token document, one longer than the rest together


def cu(lengths):
    """Cumulative document boundaries [0, l0, l0 + l1, ...] (int32)."""
    return F.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32)


def tiny_model(name="qwen3_5_tiny", packed_attention=False):
    model = build_model(compose([f"model={name}", "hw=cpu"]).model, dtype=torch.float32, seed=3).eval()
    if packed_attention:
        use_packed_attention(model)
    return model


def rows(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g) for n in lengths]


def next_token_logp(logits, ids):
    """log p(ids[t] | ids[:t]) for t >= 1."""
    return logits[:-1].log_softmax(-1).gather(-1, ids[1:, None])[:, 0]


def packed_call(model, docs):
    """Per-document next-token log-probs of one packed call, as `PolicyWithLogProbs._hidden(..., pack=True)` makes it
    (with the LM head on top)."""
    device = docs[0].device
    lengths = torch.tensor([len(d) for d in docs], device=device)
    positions = torch.cat([torch.arange(int(n), device=device) for n in lengths])
    kwargs = packed_call_kwargs(lengths)
    logits = model(input_ids=torch.cat(docs)[None], position_ids=positions[None], attention_mask=None, use_cache=False,
                   **kwargs).logits[0]
    bounds = kwargs["cu_seq_lens_q"]
    return [next_token_logp(logits[s:e], d) for s, e, d in zip(bounds[:-1], bounds[1:], docs)]


def alone(model, docs):
    """Per-document next-token log-probs, each document in a call of its own."""
    return [next_token_logp(model(input_ids=d[None], use_cache=False).logits[0], d) for d in docs]
