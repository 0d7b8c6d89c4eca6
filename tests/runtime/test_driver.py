"""The GRPO loop against in-process fake workers (no Ray, no model): how work is split over DP ranks and mini
batches, dynamic sampling, the non-finite counter, validation / checkpoint / stop scheduling."""
import logging
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

from pathlib import Path
from typing import Any, Dict, List

import pytest

from qwen35rl.config.compose import compose
from qwen35rl.config.layout import derive_layout
from qwen35rl.data import PromptLoader, build_dataset
from qwen35rl.engines.base import GLOBAL_SEQS, GLOBAL_TOKENS, RolloutResult
from qwen35rl.models.tokenizer import build_tokenizer
from qwen35rl.rewards import get_reward_fn
from qwen35rl.runtime import checkpoint as ckpt
from qwen35rl.runtime.batching import Sequences
from qwen35rl.runtime.cluster import Finished
from qwen35rl.runtime.grpo import GRPOTrainer, Timer, step_seed
from qwen35rl.runtime.signals import StopRequest
from qwen35rl.runtime.tracking import METRICS_FILE, Tracking, read_metrics
from qwen35rl.runtime.worker_groups import PolicyWorkers

DIGITS = b"0123456789"


def _answer(prompt_ids: List[int]) -> int:
    """copy_digit prompts read "7 3 9": the answer is the last digit."""
    return [t for t in prompt_ids if t in DIGITS][-1]


class FakeWorker:
    """Responds like a policy that is sure of itself on prompts with an even answer (every sample the same: no
    GRPO signal) and mixed on odd ones (half right, half wrong)."""

    def __init__(self, rank: int, log: Dict[str, list], world: int, tp: int = 1):
        self.rank, self.log, self.world, self.tp = rank, log, world, tp
        self.skipped = 0
        self.decode: Dict[str, Any] = {}  # like a vLLM rollout: no decode stats

    def data_shards(self):
        return {"train_dp_rank": self.rank // self.tp, "train_dp_size": self.world // self.tp,
                "rollout_group": self.rank, "rollout_groups": self.world}

    def generate(self, prompt_ids, params):
        self.log["generate"].append((self.rank, len(prompt_ids), params))
        out = []
        for p in prompt_ids:
            a = _answer(p)
            for j in range(params["n"]):
                out.append([a] if (a - ord("0")) % 2 == 0 or j % 2 == 0 else [ord("x"), ord("y")])
        return RolloutResult(response_ids=out, log_probs=[[-1.0] * len(r) for r in out],
                             finish_reasons=["stop"] * len(out), decode=dict(self.decode))

    def compute_log_probs(self, seqs, reference=False):
        return [[-0.5] * len(r) for r in seqs.response_ids]

    def update_actor(self, seqs, global_scale):
        self.log["update"].append((self.rank, seqs, dict(global_scale)))
        if any(a != a for a in seqs.advantages):  # NaN
            self.skipped += 1
        gap = {}
        if seqs.rollout_log_probs is not None:  # like an engine's single on-policy pass, its own max per rank
            gap = {"rollout/logprob_diff_mean": 0.5, "rollout/logprob_diff_max": 0.5 + self.rank}
        return {"actor/pg_loss": 0.25 + self.rank, "actor/skipped_steps": float(self.skipped), **gap}

    def sync_weights(self):
        self.log["sync"].append(self.rank)

    def save_checkpoint(self, path):
        Path(path, f"shard_{self.rank}").write_text("x")

    def load_checkpoint(self, path):
        return True

    def export_hf(self, path):
        if self.rank == 0:
            Path(path).mkdir(parents=True, exist_ok=True)
            Path(path, "config.json").write_text("{}")

    def max_memory_allocated_gb(self):
        return 0.1 * (self.rank + 1)

    def phase_memory_gb(self):
        return {"gen": 0.1 * (self.rank + 1), "update_actor": 0.3 - 0.1 * self.rank}


class FakeWorkers:
    def __init__(self, world: int, tp: int = 1):
        self.log: Dict[str, list] = {"generate": [], "update": [], "sync": []}
        self.workers = [FakeWorker(r, self.log, world, tp) for r in range(world)]
        self.calls: List[tuple] = []
        """(method, ranks, keyword arguments) of each call the handle made, in order."""

    @property
    def world(self):
        return len(self.workers)

    def start(self, method, per_rank, kwargs=None, ranks=None):
        """The worker groups' transport, in this process: the calls end before it returns."""
        ranks = list(range(self.world)) if ranks is None else list(ranks)
        assert len(per_rank) == len(ranks)
        self.calls.append((method, ranks, dict(kwargs or {})))
        return Finished([getattr(self.workers[r], method)(*args, **(kwargs or {})) for r, args in zip(ranks, per_rank)])


def make_trainer(tmp_path, overrides, world=2, tp=1):
    cfg = compose(["hw.devices_per_node=%d" % world, "data.reward=copy_digit", *overrides])
    tokenizer = build_tokenizer(cfg.model)
    loader = PromptLoader(build_dataset(cfg.data, tokenizer, "train"), cfg.data.train_batch_size, seed=cfg.trainer.seed)
    val = build_dataset(cfg.data, tokenizer, "val")
    total = int(cfg.trainer.total_steps)
    workers = FakeWorkers(world, tp)
    trainer = GRPOTrainer(cfg, derive_layout(cfg), PolicyWorkers(workers), tokenizer, loader, val,
                          get_reward_fn(cfg.data.reward), Tracking(cfg, tmp_path, total),
                          ckpt.CheckpointManager(tmp_path / "checkpoints", 2), StopRequest(), total, tmp_path)
    return trainer, workers


def test_step_splits_work_over_ranks_and_mini_batches(tmp_path):
    trainer, workers = make_trainer(tmp_path, ["data.train_batch_size=8", "rollout.n=4", "algorithm.mini_batch_size=4",
                                               "algorithm.ppo_epochs=2", "backend.micro_batch_size_per_device=2"])
    trainer.step = 1
    metrics = trainer.train_step()
    # generation: 8 prompts, 4 per rank, each rank seeded differently
    gens = workers.log["generate"]
    assert [(r, n) for r, n, _ in gens] == [(0, 4), (1, 4)]
    assert gens[0][2]["seed"] != gens[1][2]["seed"] and gens[0][2]["n"] == 4
    # 2 epochs x (8 / 4) mini batches, each split over 2 ranks: 4 * 4 / 2 = 8 responses per rank
    updates = workers.log["update"]
    assert len(updates) == 2 * 2 * 2
    for i in range(0, len(updates), 2):
        (r0, s0, g0), (r1, s1, g1) = updates[i], updates[i + 1]
        assert (r0, r1) == (0, 1) and len(s0) == len(s1) == 8
        assert g0 == g1
        assert g0[GLOBAL_TOKENS] == s0.token_count() + s1.token_count()
        assert g0[GLOBAL_SEQS] == 16
        assert s0.old_log_probs == [[-0.5] * len(r) for r in s0.response_ids]
    assert metrics["actor/pg_loss"] == pytest.approx(0.75)      # mean over ranks
    # odd-answer groups score 1 / 0 alternately: advantages have spread; even-answer groups are all 1: advantage 0
    assert metrics["critic/score/mean"] > 0 and "critic/advantages/mean" in metrics
    for key in ("timing_s/gen", "timing_s/old_log_prob", "timing_s/update_actor", "timing_s/step",
                "response_length/clip_ratio", "perf/throughput", "perf/mfu/actor", "perf/max_memory_allocated_gb"):
        assert key in metrics, key
    assert "timing_s/ref" not in metrics                          # no KL: no reference pass
    assert metrics["perf/max_memory_allocated_gb"] == pytest.approx(0.2)
    # each phase's peak is the largest over the workers, whichever worker holds it
    assert metrics["perf/max_memory_allocated_gb/gen"] == pytest.approx(0.2)
    assert metrics["perf/max_memory_allocated_gb/update_actor"] == pytest.approx(0.3)
    assert workers.log["sync"] == [0, 1]


def test_model_parallel_ranks_share_their_data(tmp_path):
    """tp=2 on 4 workers: 2 data-parallel groups; both ranks of a group get the same mini-batch share, while
    every worker generates its own prompts (the transformers rollout has no TP)."""
    trainer, workers = make_trainer(tmp_path, ["backend=megatron", "parallelism.tp=2", "trainer.total_steps=2",
                                               "data.train_batch_size=8",
                                               "rollout.n=2", "algorithm.mini_batch_size=8",
                                               "backend.micro_batch_size_per_device=8"], world=4, tp=2)
    trainer.step = 1
    trainer.train_step()
    assert [(r, n) for r, n, _ in workers.log["generate"]] == [(0, 2), (1, 2), (2, 2), (3, 2)]
    (r0, s0, _), (r1, s1, _), (r2, s2, _), (r3, s3, _) = workers.log["update"]
    assert s0.response_ids == s1.response_ids and s2.response_ids == s3.response_ids
    assert s0.response_ids != s2.response_ids and len(s0) == len(s2) == 8


def test_dynamic_sampling_keeps_only_groups_with_signal(tmp_path):
    trainer, _ = make_trainer(tmp_path, ["algorithm=dapo", "algorithm.overlong_shaping.buffer_len=4",
                                         "data.train_batch_size=8", "rollout.n=4", "algorithm.mini_batch_size=8"])
    trainer.step = 1
    batch, stats = trainer.collect_rollouts(trainer.step, Timer(), [0, 0, []])
    assert batch.num_groups == 8 and len(batch) == 32
    odd = [(int(ex.answer) % 2 == 1) for ex in batch.examples]
    assert all(odd), "groups whose samples all score the same must be dropped"
    assert stats["dynamic_sampling/rounds"] >= 2          # one batch of 8 random prompts rarely has 8 odd answers
    assert stats["dynamic_sampling/groups_dropped"] > 0 and stats["dynamic_sampling/groups_filled"] == 0


def test_dynamic_sampling_fills_when_rounds_run_out(tmp_path):
    trainer, _ = make_trainer(tmp_path, ["algorithm=dapo", "algorithm.overlong_shaping.buffer_len=4",
                                         "algorithm.dynamic_sampling.max_rounds=0", "data.train_batch_size=8",
                                         "rollout.n=4", "algorithm.mini_batch_size=8"])
    trainer.step = 1
    batch, stats = trainer.collect_rollouts(trainer.step, Timer(), [0, 0, []])
    even = sum(int(ex.answer) % 2 == 0 for ex in batch.examples)
    assert batch.num_groups == 8 and stats["dynamic_sampling/rounds"] == 1
    assert stats["dynamic_sampling/groups_filled"] == even == stats["dynamic_sampling/groups_dropped"]


def test_balance_batch_gives_the_ranks_equal_rows_and_close_token_counts(tmp_path):
    lengths = [9, 1, 8, 1, 7, 1, 6, 1]  # in order, rank 0 would get 19 response tokens and rank 1 15
    seqs = Sequences(prompt_ids=[[1]] * 8, response_ids=[[2] * n for n in lengths], old_log_probs=[[0.0]] * 8,
                     advantages=[1.0] * 8)
    for balance, want in ((False, [19, 15]), (True, [17, 17])):
        trainer, workers = make_trainer(tmp_path, ["data.train_batch_size=4", "rollout.n=2",
                                                   "algorithm.mini_batch_size=4", f"trainer.balance_batch={balance}"])
        trainer.update_actor(seqs)
        shares = [s for _, s, _ in workers.log["update"]]
        assert [len(s) for s in shares] == [4, 4] and [s.token_count() for s in shares] == want
        assert sorted(map(len, shares[0].response_ids + shares[1].response_ids)) == sorted(lengths)
        # the loss is still normalised over the whole mini batch: the same on every rank whatever the split
        assert workers.log["update"][0][2][GLOBAL_TOKENS] == sum(lengths)


def test_nonfinite_count_is_reported_not_averaged(tmp_path):
    trainer, workers = make_trainer(tmp_path, ["data.train_batch_size=4", "rollout.n=2", "algorithm.mini_batch_size=2"])
    for w in workers.workers:
        w.skipped = 3
    seqs = Sequences(prompt_ids=[[1]] * 8, response_ids=[[2]] * 8, old_log_probs=[[0.0]] * 8,
                     advantages=[float("nan")] * 8)
    # 4 prompts / 2 per mini batch = 2 optimizer steps, both non-finite: the run's count goes 3 -> 5
    assert trainer.update_actor(seqs)["actor/skipped_steps"] == 5


def test_fit_schedules_validation_checkpoints_and_export(tmp_path):
    trainer, workers = make_trainer(tmp_path, ["trainer.total_steps=4", "trainer.save_freq=2", "trainer.test_freq=2",
                                               "trainer.max_keep_checkpoints=0"])
    assert trainer.fit() == 0
    trainer.tracking.close()
    rows = read_metrics(tmp_path / METRICS_FILE)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [("val/score/mean" in r) for r in rows] == [False, True, False, True]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_2", "step_4"]
    state = ckpt.load_trainer_state(tmp_path / "checkpoints" / "step_4")
    assert state["step"] == 4 and state["loader"]["position"] == 4
    assert (tmp_path / "checkpoints" / "step_4" / "shard_1").is_file()
    assert (tmp_path / "final" / "config.json").is_file()
    # weights synced once before training, then after every step
    assert len(workers.log["sync"]) == 2 * (1 + 4)


def test_stop_request_finishes_the_step_then_checkpoints(tmp_path):
    trainer, workers = make_trainer(tmp_path, ["trainer.total_steps=10", "trainer.save_freq=-1", "trainer.test_freq=-1"])
    original = workers.workers[0].generate

    def generate_and_interrupt(prompt_ids, params):
        if trainer.step == 2:
            trainer.stop.request(15)  # SIGTERM arrives during step 2
        return original(prompt_ids, params)

    workers.workers[0].generate = generate_and_interrupt
    assert trainer.fit() == 128 + 15
    assert trainer.step == 2
    assert [p.name for p in ckpt.CheckpointManager(tmp_path / "checkpoints").completed()] == ["step_2"]
    assert not (tmp_path / "final").exists()


def test_step_seeds_are_distinct_and_stable():
    assert step_seed(1, 2, 0) == step_seed(1, 2, 0)
    assert len({step_seed(1, s, r) for s in range(50) for r in range(4)}) == 200


def test_single_on_policy_update_skips_the_old_log_prob_pass(tmp_path):
    """One optimizer step per batch (ppo_epochs 1, one mini batch): the update uses its own detached log-probs as
    the old ones, so no separate forward runs; with two mini batches the old log-probs are computed."""
    calls = []
    single, workers = make_trainer(tmp_path / "a", ["data.train_batch_size=4", "rollout.n=2",
                                                    "algorithm.mini_batch_size=4"])
    for w in workers.workers:
        w.compute_log_probs = lambda seqs, reference=False: calls.append(reference) or [[-0.5] * len(r) for r in seqs.response_ids]
    single.step = 1
    metrics = single.train_step()
    assert False not in calls and "timing_s/old_log_prob" in metrics  # reference passes may run, no policy pass
    assert all(s.old_log_probs is None for _, s, _ in workers.log["update"])

    two, workers = make_trainer(tmp_path / "b", ["data.train_batch_size=4", "rollout.n=2", "algorithm.mini_batch_size=2"])
    two.step = 1
    two.train_step()
    assert all(s.old_log_probs == [[-0.5] * len(r) for r in s.response_ids] for _, s, _ in workers.log["update"])


def test_hanging_reward_is_cut_off_and_the_step_goes_on(tmp_path):
    """Fake workers answer "xy" to one of the two samples of each odd prompt; the reward hangs on it. Each hang
    is cut off at the time limit, scores 0 and is counted; the step completes."""
    import time

    trainer, _ = make_trainer(tmp_path, ["data.train_batch_size=8", "rollout.n=2", "algorithm.mini_batch_size=8",
                                         "data.reward=tests.rewards.reward_helpers:digit_or_hang",
                                         "data.reward_timeout_s=0.5"])
    trainer.step = 1
    t0 = time.monotonic()
    batch, stats = trainer.collect_rollouts(trainer.step, Timer(), [0, 0, []])
    assert time.monotonic() - t0 < 60
    odd = sum(int(ex.answer) % 2 for ex in batch.examples)
    assert odd >= 1 and stats == {"reward/failed": 0, "reward/timeout": odd}
    assert [s for s, r in zip(batch.scores, batch.response_ids) if len(r) == 2] == [0.0] * odd
    assert all(s == 1.0 for s, r in zip(batch.scores, batch.response_ids) if len(r) == 1)


def test_rollout_vs_trainer_logprob_difference_is_logged(tmp_path):
    """Fake rollouts report -1.0 per token, the fake trainer -0.5: the difference is 0.5 everywhere."""
    trainer, workers = make_trainer(tmp_path, ["data.train_batch_size=4", "rollout.n=2", "algorithm.mini_batch_size=2"])
    for w in workers.workers[:1]:
        w.compute_log_probs = lambda seqs, reference=False: [[-0.5] * (len(r) - 1) + [-3.0] for r in seqs.response_ids]
    trainer.step = 1
    metrics = trainer.train_step()
    assert metrics["rollout/logprob_diff_max"] == pytest.approx(2.0)
    assert 0.5 < metrics["rollout/logprob_diff_mean"] < 2.0
    assert all(s.rollout_log_probs is None for _, s, _ in workers.log["update"])
    # one on-policy update computes no separate old log-probs: the update's pass compares, given the rollout's
    single, workers = make_trainer(tmp_path / "b", ["data.train_batch_size=4", "rollout.n=2",
                                                    "algorithm.mini_batch_size=4"])
    single.step = 1
    metrics = single.train_step()
    assert all(s.rollout_log_probs == [[-1.0] * len(r) for r in s.response_ids] for _, s, _ in workers.log["update"])
    assert metrics["rollout/logprob_diff_max"] == 1.5 and metrics["rollout/logprob_diff_mean"] == 0.5  # max of ranks


def test_decode_cuda_graph_share_is_logged_and_a_failed_capture_warned_once(tmp_path, caplog):
    trainer, workers = make_trainer(tmp_path, ["data.train_batch_size=4", "rollout.n=2", "algorithm.mini_batch_size=4"])
    w0, w1 = workers.workers
    w0.decode = dict(rows=4, steps=8, cuda_graph=True, graph_error="")
    w1.decode = dict(rows=4, steps=8, cuda_graph=False, graph_error="RuntimeError: operation not permitted")
    with caplog.at_level(logging.WARNING, logger="qwen35rl.runtime.grpo"):
        for step in (1, 2):
            trainer.step = step
            assert trainer.train_step()["rollout/cuda_graph"] == pytest.approx(0.5)
    warned = [r.getMessage() for r in caplog.records if "CUDA graph" in r.getMessage()]
    assert len(warned) == 1 and "operation not permitted" in warned[0]
    w1.decode = dict(rows=0, steps=0, cuda_graph=False, graph_error="")  # no prompts on that rank: not counted
    assert trainer.train_step()["rollout/cuda_graph"] == 1.0
    w0.decode = w1.decode = {}  # an engine without decode stats (vLLM): no metric
    assert "rollout/cuda_graph" not in trainer.train_step()


def test_a_reward_that_always_fails_stops_the_run_with_its_error(tmp_path):
    from qwen35rl.runtime.grpo import RewardFailure

    trainer, _ = make_trainer(tmp_path, ["data.train_batch_size=4", "rollout.n=2", "algorithm.mini_batch_size=4",
                                         "trainer.total_steps=5", "trainer.test_freq=-1", "trainer.save_freq=-1",
                                         "data.reward=tests.rewards.reward_helpers:always_raises",
                                         "data.reward_failure_window=2"])
    with pytest.raises(RewardFailure) as e:
        trainer.fit()
    assert trainer.step == 2  # a full window, then stop
    message = str(e.value)
    assert "failed on 16 of 16 responses (100%) over steps 1-2, more than" in message
    assert "ConnectionError: reward server at 10.0.0.9:8000 refused the connection" in message
    assert [r["step"] for r in read_metrics(tmp_path / METRICS_FILE)] == [1, 2]


def test_a_reward_failing_now_and_then_does_not_stop_the_run(tmp_path):
    """digit_or_raise raises on the "xy" answers (one of the two samples of each odd prompt): well under 50%."""
    trainer, _ = make_trainer(tmp_path, ["data.train_batch_size=4", "rollout.n=2", "algorithm.mini_batch_size=4",
                                         "trainer.total_steps=3", "trainer.test_freq=-1", "trainer.save_freq=-1",
                                         "data.reward=tests.rewards.reward_helpers:digit_or_raise",
                                         "data.reward_failure_window=1"])
    assert trainer.fit() == 0 and trainer.step == 3
    assert sum(w[0] for w in trainer.reward_window) >= 1  # it did fail, and was only counted


def test_one_step_off_trains_the_same_prompts_with_dynamic_sampling(tmp_path):
    """max_staleness=1: the batch of step t+1 is collected (DAPO's extra rounds included) while step t trains, by the
    policy version before step t's update; the prompts and samples of every step are those of the on-policy run
    (drawn in step order, seeded by their step), and the IS weights of the proximal over the behaviour policy
    (-0.5 against the fake rollout's -1.0 per token: e^0.5, under the cap 2) are folded into the advantages."""
    overrides = ["algorithm=dapo", "algorithm.overlong_shaping.buffer_len=4", "data.train_batch_size=8", "rollout.n=4",
                 "algorithm.mini_batch_size=8", "trainer.total_steps=3"]
    runs = {}
    for k in (0, 1):
        trainer, workers = make_trainer(tmp_path / f"k{k}", overrides + [f"algorithm.max_staleness={k}"])
        rows = []
        while trainer.step < trainer.total_steps:
            trainer.step += 1
            rows.append(trainer.train_step())
            trainer.prefetch.finish()
        trainer.prefetch.close()
        runs[k] = (rows, workers)
    (rows0, w0), (rows1, w1) = runs[0], runs[1]
    gens = lambda w: [(n, p["seed"]) for _, n, p in w.log["generate"]]
    assert gens(w0) == gens(w1)                                   # the same rounds, prompts and seeds, in order
    trained = lambda w: [s.response_ids for r, s, _ in w.log["update"] if r == 0]
    assert trained(w0) == trained(w1)
    assert [r["staleness/max"] for r in rows1] == [0.0, 1.0, 1.0] and "staleness/max" not in rows0[0]
    assert rows1[0]["rollout_corr/rollout_is_mean"] == pytest.approx(2.718281828 ** 0.5)
    adv0 = [s.advantages for r, s, _ in w0.log["update"] if r == 0][0]
    adv1 = [s.advantages for r, s, _ in w1.log["update"] if r == 0][0]
    assert all(a1 == [pytest.approx(a0 * 2.718281828 ** 0.5)] * len(a1) for a0, a1 in zip(adv0, adv1))
    assert all(r["dynamic_sampling/rounds"] >= 1 for r in rows1)


# ------------------------------------------------------------------------------------------- the worker handles
class Recording:
    """A worker group that records each call it is given and answers `answers[method]` on every rank."""

    def __init__(self, world: int, answers: Dict[str, Any]):
        self.world, self.answers = world, answers
        self.calls: List[tuple] = []

    def start(self, method, per_rank, kwargs=None, ranks=None):
        ranks = list(range(self.world)) if ranks is None else list(ranks)
        self.calls.append((method, ranks, list(per_rank), dict(kwargs or {})))
        return Finished([self.answers.get(method) for _ in ranks])


def test_one_step_calls_the_workers_through_the_handle_in_order(tmp_path):
    """Two mini batches (so an old log-prob pass) and a KL loss (a reference pass): what one GRPO step asks of every
    worker, in order, each a method the training worker has."""
    from qwen35rl.runtime.worker import PolicyWorker

    trainer, workers = make_trainer(tmp_path, ["data.train_batch_size=4", "rollout.n=2", "algorithm.mini_batch_size=2",
                                               "algorithm.ppo_epochs=1", "algorithm.use_kl_loss=true"])
    assert workers.calls == [("data_shards", [0, 1], {})]
    workers.calls.clear()
    trainer.step = 1
    trainer.train_step()
    assert [(m, ranks, sorted(kw)) for m, ranks, kw in workers.calls] == [
        ("generate", [0, 1], []),
        ("compute_log_probs", [0, 1], ["reference"]),
        ("compute_log_probs", [0, 1], ["reference"]),
        ("update_actor", [0, 1], ["global_scale"]),
        ("update_actor", [0, 1], ["global_scale"]),
        ("sync_weights", [0, 1], []),
        ("phase_memory_gb", [0, 1], []),
        ("max_memory_allocated_gb", [0, 1], []),
    ]
    assert [kw["reference"] for m, _, kw in workers.calls if m == "compute_log_probs"] == [False, True]
    assert all(callable(getattr(PolicyWorker, m)) for m, _, _ in workers.calls)


def test_a_misspelt_worker_call_fails_at_the_handle():
    group = Recording(2, {})
    with pytest.raises(AttributeError, match="compute_logprobs"):
        PolicyWorkers(group).compute_logprobs([], reference=True)
    with pytest.raises(RuntimeError, match="data_shards"):  # no share goes out before the ranks' groups are known
        PolicyWorkers(group).update_actor([], global_scale={})
    assert group.calls == []


def test_split_weight_sync_names_each_pools_own_methods():
    """Split placement: the weight-sync communicator is joined and fed by both pools at once, each pool through
    methods its own worker class has."""
    from qwen35rl.runtime.rollout_worker import RolloutWorker
    from qwen35rl.runtime.worker import PolicyWorker
    from qwen35rl.runtime.worker_groups import RolloutWorkers

    train, rollout = Recording(2, {"rendezvous_address": ("10.0.0.1", 29500)}), Recording(3, {})
    policy, generators = PolicyWorkers(train), RolloutWorkers(rollout)
    policy.join_weight_sync(generators)
    policy.send_weights(generators, version=7)
    assert train.calls == [("rendezvous_address", [0], [()], {}),
                           ("join_weight_sync", [0, 1], [("10.0.0.1", 29500, 4)] * 2, {}),
                           ("send_weights", [0, 1], [()] * 2, {})]
    assert rollout.calls == [("join_weight_sync", [0, 1, 2], [("10.0.0.1", 29500, 4)] * 3, {}),
                             ("receive_weights", [0, 1, 2], [(7,)] * 3, {})]
    assert all(callable(getattr(PolicyWorker, c[0])) for c in train.calls)
    assert all(callable(getattr(RolloutWorker, c[0])) for c in rollout.calls)
