#!/usr/bin/env bash
# Carry a training run directory (its checkpoint included) from one device machine to another, in pieces small
# enough for the device tool's limits: what comes back from a call is at most 64 MiB (4 files of 16,700,000 bytes
# here), and what a call takes along is at most 64 MiB with the working tree. Issue 7's 124M arm needs ~36 min of one
# GPU and a session has 30, so the run is split over two sessions and its ~1 GB checkpoint crosses between them.
#
# On the first machine (the run stopped and checkpointed):
#   bash bench/ckpt_relay.sh pack RUN_DIR          # tar + sha256 + pieces in /tmp/relay (prints the piece count)
#   bash bench/ckpt_relay.sh send K                # copies pieces 4K .. 4K+3 to $OUT (one call each K)
# Here, after each send: copy the call's pieces into .relay/ (git-ignored), then
#   bash bench/ckpt_relay.sh bundle                # regroups .relay/p* into .relay/cNN/ folders of <= BUNDLE bytes
# On the second machine, one call per folder, each carrying one .relay/cNN (a warm machine keeps the earlier ones),
# then in the call that resumes the run:
#   bash bench/ckpt_relay.sh unpack DEST_PARENT    # joins .relay/c*/p*, checks the sha256, untars the run directory
set -euo pipefail
PIECE=${PIECE:-16700000}
BUNDLE=${BUNDLE:-58000000}
T=${RELAY_TMP:-/tmp/relay}   # the sending machine's staging folder
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
bundle)
  # .relay/p000 ... -> .relay/c00/b000 ... : the joined bytes split again into carry-sized pieces
  cd .relay; ls p[0-9][0-9][0-9] > /dev/null
  cat p[0-9][0-9][0-9] > joined.tar; sed "s/run.tar/joined.tar/" run.tar.sha256 | sha256sum -c -
  rm -rf c[0-9][0-9]; split -b "$BUNDLE" -d -a 2 joined.tar b
  for b in b[0-9][0-9]; do mkdir "c${b#b}"; mv "$b" "c${b#b}/"; cp run.tar.sha256 "c${b#b}/"; done
  rm joined.tar; ls -la c*/ ;;
unpack)
  dest=$2; mkdir -p "$dest" "$T"
  sha=$(head -n 1 .relay/c00/run.tar.sha256 | cut -c1-64)
  cat .relay/c[0-9][0-9]/b[0-9][0-9] > "$T/in.tar"
  echo "$sha  $T/in.tar" | sha256sum -c -
  tar xf "$T/in.tar" -C "$dest"; rm "$T/in.tar"; echo "unpacked into $dest" ;;
*)
  echo "usage: bash bench/ckpt_relay.sh pack RUN_DIR | send K | bundle | unpack DEST_PARENT" >&2; exit 2 ;;
esac
