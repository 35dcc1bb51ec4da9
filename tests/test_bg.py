"""bench/bg.sh: a detached command outlives its caller's process group, wait reports running / done with the
command's exit status, a second start of a running name is refused, and a command killed from outside is reported
(not waited on forever, not taken for a success)."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "bg.sh"
pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("setsid") is None,
                                reason="needs bash and setsid")


def _bg(args, tmp_path, check=False, **kw):
    env = dict(os.environ, BG_DIR=str(tmp_path / "bg"))
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, check=check,
                          **kw)


def _pid(tmp_path, name):
    return int((tmp_path / "bg" / name / "pid").read_text())


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_wait_reports_running_then_done_with_the_log(tmp_path):
    flag = tmp_path / "go"
    _bg(["start", "t", "--", "bash", "-c", f"echo first; while [ ! -f {flag} ]; do sleep 0.1; done; echo last"],
        tmp_path, check=True)
    r = _bg(["wait", "t", "1"], tmp_path)
    assert r.returncode == 3 and "t running" in r.stdout and "first" in r.stdout and "last" not in r.stdout
    assert _bg(["status", "t"], tmp_path).stdout.strip() == "running"
    flag.touch()
    r = _bg(["wait", "t", "30"], tmp_path)
    assert r.returncode == 0 and "rc=0" in r.stdout and "last" in r.stdout
    assert _bg(["status", "t"], tmp_path).stdout.strip() == "done rc=0"


def test_the_exit_status_comes_back_and_watch_is_shown(tmp_path):
    watch = tmp_path / "metrics.jsonl"
    watch.write_text('{"step": 1}\n{"step": 2}\n')
    _bg(["start", "f", "--", "bash", "-c", "exit 7"], tmp_path, check=True)
    r = _bg(["wait", "f", "30", str(watch)], tmp_path)
    assert r.returncode == 7 and "rc=7" in r.stdout and '{"step": 2}' in r.stdout


def test_unknown_name(tmp_path):
    r = _bg(["wait", "nothing", "1"], tmp_path)
    assert r.returncode == 4 and "unknown" in r.stdout


def test_it_outlives_the_callers_process_group_and_refuses_a_second_start(tmp_path):
    # the caller in a session of its own, as a device call's command is; killing the caller's whole group after it
    # returned (what the end of a call may do) must leave the detached command running
    caller = subprocess.Popen(["bash", str(SCRIPT), "start", "s", "--", "sleep", "60"], start_new_session=True,
                              env=dict(os.environ, BG_DIR=str(tmp_path / "bg")), stdout=subprocess.PIPE, text=True)
    assert "started s" in caller.communicate(timeout=30)[0]
    pid = _pid(tmp_path, "s")
    try:
        try:
            os.killpg(caller.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # the group ended with the caller
        time.sleep(0.3)
        assert _alive(pid) and os.getsid(pid) == pid and os.getsid(pid) != caller.pid
        r = _bg(["start", "s", "--", "true"], tmp_path)
        assert r.returncode == 1 and "still running" in r.stderr
        assert _pid(tmp_path, "s") == pid
    finally:
        os.killpg(pid, signal.SIGKILL)


def test_a_command_killed_from_outside_is_reported(tmp_path):
    _bg(["start", "k", "--", "sleep", "60"], tmp_path, check=True)
    pid = _pid(tmp_path, "k")
    os.killpg(pid, signal.SIGKILL)  # the detached shell and its command: no rc is ever written
    deadline = time.time() + 10
    while _alive(pid) and time.time() < deadline:
        time.sleep(0.05)
    r = _bg(["wait", "k", "30"], tmp_path, timeout=20)
    assert r.returncode == 4 and "vanished" in r.stdout


FAKE_PYTHON = r"""#!/usr/bin/env bash
# python for run_h200.sh's study124_bg / bg_stop plumbing: pip and the data step succeed; the study asks the real
# bench/study.py for its arm's command (--print-commands), then logs a step every 0.1 s until that command's
# --stop-file appears, removes it, writes its --export folder and exits 0, as study.py does after a stopped run
case "$*" in
  "-m pip"*) exit 0 ;;
  *--data-only*) echo "[study] data ready"; exit 0 ;;
esac
stop=$("$REAL_PYTHON" "$REPO/bench/study.py" "$@" --print-commands | sed -n 's/.* --stop-file \([^ ]*\) .*/\1/p')
[ -n "$stop" ] || { echo "no --stop-file in the arm's command" >&2; exit 9; }
exp=; while [ $# -gt 0 ]; do [ "$1" = --export ] && exp=$2; shift; done
mkdir -p "$(dirname "$stop")"; i=0
while [ ! -f "$stop" ]; do i=$((i + 1)); echo "{\"step\": $i}" >> "$(dirname "$stop")/metrics.jsonl"; sleep 0.1; done
rm "$stop"; echo "[fake study] stopped at step $i"; mkdir -p "$exp"; echo "| table |" > "$exp/study_124m.md"
"""


def test_run_h200_bg_stop_stops_a_study124_bg_arm_through_study_py_s_stop_file(tmp_path):
    """``run_h200.sh study124_bg`` starts an arm detached and ``bg_stop`` stops it through the file that
    ``bench/study.py``'s arm command names (``--stop-file``): a stand-in ``python`` runs until that file appears.
    The arm then ends with rc 0, its export comes back in $OUT, and ``bg_stop`` of an arm never started says so
    instead of dropping a STOP file somewhere."""
    repo = SCRIPT.parents[1]
    work, fake, out = tmp_path / "w", tmp_path / "bin", tmp_path / "out"
    work.mkdir()
    (work / "bench").symlink_to(repo / "bench")
    fake.mkdir()
    (fake / "python").write_text(FAKE_PYTHON)
    (fake / "python").chmod(0o755)
    env = dict(os.environ, BG_DIR=str(tmp_path / "bg"), OUT=str(out), REPO=str(repo),
               REAL_PYTHON=sys.executable, PATH=f"{fake}:{os.environ['PATH']}")
    run = lambda *a: subprocess.run(["bash", str(repo / "bench" / "run_h200.sh"), *a], cwd=work, env=env,  # noqa: E731
                                    capture_output=True, text=True, timeout=120)
    r = run("study124_bg", "500e6", "bf16root", "100", "2")
    assert "bg: started study124_bf16root" in r.stdout and "bg: study124_bf16root running" in r.stdout, r.stdout
    metrics = work / ".study124_500e6" / "124m" / "bf16root" / "metrics.jsonl"
    assert metrics.is_file()
    r = run("bg_stop", "bf16root", "30")
    assert "bg: study124_bf16root done" in r.stdout and "rc=0" in r.stdout, r.stdout + r.stderr
    back = tmp_path / "back"                                    # what the call returns: $OUT packed in one tgz
    with tarfile.open(out / "run_h200.tgz") as tar:
        tar.extractall(back, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    assert "[fake study] stopped at step" in (back / "study124_bf16root_bg.log").read_text()
    assert (back / "study124_bf16root" / "study_124m.md").read_text() == "| table |\n"
    assert "done" in (back / "bg_wait_bf16root.txt").read_text()
    assert not (metrics.parent / "STOP").exists()
    r = run("bg_stop", "fullbest", "1")
    assert r.returncode == 1 and "no study124_bg run of fullbest" in r.stderr
    assert not list(work.rglob("STOP"))
