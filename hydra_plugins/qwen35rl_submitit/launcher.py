"""`hydra/launcher=submitit_local|submitit_slurm` for qwen35rl sweeps, on hydra-submitit-launcher 1.2.0.

The two config names are the plugin's own; qwen35rl's config registration stores them again (`register`) with
qwen35rl's launchers, which differ from the plugin's in what a training sweep needs:

- every job is sized from its own composed config (`qwen35rl.runtime.slurm.job_parameters`): nodes = hw.nodes,
  gpus_per_node = hw.devices_per_node on a GPU target, cpus_per_task = 8 per device, one task per node (the driver;
  Ray starts the per-device workers). Jobs of equal size go out as one Slurm job array;
- a multi-node job runs its function once, in the batch step on the first node (submitit's `use_srun=False`), where
  `qwen35rl.runtime.slurm.ray_for_allocation` starts Ray over the allocation with srun as launch/slurm_ray.sh does;
- what each job returned comes back to the submitting process: the sweep callbacks see every job end (the sweep
  summary), and `qwen35rl-train` gets each job's exit code (the task module's `_exit_codes`, kept per process);
- a job that raised or died (killed, timed out, a node lost) is one block naming its log and a row of the sweep
  summary with exit code 1; the other jobs' results stay.
"""

# No `from __future__ import annotations` here: Hydra's plugin scan executes this module before it is in
# sys.modules, where dataclasses cannot resolve string annotations.
import json
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

from hydra.core.config_store import ConfigStore
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra.plugins.launcher import Launcher
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'qwen35rl[slurm]' (hydra-submitit-launcher==1.2.0 and submitit)"

try:
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf, LocalQueueConf, SlurmQueueConf
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import BaseSubmititLauncher
except ImportError:  # the `slurm` extra is not installed: the configs below say so when they are used
    BaseSubmititLauncher = None


if BaseSubmititLauncher is not None:

    class _SweepLauncher(BaseSubmititLauncher):
        """The plugin's launcher with per-job sizes, the jobs' results brought back, and failed jobs as results."""

        def extra_parameters(self, params: Dict[str, Any]) -> Dict[str, Any]:
            return {}

        def job_plan(self, overrides: Sequence[str]) -> Tuple[DictConfig, Dict[str, Any]]:
            """The job's composed config and its launcher parameters."""
            from qwen35rl.runtime.slurm import job_parameters

            assert self.hydra_context is not None and self.config is not None
            job_cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            launcher = OmegaConf.to_container(job_cfg.hydra.launcher, resolve=True)
            return job_cfg, job_parameters(launcher, job_cfg)

        def executor(self, params: Dict[str, Any]) -> Any:
            import submitit

            init = {"folder": params["submitit_folder"]}
            if "max_num_timeout" in params:
                init[f"{self._EXECUTOR}_max_num_timeout"] = params["max_num_timeout"]
            executor = submitit.AutoExecutor(cluster=self._EXECUTOR, **init)
            generic = set(OmegaConf.structured(BaseQueueConf).keys())
            rest = {k if k in generic else f"{self._EXECUTOR}_{k}": v for k, v in params.items()
                    if k not in ("submitit_folder", "max_num_timeout")}
            rest.update(self.extra_parameters(params))
            executor.update_parameters(**rest)
            return executor

        def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
            assert self.config is not None and self.hydra_context is not None
            sweep_dir = Path(str(self.config.hydra.sweep.dir))
            sweep_dir.mkdir(parents=True, exist_ok=True)
            if "mode" in self.config.hydra.sweep:
                os.chmod(sweep_dir, mode=int(str(self.config.hydra.sweep.mode), 8))
            log.info(f"Submitit '{self._EXECUTOR}' sweep output dir : {sweep_dir}")

            jobs: List[Dict[str, Any]] = []
            groups: Dict[str, List[Dict[str, Any]]] = {}
            for idx, overrides in enumerate(job_overrides):
                job_cfg, params = self.job_plan(overrides)
                job = {"num": initial_job_idx + idx, "overrides": list(overrides), "cfg": job_cfg, "params": params}
                jobs.append(job)
                groups.setdefault(json.dumps(params, sort_keys=True, default=str), []).append(job)
            state = Singleton.get_state()
            for members in groups.values():
                params = members[0]["params"]
                try:
                    submitted = self.executor(params).map_array(
                        self, [j["overrides"] for j in members], ["hydra.sweep.dir"] * len(members),
                        [j["num"] for j in members], [f"job_id_for_{j['num']}" for j in members],
                        [state] * len(members))
                except Exception as e:  # sbatch refused them (partition, account, limits), or no Slurm here
                    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
                    for j in members:
                        j["refused"] = lines[-1][:300] if lines else type(e).__name__
                    continue
                size = ", ".join(f"{k}={params[k]}" for k in ("nodes", "gpus_per_node", "cpus_per_task",
                                                            "timeout_min") if params.get(k) is not None)
                for j, s in zip(members, submitted):
                    j["job"] = s
                    log.info(f"\t#{j['num']} : {' '.join(filter_overrides(j['overrides']))} -> job {s.job_id} "
                             f"({size}; log {s.task(0).paths.stderr})")

            returns = [self.result(j) for j in jobs]
            for ret, j in zip(returns, jobs):
                self.hydra_context.callbacks.on_job_end(config=j["cfg"], job_return=ret)
                self.record_exit_code(ret)
            return returns

        @staticmethod
        def result(job: Dict[str, Any]) -> JobReturn:
            """The job's return. A job that raised, or ended without returning (killed, timed out, its node lost),
            comes back as a finished job of exit code 1 whose error names the job's log: printed here in one
            block, listed by the sweep summary, and the other jobs' results are kept (Hydra's sweeper would stop
            the whole sweep at the first failed job with a traceback of this process, which says nothing)."""
            from qwen35rl.config.problems import Problem

            if "refused" in job:
                return _failed(job, Problem(
                    "sweep_job_failed", "hydra.launcher", f"the job was not submitted: {job['refused']}",
                    "check hydra.launcher (partition, account, qos, time and size limits) and that this is a "
                    "machine that submits to the cluster"))
            submitted = job["job"]
            try:
                # task 0: a job of N nodes has N tasks for Slurm, but its function runs once (use_srun=False)
                ret = submitted.task(0).result()
                if ret.status == JobStatus.COMPLETED:
                    return ret
                why = f"{type(ret._return_value).__name__}: {ret._return_value}"
            except Exception as e:  # submitit's UncompletedJobError / FailedJobError: the job did not return
                # the state Slurm gives (TIMEOUT, NODE_FAIL, CANCELLED, FAILED ...) and the last line submitit read
                # back: the exception of a job that raised, the tail of the error log of one that was killed
                why = f"it ended without a result (state {getattr(submitted, 'state', 'UNKNOWN')}): {_last_words(e)}"
            return _failed(job, Problem("sweep_job_failed", "hydra.launcher", f"job {submitted.job_id} failed: {why}",
                                        f"its log: {submitted.task(0).paths.stderr}"))

        def record_exit_code(self, ret: JobReturn) -> None:
            """Hand the job's exit code to the task's module, as the job would have in this process."""
            module = sys.modules.get(getattr(self.task_function, "__module__", ""))
            codes = getattr(module, "_exit_codes", None)
            if isinstance(codes, list):
                from qwen35rl.runtime.slurm import exit_code_of

                codes.append(exit_code_of(ret))

    def _last_words(err: Exception) -> str:
        """The line that says why, out of submitit's message: the last line of the trace of a job that raised, else
        the last line of the error log it quotes, else its own first line."""
        text = str(err)
        dashes = "-" * 22 + "\n"
        if "failed during processing with trace:" in text and text.count(dashes) >= 2:
            text = text.split(dashes)[1]
        elif "-" * 40 in text:
            text = text.split("-" * 40, 1)[1]
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        return lines[-1][:300] if lines else type(err).__name__

    def _failed(job: Dict[str, Any], problem: Any) -> JobReturn:
        """A job that did not return, as a finished job of exit code 1 with its problem (said here once)."""
        print(f"qwen35rl: sweep job #{job['num']} ({' '.join(filter_overrides(job['overrides']))})\n"
              f"  {problem.render()}", file=sys.stderr, flush=True)
        return JobReturn(overrides=job["overrides"], cfg=job["cfg"], status=JobStatus.COMPLETED,
                         hydra_cfg=OmegaConf.create({"hydra": {"job": {"num": job["num"]}}}),
                         _return_value={"valid": True, "problems": [problem.to_dict()], "exit_code": 1})

    class LocalLauncher(_SweepLauncher):
        """Every job as a process of this machine (submitit's local executor); all jobs run at once."""

        _EXECUTOR = "local"

    class SlurmLauncher(_SweepLauncher):
        """Every job as its own Slurm job (a job array per job size)."""

        _EXECUTOR = "slurm"

        def extra_parameters(self, params: Dict[str, Any]) -> Dict[str, Any]:
            # one driver per job: a multi-node job runs its function in the batch step of the first node, which
            # starts Ray on every node with srun (qwen35rl.runtime.slurm), instead of once per node
            return {"slurm_use_srun": False} if int(params.get("nodes") or 1) > 1 else {}

    @dataclass
    class QwenLocalConf(LocalQueueConf):
        _target_: str = "hydra_plugins.qwen35rl_submitit.launcher.LocalLauncher"
        timeout_min: int = 1440
        gpus_per_node: Any = "auto"
        name: str = "qwen35rl"

    @dataclass
    class QwenSlurmConf(SlurmQueueConf):
        _target_: str = "hydra_plugins.qwen35rl_submitit.launcher.SlurmLauncher"
        timeout_min: int = 1440
        nodes: int = "${hw.nodes}"  # type: ignore[assignment]
        gpus_per_node: Any = "auto"
        cpus_per_task: Any = "auto"
        name: str = "qwen35rl"

    LAUNCHERS: List[type] = [LocalLauncher, SlurmLauncher]
    CONFIGS: Dict[str, Any] = {"submitit_local": QwenLocalConf, "submitit_slurm": QwenSlurmConf}

else:

    class MissingLauncher(Launcher):
        """Stands in for the launchers when the `slurm` extra is not installed: says what to install."""

        def __init__(self, **params: Any) -> None:
            pass

        def setup(self, **kwargs: Any) -> None:
            # exit code 2: refused before anything starts, like a config error
            print(f"qwen35rl: hydra/launcher=submitit_local|submitit_slurm needs hydra-submitit-launcher, which is "
                  f"not installed here: {INSTALL_HINT}", file=sys.stderr)
            sys.exit(2)

        def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
            raise NotImplementedError

    _MISSING = {"_target_": "hydra_plugins.qwen35rl_submitit.launcher.MissingLauncher"}
    LAUNCHERS = [MissingLauncher]
    CONFIGS = {"submitit_local": _MISSING, "submitit_slurm": _MISSING}


def register() -> None:
    """Store qwen35rl's launcher configs under the plugin's names, replacing the plugin's own entries. Called by
    qwen35rl's command lines (`qwen35rl.cli.common.register_all`) after Hydra's plugin scan, which
    executes every module under hydra_plugins again, the plugin's config module included."""
    from hydra.core.plugins import Plugins

    for launcher in LAUNCHERS:  # known to Hydra also where its scan does not see this package (editable installs)
        Plugins.instance().register(launcher)
    cs = ConfigStore.instance()
    for name, node in CONFIGS.items():
        cs.store(group="hydra/launcher", name=name, node=node, provider="qwen35rl")
