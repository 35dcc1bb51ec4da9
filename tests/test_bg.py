"""bench/bg.sh: a detached command outlives its caller's process group, wait reports running / done with the
command's exit status, a second start of a running name is refused, and a command killed from outside is reported
(not waited on forever, not taken for a success)."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
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
