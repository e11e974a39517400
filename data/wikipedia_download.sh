#!/usr/bin/env bash
# Download the latest English Wikipedia dump and decompress it.
#
# Usage: data/wikipedia_download.sh [--url URL] [--keep-compressed] [--dry-run] OUTPUT_DIR
#   Writes OUTPUT_DIR/wikidump.xml (about 90 GB; the download is about 20 GB). An interrupted
#   download resumes where it stopped. --keep-compressed leaves OUTPUT_DIR/wikidump.xml.bz2 as it is
#   (wikipedia_extract.sh reads .bz2 too). --url takes another dump or a mirror (also file://).
#   --dry-run prints the commands instead of running them.
set -euo pipefail

URL=https://dumps.wikimedia.org/enwiki/latest/enwiki-latest-pages-articles-multistream.xml.bz2
usage() { sed -n '4,8p' "$0" | sed 's/^# \{0,1\}//'; }
die() { echo "error: $*" >&2; exit 2; }

url=$URL keep=0 dry=0 out=
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --url) [ $# -ge 2 ] || die "--url needs a value"; url=$2; shift 2 ;;
    --url=*) url=${1#--url=}; shift ;;
    --keep-compressed) keep=1; shift ;;
    --dry-run) dry=1; shift ;;
    -*) die "unknown option $1 (see --help)" ;;
    *) [ -z "$out" ] || die "one OUTPUT_DIR expected, got '$out' and '$1'"; out=$1; shift ;;
  esac
done
[ -n "$out" ] || { usage >&2; die "OUTPUT_DIR is missing"; }
[ -n "$url" ] || die "--url is empty"

run() { if [ "$dry" = 1 ]; then printf '%q ' "$@"; echo; else "$@"; fi; }

archive="$out/wikidump.xml.bz2"
run mkdir -p "$out"
if command -v curl >/dev/null; then
  # -C -: resume a partial download; --fail: an HTTP error must not leave an HTML page as the dump.
  run curl --fail --location --retry 5 -C - --output "$archive" "$url"
elif command -v wget >/dev/null; then
  run wget --continue --tries 5 --output-document "$archive" "$url"
else
  die "neither curl nor wget is installed (apt-get install curl)"
fi
if [ "$keep" = 0 ]; then
  # lbzip2 decompresses a multistream dump on every core; bunzip2 uses one.
  if command -v lbzip2 >/dev/null; then
    run lbzip2 --decompress --force "$archive"
  else
    run bunzip2 --force "$archive"
  fi
  result="$out/wikidump.xml"
else
  result=$archive
fi
[ "$dry" = 1 ] || echo "wrote $result" >&2
