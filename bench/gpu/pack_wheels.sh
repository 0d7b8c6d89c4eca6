#!/usr/bin/env bash
# Build every wheel directory the GPU stages of run_all.sh carry (the GPU machine has no network; a call carries at
# most 64 MiB). Run on a CPU machine with PyPI, from the repository root:
#
#   bash bench/gpu/pack_wheels.sh [base|gdn|x|all]      (default: all)
#
#   .whl/      base: Hydra + omegaconf (+ antlr4, built here: sdist only), Ray 2.60 slimmed and xz-packed (~30 MB:
#              its wheel is 79 MB), jsonschema & co. for Ray, flash-linear-attention 0.6.0, megatron-core 0.19.2
#   .whl-gdn/  gdn: flash-linear-attention 0.6.0 + TileLang 0.1.15 (and z3, TVM FFI), the fast GDN stack (~56 MB;
#              fla's GDN backward on Hopper needs TileLang with the machine's Triton 3.6)
#   .whl-x/    x: what the comparison and config jobs need next to .whl-gdn: Hydra + omegaconf + antlr4, TRL 1.16.0
#              with datasets 5.2.0, dill, multiprocess, xxhash, and megatron-core 0.19.2 (stages that use .whl-x
#              with .whl take it from here). No Liger-Kernel: TRL 1.16 dropped use_liger_loss for its own Triton
#              log-prob head, and Liger 0.8.5 has no Qwen3.5 patches
#
# Wheels are for the GPU machine's Python 3.12 on x86-64 manylinux. A directory that is complete is left as it is
# (delete it to rebuild). Sizes are printed at the end: .whl-gdn + .whl-x + the tree must stay under 64 MiB.
set -euo pipefail
what=${1:-all}
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any)
dl() {  # dl DIR REQUIREMENT...: binary wheels for cp312, no dependencies (each set is listed in full here)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${plat[@]}" -d "$1" "${@:2}" 2>&1 | grep -v "is ignored" || true
}
antlr() {  # the antlr4 runtime omegaconf 2.3 needs is an sdist: a pure-Python wheel built here
  ls "$1"/antlr4_python3_runtime-4.9.3-*.whl >/dev/null 2>&1 \
    || python3 -m pip wheel -q --no-deps -w "$1" antlr4-python3-runtime==4.9.3 2>&1 | grep -v "is ignored" || true
}
xz_pack() {  # xz_pack DIR NAME REQUIREMENT: a big wheel unpacked and xz-compressed (install-wheels.sh untars it)
  [ -f "$1/$2.tar.xz" ] && return 0
  local tmp
  tmp=$(mktemp -d)
  dl "$tmp" "$3"
  (cd "$tmp" && mkdir x && cd x && unzip -q ../*.whl && eval "${4:-true}" && tar cJf "../$2.tar.xz" .)
  mv "$tmp/$2.tar.xz" "$1/" && rm -rf "$tmp"
}
HYDRA=(hydra-core==1.3.8 omegaconf==2.3.1)
base() {
  mkdir -p .whl
  dl .whl "${HYDRA[@]}" jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 \
    rpds-py==2026.9.1 flash-linear-attention==0.6.0 fla-core==0.6.0 megatron-core==0.19.2
  antlr .whl
  # Ray without its Java jars, RLlib and the dashboard's source maps
  xz_pack .whl ray-slim ray==2.60.0 'rm -rf ray/jars ray/rllib && find ray/dashboard -name "*.map" -delete'
}
gdn() {
  mkdir -p .whl-gdn
  dl .whl-gdn flash-linear-attention==0.6.0 fla-core==0.6.0 apache-tvm-ffi==0.1.12 torch-c-dlpack-ext==0.1.5
  xz_pack .whl-gdn tilelang tilelang==0.1.15
  xz_pack .whl-gdn z3-solver z3-solver==4.15.4.0
}
x() {
  mkdir -p .whl-x
  dl .whl-x "${HYDRA[@]}" trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 xxhash==3.6.0 \
    megatron-core==0.19.2
  antlr .whl-x
}
case "$what" in
base) base ;; gdn) gdn ;; x) x ;; all) base; gdn; x ;;
*) echo "usage: pack_wheels.sh [base|gdn|x|all]" >&2; exit 2 ;;
esac
for d in .whl .whl-gdn .whl-x; do [ -d "$d" ] && echo "$(du -sh "$d" | cut -f1)	$d: $(ls "$d" | tr '\n' ' ')"; done
