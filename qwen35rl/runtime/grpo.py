"""The GRPO loop. One step reads like the algorithm:

    generate -> score -> old / ref log-probs -> advantages -> mini-batch updates -> weight sync -> log -> checkpoint

With `placement=split` generation runs on its own worker pool, and with `algorithm.max_staleness` >= 1 the next
step's batch is generated while this one trains (`prefetch`); off-policy samples are corrected by truncated
importance weights folded into the advantages (`algo.rollout_correction`).

The driver owns the data (prompts, responses, scores) and the bookkeeping; the workers own the model. Work is split
by data-parallel rank (contiguous shares, rank order) and gathered back in the same order, so a response's row
never changes meaning. All math lives in `qwen35rl.algo`; the engines stay behind their interfaces.
"""
from __future__ import annotations

import json
import logging
import shutil
import time
from collections import defaultdict, deque
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from omegaconf import DictConfig

from qwen35rl.algo import rollout_correction
from qwen35rl.algo.core import grpo_advantages, kl_penalty
from qwen35rl.algo.dapo import group_filter_mask, overlong_penalty
from qwen35rl.config import capabilities
from qwen35rl.config.layout import Layout
from qwen35rl.engines.base import GLOBAL_SEQS, GLOBAL_TOKENS, NORM_CONST
from qwen35rl.runtime import checkpoint as ckpt
from qwen35rl.runtime.disk_full import DiskFull, disk_full, unwritten
from qwen35rl.runtime.batching import Sequences, balanced_split, split_even, split_sequences
from qwen35rl.runtime import report
from qwen35rl.runtime.flops import mfu, train_flops
from qwen35rl.runtime.memory_peaks import metric_name as memory_metric_name
from qwen35rl.runtime.prefetch import Prefetcher, Rollouts
from qwen35rl.runtime.run_identity import FINAL_DIR, PROVENANCE_KEY
from qwen35rl.runtime.rollouts import RolloutBatch, data_metrics, logprob_diff_metrics
from qwen35rl.runtime.signals import StopRequest
from qwen35rl.runtime.timer import Timer
from qwen35rl.runtime.tracking import Tracking
from qwen35rl.runtime.worker import needs_reference
from qwen35rl.runtime.worker_groups import PolicyWorkers, RolloutWorkers

log = logging.getLogger(__name__)

SKIPPED_KEY = "actor/skipped_steps"
"""Train-engine metric: optimizer steps skipped so far in the run because the loss or gradient was not finite."""


def step_seed(*parts: int) -> int:
    """A sampling seed from (run seed, step, round, rank, ...): the same numbers give the same samples, which
    makes a resumed run repeat exactly what an uninterrupted one does."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1)[0] & 0x7FFFFFFF)


def _images_of(examples: Sequence[Any]) -> Dict[str, Any]:
    """The `images` argument of a generation request: per prompt its images; none for text prompts."""
    if not any(ex.images for ex in examples):
        return {}
    return {"images": [list(ex.images or []) for ex in examples]}


def _complete(log_probs: Sequence[Sequence[float]], responses: Sequence[Sequence[int]]) -> bool:
    """The rollout engine returned a log-prob for every response token."""
    return len(log_probs) == len(responses) and all(len(a) == len(b) for a, b in zip(log_probs, responses))


def _steps(first: int, last: int) -> str:
    return f"step {last}" if first == last else f"steps {first}-{last}"


class RewardFailure(RuntimeError):
    """The reward function failed on too many responses (data.max_reward_failure_rate over
    data.reward_failure_window steps): the run would go on learning from zeros."""


class GRPOTrainer:
    def __init__(self, cfg: DictConfig, layout: Layout, workers: PolicyWorkers, tokenizer: Any, loader: Any,
                 val_set: Sequence[Any], reward_fn: Any, tracking: Tracking, checkpoints: ckpt.CheckpointManager,
                 stop: StopRequest, total_steps: int, run_dir: Path, rollout_workers: Optional[RolloutWorkers] = None):
        self.cfg, self.layout, self.workers, self.tokenizer = cfg, layout, workers, tokenizer
        self.rollout_workers: Union[PolicyWorkers, RolloutWorkers] = rollout_workers or workers
        """The workers that generate: the training workers themselves unless placement=split."""
        self.pools = [workers] if self.rollout_workers is workers else [workers, self.rollout_workers]
        """Every worker group of the run, once each."""
        self.loader, self.val_set, self.reward_fn = loader, list(val_set), reward_fn
        self.tracking, self.checkpoints, self.stop = tracking, checkpoints, stop
        self.total_steps, self.run_dir = total_steps, run_dir
        self.algo, self.data, self.rollout_cfg = cfg.algorithm, cfg.data, cfg.rollout
        self.n = cfg.rollout.n
        shards = workers.data_shards()
        if len(self.pools) > 1:
            self.rollout_workers.data_shards()
        self.dp = shards[0]["train_dp_size"]
        if self.dp != layout.dp or sorted(set(workers.train_group)) != list(range(self.dp)):
            raise RuntimeError(f"train engines report data-parallel ranks {workers.train_group}; the layout has "
                               f"dp={layout.dp}")
        self.use_ref = needs_reference(cfg)
        self.is_mode = capabilities.rollout_is_mode(cfg)
        """Importance weights of the proximal over the behaviour policy: token | sequence | off."""
        # One optimizer step per batch: the old (proximal) log-probs are the current policy's, so the update takes
        # them from its own forward (detached) instead of a separate pass giving the same numbers, unless the
        # importance weights need them first.
        self.single_on_policy_update = capabilities.single_on_policy_update(cfg)
        self.staleness = int(self.algo.max_staleness)
        self.version = 0
        """The policy version the rollout engines hold: the training steps whose update they have."""
        self.prefetch = Prefetcher(self.collect)
        self.timeline: List[Dict[str, Any]] = []
        """Split placement: when each pool was busy ({step, pool, what, start, end}), written to timeline.jsonl."""
        self.step = 0
        self.saved_step = -1
        self.graph_error_logged = False
        self.last_decode: List[Dict[str, Any]] = []
        self.reward_window: deque = deque(maxlen=int(self.data.reward_failure_window))
        """(responses that failed to score, responses scored) of the latest training steps."""
        self.step_reward = [0, 0]
        self.step_errors: List[str] = []
        """How each rollout group's share of the latest generation decoded (`RolloutResult.decode`)."""
        self.activity = ""
        """What the loop is doing (a failure's block says it): the step, its validation, a checkpoint, the export."""
        self.phases: Optional[report.Phases] = None
        """The launch's start-up clock: the first step ends it with a line."""
        self.provenance_start: Optional[str] = None
        """The `provenance/start-<NNN>` of this start, named in each checkpoint's meta.json (run identity)."""
        self.first_step = 0
        """The step this start began at (0, or the resumed checkpoint's)."""
        self.data_metrics: Dict[str, float] = {}
        """Logged with every step: the rows data.skip_bad_rows left out of each split (data/skipped_rows/*)."""

    # ==================================================================================================== loop
    def fit(self) -> int:
        self.first_step = self.step
        self.stop.run_loop()  # a signal now lets the step finish (within trainer.stop_timeout_s)
        self.activity = "the first weight sync"
        self.sync_weights()  # the rollout engines start from the policy (fresh or restored)
        if self.cfg.trainer.val_before_train and self.step == 0 and self.val_set:
            self.activity = "validation before training"
            self.tracking.log(0, self.validate())
        while self.step < self.total_steps and not self.stop.requested:
            self.step += 1
            self.activity = f"training step {self.step} of {self.total_steps}"
            metrics = self.train_step()
            if self._due(self.cfg.trainer.test_freq) and self.val_set:
                self.activity = f"validation at step {self.step}"
                t0 = time.perf_counter()
                metrics.update(self.validate())
                metrics["timing_s/testing"] = time.perf_counter() - t0
            if self.step == self.first_step + 1 and self.phases is not None:
                self.phases.done("first step", f"{self.phases.total_s():.1f} s since the command started; one line "
                                               "per step follows")
            if self.step % max(self.cfg.trainer.log_every, 1) == 0 or self.step == self.total_steps:
                self.tracking.log(self.step, {**metrics, **self.data_metrics})
            self.write_timeline()
            self.check_reward_failures()
            # after logging: a step with a checkpoint always has its metrics row (resume keeps rows up to it)
            if self._due(self.cfg.trainer.save_freq) or self.stop.requested:
                self.activity = f"the checkpoint of step {self.step}"
                self.save_checkpoint()
        if self.stop.requested:
            return self.stop.exit_code
        if self.saved_step != self.step and not (self.checkpoints.root / f"step_{self.step}").is_dir():
            self.activity = f"the checkpoint of step {self.step}"
            self.save_checkpoint()
        if self.cfg.trainer.export_hf:
            self.activity = "the final Hugging Face export"
            self.export_final()
        self.activity = ""
        return 0

    def _due(self, freq: Any) -> bool:
        freq = int(freq)
        return (freq > 0 and self.step % freq == 0) or self.step == self.total_steps

    def check_reward_failures(self) -> None:
        """RewardFailure when more than data.max_reward_failure_rate of the responses of the last
        data.reward_failure_window steps failed to score."""
        self.reward_window.append((self.step_reward[0], self.step_reward[1], list(self.step_errors)))
        if len(self.reward_window) < self.reward_window.maxlen:
            return
        failed, total = sum(w[0] for w in self.reward_window), sum(w[1] for w in self.reward_window)
        if total and failed / total > float(self.data.max_reward_failure_rate):
            first = [e for w in self.reward_window for e in w[2]][:3]
            raise RewardFailure(
                f"the reward function ({self.data.reward}) failed on {failed} of {total} responses "
                f"({failed / total:.0%}) over {_steps(self.step - len(self.reward_window) + 1, self.step)}, more than "
                f"data.max_reward_failure_rate={self.data.max_reward_failure_rate:g}: the run would learn nothing. "
                f"First errors:\n" + "\n".join(f"           {e}" for e in first))

    def train_step(self) -> Dict[str, float]:
        """One GRPO step: the step's scored batch, the old and reference log-probs, the advantages, the policy
        update, and the rollout engines' new weights."""
        timer = Timer()
        with timer("step"):
            rollouts = self.take_rollouts(timer)                                          # generate + score
            batch, metrics = rollouts.batch, dict(rollouts.metrics)
            seqs = batch.sequences()
            with self.busy(timer, "old_log_prob"):
                self.old_log_probs(batch, seqs, metrics)
            if self.single_on_policy_update and _complete(batch.rollout_log_probs, seqs.response_ids):
                seqs.rollout_log_probs = batch.rollout_log_probs  # the update's one pass logs the gap itself
            if self.use_ref:
                with self.busy(timer, "ref"):
                    seqs.ref_log_probs = self.log_probs(seqs, reference=True)
            with timer("adv"):
                rewards, advantages = self.compute_advantages(batch, seqs, metrics)
            with self.busy(timer, "update_actor"):
                metrics.update(self.update_actor(seqs))
            with timer("wait_rollout"):
                self.prefetch.finish()             # generation must end before the rollout engines' weights change
            with timer("sync_weights"):
                self.sync_weights()
        metrics.update(self.step_metrics(rollouts, rewards, advantages, timer))
        return metrics

    def take_rollouts(self, timer: Timer) -> Rollouts:
        """This step's scored batch: generated now, or (max_staleness >= 1) during the last step, in which case the
        next step's batch starts generating at once, to run during this step's update."""
        with timer("wait_rollout" if self.staleness else "rollout"):
            rollouts = self.prefetch.take(self.step, self.version)
        if self.staleness and self.step < self.total_steps and not self.stop.requested:
            self.prefetch.start(self.step + 1, self.version)
        self.step_reward, self.step_errors = rollouts.reward_tally[:2], list(rollouts.reward_tally[2])
        return rollouts

    def old_log_probs(self, batch: RolloutBatch, seqs: Sequences, metrics: Dict[str, float]) -> None:
        """The proximal policy's log-probs into `seqs`: the rollout engine's (backend.use_rollout_log_probs), none
        when one on-policy update takes them from its own forward, else a forward pass of the policy."""
        if self.cfg.backend.use_rollout_log_probs:
            seqs.old_log_probs = batch.rollout_log_probs
        elif not self.single_on_policy_update:
            seqs.old_log_probs = self.log_probs(seqs)
            metrics.update(logprob_diff_metrics(batch.rollout_log_probs, seqs.old_log_probs))

    def compute_advantages(self, batch: RolloutBatch, seqs: Sequences,
                           metrics: Dict[str, float]) -> Tuple[torch.Tensor, torch.Tensor]:
        """(final rewards, group-normalised advantages); the advantages go into `seqs`, with the truncated importance
        weights of the proximal over the behaviour policy folded in per token when rollout correction is on."""
        rewards = self.final_rewards(batch, seqs, metrics)
        advantages = grpo_advantages(rewards, batch.group_index, self.algo.norm_adv_by_std)
        seqs.advantages = advantages.tolist()
        if self.is_mode != "off":
            weights, is_metrics = rollout_correction.is_weights(
                seqs.old_log_probs, batch.rollout_log_probs, self.is_mode, self.algo.rollout_is_threshold)
            seqs.advantages = rollout_correction.fold(seqs.advantages, weights)
            metrics.update(is_metrics)
        return rewards, advantages

    def step_metrics(self, rollouts: Rollouts, rewards: torch.Tensor, advantages: torch.Tensor,
                     timer: Timer) -> Dict[str, float]:
        """The step's data, decode, timing and performance metrics (the last ask the workers for memory peaks)."""
        batch = rollouts.batch
        metrics: Dict[str, float] = {}
        if self.staleness:
            metrics.update({"staleness/mean": float(rollouts.staleness()), "staleness/max": float(rollouts.staleness())})
        metrics.update(data_metrics(batch, rewards, advantages, self.data.max_response_length))
        metrics.update(self.decode_metrics(rollouts.decode))
        metrics.update({f"timing_s/{k}": v for k, v in rollouts.seconds.items()})
        metrics.update(timer.metrics())
        metrics.update(self.perf_metrics(batch, timer))
        return metrics

    def collect(self, step: int, version: int) -> Rollouts:
        """The scored batch of training step `step`, generated by the rollout engines' policy `version` (in the
        prefetch thread with max_staleness >= 1)."""
        timer, tally = Timer(), [0, 0, []]
        t0 = time.time()
        batch, metrics = self.collect_rollouts(step, timer, tally)
        self.mark("rollout", f"generate step {step}", t0)
        return Rollouts(step=step, version=version, batch=batch, metrics=metrics, seconds=dict(timer.seconds),
                        reward_tally=tally, decode=list(self.last_decode))

    def sync_weights(self) -> None:
        """The rollout engines take the policy: colocated, each worker from its own train engine; split, training
        rank 0 sends to the rollout pool (which is idle: `train_step` waited for its generation)."""
        t0 = time.time()
        if self.rollout_workers is self.workers:
            self.workers.sync_weights()
        else:
            self.workers.send_weights(self.rollout_workers, version=self.step)
        self.version = self.step
        self.mark("both", "sync_weights", t0)

    @contextmanager
    def busy(self, timer: Timer, name: str) -> Iterator[None]:
        """A training-pool phase: timed, and on the timeline with split placement."""
        t0 = time.time()
        with timer(name):
            yield
        self.mark("train", name, t0)

    def mark(self, pool: str, what: str, t0: float) -> None:
        """`pool` (train | rollout | both) was busy with `what` from t0 until now, during training step self.step."""
        if self.layout.split:
            self.timeline.append({"step": self.step, "pool": pool, "what": what, "start": t0, "end": time.time()})

    def write_timeline(self) -> None:
        """Append the busy intervals so far to timeline.jsonl (split placement; a thread may still add one)."""
        if not self.timeline:
            return
        rows, self.timeline = self.timeline, []
        with open(self.run_dir / "timeline.jsonl", "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)

    # ========================================================================================= generate + score
    def collect_rollouts(self, step: int, timer: Timer, tally: List[Any]):
        """A full batch of prompt groups, generated and scored. With DAPO dynamic sampling, groups whose scores
        are all equal carry no signal and are dropped; more prompts are drawn (at most `max_rounds` extra rounds)
        until `train_batch_size` groups remain. If the rounds run out, dropped groups fill the rest (their
        advantage is 0, so they only dilute the update)."""
        dyn = self.algo.dynamic_sampling
        want = self.data.train_batch_size
        # `tally`: [failed, scored, first errors] of the training scores
        rounds = 1 + (dyn.max_rounds if dyn.enable else 0)
        kept: List[RolloutBatch] = []
        dropped: List[RolloutBatch] = []
        num_kept = num_dropped = used = 0
        stats: Dict[str, float] = defaultdict(float)
        for round_ in range(rounds):
            used = round_ + 1
            examples = self.loader.next_batch()
            with timer("gen"):
                batch = self.generate(examples, n=self.n, temperature=self.rollout_cfg.temperature,
                                      top_p=self.rollout_cfg.top_p, top_k=self.rollout_cfg.top_k,
                                      seed=step_seed(self.cfg.trainer.seed, step, round_))
            with timer("reward"):
                for k, v in self.score(batch, tally=tally).items():
                    stats[k] += v
            if not dyn.enable:
                return batch, dict(stats)
            signal = batch.scores if dyn.metric == "score" else batch.rewards
            keep = group_filter_mask(torch.tensor(signal), batch.group_index)
            kept.append(batch.select_groups(keep.nonzero().flatten().tolist()))
            dropped.append(batch.select_groups((~keep).nonzero().flatten().tolist()))
            num_kept += int(keep.sum())
            num_dropped += int((~keep).sum())
            if num_kept >= want:
                break
        batch = RolloutBatch.concat(kept)
        batch = batch.select_groups(range(min(want, batch.num_groups)))
        filled = want - batch.num_groups
        if filled:
            batch = RolloutBatch.concat([batch, RolloutBatch.concat(dropped).select_groups(range(filled))])
        stats.update({"dynamic_sampling/rounds": used, "dynamic_sampling/groups_dropped": num_dropped,
                      "dynamic_sampling/groups_filled": filled})
        return batch, dict(stats)

    def generate(self, examples: Sequence[Any], *, n: int, temperature: float, top_p: float, top_k: int,
                 seed: int) -> RolloutBatch:
        """n responses per prompt; prompts split over the workers, each generating its share."""
        shares = split_even(list(examples), self.rollout_workers.rollout_groups)
        params = dict(n=n, temperature=temperature, top_p=top_p, top_k=top_k,
                      max_new_tokens=self.data.max_response_length)
        results = self.rollout_workers.generate(
            [[ex.prompt_ids for ex in share] for share in shares],
            [dict(params, seed=step_seed(seed, group), **_images_of(share)) for group, share in enumerate(shares)])
        self.last_decode = [result.decode for result in results]
        batch = RolloutBatch(n=n, examples=list(examples), prompt_ids=[], response_ids=[], rollout_log_probs=[],
                             finish_reasons=[])
        for share, result in zip(shares, results):
            batch.prompt_ids.extend(ex.prompt_ids for ex in share for _ in range(n))
            batch.response_ids.extend(result.response_ids)
            batch.rollout_log_probs.extend(result.log_probs)
            batch.finish_reasons.extend(result.finish_reasons)
        return batch

    def decode_metrics(self, decode: Sequence[Dict[str, Any]]) -> Dict[str, float]:
        """`timing_s/gen_wake`, `timing_s/gen_generate`, `timing_s/gen_sleep`: the parts of a colocated generation
        (the slowest rollout group's). `rollout/cuda_graph`: share of the rollout groups whose generation of the batch
        decoded as a captured CUDA graph (hf engine only: `rollout.cuda_graph`). The first failed capture's error is
        logged as a warning."""
        metrics = {f"timing_s/gen_{part}": max(s[f"{part}_s"] for s in decode if f"{part}_s" in s)
                   for part in ("wake", "generate", "sleep") if any(f"{part}_s" in s for s in decode)}
        decoded = [s for s in decode if s.get("rows")]
        if not decoded:
            return metrics
        error = next((s["graph_error"] for s in decoded if s["graph_error"]), "")
        if error and not self.graph_error_logged:
            self.graph_error_logged = True
            log.warning("the rollout's decode step could not be captured as a CUDA graph, so it decodes eagerly "
                        "(rollout/cuda_graph < 1; rollout.cuda_graph=false skips the attempt): %s", error)
        return {**metrics, "rollout/cuda_graph": sum(float(s["cuda_graph"]) for s in decoded) / len(decoded)}

    def score(self, batch: RolloutBatch, tally: Optional[List[Any]] = None) -> Dict[str, float]:
        """Reward function per response (in worker processes with a time limit), then overlong shaping. Training
        scores count into `tally` ([failed, scored, first errors]) towards data.max_reward_failure_rate."""
        from qwen35rl.rewards import score_responses

        texts = self.tokenizer.batch_decode(batch.response_ids, skip_special_tokens=True)
        examples = batch.response_examples()
        errors: List[str] = []
        scores, stats = score_responses(self.reward_fn, texts, [ex.answer for ex in examples], examples,
                                        self.data.reward_timeout_s, errors=errors,
                                        cancel=lambda: self.stop.abandoned)
        if tally is not None:
            tally[0] += int(stats.get("reward/failed", 0) + stats.get("reward/timeout", 0))
            tally[1] += len(texts)
            tally[2] = (tally[2] + errors)[:3]
        batch.scores = list(scores)
        rewards = torch.tensor(batch.scores, dtype=torch.float32)
        shaping = self.algo.overlong_shaping
        if shaping.enable:
            rewards = rewards + overlong_penalty(batch.response_lengths(), self.data.max_response_length,
                                                 shaping.buffer_len, shaping.penalty_factor)
        batch.rewards = rewards.tolist()
        return {k: float(v) for k, v in stats.items()}

    # ================================================================================== log-probs + advantages
    def log_probs(self, seqs: Sequences, reference: bool = False) -> List[List[float]]:
        if len(seqs) % self.dp:
            raise ValueError(f"{len(seqs)} responses do not split evenly over {self.dp} data-parallel ranks")
        shares = self.workers.compute_log_probs(split_sequences(seqs, self.dp), reference=reference)
        return [row for share in shares for row in share]

    def final_rewards(self, batch: RolloutBatch, seqs: Sequences, metrics: Dict[str, float]) -> torch.Tensor:
        """Sequence rewards for the advantage: shaped scores, minus the KL to the reference when it is part of
        the reward (coefficient kl_loss_coef, estimator kl_loss_type, summed over the response)."""
        rewards = torch.tensor(batch.rewards, dtype=torch.float32)
        if self.algo.use_kl_in_reward:
            kl = torch.tensor([float(kl_penalty(torch.tensor(old), torch.tensor(ref), self.algo.kl_loss_type).sum())
                               for old, ref in zip(seqs.old_log_probs, seqs.ref_log_probs)])
            rewards = rewards - self.algo.kl_loss_coef * kl
            metrics["critic/kl_in_reward/mean"] = float(kl.mean())
        return rewards

    # ================================================================================================ update
    def update_actor(self, seqs: Sequences) -> Dict[str, float]:
        """ppo_epochs passes over the batch in mini batches of mini_batch_size prompts (x n responses); each mini
        batch is one optimizer step, its loss normalised over the whole mini batch across DP ranks."""
        per_mini = self.algo.mini_batch_size * self.n
        norm_const = float(self.algo.loss_scale_factor or self.data.max_response_length)
        collected: Dict[str, List[float]] = defaultdict(list)
        for epoch in range(self.algo.ppo_epochs):
            order = list(range(len(seqs)))
            if self.algo.shuffle:
                gen = torch.Generator().manual_seed(step_seed(self.cfg.trainer.seed, self.step, epoch, 1))
                order = torch.randperm(len(seqs), generator=gen).tolist()
            for start in range(0, len(seqs), per_mini):
                mini = seqs.take(order[start:start + per_mini])
                scale = {GLOBAL_TOKENS: float(mini.token_count()),
                         GLOBAL_SEQS: float(sum(1 for r in mini.response_ids if r)), NORM_CONST: norm_const}
                split = balanced_split if self.cfg.trainer.get("balance_batch", False) else split_sequences
                results = self.workers.update_actor(split(mini, self.dp), global_scale=scale)
                for key in results[0]:
                    values = [float(r[key]) for r in results]
                    collected[key].append(max(values) if key.endswith("_max") else sum(values) / len(values))
        metrics = {k: max(v) if k.endswith("_max") else sum(v) / len(v) for k, v in collected.items()}
        if SKIPPED_KEY in collected:  # a running count: its latest value, not an average
            metrics[SKIPPED_KEY] = collected[SKIPPED_KEY][-1]
        return metrics

    # ============================================================================================ validation
    def validate(self) -> Dict[str, float]:
        """Greedy (rollout.val_temperature), one response per held-out prompt. The first
        trainer.log_val_generations prompts (the same ones every time) are kept with their responses and scores."""
        scores: List[float] = []
        lengths: List[int] = []
        samples: List[Dict[str, Any]] = []
        keep = int(self.cfg.trainer.get("log_val_generations", 0) or 0)
        failed = 0.0
        size = max(self.data.val_batch_size, 1)
        for i in range(0, len(self.val_set), size):
            batch = self.generate(self.val_set[i:i + size], n=1, temperature=self.rollout_cfg.val_temperature,
                                  top_p=1.0, top_k=-1, seed=step_seed(self.cfg.trainer.seed, 0, i))
            stats = self.score(batch)
            failed += stats.get("reward/failed", 0) + stats.get("reward/timeout", 0)
            scores.extend(batch.scores)
            lengths.extend(len(r) for r in batch.response_ids)
            for ex, ids, score in zip(batch.examples, batch.response_ids, batch.scores):
                if len(samples) < keep:
                    samples.append({"index": int(ex.index), "prompt": ex.prompt_text, "answer": ex.answer,
                                    "response": self.tokenizer.decode(ids, skip_special_tokens=True),
                                    "score": float(score)})
        self.tracking.log_generations(self.step, samples)
        return {"val/score/mean": float(np.mean(scores)), "val/response_length/mean": float(np.mean(lengths)),
                "val/reward/failed": failed}

    # ============================================================================================ perf + ckpt
    def perf_metrics(self, batch: RolloutBatch, timer: Timer) -> Dict[str, float]:
        seq_lens = [len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids)]
        step_s = timer.seconds["step"]
        update_flops = train_flops(self.cfg.model, seq_lens) * self.algo.ppo_epochs
        devices = sum(g.world for g in self.pools)  # throughput per device of the run, both pools
        phase_peaks: Dict[str, float] = {}  # each phase's peak over every worker of both pools (none on CPU)
        for peaks in (d for g in self.pools for d in g.phase_memory_gb()):
            for phase, gb in peaks.items():
                key = memory_metric_name(phase)
                phase_peaks[key] = max(gb, phase_peaks.get(key, 0.0))
        return {
            **phase_peaks,
            "perf/total_num_tokens": float(sum(seq_lens)),
            "perf/throughput": sum(seq_lens) / step_s / devices if step_s > 0 else 0.0,
            "perf/mfu/actor": mfu(update_flops, timer.seconds["update_actor"], self.workers.world,
                                  self.cfg.hw.peak_tflops),
            "perf/max_memory_allocated_gb": max(m for g in self.pools for m in g.max_memory_allocated_gb()),
        }

    def save_checkpoint(self) -> Path:
        t0 = time.perf_counter()
        tmp = self.checkpoints.begin(self.step)
        try:
            self.workers.save_checkpoint(str(tmp))
            # the prefetched batch (max_staleness >= 1) was drawn from the loader already: it is part of the state
            in_flight = self.prefetch.state_dict()
            ckpt.save_trainer_state(tmp, {"step": self.step, "loader": self.loader.state_dict(),
                                          "rng": ckpt.rng_state(), "in_flight": in_flight})
            final = self.checkpoints.commit(tmp, self.step, {
                "world": self.workers.world, "layout": self.layout.to_dict(), "total_steps": self.total_steps,
                "in_flight": [] if in_flight is None else [{"step": in_flight["step"],
                                                            "policy_version": in_flight["version"],
                                                            "responses": len(in_flight["batch"])}],
                "checkpoint_layout": capabilities.checkpoint_layout(self.cfg, self.layout),
                PROVENANCE_KEY: self.provenance_start})
        except Exception as e:
            shutil.rmtree(tmp, ignore_errors=True)  # a half-written save only takes space
            if disk_full(e):
                raise DiskFull(f"checkpoint step_{self.step}: {unwritten(e)}") from e
            raise
        self.saved_step = self.step
        log.info("checkpoint %s (%.1f s)", report.shown_path(final), time.perf_counter() - t0)
        return final

    def restore(self, path: Path) -> None:
        restored = self.workers.load_checkpoint(str(path))
        try:
            state = ckpt.load_trainer_state(path)
        except Exception as e:  # verified checkpoints load; this is one saved before files were listed
            raise ckpt.CheckpointError(f"checkpoint {path}: {ckpt.TRAINER_STATE_FILE} does not load "
                                       f"({type(e).__name__}: {e}); resume from another one with "
                                       f"trainer.resume=<dir>") from e
        self.step = self.saved_step = int(state["step"])
        self.loader.load_state_dict(state["loader"])
        self.prefetch.load_state_dict(state.get("in_flight"))
        self.version = self.step  # the first sync of fit() gives the rollout engines the restored policy
        ckpt.set_rng_state(state["rng"])
        if not all(restored):
            log.warning("checkpoint %s was saved with another world size: worker RNG states start fresh", path)

    def export_final(self) -> Path:
        """The final policy in Hugging Face format, written to a temporary dir and renamed into `final/`."""
        final = self.run_dir / FINAL_DIR
        tmp = self.run_dir / f".{FINAL_DIR}-tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            self.workers.export_hf(str(tmp))
        except Exception as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if disk_full(e):
                raise DiskFull(f"the Hugging Face export {final}: {unwritten(e)}") from e
            raise
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        return final
