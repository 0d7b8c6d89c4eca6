"""The parallel layout derived from a resolved config: world size and every degree, computed once here."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Dict, Optional


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
