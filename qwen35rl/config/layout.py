"""The parallel layout derived from a resolved config: world size and every degree, computed once here."""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, fields
from typing import Any, Dict, List, Optional, Tuple

from qwen35rl.config.engine_specs import TRAIN_ENGINES, train_engine

SPLIT = "split"
"""`placement.mode` of a run whose rollout engines have devices of their own."""


@dataclass(frozen=True)
class Layout:
    world: int
    """Devices of the training engines: every device when colocated, the training pool with placement=split."""
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
    rollout_world: Optional[int] = None
    """Devices of the rollout engines: `world` when colocated (None is filled in so), placement.rollout_devices
    with placement=split. rollout_dp derives from it."""
    split: bool = False
    """placement=split: the rollout devices are not the training devices (the last rollout_world in rank order)."""

    def __post_init__(self) -> None:
        if self.rollout_world is None:
            object.__setattr__(self, "rollout_world", self.world)

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Layout":
        """A layout from `to_dict` (checkpoint meta), also one written before a field existed (the defaults:
        colocated); keys this version does not know are ignored."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    @property
    def devices(self) -> int:
        """Every device of the run: the training pool plus, with split, the rollout pool."""
        return self.world + self.rollout_world if self.split else self.world

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
        if not train_engine(self.backend).model_parallel:  # its own degrees: FSDP size, Ulysses SP
            d.update({k: getattr(self, k) for k in train_engine(self.backend).layout_keys})
        return d

    def rollout_dict(self) -> Dict[str, int]:
        return {"tp": self.rollout_tp, "dp": self.rollout_dp, "ep": self.rollout_ep}

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


def placement(cfg: Any) -> Dict[str, Any]:
    """`cfg.placement` as {mode, rollout_devices}; a tree composed without the group (an older saved config) is
    colocated."""
    try:
        p = cfg["placement"]
    except (KeyError, AttributeError):
        p = None
    if p is None:
        return {"mode": "colocated", "rollout_devices": None}
    return {"mode": str(p["mode"]), "rollout_devices": p["rollout_devices"]}


def is_split(cfg: Any) -> bool:
    return placement(cfg)["mode"] == SPLIT


def pool_sizes(cfg: Any) -> Tuple[int, int]:
    """(training devices, rollout devices) of `cfg`. Colocated: (all, all). Split: the devices less
    placement.rollout_devices, and rollout_devices; a value the rules refuse (null, < 1, >= the device count) is
    clamped into [0, devices] so that everything derived stays computable."""
    hw = cfg["hw"]
    devices = int(hw["nodes"]) * int(hw["devices_per_node"])
    if not is_split(cfg):
        return devices, devices
    rollout = placement(cfg)["rollout_devices"]
    rollout = min(max(int(rollout) if isinstance(rollout, int) and not isinstance(rollout, bool) else 0, 0), devices)
    return devices - rollout, rollout


def pools_per_node(cfg: Any) -> List[Dict[str, int]]:
    """{training, rollout} devices of each node, in node order. Split: the rollout pool is the last
    rollout_devices devices in rank order (node-major), so it fills the last nodes first. Colocated: every device
    is in both."""
    per_node, nodes = int(cfg["hw"]["devices_per_node"]), int(cfg["hw"]["nodes"])
    train, _ = pool_sizes(cfg)
    if not is_split(cfg):
        return [{"training": per_node, "rollout": per_node} for _ in range(nodes)]
    out = []
    for n in range(nodes):
        t = min(max(train - n * per_node, 0), per_node)
        out.append({"training": t, "rollout": per_node - t})
    return out


def derive_layout(cfg: Any) -> Layout:
    """Layout of `cfg` (a resolved DictConfig or plain dict tree). Non-dividing degrees floor to 0 or more; the
    validation rules report them, this function never raises on a bad layout. With placement=split the training
    degrees divide the training pool and the rollout degrees the rollout pool (`pool_sizes`)."""
    par = cfg["parallelism"]
    world, rollout_world = pool_sizes(cfg)
    backend = str(cfg["backend"]["name"])
    spec = TRAIN_ENGINES.get(backend)  # an unknown name (the engine_known rule says so) reads every degree
    if spec is not None and not spec.model_parallel:
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
    rdp = int(rdp) if rdp is not None else rollout_world // max(rtp, 1)
    return Layout(world=world, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, dp=dp, vpp=vpp, fsdp_size=fsdp_size, sp=sp,
                  rollout_tp=rtp, rollout_dp=rdp, rollout_ep=rep, backend=backend, rollout_world=rollout_world,
                  split=is_split(cfg))


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
