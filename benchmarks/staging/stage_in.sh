#!/usr/bin/env bash
# Carry files to a host reached only through small transfers: cut each in parts of at most SIZE bytes with its
# sha256 beside them, carry the parts in as many transfers as needed, and join them there, checked.
#   bash benchmarks/staging/stage_in.sh cut FILE PARTS_DIR [SIZE]     here: PARTS_DIR/NAME.part-aa, -ab, ..., NAME.sha256
#   bash benchmarks/staging/stage_in.sh join PARTS_DIR... DEST_DIR    there: DEST_DIR/NAME from the parts, sha256 checked
#   bash benchmarks/staging/stage_in.sh pack DIR ARCHIVE              a folder (e.g. setup.sh's wheels) as one .tar
# join takes the parts from several folders (one a transfer) and may run again as more arrive: a file whose parts
# are not all there yet fails its check and is left out, and says so. Nothing else in benchmarks/ depends on this.
set -euo pipefail
SIZE_DEFAULT=31000000
case "${1:-}" in
  cut)
    file=$2 parts=$3 size=${4:-$SIZE_DEFAULT}; name=$(basename "$file")
    mkdir -p "$parts" && rm -f "$parts/$name".part-*
    split -b "$size" "$file" "$parts/$name.part-"
    sha256sum "$file" | cut -d' ' -f1 > "$parts/$name.sha256"
    ls -l "$parts/$name".* ;;
  join)
    shift; dest=${*: -1}; dirs=("${@:1:$#-1}"); mkdir -p "$dest"; rc=0
    for sum in $(ls "${dirs[@]/%//}"*.sha256 2>/dev/null); do
      name=$(basename "$sum" .sha256)
      cat $(ls "${dirs[@]/%//}$name".part-* | sort -t- -k2) > "$dest/$name.joining"
      if [ "$(sha256sum "$dest/$name.joining" | cut -d' ' -f1)" = "$(cat "$sum")" ]; then
        mv "$dest/$name.joining" "$dest/$name"; echo "joined $dest/$name"
      else
        rm "$dest/$name.joining"; echo "$name: parts missing or damaged (sha256 differs)" >&2; rc=5
      fi
    done
    exit $rc ;;
  pack)
    tar -C "$(dirname "$2")" -cf "$3" "$(basename "$2")" && ls -l "$3" ;;
  *)
    sed -n '2,9p' "$0" >&2; exit 2 ;;
esac
