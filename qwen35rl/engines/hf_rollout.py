"""RolloutEngine over transformers `generate`: one batched call for all prompts x n (left padding).

Meant for CPU runs and small models: per-token log-probs come from the raw logits of every step
(`output_logits`), which holds [steps, rows, vocab] floats until the call returns.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from transformers import GenerationConfig

from qwen35rl.engines.base import RolloutEngine, RolloutRequest, RolloutResult


class HfRolloutEngine(RolloutEngine):
    def __init__(self, model: Any, tokenizer: Any, *, device: Any, pad_token_id: int,
                 eos_token_id: Union[int, Sequence[int]], processor: Optional[Any] = None):
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()
        self.tokenizer, self.processor = tokenizer, processor
        self.pad_token_id = int(pad_token_id)
        self.eos_token_ids = [int(eos_token_id)] if isinstance(eos_token_id, int) else [int(e) for e in eos_token_id]

    # ------------------------------------------------------------------------------------------ generate
    @torch.no_grad()
    def generate(self, request: RolloutRequest) -> RolloutResult:
        if request.images is not None and any(request.images):
            raise NotImplementedError("HfRolloutEngine generates from text prompts; images need the vLLM engine")
        if not request.prompt_ids:
            return RolloutResult([], [], [])
        rows = [p for p in request.prompt_ids for _ in range(request.n)]  # prompt-major: row i*n + j
        width = max(len(p) for p in rows)
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        for i, p in enumerate(rows):
            if not p:
                raise ValueError(f"prompt {i // request.n} is empty")
            input_ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            attention[i, width - len(p):] = 1

        greedy = request.temperature <= 0
        gen_cfg = GenerationConfig(
            do_sample=not greedy,
            temperature=None if greedy else float(request.temperature),
            top_p=None if greedy else float(request.top_p),
            top_k=None if greedy or request.top_k is None or request.top_k <= 0 else int(request.top_k),
            max_new_tokens=int(request.max_new_tokens),
            eos_token_id=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
            output_logits=True,
            return_dict_in_generate=True,
            use_cache=True,
        )
        with self._seeded(request.seed):
            out = self.model.generate(input_ids=input_ids.to(self.device), attention_mask=attention.to(self.device),
                                      generation_config=gen_cfg)
        new_tokens = out.sequences[:, width:].cpu()
        # log-probs under the sampling distribution: log_softmax(logits / T) (T = 1 for greedy)
        temperature = 1.0 if greedy else float(request.temperature)
        logits = torch.stack(out.logits, dim=1).float()  # [rows, steps, V]
        logp = torch.log_softmax(logits / temperature, dim=-1).gather(-1, new_tokens[:, :, None].to(logits.device))
        logp = logp.squeeze(-1).cpu()

        response_ids, log_probs, finish = [], [], []
        for i in range(len(rows)):
            tokens = new_tokens[i].tolist()
            stop = next((k for k, t in enumerate(tokens) if t in self.eos_token_ids), None)
            length = len(tokens) if stop is None else stop + 1
            response_ids.append(tokens[:length])
            log_probs.append(logp[i, :length].tolist())
            finish.append("length" if stop is None else "stop")
        return RolloutResult(response_ids, log_probs, finish)

    @contextlib.contextmanager
    def _seeded(self, seed: Optional[int]):
        if seed is None:
            yield
            return
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(int(seed))
            yield

    # ------------------------------------------------------------------------------------------ weights
    @torch.no_grad()
    def load_weights(self, buckets: Iterator[List[Tuple[str, torch.Tensor]]]) -> None:
        targets = dict(self.model.named_parameters(remove_duplicate=False))
        targets.update(self.model.named_buffers(remove_duplicate=False))
        for bucket in buckets:
            for name, tensor in bucket:
                if name not in targets:
                    raise KeyError(f"load_weights: the rollout model has no tensor named {name!r}")
                dst = targets[name]
                if dst.shape != tensor.shape:
                    raise ValueError(f"load_weights: {name} has shape {tuple(dst.shape)}, got {tuple(tensor.shape)}")
                dst.copy_(tensor.to(device=dst.device, dtype=dst.dtype))

    def sleep(self, level: int = 1) -> None:
        """Level 2 moves the weights to CPU (there is no KV cache between calls to free)."""
        if level >= 2 and self.device.type != "cpu":
            self.model.to("cpu")
            torch.cuda.empty_cache()

    def wake_up(self) -> None:
        self.model.to(self.device)
