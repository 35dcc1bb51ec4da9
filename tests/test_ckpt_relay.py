"""bench/ckpt_relay.sh: a run directory split into pieces, regrouped, joined and checked comes back byte for byte,
a damaged or missing piece is refused, and a relayed training run resumes bit for bit (small piece sizes stand in
for the device's 16.7 MB / 55 MB)."""
from __future__ import annotations

import os
import random
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
    """A run directory sent piece by piece (4 pieces a call, each call's files in a folder of their own, as the
    device tool returns them), collected and bundled here, then each bundle carried alone into the receiving
    machine's checkout and stashed there (a carried path lasts one call on the device)."""
    rng = random.Random(7)
    run = tmp_path / "a" / "fullbest"
    (run / "checkpoint").mkdir(parents=True)
    files = {"checkpoint/model.safetensors": rng.randbytes(40_011), "checkpoint/state.pt": rng.randbytes(17_003),
             "metrics.jsonl": b'{"step": 1}\n'}
    for name, data in files.items():
        (run / name).write_bytes(data)
    env = dict(os.environ, PIECE="4000", BUNDLE="15000", RELAY_TMP=str(tmp_path / "stage"),
               RELAY_IN=str(tmp_path / "stash"))
    sender = tmp_path / "sender"
    sender.mkdir()
    calls = []
    env["OUT"] = str(tmp_path / "call0")
    Path(env["OUT"]).mkdir()
    _relay(["pack", str(run)], sender, env)
    calls.append(env["OUT"])
    n_pieces = len(list((tmp_path / "stage" / "parts").iterdir()))
    assert n_pieces > 4  # several calls' worth
    for k in range((n_pieces + 3) // 4):
        env["OUT"] = str(tmp_path / f"call{k + 1}")
        Path(env["OUT"]).mkdir()
        _relay(["send", str(k)], sender, env)
        sent = sorted(Path(env["OUT"]).glob("p*"))
        assert 1 <= len(sent) <= 4 and all(f.stat().st_size <= 4000 for f in sent)
        calls.append(env["OUT"])
    here = tmp_path / "here"
    here.mkdir()
    assert f"{n_pieces} pieces" in _relay(["collect", *calls], here, env).stdout
    _relay(["bundle"], here, env)
    relay = here / ".relay"
    bundles = sorted(relay.glob("c*"))
    assert len(bundles) > 1 and all(b.stat().st_size <= 15000 for b in relay.glob("c*/b*"))
    receiver = tmp_path / "receiver"
    for c in bundles:  # one call per bundle: only the carried folder is in the receiver's .relay
        shutil.rmtree(receiver / ".relay", ignore_errors=True)
        shutil.copytree(c, receiver / ".relay" / c.name)
        _relay(["stash", c.name], receiver, env)
    shutil.rmtree(receiver / ".relay")
    return files, receiver, env


def test_round_trip(tmp_path):
    files, here, env = _ship(tmp_path)
    dest = tmp_path / "b"
    _relay(["unpack", str(dest)], here, env)
    for name, data in files.items():
        assert (dest / "fullbest" / name).read_bytes() == data


@pytest.mark.parametrize("damage", ["flip", "missing"])
def test_damage_is_refused(tmp_path, damage):
    _files, here, env = _ship(tmp_path)
    relay = Path(env["RELAY_IN"])
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


def test_stash_without_the_carried_folder_fails(tmp_path):
    env = dict(os.environ, RELAY_IN=str(tmp_path / "stash"))
    r = _relay(["stash", "c03"], tmp_path, env, check=False)
    assert r.returncode != 0 and "carry it" in r.stderr


def test_a_relayed_checkpoint_resumes_bit_exactly(tmp_path):
    """The plan's whole path on a tiny CPU run with the study arm's optimizer and LoRA-SVD: train to step 4, relay the
    run directory (its original deleted, as on a machine given back), unpack it where it was, resume to step 8: the
    same per-step losses, bit for bit, as 8 steps straight."""
    import torch

    from fp4compile.train import loop as L

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        def cfg(name, **kw):
            return L.TrainConfig(out_dir=str(tmp_path / name), model="tiny", backend="none", steps=8, batch_size=4,
                                 seq_len=32, log_interval=2, eval_batches=2, progress=False, warmup_steps=2, lr=3e-3,
                                 optimizer="qroot", lora=True, lora_rank=16, lora_train_factors=False,
                                 lora_realign_every=2, lora_realign_after=2, **kw)

        L.train(cfg("straight"))
        assert L.train(cfg("a/run", stop_after=4)).step == 4
        env = dict(os.environ, PIECE="100000", BUNDLE="300000", RELAY_TMP=str(tmp_path / "stage"),
                   RELAY_IN=str(tmp_path / "stash"), OUT=str(tmp_path / "out"))
        Path(env["OUT"]).mkdir()
        _relay(["pack", str(tmp_path / "a" / "run")], tmp_path, env)
        n_pieces = len(list((tmp_path / "stage" / "parts").iterdir()))
        for k in range((n_pieces + 3) // 4):
            _relay(["send", str(k)], tmp_path, env)
        here = tmp_path / "here"
        here.mkdir()
        _relay(["collect", env["OUT"]], here, env)
        _relay(["bundle"], here, env)
        for c in sorted((here / ".relay").glob("c*")):
            _relay(["stash", c.name], here, env)
        shutil.rmtree(tmp_path / "a" / "run")
        _relay(["unpack", str(tmp_path / "a")], here, env)
        assert L.train(cfg("a/run", resume=True)).step == 8
        events = [(r["step"], r["event"]) for r in L.read_metrics(tmp_path / "a" / "run") if r.get("event")]
        assert (4, "stopped") in events and events[-1] == (8, "done")       # it resumed, not started over

        def losses(d):
            return [(r["step"], r["loss"]) for r in L.read_metrics(d) if "loss" in r and "event" not in r]

        a, b = losses(tmp_path / "straight"), losses(tmp_path / "a" / "run")
        assert [s for s, _ in a] == list(range(1, 9)) and a == b
    finally:
        torch.set_num_threads(n)
