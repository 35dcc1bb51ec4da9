"""bench/gemm.py's ``--tma-configs`` candidates: every TMA GEMM tile both as listed and flattened, each once."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import gemm as B  # noqa: E402
from fp4compile.kernels import gemm as G  # noqa: E402


def test_candidates_are_every_tile_plain_and_flattened_once():
    cands = B.tma_candidates()
    names = [n for n, _ in cands]
    assert len(names) == len(set(names))
    tiles = {(c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], c["num_warps"], c["num_stages"], bool(c.get("EPI_SUBTILE")))
             for c in G.TMA_CONFIGS}
    got = {(c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], c["num_warps"], c["num_stages"], bool(c.get("EPI_SUBTILE")),
            c["FLATTEN"]) for _, c in cands}
    assert got == {t + (f,) for t in tiles for f in (False, True)}
    for n, c in cands:                                       # the name says what the config holds
        assert n == B.tile_name(c) and n.endswith(" flat") == c["FLATTEN"]


def test_tile_name():
    assert B.tile_name(dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3, EPI_SUBTILE=True),
                       flatten=True) == "128x256x64 w8 s3 sub flat"
    assert B.tile_name(dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4)) == "128x128x64 w4 s4"
