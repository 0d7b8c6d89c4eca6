"""RolloutEngine over a transformers Qwen3.5 model: one batched decode of all prompts x n (left padding).

The decode loop is ours, over the model's own forward and transformers' `StaticCache` (fixed-size KV cache for the
full-attention layers, in-place conv / recurrent states for the Gated DeltaNet layers): every step has the same
shapes and tensor addresses, so on CUDA one step is captured once as a CUDA graph and replayed (a 0.8B decode step
is otherwise dominated by launching ~1000 small kernels from Python). Only the last position's logits are ever
computed, and the sampled token's log-prob is taken per step, so nothing of size [steps, rows, vocab] is kept.

The CUDA graph is on unless `cuda_graphs=False` (config key `rollout.cuda_graph`; bench/results/h200.md has H200
timings of both ways, in the colocated worker next to FSDP2). Off, on a device other than CUDA, or after a failed
capture, the same static-cache loop runs eagerly; `stats` tells which way the last generation ran.

A graph removes the launch cost, not the kernels: a 0.8B step is about 1,500 small ones (bench/results/
decode_ops_cpu.md). `compile_decode=True` (`rollout.compile_decode`) runs the decode step's decoder through
torch.compile, which fuses the elementwise chains (norms, gates, casts); it is compiled once per engine with dynamic
shapes (rows and cache length change between generations), and on CUDA captured into the graph like the eager step.
"""
from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from transformers import StaticCache

from qwen35rl.engines.base import RolloutEngine, RolloutRequest, RolloutResult

log = logging.getLogger(__name__)

EAGER_STEPS_BEFORE_CAPTURE = 2
"""Decode steps run eagerly (on a side stream) before capturing: Triton autotuning and lazy initialisation must not
happen inside the capture."""
FINISHED_CHECK_EVERY = 16
"""Steps between checks whether every row has stopped (each check waits for the device)."""


def cache_argument(decoder: torch.nn.Module) -> str:
    """The decoder's name for the KV cache argument: `cache` in newer transformers (which warns on the old
    `past_key_values`), `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(type(decoder).forward).parameters else "past_key_values"


@dataclass
class DecodeStats:
    """How the last `generate` ran (for benchmarks and the driver's `rollout/cuda_graph` metric); rows=0: it had
    no prompts."""

    rows: int = 0
    steps: int = 0
    cuda_graph: bool = False
    """The decode steps replayed a captured CUDA graph."""
    graph_error: str = ""
    """Why the capture failed (empty when it did not fail or was not tried)."""


class HfRolloutEngine(RolloutEngine):
    def __init__(self, model: Any, tokenizer: Any, *, device: Any, pad_token_id: int,
                 eos_token_id: Union[int, Sequence[int]], processor: Optional[Any] = None,
                 cuda_graphs: bool = True, compile_decode: bool = False):
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()
        self.tokenizer, self.processor = tokenizer, processor
        self.pad_token_id = int(pad_token_id)
        self.eos_token_ids = [int(eos_token_id)] if isinstance(eos_token_id, int) else [int(e) for e in eos_token_id]
        self.cuda_graphs = cuda_graphs
        """Capture the decode step when the device is CUDA (checked per generation)."""
        self.compile_decode = compile_decode
        self.compile_error = ""
        """Why compiling the decode step failed (empty when it did not fail or was not tried)."""
        self._compiled_decoder: Optional[Callable] = None
        self.stats = DecodeStats()

    # ------------------------------------------------------------------------------------------ generate
    @torch.no_grad()
    def generate(self, request: RolloutRequest) -> RolloutResult:
        self.stats = DecodeStats()
        if not request.prompt_ids:
            return RolloutResult([], [], [])
        rows = [p for p in request.prompt_ids for _ in range(request.n)]  # prompt-major: row i*n + j
        for i, p in enumerate(rows):
            if not p:
                raise ValueError(f"prompt {i // request.n} is empty")
        greedy = request.temperature <= 0
        sampler = Sampler(1.0 if greedy else float(request.temperature), greedy,
                          None if greedy else float(request.top_p),
                          None if greedy or request.top_k is None or request.top_k <= 0 else int(request.top_k),
                          self._generator(request.seed))
        images = None
        if request.images is not None and any(request.images):
            if self.processor is None:
                raise ValueError("prompts with images need the model's processor (HfRolloutEngine(processor=...))")
            images = ImagePrompts(self.processor.image_processor, request.images, request.n)
        tokens, log_probs = self._decode(rows, int(request.max_new_tokens), sampler, images)

        response_ids, out_logp, finish = [], [], []
        for i in range(len(rows)):
            ids = tokens[i].tolist()
            stop = next((k for k, t in enumerate(ids) if t in self.eos_token_ids), None)
            length = len(ids) if stop is None else stop + 1
            response_ids.append(ids[:length])
            out_logp.append(log_probs[i, :length].tolist())
            finish.append("length" if stop is None else "stop")
        return RolloutResult(response_ids, out_logp, finish)

    def _generator(self, seed: Optional[int]) -> Optional[torch.Generator]:
        if seed is None:
            return None
        gen = torch.Generator(device=self.device)
        gen.manual_seed(int(seed))
        return gen

    def _decode(self, rows: List[List[int]], max_new: int, sampler: "Sampler",
                images: Optional["ImagePrompts"] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """Tokens [B, max_new] (pad after a row's stop token) and their log-probs [B, max_new], on the CPU."""
        dev, n_rows = self.device, len(rows)
        width = max(len(p) for p in rows)
        total = width + max_new
        input_ids = torch.full((n_rows, width), self.pad_token_id, dtype=torch.long)
        prompt_mask = torch.zeros((n_rows, width), dtype=torch.bool)
        for i, p in enumerate(rows):
            input_ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            prompt_mask[i, width - len(p):] = True
        input_ids, prompt_mask = input_ids.to(dev), prompt_mask.to(dev)
        positions = (prompt_mask.long().cumsum(1) - 1).clamp(min=0)

        decoder, lm_head = self.model.get_decoder(), self.model.lm_head
        cache = {cache_argument(decoder): StaticCache(config=self.model.config, max_cache_len=total)}
        # key columns a query may see: the prompt's real tokens, then every generated token up to itself
        keys = torch.zeros((n_rows, 1, 1, total), dtype=torch.bool, device=dev)
        keys[:, 0, 0, :width] = prompt_mask
        causal = torch.ones((width, width), dtype=torch.bool, device=dev).tril()
        prefill_mask = keys[:, :, :, :width] & causal  # [B, 1, P, P] ...
        prefill_mask |= torch.eye(width, dtype=torch.bool, device=dev)  # a left pad sees itself: no empty softmax row
        prefill_mask = torch.nn.functional.pad(prefill_mask, (0, max_new), value=False)
        linear_mask = None if bool(prompt_mask.all()) else prompt_mask.long()
        embeds = None
        if images is not None:  # image features at the image tokens, 3-D (mrope) positions
            embeds, positions = images.prefill_inputs(self.model, input_ids, prompt_mask)
        hidden = decoder(input_ids=None if embeds is not None else input_ids, inputs_embeds=embeds,
                         position_ids=positions, use_cache=True, **cache,
                         attention_mask={"full_attention": prefill_mask, "linear_attention": linear_mask}
                         ).last_hidden_state[:, -1:]
        logits = lm_head(hidden)[:, -1]
        del prefill_mask, hidden

        # static inputs of one decode step: the token fed, its position, the visible key columns
        step_ids = torch.zeros((n_rows, 1), dtype=torch.long, device=dev)
        # generated tokens are text: one position, next after the prompt's last (the largest of its 3-D ones)
        step_pos = (positions if positions.dim() == 2 else positions.amax(0))[:, -1:].clone()

        step_decoder = self._step_decoder(decoder)

        def step() -> torch.Tensor:
            h = step_decoder(input_ids=step_ids, position_ids=step_pos, use_cache=True, **cache,
                             attention_mask={"full_attention": keys, "linear_attention": None}).last_hidden_state
            return lm_head(h)[:, -1]

        runner = StepRunner(step, self.cuda_graphs and dev.type == "cuda")
        tokens = torch.full((n_rows, max_new), self.pad_token_id, dtype=torch.long, device=dev)
        log_probs = torch.zeros((n_rows, max_new), dtype=torch.float32, device=dev)
        finished = torch.zeros(n_rows, dtype=torch.bool, device=dev)
        eos = torch.tensor(self.eos_token_ids, dtype=torch.long, device=dev)
        steps = 0
        for t in range(max_new):
            if t > 0:
                step_ids.copy_(tokens[:, t - 1:t])
                step_pos.add_(1)
                keys[:, 0, 0, width + t - 1] = True
                logits = runner()
            token, logp = sampler(logits)
            token = torch.where(finished, torch.full_like(token, self.pad_token_id), token)
            tokens[:, t] = token
            log_probs[:, t] = torch.where(finished, torch.zeros_like(logp), logp)
            finished |= torch.isin(token, eos)
            steps = t + 1
            if (t + 1) % FINISHED_CHECK_EVERY == 0 and bool(finished.all()):
                break
        self.stats = DecodeStats(rows=n_rows, steps=steps, cuda_graph=runner.captured, graph_error=runner.error)
        return tokens.cpu(), log_probs.cpu()

    def _step_decoder(self, decoder: torch.nn.Module) -> Callable:
        """The decoder the decode step calls: itself, or (compile_decode) its torch.compile wrapper, built once; the
        weights stay the module's own, so a weight sync reaches the compiled step. A compilation that fails (an
        error of dynamo or its backend, raised before the step runs a kernel, so the caches are untouched) turns
        compile_decode off for this engine: that step and every later one decode eagerly, and the error is logged."""
        if not self.compile_decode:
            return decoder
        if self._compiled_decoder is None:
            self._compiled_decoder = torch.compile(decoder, dynamic=True)
        compiled = self._compiled_decoder

        def call(**kwargs: Any) -> Any:
            if not self.compile_decode:
                return decoder(**kwargs)
            try:
                return compiled(**kwargs)
            except torch._dynamo.exc.TorchDynamoException as e:
                self.compile_decode, self.compile_error = False, f"{type(e).__name__}: {e}"[:500]
                log.warning("the decode step could not be compiled (%s); decoding eagerly (rollout.compile_decode="
                            "false skips the attempt)", self.compile_error)
                return decoder(**kwargs)

        return call

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


class ImagePrompts:
    """The images of one generation call (per prompt, a list of PIL images). The vision tower runs once per prompt;
    its features fill the image tokens of all n rows of that prompt."""

    def __init__(self, image_processor: Any, images: Sequence[Optional[Sequence[Any]]], n: int):
        self.image_processor, self.n = image_processor, n
        self.counts = [len(imgs or []) for imgs in images]
        self.flat = [img for imgs in images for img in (imgs or [])]

    def prefill_inputs(self, model: Any, input_ids: torch.Tensor, prompt_mask: torch.Tensor
                       ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Input embeddings [B, P, H] and 3-D positions [3, B, P] of the left-padded prompt rows."""
        from qwen35rl.models.processor import vision_inputs

        core, config = model.model, model.config
        embeds = core.get_input_embeddings()(input_ids)
        is_image = input_ids == config.image_token_id
        grids = None
        vision = vision_inputs(self.image_processor, self.flat)
        if vision:
            grid = vision["image_grid_thw"].to(input_ids.device)
            feats = core.get_image_features(vision["pixel_values"].to(input_ids.device), grid,
                                            return_dict=True).pooler_output  # one tensor per image
            per_prompt = _split(list(feats), self.counts)
            row_feats = torch.cat([f for p in per_prompt for _ in range(self.n) for f in p])
            if row_feats.shape[0] != int(is_image.sum()):
                raise ValueError(f"{int(is_image.sum())} image tokens in the prompts for {row_feats.shape[0]} image "
                                 f"features: prompt ids and images do not belong together")
            embeds = embeds.masked_scatter(is_image[..., None], row_feats.to(embeds.dtype))
            grids = torch.cat([g for p in _split(list(grid), self.counts) for _ in range(self.n) for g in p]).view(-1, 3)
        types = is_image.long() + 2 * (input_ids == config.video_token_id).long()
        positions, _ = core.get_rope_index(input_ids, mm_token_type_ids=types, image_grid_thw=grids,
                                           attention_mask=prompt_mask.long())
        return embeds, positions


def _split(items: List[Any], counts: Sequence[int]) -> List[List[Any]]:
    out, start = [], 0
    for c in counts:
        out.append(items[start:start + c])
        start += c
    return out


class Sampler:
    """Next token from the last position's logits: greedy, or temperature + top-k + top-p sampling. The log-prob
    returned is under softmax(logits / T) (T = 1 for greedy), before top-k/top-p, as the trainer recomputes it."""

    def __init__(self, temperature: float, greedy: bool, top_p: Optional[float], top_k: Optional[int],
                 generator: Optional[torch.Generator]):
        self.temperature, self.greedy, self.top_p, self.top_k = temperature, greedy, top_p, top_k
        self.generator = generator

    def __call__(self, logits: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        z = logits.float()
        if self.temperature != 1.0:
            z = z / self.temperature
        log_probs = torch.log_softmax(z, dim=-1)
        if self.greedy:
            token = z.argmax(-1)
        else:
            token = self._sample(z)
        return token, log_probs.gather(-1, token[:, None]).squeeze(-1)

    def _sample(self, z: torch.Tensor) -> torch.Tensor:
        if self.top_k is not None and self.top_k < z.shape[-1]:
            kth = torch.topk(z, self.top_k, dim=-1).values[:, -1:]
            z = z.masked_fill(z < kth, float("-inf"))
        if self.top_p is not None and self.top_p < 1.0:
            sorted_z, order = torch.sort(z, dim=-1, descending=True)
            cum = torch.softmax(sorted_z, dim=-1).cumsum(-1)
            drop = cum - torch.softmax(sorted_z, dim=-1) > self.top_p  # keep the smallest prefix reaching top_p
            z = z.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
        probs = torch.softmax(z, dim=-1)
        # exponential race == sampling from probs, without multinomial's host synchronisation
        race = torch.empty_like(probs).exponential_(generator=self.generator)
        return (probs / race).argmax(-1)


class StepRunner:
    """Runs the decode step: eagerly, or (CUDA) eagerly for a few warm-up steps on a side stream, then captured once
    as a CUDA graph and replayed. A failed capture falls back to eager steps and records why."""

    def __init__(self, step: Callable[[], torch.Tensor], cuda_graphs: bool):
        self.step, self.use_graph = step, cuda_graphs
        self.calls, self.captured, self.error = 0, False, ""
        self.graph: Optional[Any] = None
        self.out: Optional[torch.Tensor] = None

    def __call__(self) -> torch.Tensor:
        self.calls += 1
        if not self.use_graph:
            return self.step()
        if self.graph is not None:
            self.graph.replay()
            return self.out
        if self.calls <= EAGER_STEPS_BEFORE_CAPTURE:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                out = self.step()
            torch.cuda.current_stream().wait_stream(side)
            return out
        try:
            graph = torch.cuda.CUDAGraph()
            torch.cuda.synchronize()
            # thread-local: CUDA calls of other threads (NCCL watchdog, Ray) neither fail nor wait during the capture
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                out = self.step()
        except Exception as e:  # noqa: BLE001 - any capture problem: decode eagerly instead
            # a capture only records kernels, so the cache is as before the step: run it eagerly
            self.use_graph, self.error = False, f"{type(e).__name__}: {e}"[:500]
            # info: every generation tries again; the driver warns once from `stats`
            log.info("decode step could not be captured as a CUDA graph (%s); decoding eagerly", self.error)
            torch.cuda.synchronize()
            return self.step()
        self.graph, self.out, self.captured = graph, out, True
        graph.replay()
        return out
