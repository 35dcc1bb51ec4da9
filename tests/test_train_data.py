"""fp4compile.train.data: tokenizers, sources, deterministic and rank-sharded batches, the tokenize CLI."""
import json
import lzma

import numpy as np
import pytest
import torch

from fp4compile.train import data as D


def test_byte_tokenizer_round_trip():
    tok = D.ByteTokenizer()
    text = "héllo, wörld ✓\n"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and max(ids) < 256
    assert tok.decode(ids) == text
    arr = tok.encode_docs(["ab", "c"])
    assert arr.tolist() == [97, 98, 256, 99, 256]


def _tiny_tiktoken_file(path):
    """A rank file with the 256 single bytes plus two merges ('he', 'hel'), in tiktoken's format."""
    import base64

    ranks = [bytes([i]) for i in range(256)] + [b"he", b"hel"]
    path.write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(ranks)))
    return path


def test_tiktoken_file_tokenizer_offline(tmp_path):
    tok = D.get_tokenizer(str(_tiny_tiktoken_file(tmp_path / "mini.tiktoken")))
    assert tok.vocab_size == 259 and tok.eot == 258
    assert tok.encode("hello") == [257, ord("l"), ord("o")]         # 'hel' merged, then bytes
    assert tok.decode(tok.encode("hello there")) == "hello there"
    assert tok.encode_docs(["he"]).tolist() == [256, 258]


@pytest.mark.skipif(not D.default_gpt2_path().is_file(),
                    reason=f"GPT-2 rank file not present at {D.default_gpt2_path()} (set $FP4COMPILE_GPT2)")
def test_gpt2_bpe_offline():
    tok = D.get_tokenizer("gpt2")
    assert tok.encode("Hello world!") == [15496, 995, 0]
    assert tok.eot == 50256 and tok.vocab_size == 50257 and D.padded_vocab(tok.vocab_size) == 50304
    s = "The quick brown fox's 2 jumps\n\n  over   naïve dogs."
    assert tok.decode(tok.encode(s)) == s


def test_hf_bpe_train_round_trip(tmp_path):
    pytest.importorskip("tokenizers")
    src = tmp_path / "text.txt"
    src.write_text(("the cat sat on the mat. the dog sat on the log.\n" * 50) + "<|endoftext|>\nanother doc\n")
    tok = D.train_bpe([src], tmp_path / "tok.json", vocab_size=300)
    assert 256 < tok.vocab_size <= 300 and tok.eot is not None
    s = "the cat sat on the log"
    assert tok.decode(tok.encode(s)) == s
    assert len(tok.encode(s)) < len(s.encode())                      # merges were learned
    assert D.get_tokenizer(str(tmp_path / "tok.json")).encode(s) == tok.encode(s)
    # a literal end-of-text marker inside a document is text (as for the byte and tiktoken tokenizers);
    # only encode_docs puts EOT ids at the document boundaries
    t = D.get_tokenizer(str(tmp_path / "tok.json"))
    assert t.eot not in t.encode("a <|endoftext|> b") and t.decode(t.encode("a <|endoftext|> b")) == "a <|endoftext|> b"
    assert list(t.encode_docs(["x <|endoftext|> y", "z"])).count(t.eot) == 2


def test_unknown_tokenizer_and_source_errors(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="unknown tokenizer"):
        D.get_tokenizer("sentencepiece")
    with pytest.raises(FileNotFoundError, match="neither a file"):
        D.resolve_source(str(tmp_path / "nope"))
    # a corpus part without shards fails even after an earlier part found files
    monkeypatch.setattr(D, "SHARED_DATA", tmp_path / "empty_shared")
    with pytest.raises(FileNotFoundError, match="no train-"):
        D.resolve_source("stdlib,corpus")
    with pytest.raises(FileNotFoundError, match="tiktoken rank file not found"):
        D.get_tokenizer(str(tmp_path / "missing.tiktoken"))


def test_stdlib_split_disjoint_and_fixed():
    train, val = D.stdlib_files("train"), D.stdlib_files("val")
    assert not set(train) & set(val)
    assert any(p.name == "decoder.py" and p.parent.name == "json" for p in val)
    assert any(p.name == "argparse.py" for p in val) and not any(p.name == "argparse.py" for p in train)
    assert not any("site-packages" in p.parts or "test" in p.parts for p in train + val)
    assert train == sorted(train) == D.stdlib_files("train")
    assert sum(p.stat().st_size for p in train) > 5e6                  # megabytes of real text


def test_documents_xz_and_separators(tmp_path):
    p = tmp_path / "c.txt.xz"
    with lzma.open(p, "wt", encoding="utf-8") as f:
        f.write("doc one\nline 2\n<|endoftext|>\ndoc two\n<|endoftext|>\n")
    assert list(D.iter_documents(p)) == ["doc one\nline 2\n", "doc two\n"]
    toks = D.tokenize_files([p], D.ByteTokenizer())
    assert D.ByteTokenizer().decode(toks) == "doc one\nline 2\ndoc two\n"
    assert (toks == 256).sum() == 2
    assert len(D.tokenize_files([p], D.ByteTokenizer(), max_tokens=5)) == 5


def test_batches_deterministic_shift_and_epochs():
    tokens = np.arange(1001, dtype=np.uint16)
    b = D.TokenBatches(tokens, seq_len=10, seed=3)
    assert b.n_windows == 100
    x, y = b.batch(0, 8)
    assert x.shape == (8, 10) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1]) and torch.equal(y - x, torch.ones_like(x))
    x2, _ = D.TokenBatches(tokens, 10, seed=3).batch(0, 8)          # fresh object, same (seed, index)
    assert torch.equal(x, x2)
    assert not torch.equal(x, D.TokenBatches(tokens, 10, seed=4).batch(0, 8)[0])
    # every epoch visits each window exactly once, in a different order
    e0, e1 = b.windows(0, 100), b.windows(100, 100)
    assert sorted(e0) == sorted(e1) == list(range(100)) and not np.array_equal(e0, e1)
    # a batch straddling the epoch boundary is the concatenation of the two epochs' windows
    assert np.array_equal(b.windows(95, 10), np.concatenate([e0[95:], e1[:5]]))
    # sample i does not depend on what was drawn before (resume): a late window first, then early ones
    fresh = D.TokenBatches(tokens, 10, seed=3)
    assert np.array_equal(fresh.windows(250, 4), b.windows(250, 4))
    # shuffle=False (evaluation): windows in order
    xe, _ = D.TokenBatches(tokens, 10, shuffle=False).batch(0, 3)
    assert xe[:, 0].tolist() == [0, 10, 20]


@pytest.mark.parametrize("world", [2, 4])
def test_rank_sharding_is_a_partition_of_the_global_batch(world):
    tokens = np.arange(5000, dtype=np.uint32)
    b = D.TokenBatches(tokens, seq_len=16, seed=1)
    n = 3
    for first in (0, 120, 300):
        whole, _ = b.batch(first, n * world)                          # single process, world·n rows
        parts = [b.batch(first, n, rank=r, world_size=world)[0] for r in range(world)]
        assert torch.equal(torch.cat(parts), whole)
    with pytest.raises(ValueError, match="outside world_size"):
        b.batch(0, 2, rank=world, world_size=world)


def test_too_little_data_is_an_error():
    with pytest.raises(ValueError, match="too few"):
        D.TokenBatches(np.arange(10, dtype=np.uint16), seq_len=16)


def test_bin_round_trip_sidecar_and_errors(tmp_path):
    tok = D.ByteTokenizer()
    toks = tok.encode_docs(["hello world", "second"])
    meta = D.write_bin(toks, tmp_path / "t.bin", tok, ["x"])
    assert meta["n_tokens"] == len(toks) and meta["dtype"] == "uint16"
    arr = D.load_bin(tmp_path / "t.bin", tok)
    assert isinstance(arr, np.memmap) and np.array_equal(arr, toks)
    assert np.array_equal(D.load_tokens(str(tmp_path / "t.bin"), tok), toks)

    class Other:
        name, vocab_size, eot = "other", 50257, 50256

    with pytest.raises(ValueError, match="tokenized with 'bytes'"):
        D.load_bin(tmp_path / "t.bin", Other())
    with open(tmp_path / "t.bin", "ab") as f:                           # a stray byte: not whole tokens
        f.write(b"\0")
    with pytest.raises(ValueError, match="not a multiple"):
        D.load_bin(tmp_path / "t.bin")
    with open(tmp_path / "t.bin", "ab") as f:                           # one token too many vs the sidecar
        f.write(b"\0")
    with pytest.raises(ValueError, match="sidecar says"):
        D.load_bin(tmp_path / "t.bin")
    # a tokenizer whose files are missing is fine when all data are .bin files with sidecars
    D.write_bin(toks, tmp_path / "v.bin", tok, ["y"])
    vo = D.tokenizer_for_sources(str(tmp_path / "gone.tiktoken"), [str(tmp_path / "v.bin"), ""])
    assert (vo.vocab_size, vo.eot) == (257, 256)
    with pytest.raises(FileNotFoundError):
        D.tokenizer_for_sources(str(tmp_path / "gone.tiktoken"), ["stdlib"])


def test_tokenize_cli_max_tokens(tmp_path, capsys):
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "a.txt").write_text("alpha " * 100)
    (folder / "b.md").write_text("beta " * 100)
    out = tmp_path / "out" / "train.bin"
    assert D.main(["tokenize", "--source", str(folder), "--tokenizer", "bytes", "--out", str(out),
                   "--max-tokens", "700"]) == 0
    meta = json.loads((tmp_path / "out" / "train.bin.json").read_text())
    assert meta["n_tokens"] == 700 and out.stat().st_size == 1400 and meta["tokenizer"] == "bytes"
    arr = D.load_bin(out)
    assert D.ByteTokenizer().decode(arr[:12]) == "alpha alpha "
    assert D.ByteTokenizer().decode(arr[601:606]) == "beta "           # 600 bytes of a.txt + EOT, then b.md
    assert "700" in capsys.readouterr().out.replace(",", "")
