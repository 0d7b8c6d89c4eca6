"""A stand-in `transformer_engine` package, so the Megatron engine's Transformer-Engine-present branch runs on CPU.

megatron-core imports TE's modules at import time wherever `import transformer_engine` succeeds and checks for
its classes with isinstance; it probes TE's kernels (fused permutation, grouped GEMM, ...) and falls back when
they are missing. The stand-in answers exactly so: every `transformer_engine.*` package imports, any capitalised
name is an empty class (isinstance is False), the packages below are submodules, the functions megatron imports
without a fallback are stubs that refuse to run, and every other name (the kernels megatron probes for, such as
the fused permutation and grouped GEMM) is absent. TE's FusedAdam, which megatron-core's optimizer uses wherever TE
imports, is a torch optimizer with its interface and step bookkeeping. It builds nothing TE would: a run on it shows what the engine does with TE present and its
kernels unavailable to the specs the engine builds.

`install()` in the process that will import megatron (a spawned worker), before it does.
"""
import importlib
import importlib.abc
import importlib.machinery
import sys
import types

VERSION = "2.8.0"
PACKAGES = {"pytorch", "common", "ops", "tensor", "fp8", "distributed", "optimizers", "module", "attention",
            "cpp_extensions", "float8_tensor", "mxfp8_tensor", "utils", "quantization", "recipe", "jax",
            "dot_product_attention", "export", "permutation", "router", "float8_blockwise_tensor",
            "transformer_engine_torch"}

IMPORTED = {"activation_recompute_forward", "fp8_autocast", "fused_compute_score_for_moe_aux_loss",
            "fused_moe_aux_loss", "fused_topk_with_score_function"}
"""Functions megatron-core 0.16.1 imports without a fallback once TE imports (the router fusions are used only
when asked for): stubs that refuse to run."""


def _stub(name):
    def refuse(*args, **kwargs):
        raise NotImplementedError(f"transformer_engine.{name} is not available in the stand-in")
    refuse.__name__ = name
    return refuse


class _Module(types.ModuleType):
    def __getattr__(self, name):
        if name in CLASSES.get(self.__name__, {}):
            return CLASSES[self.__name__][name]
        if name[:1].isupper():
            cls = type(name, (), {})
            setattr(self, name, cls)
            return cls
        if name in PACKAGES:
            return importlib.import_module(f"{self.__name__}.{name}")
        if name in IMPORTED:
            return _stub(name)
        raise AttributeError(f"module {self.__name__!r} has no attribute {name!r} (Transformer Engine stand-in)")


def _fused_adam():
    import torch

    class FusedAdam(torch.optim.Optimizer):
        """TE's FusedAdam as megatron and the engine meet it: its constructor, AdamW math (adam_w_mode) and the
        step count in the param group, not in the parameters' state."""

        def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, *, adam_w_mode=True,
                     bias_correction=True, **_):
            super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                          bias_correction=bias_correction))
            self.adam_w_mode = adam_w_mode

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                group["step"] = group.get("step", 0) + 1
                t, (b1, b2), lr, wd = group["step"], group["betas"], group["lr"], group["weight_decay"]
                c1, c2 = (1 - b1 ** t, 1 - b2 ** t) if group["bias_correction"] else (1.0, 1.0)
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    state = self.state[p]
                    if not state:
                        state.update(exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                    g = p.grad if self.adam_w_mode or not wd else p.grad + wd * p
                    state["exp_avg"].mul_(b1).add_(g, alpha=1 - b1)
                    state["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
                    if self.adam_w_mode and wd:
                        p.mul_(1 - lr * wd)
                    p.addcdiv_(state["exp_avg"] / c1, (state["exp_avg_sq"] / c2).sqrt_().add_(group["eps"]), value=-lr)

    return FusedAdam


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        top, _, rest = name.partition(".")
        if top == "transformer_engine" and all(part in PACKAGES for part in rest.split(".") if rest):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Module(spec.name)
        module.__path__ = []
        if spec.name == "transformer_engine":
            module.__version__ = VERSION
        return module

    def exec_module(self, module):
        pass


CLASSES = {}
"""Names a stand-in module provides for real: {module: {name: object}} (filled by install)."""


def install() -> None:
    if "megatron.core" in sys.modules:
        raise RuntimeError("install the Transformer Engine stand-in before megatron-core is imported")
    CLASSES["transformer_engine.pytorch.optimizers"] = {"FusedAdam": _fused_adam()}
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
