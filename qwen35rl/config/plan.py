"""The plan: everything knowable before launch, as one dict (the JSON contract of `qwen35rl-plan format=json`)
and as readable text. Imports nothing heavy: cluster packages are only looked up with importlib's find_spec."""
from __future__ import annotations

import importlib.util
from typing import Any, Callable, Dict, List, Optional, Tuple

from omegaconf import DictConfig, OmegaConf

from qwen35rl.config.launcher import auto_choice, launcher_of
from qwen35rl.config import (auto_batch, capabilities, data_check, engine_specs, fit_hint, layout_search, memory,
                             params, quirks, redact, rules, run_name, step_time, vllm_facts)
from qwen35rl.config.layout import Layout, pools_per_node
from qwen35rl.config.problems import ERROR, WARNING, Problem
from qwen35rl.config.resolved import resolve_run
from qwen35rl.config.run_summary import render_lines as run_lines, run_summary
from qwen35rl.config.verl import exporter as verl_exporter


INSTALL: Dict[str, Callable[[str], Tuple[str, str]]] = {
    "vllm": lambda device: ("vLLM", "install it with " + ("vllm-ascend (Ascend's install guide)" if device == "npu"
                                                          else "pip install 'qwen35rl[gpu]'") + ", or use rollout=hf"),
    "megatron": lambda device: ("megatron-core", "pip install 'qwen35rl[gpu]' (NPU: MindSpeed + megatron-core, see "
                                                 "README)"),
}
"""For a package an engine's spec lists (keyed by package, not engine), on a device type: what it is called and
how to install it."""


def environment_problems(cfg: DictConfig) -> List[Problem]:
    """Cluster packages missing here (those the engines' specs list): a warning, since plans are often made on a
    login node without them."""
    out = []
    for key, group, spec in (
            ("rollout.engine", "rollout", engine_specs.declared(engine_specs.ROLLOUT_ENGINES, cfg.rollout.engine)),
            ("backend", "backend", engine_specs.declared(engine_specs.TRAIN_ENGINES, cfg.backend.name))):
        for package in (spec.packages if spec is not None else ()):  # an unknown engine: engine_known says so
            if importlib.util.find_spec(package) is None:
                what, hint = INSTALL.get(package, lambda _: (package, f"pip install {package}"))(str(cfg.hw.device))
                out.append(Problem(f"{package}_not_installed", key, f"{what} is not installed here; training with "
                                   f"{group}={spec.name} needs it on every node", hint, WARNING))
    if cfg.hw.device == "npu" and importlib.util.find_spec("torch_npu") is None:
        out.append(Problem("torch_npu_not_installed", "hw.device", "torch_npu is not installed here; NPU training "
                           "needs it (and CANN) on every node", "pip install 'qwen35rl[npu]' on the Ascend nodes", WARNING))
    return out


def launcher_plan(configured: DictConfig) -> Dict[str, Any]:
    """How the workers start: trainer.launcher as configured, what it resolves to, and why for `auto`."""
    setting = str(configured.trainer.launcher)
    return {"configured": setting, "launcher": launcher_of(configured),
            "why": auto_choice(configured)[1] if setting == "auto" else None}


def _launcher_text(launcher: Optional[Dict[str, Any]], devices: int) -> str:
    if not launcher:
        return ""
    how = ("workers as Ray actors" if launcher["launcher"] == "ray" else "the worker in this process, no Ray"
           if devices == 1 else "workers in local processes, no Ray")
    return f"; {how} (trainer.launcher={launcher['configured']}" + (f": {launcher['why']})" if launcher["why"] else ")")


def build_plan(cfg: DictConfig) -> Dict[str, Any]:
    """The plan dict of the run `resolve_run` makes of `cfg`. With `parallelism=auto` the best searched layout is
    applied first (and the top five listed)."""
    searched_from = cfg
    resolved = resolve_run(cfg)
    cfg, layout, mem, candidates = resolved.cfg, resolved.layout, resolved.memory, list(resolved.candidates)
    if rules.gate_problems(memory.as_tree(searched_from)):  # a value out of range: nothing was searched or estimated
        return refused_plan(cfg, rules.check_all(cfg, layout) + environment_problems(cfg))
    problems = list(resolved.problems) + rules.check_all(cfg, layout) + environment_problems(cfg)
    problems = fit_hint.with_fit_hint(vllm_facts.resolve(searched_from), problems)  # a model that does not fit
    if mem is None:  # an empty pool of placement=split (split_pool_sizes says so): no memory or cost arithmetic
        return refused_plan(cfg, problems)
    count = params.count_params(cfg.model)
    preset, changed = layout_search.layout_origin(cfg)
    run = run_summary(cfg)
    return {
        "valid": not any(p.severity == ERROR for p in problems),
        "problems": [p.to_dict() for p in problems],
        "model": str(cfg.model.name),
        "hw": run_name.hw_label(cfg.hw),
        "hw_preset": str(cfg.hw.name),
        "backend": str(cfg.backend.name),
        "rollout_engine": str(cfg.rollout.engine),
        "world_size": layout.world,
        "train": layout.train_dict(),
        "rollout": layout.rollout_dict(),
        "layout_name": layout_search.layout_label(cfg),
        "layout_preset": preset,
        "layout_overrides": changed,
        "params": count.to_dict(),
        "memory_gib": mem.to_dict(),
        "offload": offload_settings(cfg, mem, layout, memory.pool_is_auto(searched_from)),
        "compile": compile_settings(cfg),
        "cost": {**layout_search.cost(cfg, layout, mem), "score_unit": layout_search.SCORE_UNIT},
        "step_time": _step_time(cfg, layout, mem, run["total_steps"]),
        "batch": batch_arithmetic(cfg, layout, resolved.choice),
        "placement": placement_plan(cfg, layout, mem),
        "device": str(cfg.hw.device),
        "nodes": int(cfg.hw.nodes),
        "devices_per_node": int(cfg.hw.devices_per_node),
        "launcher": launcher_plan(searched_from),
        "worker_env": redact.redact({**OmegaConf.to_container(cfg.hw.env), **OmegaConf.to_container(cfg.backend.env)}),
        "vllm_quirks": vllm_quirks(cfg),
        "output_dir": f"{cfg.trainer.output_root}/{cfg.trainer.run_name}",
        "auto_candidates": [c.to_dict() for c in candidates[:5]],
        "auto_candidate_count": len(candidates),
        "auto_tested": layout_search.tested_rank(searched_from, candidates) if candidates else None,
        "auto_choice": layout_search.explain(searched_from, candidates) if candidates else None,
        "vllm": resolved.vllm.to_dict() if resolved.vllm is not None else None,
        "run": run,
        "data_check": data_check.check(cfg),
        "verl": verl_export(cfg),
    }


def _step_time(cfg: DictConfig, layout: Layout, mem: memory.MemoryEstimate,
               total_steps: Optional[int]) -> Optional[Dict[str, Any]]:
    st = step_time.estimate(cfg, layout, mem)
    return None if st is None else st.to_dict(total_steps, layout.devices)


def placement_plan(cfg: DictConfig, layout: Layout, mem: memory.MemoryEstimate) -> Dict[str, Any]:
    """Where each phase runs and how far behind the policy its samples may be: the placement, max_staleness, the
    resolved importance-sampling mode, and both pools (devices, where they start in node-major rank order, devices
    per node, the Ray resources they take, their layout and per-device memory peak). Colocated: both pools are
    every device."""
    per_node, resource = pools_per_node(cfg), str(cfg.hw.ray_resource)
    r = lambda x: round(float(x), 3)  # noqa: E731

    def pool(name: str, devices: int, first: int, pool_layout: Dict[str, Any], peak: float) -> Dict[str, Any]:
        return {"devices": devices, "first_device": first, "per_node": [n[name] for n in per_node],
                "ray_resources": {resource: devices}, "layout": pool_layout, "peak_gib": r(peak),
                "fits": peak <= mem.capacity_gib}

    return {
        "mode": "split" if layout.split else "colocated",
        "max_staleness": int(cfg.algorithm.max_staleness),
        "rollout_is": capabilities.rollout_is_mode(cfg),
        "rollout_is_threshold": float(cfg.algorithm.rollout_is_threshold),
        "pools": {"training": pool("training", layout.world, 0, layout.train_dict(), mem.train_peak_gib),
                  "rollout": pool("rollout", layout.rollout_world, layout.world if layout.split else 0,
                                  {"engine": str(cfg.rollout.engine), **layout.rollout_dict()}, mem.rollout_peak_gib)},
        "capacity_gib": r(mem.capacity_gib),
    }


def offload_settings(cfg: DictConfig, mem, layout: Optional[Layout] = None, pool_auto: bool = False) -> Dict[str, Any]:
    """What the trainer keeps in host memory and when, and the host memory that takes per device (GiB). With
    offload on (a recipe or tested layout may set it for its own hardware, and it stays on when an overlay adds
    nodes), `without`: the train and rollout peaks with every offload key off (an `auto` vLLM pool sized again),
    whether that fits, and the keys."""
    b = cfg.backend
    out: Dict[str, Any] = {"param": bool(b.param_offload), "grad": bool(b.grad_offload),
                           "optimizer": bool(b.optimizer_offload), "host_gib": round(float(mem.host_gib), 3)}
    if engine_specs.train_engine(cfg).offloads_between_phases:  # a host optimizer step, no whole-step policy
        out["optimizer_cpu_fraction"] = float(b.optimizer_offload_fraction) if b.optimizer_cpu_offload else 0.0
    else:
        out["offload_policy"] = bool(b.offload_policy)
    keys = [k for k in engine_specs.train_engine(cfg).offload_keys if OmegaConf.select(cfg, k) is True]
    if keys and layout is not None:
        tree = memory.as_tree(cfg)
        for k in keys:
            tree["backend"][k.split(".", 1)[1]] = False
        if pool_auto:
            tree["rollout"]["gpu_memory_utilization"] = memory.AUTO
        est = memory.estimate(tree, layout)
        out["without"] = {"keys": [f"{k}=false" for k in keys], "train_peak_gib": round(est.train_peak_gib, 3),
                          "rollout_peak_gib": round(est.rollout_peak_gib, 3), "fits": bool(est.fits)}
    return out


def compile_settings(cfg: DictConfig) -> Dict[str, bool]:
    """What runs through torch.compile on this config's devices; the first step of a run pays the compilation. The
    engines' log-prob head and the FSDP engine's GDN convolution (backend.use_torch_compile), its decoder layers'
    norms and MLPs (backend.compile_layers), the hf rollout's decode step (rollout.compile_decode)."""
    device, layers = str(cfg.hw.device), engine_specs.train_engine(cfg).compiles_layers
    kernels = capabilities.compiles_log_probs(cfg.backend.use_torch_compile, device)
    return {"log_probs": kernels, "conv": layers and kernels, "layers": layers and bool(cfg.backend.compile_layers),
            "decode": (engine_specs.rollout_engine(cfg).compiles_decode
                       and capabilities.compiles_decode(cfg.rollout.compile_decode, device))}


COMPILED_PARTS = {"log_probs": "log-prob head", "conv": "GDN convolution", "layers": "layer norms and MLPs",
                  "decode": "decode step"}


def _compile_line(plan: Dict[str, Any]) -> str:
    parts = [text for key, text in COMPILED_PARTS.items() if (plan.get("compile") or {}).get(key)]
    on_vllm = engine_specs.rollout_uses(str(plan.get("rollout_engine")), "vllm")
    vllm = "; vLLM compiles by its own settings" if on_vllm else ""
    if not parts:
        return f"  compile    none (qwen35rl's engines run eagerly{vllm})"
    return "  compile    " + ", ".join(parts) + f" (torch.compile: the first step compiles them{vllm})"


def verl_export(cfg: DictConfig) -> Dict[str, Any]:
    """The verl 0.9.1 launch of this config (`format=verl` prints it), its environment redacted like the plan's."""
    out = verl_exporter.export(cfg)
    out["env"] = redact.redact(out["env"])
    return out


def refused_plan(cfg: DictConfig, problems: List[Problem]) -> Dict[str, Any]:
    """The plan of a config with values out of range: its problems, and what needs no arithmetic over them."""
    zero = {"total": 0, "active": 0, "text": 0, "vision": 0, "mtp": 0}
    return {
        "valid": False, "problems": [p.to_dict() for p in problems], "model": str(cfg.model.name),
        "hw": run_name.hw_label(cfg.hw), "hw_preset": str(cfg.hw.name), "backend": str(cfg.backend.name),
        "rollout_engine": str(cfg.rollout.engine),
        "world_size": None, "train": {}, "rollout": {"tp": None, "dp": None, "ep": None},
        "layout_name": str(cfg.parallelism.name), "layout_preset": None, "layout_overrides": [], "params": zero,
        "memory_gib": {}, "offload": {}, "cost": {}, "step_time": None, "placement": {},
        "batch": {"prompts_per_step": None, "responses_per_prompt": None, "responses_per_step": None,
                  "optimizer_steps_per_rollout_batch": None,
                  "responses_per_mini_batch_per_dp_rank": None, "micro_batches_per_device": None,
                  "micro_batch_size_per_device": None, "gradient_checkpointing": None, "dynamic_batch_size": False,
                  "max_tokens_per_device": None, "sequence_length": None, "auto": None},
        "device": str(cfg.hw.device), "nodes": cfg.hw.nodes, "devices_per_node": cfg.hw.devices_per_node,
        "worker_env": {}, "vllm_quirks": [], "output_dir": f"{cfg.trainer.output_root}/{cfg.trainer.run_name}",
        "auto_candidates": [], "auto_candidate_count": 0, "auto_tested": None, "data_check": data_check.check(cfg),
    }


def vllm_quirks(cfg: DictConfig) -> List[Dict[str, Any]]:
    """The platform's vLLM quirks that this run's vLLM version gets, as the engine will apply them: {key, value,
    why, overridden (the user's rollout.engine_kwargs set the key)}. Empty without rollout=vllm."""
    if not engine_specs.rollout_uses(cfg, "vllm"):
        return []
    user = cfg.rollout.engine_kwargs or {}
    return [{"key": q["key"], "value": q["value"], "why": q.get("why"), "overridden": q["key"] in user}
            for q in quirks.applying_quirks(cfg)]


def batch_arithmetic(cfg: DictConfig, layout, choice: Optional[auto_batch.Choice] = None) -> Dict[str, Any]:
    """The batch vocabulary's numbers; `auto`: what an `auto` micro batch / checkpointing resolved to and why
    (`auto_batch.Choice.to_dict`), None when neither was auto."""
    n, prompts, mini = int(cfg.rollout.n), int(cfg.data.train_batch_size), int(cfg.algorithm.mini_batch_size)
    micro = int(cfg.backend.micro_batch_size_per_device)
    per_dp = (mini * n) // max(layout.dp, 1)
    return {
        "prompts_per_step": prompts,
        "responses_per_prompt": n,
        "responses_per_step": prompts * n,
        "optimizer_steps_per_rollout_batch": (prompts // mini if mini else 0) * int(cfg.algorithm.ppo_epochs),
        "responses_per_mini_batch_per_dp_rank": per_dp,
        "micro_batches_per_device": None if cfg.backend.dynamic_batch_size else per_dp // max(micro, 1),
        "micro_batch_size_per_device": micro,
        "gradient_checkpointing": bool(cfg.backend.gradient_checkpointing),
        "dynamic_batch_size": bool(cfg.backend.dynamic_batch_size),
        "max_tokens_per_device": int(cfg.backend.max_tokens_per_device),
        "sequence_length": int(cfg.data.max_prompt_length) + int(cfg.data.max_response_length),
        "auto": None if choice is None else {**choice.to_dict(), "text": choice.describe()},
    }


def _fmt_count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n:,}"


def _fmt_gib(x) -> str:
    if x is None:
        return "n/a"
    return f"{x:.1f} GiB" if x >= 0.1 else f"{x * 1024:.1f} MiB"


_TERM_NAMES = {"train/weights": "weights", "train/optimizer": "optimizer", "train/grads": "grads",
               "train/gathered_params": "gathered params", "train/activations": "activations",
               "train/vision_activations": "vision activations", "train/backward_transient": "backward transient",
               "train/optimizer_step": "optimizer step", "train/reference": "reference", "train/sleeping_engine":
               "sleeping engine", "rollout/weights": "weights", "rollout/kept_by_trainer": "trainer state",
               "rollout/activations": "activations", "rollout/kv_cache": "KV cache", "rollout/pool": "vLLM pool",
               "rollout/sequence_cache": "one sequence", "host/trainer_offload": "trainer",
               "host/sleeping_engine": "sleeping engine"}


def _terms(m: Dict[str, Any], phase: str) -> str:
    """The non-zero memory terms of one phase, largest first: "grads 11.2 GiB, weights 5.6 GiB"."""
    terms = [(k, v) for k, v in (m.get("terms") or {}).items() if k.startswith(phase + "/") and v]
    terms.sort(key=lambda kv: -kv[1])
    return ", ".join(f"{_TERM_NAMES.get(k, k.split('/', 1)[1].replace('_', ' '))} {_fmt_gib(v)}" for k, v in terms)


def _offload_line(plan: Dict[str, Any]) -> str:
    o, m = plan.get("offload") or {}, plan["memory_gib"]
    what = [name for key, name in (("param", "params"), ("grad", "grads"), ("optimizer", "optimizer states"))
            if o.get(key)]
    parts = [f"{', '.join(what)} to the host between phases"] if what else []
    if o.get("optimizer_cpu_fraction"):
        parts.append(f"CPU optimizer step on {o['optimizer_cpu_fraction']:.0%} of the states")
    if o.get("offload_policy"):
        parts.append("FSDP CPU offload policy (parameters, gradients and optimizer on the host throughout)")
    if not parts:
        return "  offload    none (the trainer's state stays on the device)"
    host = _terms(m, "host")
    parts.append(f"host {_fmt_gib(o.get('host_gib', m.get('host')) or 0.0)} per device" + (f" ({host})" if host else ""))
    w = o.get("without")
    if w:
        peaks = f"train peak {_fmt_gib(w['train_peak_gib'])}, rollout peak {_fmt_gib(w['rollout_peak_gib'])}"
        parts.append(f"not needed here: without it {peaks} of {_fmt_gib(m.get('capacity'))} usable fit "
                     f"({' '.join(w['keys'])} saves the copies)" if w["fits"] else
                     f"needed here: without it {peaks} of {_fmt_gib(m.get('capacity'))} usable do not fit")
    return "  offload    " + "; ".join(parts)


def _secs(x: float) -> str:
    return f"{x:.3g}" if x >= 0.001 else "<0.001"


def _score(x: Any) -> str:
    return "n/a" if x is None else f"{x:.3g} s/step"


def _degrees(d: Dict[str, Any], always: Tuple[str, ...]) -> str:
    """The degrees of a pool's layout that say something: those in `always`, and the others above 1."""
    return " ".join(f"{k.upper()}{v}" for k, v in d.items()
                    if k != "engine" and v is not None and (k in always or v != 1))


def _nodes(per_node: List[int]) -> str:
    """Devices of a pool on each node, runs of equal nodes merged: "nodes 0-13: 16, node 14: 8"."""
    runs: List[List[int]] = []
    for i, n in enumerate(per_node):
        if n and runs and runs[-1][1] == i - 1 and runs[-1][2] == n:
            runs[-1][1] = i
        elif n:
            runs.append([i, i, n])
    return ", ".join(f"node {a}: {n}" if a == b else f"nodes {a}-{b}: {n}" for a, b, n in runs)


def _placement_lines(plan: Dict[str, Any]) -> List[str]:
    """`pools` (placement=split: each pool's devices, Ray resources, layout and peak) and `staleness` (split, or
    a colocated run that weighs by the behaviour policy)."""
    pl = plan.get("placement") or {}
    if not pl:
        return []
    lines = []
    split = pl["mode"] == "split"
    if split:
        parts = []
        for name, pool in pl["pools"].items():
            (resource, count), = pool["ray_resources"].items()
            engine = f"{pool['layout']['engine']} " if name == "rollout" else ""
            always = ("dp",) if name == "training" else ("tp", "dp")
            parts.append(f"{name} {count} {resource} ({engine}{_degrees(pool['layout'], always)}; peak "
                         f"{_fmt_gib(pool['peak_gib'])} per device; {_nodes(pool['per_node'])})")
        lines.append("  pools      " + ", ".join(parts))
    if split or pl["rollout_is"] != "off":
        k = pl["max_staleness"]
        ahead = (f"{k}: the rollout pool generates up to {k} batch(es) ahead of training" if k else
                 "0: on-policy (generate, train, sync weights, in turn)")
        is_text = ("off" if pl["rollout_is"] == "off" else
                   f"{pl['rollout_is']} (truncated at {pl['rollout_is_threshold']:g})")
        lines.append(f"  staleness  max {ahead}; rollout IS {is_text}")
    return lines


def render_text(plan: Dict[str, Any]) -> str:
    if plan.get("world_size") is None:  # refused_plan: a value out of range, nothing was computed with it
        return "\n".join([f"qwen35rl plan: {plan['model']} on {_hw(plan)} with {plan['backend']} (INVALID)",
                          "  not planned: no layout, batch or memory arithmetic over the value(s) out of range "
                          "below", *_problem_lines(plan)])
    t, r, b, m, p = plan["train"], plan["rollout"], plan["batch"], plan["memory_gib"], plan["params"]
    train = " ".join(f"{k.upper()}{v}" for k, v in t.items() if v is not None)
    n = b.get("responses_per_prompt")
    pools = (plan.get("placement") or {}).get("pools") if (plan.get("placement") or {}).get("mode") == "split" else None
    world = (f"{plan['nodes'] * plan['devices_per_node']} devices: training pool {pools['training']['devices']}, "
             f"rollout pool {pools['rollout']['devices']}" if pools else f"world {plan['world_size']}")
    peaks = ("training pool peak", "rollout pool peak") if pools else ("train peak", "rollout peak")
    lines = [
        f"qwen35rl plan: {plan['model']} on {_hw(plan)} with {plan['backend']}"
        f" ({'VALID' if plan['valid'] else 'INVALID'})",
        f"  model      {_fmt_count(p['total'])} total, {_fmt_count(p['active'])} active"
        f" (text {_fmt_count(p['text'])}, vision {_fmt_count(p['vision'])}, MTP {_fmt_count(p['mtp'])})",
        *_run_lines(plan),
        f"  hardware   {plan['nodes']} node(s) x {plan['devices_per_node']} {plan['device']} = {world}"
        f"{_launcher_text(plan.get('launcher'), plan['nodes'] * plan['devices_per_node'])}",
        f"  train      {train}   [layout: {plan['layout_name']}]",
        f"  rollout    {plan['rollout_engine']} TP{r['tp']} DP{r['dp']} EP{r['ep']}",
        *_placement_lines(plan),
        f"  batch      {b['prompts_per_step']} prompts x {n if n is not None else 'n'} -> {b['responses_per_step']}"
        f" responses/step; {b['optimizer_steps_per_rollout_batch']} optimizer step(s) per rollout batch;"
        f" {b['responses_per_mini_batch_per_dp_rank']} responses per DP rank per mini batch"
        + (f" in {b['micro_batches_per_device']} micro batch(es) of {b['micro_batch_size_per_device']}"
           if b["micro_batches_per_device"] is not None
           else f" in micro batches of at most {b['max_tokens_per_device']} tokens"),
        *([f"  auto       {b['auto']['text']}"] if b.get("auto") else []),
        f"  memory     {peaks[0]} {_fmt_gib(m.get('train_peak'))}, log-prob peak {_fmt_gib(m.get('log_prob_peak'))},"
        f" {peaks[1]} {_fmt_gib(m.get('rollout_peak'))},"
        f" usable {_fmt_gib(m.get('capacity'))} per device -> {'fits' if m.get('fits') else 'DOES NOT FIT'}"
        + (f" ({m['headroom']:.0%} free)" if m.get("headroom") is not None and m.get("fits") else ""),
    ]
    for phase in ("train", "log_prob", "rollout"):
        if _terms(m, phase):
            label = phase.replace("_", "-") + ":"
            lines.append(f"             {label:9}{' ' if len(label) >= 9 else ''}{_terms(m, phase)}")
    if plan.get("offload"):
        lines.append(_offload_line(plan))
    if plan.get("compile") is not None:
        lines.append(_compile_line(plan))
    c = plan.get("cost") or {}
    if c.get("score") is not None:
        parts = [f"{k[:-2].replace('comm_', 'comm ')} {_secs(v)}" for k, v in c.items()
                 if k.endswith("_s") and isinstance(v, (int, float)) and v > 0]
        penalty = c.get("headroom_penalty", 1.0)
        lines.append(f"  cost       score {_score(c['score'])} (estimated seconds per RL step from nominal constants,"
                     f" for ranking layouts: {', '.join(parts)}"
                     + ("; the pools overlap: the longer part counts" if c.get("overlapped") else "")
                     + (f"; x{penalty:.2f} for memory headroom under 10%" if penalty > 1.0 else "") + ")")
    lines.append(f"  output     {plan['output_dir']}")
    v = plan.get("vllm")
    if v:
        lines.append(f"  vllm       {v['version']} ({v['source']}); GDN prefill {v['gdn_prefill']}; rollout checkpoint "
                     f"{v['rollout_checkpoint']}; weights at start: {v['load_format']['why']} (load_format="
                     f"{v['load_format']['value']}); engine arguments checked against {v['engine_args_from']}")
    for q in plan.get("vllm_quirks", []):
        state = "overridden by rollout.engine_kwargs" if q["overridden"] else "applied"
        lines.append(f"  vllm quirk {q['key']}={q['value']} ({state}): {q['why']}")
    if plan["worker_env"]:
        lines.append("  worker env " + " ".join(f"{k}={v}" for k, v in sorted(plan["worker_env"].items())))
    if plan["auto_candidates"]:
        total = plan.get("auto_candidate_count") or len(plan["auto_candidates"])
        lines.append(f"  parallelism=auto, best {len(plan['auto_candidates'])} of {total} valid layouts"
                     " (score: estimated seconds per RL step, lower is better):")
        for i, c in enumerate(plan["auto_candidates"], 1):
            lines.append(f"    {i}. {_score(c.get('score')):>12}  {' '.join(c.get('overrides', []))}")
        why = plan.get("auto_choice")
        if why:
            lines.append(f"  auto chose {why['chosen']}")
            if why.get("runner_up"):
                lines.append(f"  runner-up  {why['runner_up']}")
        tested = plan.get("auto_tested")
        if tested:
            where = (f"ranks {tested['rank']} of {tested['of']}" if tested.get("rank") else
                     f"is not among the {tested['of']} candidates: {tested.get('why')}")
            lines.append(f"  tested layout {tested['name']} {where} (score {_score(tested.get('score'))});"
                         " its settings outside parallelism are kept")
            lines.append(f"    {' '.join(tested['overrides'])}")
    lines += _problem_lines(plan)
    return "\n".join(lines)


def _hw(plan: Dict[str, Any]) -> str:
    """The hardware label, and the preset it was resized from (hw=gpu_1node with hw.nodes=4: gpu_4x8)."""
    preset = plan.get("hw_preset")
    return plan["hw"] + (f" (hw={preset} with other node / device counts)" if preset and preset != plan["hw"] else "")


def _problem_lines(plan: Dict[str, Any]) -> List[str]:
    lines = []
    for prob in plan["problems"]:
        lines.append(f"  {prob['severity']}: [{prob['code']}] {prob['key']}: {prob['message']}")
        if prob.get("hint"):
            lines.append(f"      hint: {prob['hint']}")
    return lines


def _run_lines(plan: Dict[str, Any]) -> List[str]:
    """What the run does (run_summary), with its step time after the run line when it was planned, and the data
    check's line per file after the data line."""
    lines = run_lines(plan["run"]) if plan.get("run") else []
    if plan.get("run") and plan.get("memory_gib"):
        lines.insert(1, step_time.render(plan.get("step_time"), plan.get("device", "cuda")))
    at = next((i + 1 for i, line in enumerate(lines) if line.startswith("  data ")), len(lines))
    return lines[:at] + data_check.render_lines(plan.get("data_check")) + lines[at:]
