#!/usr/bin/env bash
# Carry a training run directory (its checkpoint included) from one device machine to another, in pieces small
# enough for the device tool's limits: what comes back from a call is at most 64 MiB (4 files of 16,700,000 bytes
# here), and what a call takes along is at most 64 MiB with the working tree. Issue 7's 124M arm needs ~34 min of one
# GPU and a session has 30, so the run is split over two sessions and its ~1 GB checkpoint crosses between them.
# A carried path lasts one call on the device (the next call's carry replaces it), so each receiving call stashes
# its piece in $RELAY_IN (default /tmp/relay_in), which stays while the machine is warm.
#
# On the first machine (the run stopped and checkpointed):
#   bash bench/ckpt_relay.sh pack RUN_DIR          # tar + sha256 + pieces in /tmp/relay (prints the piece count)
#   OUT=$OUT bash bench/ckpt_relay.sh send K       # copies pieces 4K .. 4K+3 to $OUT (one call each K)
# Here, once every piece is back:
#   bash bench/ckpt_relay.sh collect DIR...        # copies the pieces and run.tar.sha256 of each call's files_at
#   bash bench/ckpt_relay.sh bundle                # joins .relay/p*, checks the sha256, regroups into .relay/cNN/
# On the second machine, one call per folder, each carrying one .relay/cNN:
#   bash bench/ckpt_relay.sh stash cNN             # copies the carried folder to $RELAY_IN
# then in the call that resumes the run:
#   bash bench/ckpt_relay.sh unpack DEST_PARENT    # joins the stashed pieces, checks the sha256, untars the run
set -euo pipefail
PIECE=${PIECE:-16700000}
BUNDLE=${BUNDLE:-55000000}   # a carried bundle plus the working tree (8.7 MB in session 68) must stay under 64 MiB
T=${RELAY_TMP:-/tmp/relay}   # the sending machine's staging folder
IN=${RELAY_IN:-/tmp/relay_in}   # the receiving machine's stash
case "${1:-}" in
pack)
  src=$2; rm -rf "$T"; mkdir -p "$T/parts"
  tar cf "$T/run.tar" -C "$(dirname "$src")" "$(basename "$src")"
  (cd "$T" && sha256sum run.tar > run.tar.sha256)
  split -b "$PIECE" -d -a 3 "$T/run.tar" "$T/parts/p"
  echo "packed $(stat -c %s "$T/run.tar") bytes in $(ls "$T/parts" | wc -l) pieces; sha256 $(cut -c1-64 "$T/run.tar.sha256")"
  cp "$T/run.tar.sha256" "${OUT:?}/" ;;
send)
  k=$2
  for i in 0 1 2 3; do
    f=$(printf "%s/parts/p%03d" "$T" $((4 * k + i))); if [ -f "$f" ]; then cp "$f" "${OUT:?}/"; fi
  done; ls -la "$OUT" ;;
collect)
  shift; mkdir -p .relay
  for d in "$@"; do
    for f in "$d"/p[0-9][0-9][0-9] "$d"/run.tar.sha256; do if [ -f "$f" ]; then cp "$f" .relay/; fi; done
  done; echo "$(ls .relay | grep -c '^p[0-9]') pieces in .relay" ;;
bundle)
  # .relay/p000 ... -> .relay/c00/b000 ... : the joined bytes split again into carry-sized pieces
  cd .relay; ls p[0-9][0-9][0-9] > /dev/null
  cat p[0-9][0-9][0-9] > joined.tar; sed "s/run.tar/joined.tar/" run.tar.sha256 | sha256sum -c -
  rm -rf c[0-9][0-9]; split -b "$BUNDLE" -d -a 2 joined.tar b
  for b in b[0-9][0-9]; do mkdir "c${b#b}"; mv "$b" "c${b#b}/"; done
  cp run.tar.sha256 c00/   # unpack reads the checksum from the first bundle only
  rm joined.tar; ls -la c*/ ;;
stash)
  c=$2; [ -d ".relay/$c" ] || { echo "no .relay/$c here: carry it" >&2; exit 1; }
  mkdir -p "$IN"; rm -rf "${IN:?}/$c"; cp -r ".relay/$c" "$IN/"; ls "$IN" ;;
unpack)
  dest=$2; mkdir -p "$dest" "$T"
  sha=$(head -n 1 "$IN/c00/run.tar.sha256" | cut -c1-64)
  cat "$IN"/c[0-9][0-9]/b[0-9][0-9] > "$T/in.tar"
  echo "$sha  $T/in.tar" | sha256sum -c -
  tar xf "$T/in.tar" -C "$dest"; rm "$T/in.tar"; echo "unpacked into $dest" ;;
*)
  echo "usage: bash bench/ckpt_relay.sh pack RUN_DIR | send K | collect DIR... | bundle | stash cNN | unpack DEST_PARENT" >&2; exit 2 ;;
esac
