"""bench/ckpt_relay.sh: a run directory split into pieces, regrouped, joined and checked comes back byte for byte,
and a damaged or missing piece is refused (small piece sizes stand in for the device's 16 MiB / 58 MB)."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "ckpt_relay.sh"
pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("sha256sum") is None,
                                reason="needs bash and coreutils")


def _relay(args, cwd, env, check=True):
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          check=check)


def _ship(tmp_path: Path):
    """A run directory sent piece by piece (4 pieces a call) and bundled on the receiving side."""
    rng = __import__("random").Random(7)
    run = tmp_path / "a" / "fullbest"
    (run / "checkpoint").mkdir(parents=True)
    files = {"checkpoint/model.safetensors": rng.randbytes(40_011), "checkpoint/state.pt": rng.randbytes(17_003),
             "metrics.jsonl": b'{"step": 1}\n'}
    for name, data in files.items():
        (run / name).write_bytes(data)
    here = tmp_path / "here"
    here.mkdir()
    env = dict(os.environ, PIECE="4000", BUNDLE="15000", RELAY_TMP=str(tmp_path / "stage"))
    out = tmp_path / "out"
    out.mkdir()
    env["OUT"] = str(out)
    _relay(["pack", str(run)], here, env)
    relay = here / ".relay"
    relay.mkdir()
    shutil.copy(out / "run.tar.sha256", relay)
    n_pieces = len(list((tmp_path / "stage" / "parts").iterdir()))
    assert n_pieces > 4  # several calls' worth
    for k in range((n_pieces + 3) // 4):
        for f in out.glob("p*"):
            f.unlink()
        _relay(["send", str(k)], here, env)
        sent = sorted(out.glob("p*"))
        assert 1 <= len(sent) <= 4 and all(f.stat().st_size <= 4000 for f in sent)
        for f in sent:
            shutil.copy(f, relay)
    _relay(["bundle"], here, env)
    for f in relay.glob("p*"):
        f.unlink()
    bundles = sorted(relay.glob("c*/b*"))
    assert len(bundles) > 1 and all(b.stat().st_size <= 15000 for b in bundles)
    return files, here, env


def test_round_trip(tmp_path):
    files, here, env = _ship(tmp_path)
    dest = tmp_path / "b"
    _relay(["unpack", str(dest)], here, env)
    for name, data in files.items():
        assert (dest / "fullbest" / name).read_bytes() == data


@pytest.mark.parametrize("damage", ["flip", "missing"])
def test_damage_is_refused(tmp_path, damage):
    _files, here, env = _ship(tmp_path)
    relay = here / ".relay"
    if damage == "flip":
        b = relay / "c01" / "b01"
        data = bytearray(b.read_bytes())
        data[100] ^= 1
        b.write_bytes(bytes(data))
    else:
        shutil.rmtree(relay / "c01")
    dest = tmp_path / "b"
    r = _relay(["unpack", str(dest)], here, env, check=False)
    assert r.returncode != 0
    assert not (dest / "fullbest").exists()
