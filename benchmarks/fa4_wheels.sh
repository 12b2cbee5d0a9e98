#!/usr/bin/env bash
# FlashAttention-4 (flash-attn-4, CuTe DSL) for the device host, which lacks it and cannot reach
# a registry: fetch its wheels here and split them across two device calls, since the CUTLASS
# DSL's compiler library alone is a 92 MB wheel and one call carries at most 64 MiB.
#
#   bash benchmarks/fa4_wheels.sh            # here: fills .whl_fa4a/ (~46 MB) and .whl_fa4b/ (~55 MB)
#   device call 1: carry [".whl_fa4a"], command starting with  bash benchmarks/fa4_wheels.sh --stage &&
#     (a carried path does not outlive its call, so the part is kept in /tmp on the warm machine)
#   device call 2, within the machine's idle window: carry [".whl_fa4b"], command starting with
#     bash benchmarks/fa4_wheels.sh --install && export PYTHONPATH=$(cat /tmp/fa4site.path):. && ...
#   (--target installs skip .pth files: the CUTLASS DSL's own `cutlass` package sits one level
#   down, in nvidia_cutlass_dsl/dsl_packages, so that folder goes on the path too)
#
# Versions: flash-attn-4 4.0.0b36 (its SM 9.0 forward and backward) and what it requires, for
# the device's Python 3.12 and CUDA 13.
set -euo pipefail
cd "$(dirname "$0")/.."
A=.whl_fa4a
B=.whl_fa4b
LIBS=nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl

STAGED=/tmp/fa4_staged
if [ "${1:-}" = "--stage" ]; then
  mkdir -p "$STAGED" && cp "$A"/* "$STAGED"/
  exit 0
fi
if [ "${1:-}" = "--install" ]; then
  [ -f "$STAGED/$LIBS.part-aa" ] || { echo "fa4_wheels: $STAGED/$LIBS.part-aa is not here: run device call 1 (carry $A, bash benchmarks/fa4_wheels.sh --stage) first, on this same warm machine" >&2; exit 2; }
  mkdir -p /tmp/fa4whl
  cat "$STAGED/$LIBS".part-* "$B/$LIBS".part-* > "/tmp/fa4whl/$LIBS"
  cp "$B"/*.whl /tmp/fa4whl/
  # Unzipped, not `pip install --target`: the CUTLASS DSL's three wheels share the top-level
  # folder nvidia_cutlass_dsl/, and --target --upgrade lets the last one replace the others'.
  # (None of these wheels has a .data/ part, so a wheel's zip root is its site-packages part.)
  rm -rf /tmp/fa4site && mkdir -p /tmp/fa4site
  for w in /tmp/fa4whl/*.whl; do python3 -m zipfile -e "$w" /tmp/fa4site; done  # the host has no unzip
  echo "/tmp/fa4site:/tmp/fa4site/nvidia_cutlass_dsl/dsl_packages" > /tmp/fa4site.path
  exit 0
fi

for d in "$A" "$B"; do
  grep -qx "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >> .git/info/exclude
  mkdir -p "$d"
done
fetch() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$1" "${@:2}"
}
fetch "$B" flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1 \
  apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5 quack-kernels==0.6.5
tmp=$(mktemp -d)
fetch "$tmp" nvidia-cutlass-dsl-libs-cu13==4.8.1
split -b 46M "$tmp/$LIBS" "$tmp/$LIBS.part-"
mv "$tmp/$LIBS.part-aa" "$A/"
mv "$tmp/$LIBS".part-a[b-z] "$B/"
rm -rf "$tmp"
du -sh "$A" "$B"
