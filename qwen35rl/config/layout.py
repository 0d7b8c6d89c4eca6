"""The parallel layout derived from a resolved config: world size and every degree, computed once here."""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional


@dataclass(frozen=True)
class Layout:
    world: int
    tp: int
    pp: int
    cp: int
    ep: int
    etp: int
    dp: int
    """Training data parallel = world / (tp * pp * cp) (FSDP: world / sp)."""
    vpp: Optional[int]
    fsdp_size: int
    sp: int
    rollout_tp: int
    rollout_dp: int
    rollout_ep: int
    backend: str

    @property
    def edp(self) -> int:
        """Expert data parallel (Megatron): the ranks holding the same experts = world / (pp * ep * etp)."""
        return self.world // max(self.pp * self.ep * self.etp, 1)

    @property
    def rollout_replica_size(self) -> int:
        """Devices of one rollout engine: TP (EP = 1) or TP*DP (one DP-attention + EP-MoE engine)."""
        return self.rollout_tp * self.rollout_dp if self.rollout_ep > 1 else self.rollout_tp

    def train_dict(self) -> Dict[str, Any]:
        d = {k: getattr(self, k) for k in ("tp", "pp", "cp", "ep", "etp", "dp", "vpp")}
        if self.backend == "fsdp":
            d.update(fsdp_size=self.fsdp_size, sp=self.sp)
        return d

    def rollout_dict(self) -> Dict[str, int]:
        return {"tp": self.rollout_tp, "dp": self.rollout_dp, "ep": self.rollout_ep}

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


def derive_layout(cfg: Any) -> Layout:
    """Layout of `cfg` (a resolved DictConfig or plain dict tree). Non-dividing degrees floor to 0 or more; the
    validation rules report them, this function never raises on a bad layout."""
    hw, par = cfg["hw"], cfg["parallelism"]
    world = int(hw["nodes"]) * int(hw["devices_per_node"])
    backend = str(cfg["backend"]["name"])
    if backend == "fsdp":
        # FSDP shards parameters, not layers: only Ulysses SP takes devices away from data parallel.
        tp = pp = cp = ep = etp = 1
        sp = int(par["sp"])
        dp = world // max(sp, 1)
        fsdp_size = world if int(par["fsdp_size"]) in (-1, 0) else int(par["fsdp_size"])
        vpp = None
    else:
        tp, pp, cp, ep, etp = (int(par[k]) for k in ("tp", "pp", "cp", "ep", "etp"))
        sp, fsdp_size = 1, -1
        dp = world // max(tp * pp * cp, 1)
        vpp = par["vpp"]
    rtp, rep = int(par["rollout"]["tp"]), int(par["rollout"]["ep"])
    rdp = par["rollout"]["dp"]
    rdp = int(rdp) if rdp is not None else world // max(rtp, 1)
    return Layout(world=world, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, dp=dp, vpp=vpp, fsdp_size=fsdp_size, sp=sp,
                  rollout_tp=rtp, rollout_dp=rdp, rollout_ep=rep, backend=backend)


# ------------------------------------------------------------------------------------------- pipeline stages
_STAGE_SYMBOLS = set("EtmL")


def parse_pipeline_layout(text: str) -> List[List[str]]:
    """Megatron's pipeline layout string -> the symbols of each (virtual) stage, e.g. "Et*2|(tt|)*2,t|tL" ->
    [[E,t,t],[t,t],[t,t],[t],[t,L]]. Stages split at '|', `X*N` and `(...)*N` repeat, commas are cosmetic;
    E embedding, t decoder layer, m MTP, L loss. Raises ValueError on anything else."""
    s = str(text).replace(",", "").replace(" ", "")
    group = re.compile(r"\(([^()]*)\)\*(\d+)")
    while group.search(s):
        s = group.sub(lambda g: g.group(1) * int(g.group(2)), s)
    s = re.sub(r"([A-Za-z])\*(\d+)", lambda g: g.group(1) * int(g.group(2)), s)
    stages = [list(part) for part in s.split("|")]
    bad = {c for st in stages for c in st} - _STAGE_SYMBOLS
    if bad or "(" in s or "*" in s:
        raise ValueError(f"cannot read pipeline layout {text!r} (symbols E, t, m, L; '|' between stages; X*N repeats)")
    return stages


def even_pipeline_layout(num_layers: int, stages: int) -> List[List[str]]:
    """Layers split as evenly as possible (earlier stages take one fewer when it does not divide), embedding on
    the first stage, loss on the last."""
    base, extra = divmod(num_layers, max(stages, 1))
    out = [["t"] * (base + (1 if i >= stages - extra else 0)) for i in range(stages)]
    out[0].insert(0, "E")
    out[-1].append("L")
    return out


def format_pipeline_layout(stages: List[List[str]]) -> str:
    """The inverse of parse_pipeline_layout for a suggestion: 'E,t*9|t*10|...,L'."""
    def one(st: List[str]) -> str:
        n = st.count("t")
        core = f"t*{n}" if n > 1 else "t" * n
        return ",".join(x for x in ([("E" if "E" in st else "")] + [core] + [("L" if "L" in st else "")]) if x)
    return "|".join(one(st) for st in stages)


def pipeline_stages(cfg: Any, layout: Layout) -> List[List[str]]:
    """Virtual stages of the training pipeline (pp * vpp of them, in Megatron's order): the explicit
    `parallelism.pipeline_layout` when set and readable, else an even split."""
    text = cfg["parallelism"]["pipeline_layout"]
    if text:
        try:
            return parse_pipeline_layout(text)
        except ValueError:
            pass  # the pipeline rules report it; planning continues with an even split
    return even_pipeline_layout(int(cfg["model"]["num_hidden_layers"]), layout.pp * (layout.vpp or 1))
