#!/usr/bin/env bash
# Extract the article text of a Wikipedia XML dump with wikiextractor.
#
# Usage: data/wikipedia_extract.sh [--processes N] [--bytes SIZE] [--json] DUMP OUTPUT_DIR
#   DUMP is wikidump.xml or wikidump.xml.bz2; OUTPUT_DIR receives AA/wiki_00, ... files of
#   SIZE (default 100M) for wikipedia_preprocess.py. N defaults to the number of cores.
#   wikiextractor (AGPL-3.0) runs as a separate command and is never imported by this project:
#   install it with `pip install wikiextractor`. Set PYTHON to choose the interpreter.
set -euo pipefail

usage() { sed -n '4,8p' "$0" | sed 's/^# \{0,1\}//'; }
die() { echo "error: $*" >&2; exit 2; }

python=${PYTHON:-python3}
processes=$(nproc 2>/dev/null || echo 1) bytes=100M json=() args=()
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --processes) [ $# -ge 2 ] || die "--processes needs a value"; processes=$2; shift 2 ;;
    --bytes) [ $# -ge 2 ] || die "--bytes needs a value"; bytes=$2; shift 2 ;;
    --json) json=(--json); shift ;;
    -*) die "unknown option $1 (see --help)" ;;
    *) args+=("$1"); shift ;;
  esac
done
[ ${#args[@]} -eq 2 ] || { usage >&2; die "expected DUMP and OUTPUT_DIR, got ${#args[@]} arguments"; }
dump=${args[0]} out=${args[1]}
[[ "$processes" =~ ^[1-9][0-9]*$ ]] || die "--processes must be a positive integer, got '$processes'"
[[ "$bytes" =~ ^[1-9][0-9]*[KMG]?$ ]] || die "--bytes must look like 100M, got '$bytes'"
[ -f "$dump" ] || die "dump $dump does not exist (run data/wikipedia_download.sh first)"
# find_spec locates the package without importing it.
"$python" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("wikiextractor") is None)' \
  || die "wikiextractor is not installed for $python: pip install wikiextractor"

mkdir -p "$out"
# wikiextractor logs its progress (articles and articles/s) on stderr.
"$python" -m wikiextractor.WikiExtractor "$dump" --output "$out" --bytes "$bytes" \
  --processes "$processes" "${json[@]}"
echo "extracted $dump into $out" >&2
