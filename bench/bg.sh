#!/usr/bin/env bash
# Run one long command on a device machine across several calls: started detached (its own session, stdin and
# output away from the call's), it outlives the call that started it while the machine stays warm (session 66: a
# detached writer kept writing between two calls; the next call must come within the idle release, 30 s), so a
# 124M arm trains in one process over several calls instead of paying its start-up (imports, compile, CUDA graphs,
# checkpoint load: ~70 s) in every call, and its time budget is no longer bound by the 10-minute call.
#
#   bash bench/bg.sh start NAME -- CMD [ARGS...]   # starts CMD detached; refuses if NAME is still running
#   bash bench/bg.sh wait NAME SECONDS [WATCH]     # waits until CMD ends or SECONDS pass; prints the log's tail
#                                                  # and WATCH's last line (e.g. a run's metrics.jsonl)
#   bash bench/bg.sh status NAME                   # running / done rc=N / vanished (killed) / unknown
# wait exits 0 once CMD ended with 0, CMD's own exit status if it failed, 3 while it still runs, 4 for an unknown
# NAME or a CMD killed before it could end, so that "bash bench/bg.sh wait study 540 && bash bench/ckpt_relay.sh
# pack ..." packs a run only once it has ended well (done, or stopped and checkpointed by its time budget).
# State lives in $BG_DIR/NAME (default /tmp/bg): pid, log (CMD's stdout and stderr), rc once it ended.
set -euo pipefail
ROOT=${BG_DIR:-/tmp/bg}
usage() { echo "usage: bash bench/bg.sh start NAME -- CMD [ARGS...] | wait NAME SECONDS [WATCH] | status NAME" >&2
  exit 2; }
state() {  # prints running / done / vanished / unknown for $1's folder
  local d=$1 pid; pid=$(cat "$d/pid" 2>/dev/null || true)
  if [ -f "$d/rc" ]; then echo done
  elif [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && ! grep -qs '^State:.*zombie' "/proc/$pid/status"; then
    echo running   # (an unreaped zombie counts as gone)
  elif [ -n "$pid" ]; then echo "vanished"   # no rc and no process: killed from outside (rc never written)
  else echo unknown; fi; }
[ $# -ge 2 ] || usage
cmd=$1 name=$2 d="$ROOT/$2"; shift 2
case "$cmd" in
start)
  [ "${1:-}" = "--" ] && shift; [ $# -ge 1 ] || usage
  if [ "$(state "$d")" = running ]; then echo "bg: $name is still running (pid $(cat "$d/pid"))" >&2; exit 1; fi
  rm -rf "$d"; mkdir -p "$d"
  # setsid: a session of its own, so whatever ends the caller's process group or session leaves it running
  # (setsid forks when its caller leads a process group, so the detached shell writes its own pid)
  setsid nohup bash -c 'echo $$ > "$0/pid"; "$@"; echo $? > "$0/rc.tmp" && mv "$0/rc.tmp" "$0/rc"' "$d" "$@" \
      > "$d/log" 2>&1 < /dev/null &
  for _ in $(seq 50); do [ -s "$d/pid" ] && break; sleep 0.1; done
  [ -s "$d/pid" ] || { echo "bg: $name did not start" >&2; exit 1; }
  echo "bg: started $name (pid $(cat "$d/pid")): $*" ;;
wait)
  limit=${1:?seconds}; watch=${2:-}; t0=$SECONDS
  while [ "$(state "$d")" = running ] && [ $((SECONDS - t0)) -lt "$limit" ]; do sleep 2; done
  s=$(state "$d")
  echo "bg: $name $s after $((SECONDS - t0)) s of waiting$([ "$s" = done ] && echo ", rc=$(cat "$d/rc")")"
  [ -f "$d/log" ] && tail -n 5 "$d/log"
  if [ -n "$watch" ] && [ -f "$watch" ]; then echo "bg: $watch: $(tail -n 1 "$watch")"; fi
  case "$s" in
  done) exit "$(cat "$d/rc")" ;;
  running) exit 3 ;;
  *) exit 4 ;;
  esac ;;
status)
  s=$(state "$d"); echo "$s$([ "$s" = done ] && echo " rc=$(cat "$d/rc")")" ;;
*) usage ;;
esac
