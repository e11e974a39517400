#!/usr/bin/env bash
# Rebuild the shipped sample data set, data/sample/, with the project's own writer.
#
# Text: reStructuredText sources of the Python 3.11 documentation from Debian's python3.11-doc
# package (PSF License Agreement, see data/sample/README.md). Training shards: the tutorial and five
# HOWTOs; validation shard: two FAQ pages. GPT-2 BPE, records of 2049 ids (--seq-length 2048,
# --stride 2048), so they serve every sequence length from 128 to 2048 (the paper presets).
#
# Usage: data/make_sample_data.sh [SOURCES_DIR | python3.11-doc_*.deb]
#   Without an argument the package is fetched with `apt-get download python3.11-doc`.
set -euo pipefail

usage() { echo "usage: $0 [SOURCES_DIR | python3.11-doc_*.deb]" >&2; exit 2; }
[ $# -le 1 ] || usage
case "${1:-}" in -h|--help) echo "usage: $0 [SOURCES_DIR | python3.11-doc_*.deb]"; exit 0 ;; esac

repo=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
chmod a+rwx "$work"  # apt-get download writes as the _apt user where it can
trap 'rm -rf "$work"' EXIT

src=${1:-}
if [ -z "$src" ] || [ -f "$src" ]; then
  deb=$src
  if [ -z "$deb" ]; then
    (cd "$work" && apt-get download python3.11-doc) || {
      echo "error: apt-get download python3.11-doc failed (run apt-get update first?)" >&2; exit 2; }
    deb=$(ls "$work"/python3.11-doc_*.deb)
  fi
  dpkg-deb -x "$deb" "$work/root"
  src="$work/root/usr/share/doc/python3.11/html/_sources"
fi
[ -d "$src/tutorial" ] || { echo "error: $src has no tutorial/: not the documentation sources" >&2; exit 2; }

out="$repo/data/sample"
write=(python3 "$repo/data/write_into_tfrecord.py" --input-format files --seq-length 2048
       --stride 2048 --workers 2 --overwrite)
"${write[@]}" --output-file-path "$out" --num-shards 4 --input-file-path \
  "$src"/tutorial/*.rst.txt "$src"/howto/{functional,logging,regex,sorting,unicode}.rst.txt
"${write[@]}" --output-file-path "$out/validation" --num-shards 1 --input-file-path \
  "$src"/faq/{design,general}.rst.txt
