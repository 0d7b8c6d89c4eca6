"""The Megatron engine on GPUs: numerics against transformers and a few GRPO steps, per parallel layout.

For a random-init model with real Qwen3.5 head shapes (few layers; dense: the 0.8B architecture, MoE: the 35B-A3B
architecture with fewer experts) the same bf16 weights go into transformers and into the Megatron engine. For each
layout (TP1 / TP2 / PP2 / EP2; world 2 unless a layout fills it) the script prints
- how far the engine's per-token log-probs and entropies are from transformers in fp32, next to how far transformers
  in bf16 is from itself in fp32 (the bf16 noise floor: the engine should be of the same order),
- GRPO steps on one fixed batch (fixed advantages, old log-probs from the first forward): policy loss, grad norm,
  step time, tokens/s and MFU (6·N·tokens over the peak), and whether the loss went down,
and writes everything as JSON (`--out`).

Run on the GPU machine (Python 3.12, torch 2.11, transformers 5.17), from the project root. Wheels first, on the
CPU machine: `../shared/gpu/pack-wheels.sh megatron-core==0.19.2` (hydra/omegaconf, flash-linear-attention and the
2.4 MB megatron-core wheel in .whl/). Then on the GPU machine:
    bash bench/gpu/install-wheels.sh .whl && export PYTHONPATH=/tmp/site:$PWD:$PYTHONPATH
    torchrun --standalone --nproc_per_node=2 bench/gpu/megatron_numerics.py --out /tmp/out/megatron.json
(about 2 GB of weights per model; the MoE model's HF random init on CPU is the slowest part).
VL models (`dense_vl`, `moe_vl`, `tiny_vl`, `tiny_vl_moe`): transformers' VL model (`Qwen3_5ForConditionalGeneration`) against the engine's
Qwen3.5-VL (vision tower on the first stage, M-RoPE), on a fixed batch with one random-noise image per row
(`--image-size`, WxH pixels, through the model's processor; 384x256 at the official sizes: a 24 x 16 patch grid, 96
image tokens); MFU counts the text tokens as the driver does, "+vision" adds 6 x the tower's weights per patch.
A dry run of this script's logic works on CPU (the engine installs megatron's CPU stand-ins itself) with the
`tiny` / `tiny_moe` / `tiny_vl` models:
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=1 bench/gpu/megatron_numerics.py --models tiny_vl \
        --layouts tp1 --rows 2 --prompt 64 --response 32 --steps 2
`--gdn torch` (default) runs megatron-core's own torch GDN recurrence (deterministic_mode; fla's chunked backward is
refused on Hopper with Triton 3.6 unless TileLang is installed), `--gdn fla` its fla path. megatron-core's GDN
imports fla either way (its q/k L2 norm is fla's kernel).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch
import torch.distributed as dist

MODELS = {
    # name: (config, overrides): real head shapes, 4 layers (3 GDN + 1 gated full attention)
    "dense": ("qwen3_5_0_8b", ["model.num_hidden_layers=4"]),
    "moe": ("qwen3_5_35b_a3b", ["model.num_hidden_layers=4", "model.num_experts=64"]),
    # Qwen3.5-VL: the 0.8B text architecture (4 layers) with its real vision tower (12 blocks) on image data
    "dense_vl": ("qwen3_5_0_8b", ["model.num_hidden_layers=4", "data.has_images=true"]),
    # the MoE VL architecture (Qwen3.5-35B-A3B's shapes, 4 layers, 64 of its experts) with its vision tower
    "moe_vl": ("qwen3_5_35b_a3b", ["model.num_hidden_layers=4", "model.num_experts=64", "data.has_images=true"]),
    # dry runs of this script (CPU, tests' stand-ins for CUDA)
    "tiny": ("qwen3_5_tiny", ["model.dtype=bfloat16"]),
    "tiny_moe": ("qwen3_5_tiny_moe", ["model.dtype=bfloat16"]),
    "tiny_vl": ("qwen3_5_tiny_vl", ["model.dtype=bfloat16", "data.has_images=true"]),
    "tiny_vl_moe": ("qwen3_5_tiny_vl_moe", ["model.dtype=bfloat16", "data.has_images=true"]),
}
VL_MODELS = {"dense_vl", "moe_vl", "tiny_vl", "tiny_vl_moe"}
"""Models that keep `model.vision` and train on images: the fixed batch holds one image per row."""
LAYOUTS = {"tp1": {}, "tp2": {"tp": 2}, "pp2": {"pp": 2}, "ep2": {"ep": 2}, "tp2ep2": {"tp": 2, "ep": 2}}


T0 = time.perf_counter()


def log(*args):
    if dist.get_rank() == 0:
        print(f"[{time.perf_counter() - T0:.0f} s]", *args, flush=True)


def compose_cfg(model: str, layout: Dict[str, int], args) -> Any:
    from omegaconf import OmegaConf

    from qwen35rl.config.compose import compose

    name, extra = MODELS[model]
    p = {"tp": 1, "pp": 1, "ep": 1, **layout}
    vision = [] if model in VL_MODELS else ["model.vision=null"]
    cfg = compose([f"model={name}", "model.init=random", "model.tokenizer=byte", *vision,
                   "model.dtype=bfloat16", "hw=gpu_1x", f"hw.devices_per_node={dist.get_world_size()}",
                   "backend=megatron", "rollout=hf", "backend.optimizer_cpu_offload=false",
                   f"backend.gradient_checkpointing={str(args.recompute).lower()}", f"backend.lr={args.lr}",
                   "backend.moe_aux_loss_coeff=0", "backend.moe_z_loss_coeff=0",
                   f"parallelism.tp={p['tp']}", f"parallelism.pp={p['pp']}", f"parallelism.ep={p['ep']}",
                   # megatron-core < 0.19 needs ETP = TP when EP = 1 (version.EXPERT_GROUPS_WITHOUT_EP)
                   f"parallelism.etp={p['tp'] if p['ep'] == 1 else 1}",
                   "trainer.seed=1"] + extra + list(args.set))
    OmegaConf.set_readonly(cfg, False)
    OmegaConf.set_struct(cfg, False)
    cfg.backend.transformer_overrides = {"deterministic_mode": args.gdn == "torch", **args.transformer_overrides}
    return cfg


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def fixed_batch(vocab: int, rows: int, prompt: int, response: int, seed: int = 0):
    """Prompts left-padded, responses right-padded (the runtime's layout), random tokens, fixed advantages."""
    from qwen35rl.engines.base import Batch

    g = torch.Generator().manual_seed(seed)
    width = prompt + response
    ids = torch.zeros(rows, width, dtype=torch.long)
    mask = torch.zeros(rows, width, dtype=torch.long)
    resp = torch.zeros(rows, width, dtype=torch.long)
    for r in range(rows):
        p = int(torch.randint(prompt // 2, prompt + 1, (1,), generator=g))
        n = int(torch.randint(response // 2, response + 1, (1,), generator=g))
        ids[r, prompt - p:prompt + n] = torch.randint(0, vocab, (p + n,), generator=g)
        mask[r, prompt - p:prompt + n] = 1
        resp[r, prompt:prompt + n] = 1
    adv = torch.where(torch.arange(rows) % 2 == 0, 1.0, -1.0)[:, None] * resp
    return Batch(input_ids=ids, attention_mask=mask, response_mask=resp, advantages=adv.float())


def noise_images(rows: int, size: str, seed: int = 0):
    """`rows` random-noise RGB images of `size` ("WxH" pixels)."""
    import numpy as np
    from PIL import Image

    w, h = (int(x) for x in size.lower().split("x"))
    rng = np.random.default_rng(seed)
    return [Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8")) for _ in range(rows)]


def fixed_vl_batch(cfg, rows: int, prompt: int, response: int, image_size: str, seed: int = 0, image_seed: int = 0):
    """As `fixed_batch`, with one image per row: prompt = text + <vision_start> + image tokens + <vision_end> +
    text (left-padded), response text (right-padded). Text ids are drawn below the special-token ids, so no random
    id is an image slot. The images come through the model's processor (`build_processor`: the official sizes when
    `model.hf_id` is set) in row order, as `Batch.multimodal` holds them."""
    from qwen35rl.engines.base import Batch
    from qwen35rl.models.processor import build_processor, vision_inputs
    from qwen35rl.config.special_tokens import special_token_ids
    from qwen35rl.models.tokenizer import build_tokenizer

    special = special_token_ids(cfg.model)
    proc = build_processor(cfg.model, build_tokenizer(cfg.model))
    vision = vision_inputs(proc.image_processor, noise_images(rows, image_size, image_seed))
    merge = int(cfg.model.vision.spatial_merge_size)
    tokens = (vision["image_grid_thw"].prod(-1) // merge ** 2).tolist()
    text_hi = min(special.values())  # text ids in [0, text_hi)
    g = torch.Generator().manual_seed(seed)
    prompt = max(prompt, max(tokens) + 4)  # room for the image and a token of text on each side
    width = prompt + response
    ids = torch.zeros(rows, width, dtype=torch.long)
    mask = torch.zeros(rows, width, dtype=torch.long)
    resp = torch.zeros(rows, width, dtype=torch.long)

    def text(n):
        return torch.randint(0, text_hi, (n,), generator=g).tolist()

    for r in range(rows):
        fixed = tokens[r] + 2
        p = int(torch.randint(max(prompt // 2, fixed + 2), prompt + 1, (1,), generator=g))
        before = int(torch.randint(1, p - fixed, (1,), generator=g))
        n = int(torch.randint(response // 2, response + 1, (1,), generator=g))
        row = (text(before) + [special["vision_start"]] + [special["image_pad"]] * tokens[r] + [special["vision_end"]]
               + text(p - fixed - before) + text(n))
        ids[r, prompt - p:prompt + n] = torch.tensor(row)
        mask[r, prompt - p:prompt + n] = 1
        resp[r, prompt:prompt + n] = 1
    adv = torch.where(torch.arange(rows) % 2 == 0, 1.0, -1.0)[:, None] * resp
    return Batch(input_ids=ids, attention_mask=mask, response_mask=resp, advantages=adv.float(), multimodal=vision)


def take_rows(batch, start: int, stop: int):
    """Rows [start, stop) of a batch, with their images (the fixed VL batch: one image per row, in row order)."""
    out = type(batch)(**{k: (v[start:stop] if torch.is_tensor(v) else v) for k, v in vars(batch).items()})
    mm = batch.multimodal
    if mm:
        grid = mm["image_grid_thw"]
        if grid.shape[0] != batch.input_ids.shape[0]:
            raise ValueError("take_rows expects one image per row")
        first = torch.cat([grid.new_zeros(1), grid.prod(-1).cumsum(0)]).tolist()
        out.multimodal = {"pixel_values": mm["pixel_values"][first[start]:first[stop]],
                          "image_grid_thw": grid[start:stop]}
    return out


@torch.no_grad()
def hf_reference(hf, batch, device, dtype):
    """transformers' per-token log-probs and entropies ([B, T], token t from logits at t-1), in `dtype`. A batch
    with images runs the VL model on them (its own 3-D positions from the attention mask and image tokens)."""
    from qwen35rl.algo.core import entropy_from_logits, logprobs_from_logits
    from qwen35rl.models.image_tokens import prompt_image_mask

    model = hf.to(device=device, dtype=dtype)
    ids, mask = batch.input_ids.to(device), batch.attention_mask.to(device)
    if batch.multimodal:
        image_mask = prompt_image_mask(batch.input_ids, batch.attention_mask, batch.response_mask,
                                       hf.config.image_token_id)
        logits = model(input_ids=ids, attention_mask=mask, mm_token_type_ids=image_mask.long().to(device),
                       **{k: v.to(device) for k, v in batch.multimodal.items()}).logits
    else:
        logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits
    logp = torch.zeros(ids.shape, device=device)
    ent = torch.zeros(ids.shape, device=device)
    for r in range(ids.shape[0]):  # row by row: fp32 logits of the whole batch over 248k vocab are large
        lg = logits[r, :-1].float()
        logp[r, 1:] = logprobs_from_logits(lg, ids[r, 1:])
        ent[r, 1:] = entropy_from_logits(lg)
    resp = batch.response_mask.to(device).bool()
    return (logp * resp).cpu(), (ent * resp).cpu()


def diff(a, b, mask):
    d = (a - b).abs()[mask.bool()]
    return {"max": float(d.max()), "mean": float(d.mean())}


def run_layout(model: str, layout_name: str, args, hf_state, refs, batch) -> Dict[str, Any]:
    from megatron.core import parallel_state

    from qwen35rl.algo.loss import ActorLoss
    from qwen35rl.engines.megatron.engine import MegatronTrainEngine
    from qwen35rl.runtime.flops import mfu, train_flops

    cfg = compose_cfg(model, LAYOUTS[layout_name], args)
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    device = args.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    from qwen35rl.config.layout import derive_layout

    eng = MegatronTrainEngine(cfg, layout=derive_layout(cfg), rank=dist.get_rank(), world_size=dist.get_world_size(),
                              device=device, total_steps=args.steps, hf_state=hf_state)
    build_s = time.perf_counter() - t0
    out: Dict[str, Any] = {"model": model, "layout": layout_name, "dp": eng.dp_size, "build_s": build_s}

    _sync()
    t0 = time.perf_counter()
    logp, ent = eng.compute_log_probs(batch, with_entropy=True)
    _sync()
    out["logprob_s"] = time.perf_counter() - t0
    mask = batch.response_mask
    out["logp_vs_fp32"] = diff(logp, refs["fp32"][0], mask)
    out["ent_vs_fp32"] = diff(ent, refs["fp32"][1], mask)
    out["logp_vs_hf_bf16"] = diff(logp, refs["bf16"][0], mask)

    # GRPO steps on the fixed batch: old log-probs from the first forward, two micro batches
    batch.old_log_probs = logp
    batch.ref_log_probs = logp
    rows = batch.input_ids.shape[0]
    micro = [take_rows(batch, 0, rows // 2), take_rows(batch, rows // 2, rows)]
    seq_lens = batch.attention_mask.sum(1).tolist()
    flops = train_flops(cfg.model, seq_lens)
    # the vision tower, which train_flops leaves out: about 6 x its weights per patch (its attention left out)
    vision_flops = 6.0 * args.vision_params * (int(batch.multimodal["image_grid_thw"].prod(-1).sum())
                                               if batch.multimodal else 0)
    steps = []
    for i in range(args.steps):
        _sync()
        t0 = time.perf_counter()
        m = eng.train_mini_batch(micro, ActorLoss.from_config(eng.cfg), {})
        _sync()
        dt = time.perf_counter() - t0
        steps.append({"pg_loss": m["actor/pg_loss"], "grad_norm": m["actor/grad_norm"], "ppo_kl": m["actor/ppo_kl"],
                      "clipfrac": m["actor/pg_clipfrac"], "step_s": dt,
                      # every DP rank holds the same batch here: tokens of the layout = tokens x DP
                      "tokens_per_s_per_gpu": sum(seq_lens) * eng.dp_size / dt / dist.get_world_size(),
                      "mfu": mfu(flops * eng.dp_size, dt, dist.get_world_size(), float(args.peak_tflops)),
                      "mfu_with_vision": mfu((flops + vision_flops) * eng.dp_size, dt, dist.get_world_size(),
                                             float(args.peak_tflops))})
        log(f"  {model}/{layout_name} step {i}: pg_loss {m['actor/pg_loss']:+.5f} grad_norm {m['actor/grad_norm']:.4f} "
            f"{dt:.2f} s")
    out["steps"] = steps
    losses = [s["pg_loss"] for s in steps]
    out["loss_decreased"] = bool(all(map(torch.isfinite, torch.tensor(losses))) and losses[-1] < losses[0])

    t0 = time.perf_counter()
    exported = {name: t.shape for bucket in eng.export_weights(512) for name, t in bucket}
    out["export_s"] = time.perf_counter() - t0
    out["export_tensors"] = len(exported)
    out["export_matches_hf_names"] = set(exported) == set(hf_state)
    if not out["export_matches_hf_names"]:
        out["export_missing"] = sorted(set(hf_state) - set(exported))[:20]
        out["export_extra"] = sorted(set(exported) - set(hf_state))[:20]
    out["export_vision_tensors"] = sum(k.startswith("model.visual.") for k in exported)
    out["export_shapes_match"] = all(tuple(exported[k]) == tuple(hf_state[k].shape) for k in set(exported) & set(hf_state))
    out["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
    del eng
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def table(rows: List[Dict[str, Any]], floor: Dict[str, Dict[str, float]]) -> str:
    lines = ["| model | layout | DP | max/mean abs dlogp vs HF fp32 | (HF bf16 vs fp32) | max abs dentropy | "
             "pg_loss first -> last | decreased | step s | tok/s/GPU | MFU (+vision) | export = HF names | peak GiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['layout']} | | error: {r['error'][:80]} | | | | | | | | | |")
            continue
        s, f = r["steps"], floor[r["model"]]
        last = s[-1]
        lines.append(
            f"| {r['model']} | {r['layout']} | {r['dp']} | {r['logp_vs_fp32']['max']:.4f} / {r['logp_vs_fp32']['mean']:.5f} "
            f"| {f['max']:.4f} / {f['mean']:.5f} | {r['ent_vs_fp32']['max']:.4f} | {s[0]['pg_loss']:+.4f} -> "
            f"{last['pg_loss']:+.4f} | {r['loss_decreased']} | {last['step_s']:.2f} | {last['tokens_per_s_per_gpu']:.0f} "
            f"| {100 * last['mfu']:.1f}% ({100 * last['mfu_with_vision']:.1f}%) | {r['export_matches_hf_names']} "
            f"| {r['peak_mem_gib']:.1f} |")
    return "\n".join(lines)


def main(argv=None, transformer_overrides=None):
    """`transformer_overrides`: extra TransformerConfig fields (dry runs on CPU set megatron's CPU-able options)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="dense,moe")
    ap.add_argument("--layouts", default="tp1,tp2,pp2,ep2")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--response", type=int, default=768)
    ap.add_argument("--image-size", default="384x256", help="WxH pixels of the VL models' images (one per row)")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--gdn", choices=("torch", "fla"), default="torch")
    ap.add_argument("--recompute", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--peak-tflops", type=float, default=794.0, help="bf16 matmul peak measured on the H200")
    ap.add_argument("--set", action="append", default=[], help="extra config override (repeatable)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    args.transformer_overrides = dict(transformer_overrides or {})

    local = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        torch.cuda.set_device(local)
        args.device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=args.device)
    else:
        args.device = torch.device("cpu")
        if not dist.is_initialized():
            dist.init_process_group("gloo")
    from qwen35rl.models.build import build_model

    rows, floor = [], {}
    results = {"args": {k: str(v) for k, v in vars(args).items()}, "world": dist.get_world_size(),
               "env": {"torch": torch.__version__,
                       "device": torch.cuda.get_device_name() if args.device.type == "cuda" else "cpu"}}
    try:
        import megatron.core

        results["env"]["megatron_core"] = megatron.core.__version__
    except Exception:
        pass
    def save() -> None:  # after every layout: a run cut short by its time limit keeps what finished
        results["floor"], results["rows"] = floor, rows
        if args.out and dist.get_rank() == 0:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(results, indent=1))

    for model in args.models.split(","):
        cfg = compose_cfg(model, {}, args)
        threads = torch.get_num_threads()  # torchrun starts each rank with one thread: the CPU-side init wants more
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
        vl = model in VL_MODELS
        hf = build_model(cfg.model, dtype=torch.bfloat16, seed=int(cfg.trainer.seed), text_only=not vl)
        torch.set_num_threads(threads)
        log(f"{model}: transformers model built ({type(hf).__name__})")
        hf_state = {k: v.clone() for k, v in hf.state_dict().items()}
        if cfg.model.tie_word_embeddings:
            hf_state.pop("lm_head.weight", None)
        args.vision_params = sum(v.numel() for k, v in hf_state.items() if k.startswith("model.visual."))
        if vl:
            batch = fixed_vl_batch(cfg, args.rows, args.prompt, args.response, args.image_size)
            grid = batch.multimodal["image_grid_thw"]
            results.setdefault("batches", {})[model] = {
                "image_size": args.image_size, "image_grid_thw": grid[0].tolist(),
                "image_tokens_per_row": int(grid[0].prod()) // int(cfg.model.vision.spatial_merge_size) ** 2,
                "width": batch.input_ids.shape[1], "tokens": int(batch.attention_mask.sum()),
                "response_tokens": int(batch.response_mask.sum()), "vision_params": args.vision_params}
            log(f"{model}: VL batch {results['batches'][model]}")
        else:
            batch = fixed_batch(int(cfg.model.vocab_size), args.rows, args.prompt, args.response)
        if args.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        refs = {"bf16": hf_reference(hf, batch, args.device, torch.bfloat16)}
        first_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        hf_reference(hf, batch, args.device, torch.bfloat16)  # again: kernel compilation and autotuning are done
        log(f"{model}: transformers bf16 reference {first_s:.1f} s, again {time.perf_counter() - t0:.1f} s")
        refs["fp32"] = hf_reference(hf, batch, args.device, torch.float32)
        if vl:  # how much the images move the response log-probs (other noise images, same tokens): the gap
            # against fp32 means something only well below this
            other = fixed_vl_batch(cfg, args.rows, args.prompt, args.response, args.image_size, image_seed=1)
            assert torch.equal(other.input_ids, batch.input_ids)
            effect = diff(hf_reference(hf, other, args.device, torch.float32)[0], refs["fp32"][0], batch.response_mask)
            results["batches"][model]["image_effect_fp32"] = effect
            log(f"{model}: other images move the fp32 log-probs by max {effect['max']:.4f} mean {effect['mean']:.5f}")
        if args.device.type == "cuda":
            results.setdefault("hf_reference_peak_mem_gib", {})[model] = torch.cuda.max_memory_allocated() / 2**30
        del hf
        if args.device.type == "cuda":
            torch.cuda.empty_cache()
        floor[model] = diff(refs["bf16"][0], refs["fp32"][0], batch.response_mask)
        log(f"{model}: HF bf16 vs fp32 log-prob noise floor max {floor[model]['max']:.4f} mean {floor[model]['mean']:.5f}")
        for name in args.layouts.split(","):
            need = max(LAYOUTS[name].values(), default=1)
            if "ep" in LAYOUTS[name] and not cfg.model.moe or need > dist.get_world_size():
                continue
            try:
                r = run_layout(model, name, args, {k: v.clone() for k, v in hf_state.items()}, refs, batch)
            except Exception as e:  # record and go on with the next layout
                import traceback

                log(traceback.format_exc())
                r = {"model": model, "layout": name, "error": f"{type(e).__name__}: {e}"}
            rows.append(r)
            log(f"{model}/{name}: " + json.dumps({k: v for k, v in r.items() if k != "steps"}))
            save()
    save()
    log(table(rows, floor))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
