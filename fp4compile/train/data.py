"""Tokenizers, token sources and deterministic batches for training.

Tokenizers (``get_tokenizer(spec)``):
    ``"bytes"``               byte-level, ids 0..255 plus ``<|endoftext|>`` = 256
    ``"gpt2"``                GPT-2 BPE built offline from a local ``gpt2.tiktoken`` file (``$FP4COMPILE_GPT2``,
                              else ``/work/shared/data/gpt2.tiktoken``); ``<|endoftext|>`` = 50256
    ``path/x.tiktoken``       any tiktoken rank file, split with the GPT-2 regex
    ``path/tokenizer.json``   a Hugging Face ``tokenizers`` BPE (``train_bpe`` makes one)

Token sources (``load_tokens(spec, tokenizer)`` returns a 1-D uint16/uint32 array):
    ``"stdlib"`` / ``"stdlib:val"``   the running Python's standard-library ``*.py`` files (train / held-out modules)
    ``"corpus"`` / ``"corpus:val"`` / ``"corpus:brown"``  the shared corpus (``*.txt.xz`` shards, lzma)
    ``x.bin``                         pre-tokenized tokens (np.memmap; dtype from the ``x.bin.json`` sidecar)
    a folder, a text file, ``.txt.xz`` files, or several of them joined with ``,``

Batches (``TokenBatches``): the token stream is cut into non-overlapping windows of ``seq_len + 1`` tokens;
each epoch visits every window once in a permutation drawn from ``(seed, epoch)``. Sample ``i`` of the run is
a pure function of ``(seed, i)``, so a resumed run sees exactly the batches an uninterrupted one would, and
rank ``r`` of ``world`` takes its rows of the same global batch (the union over ranks is the single-process
batch).

CLI: ``python -m fp4compile.train.data tokenize --source corpus --tokenizer gpt2 --out .data/train.bin
--max-tokens 30000000`` writes a compact token file (+ ``.json`` sidecar) to carry to the GPU.
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import json
import lzma
import os
import sys
import sysconfig
import time
from pathlib import Path
from typing import Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

EOT_TEXT = "<|endoftext|>"
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
SHARED_DATA = Path(os.environ.get("FP4COMPILE_SHARED_DATA", "/work/shared/data"))
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".txt.xz", ".xz")

# ----------------------------------------------------------------------------------------------------------
# tokenizers


class ByteTokenizer:
    """UTF-8 bytes as tokens (0..255); ``<|endoftext|>`` separates documents as id 256."""

    name = "bytes"
    vocab_size = 257
    eot = 256

    def encode(self, text: str) -> List[int]:
        """Token ids of ``text`` (no EOT appended): its UTF-8 bytes."""
        return list(text.encode("utf-8"))

    def encode_docs(self, docs: Sequence[str]) -> np.ndarray:
        """Token ids of ``docs``, each document followed by the EOT id, as one 1-D uint16 array."""
        parts = []
        for d in docs:
            parts.append(np.frombuffer(d.encode("utf-8"), dtype=np.uint8).astype(np.uint16))
            parts.append(np.array([self.eot], dtype=np.uint16))
        return np.concatenate(parts) if parts else np.zeros(0, np.uint16)

    def decode(self, ids: Iterable[int]) -> str:
        """The text of ``ids``: ids >= 256 (EOT) dropped, invalid UTF-8 replaced."""
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class TiktokenTokenizer:
    """A ``tiktoken.Encoding`` built offline from a local rank file (GPT-2 split regex, ``<|endoftext|>``)."""

    def __init__(self, path: os.PathLike, name: Optional[str] = None):
        import tiktoken
        import tiktoken.load

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"tiktoken rank file not found: {path} (set $FP4COMPILE_GPT2 or pass a path)")
        ranks = tiktoken.load.load_tiktoken_bpe(str(path))
        self.name = name or path.name
        self.enc = tiktoken.Encoding(name=self.name, pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                                     special_tokens={EOT_TEXT: len(ranks)})
        self.eot = len(ranks)
        self.vocab_size = self.enc.n_vocab

    def encode(self, text: str) -> List[int]:
        """Token ids of ``text`` (no EOT appended; a literal ``<|endoftext|>`` is encoded as ordinary text)."""
        return self.enc.encode_ordinary(text)

    def encode_docs(self, docs: Sequence[str]) -> np.ndarray:
        """Token ids of ``docs``, each document followed by the EOT id, as one 1-D array (uint16, uint32
        for a vocabulary above 65536)."""
        out = self.enc.encode_ordinary_batch(list(docs), num_threads=os.cpu_count() or 1)
        dtype = np.uint16 if self.vocab_size <= 65536 else np.uint32
        parts = []
        for ids in out:
            parts.append(np.asarray(ids, dtype=dtype))
            parts.append(np.array([self.eot], dtype=dtype))
        return np.concatenate(parts) if parts else np.zeros(0, dtype)

    def decode(self, ids: Iterable[int]) -> str:
        """The text of ``ids``."""
        return self.enc.decode(list(ids))


class HFTokenizer:
    """A Hugging Face ``tokenizers`` JSON file (e.g. a byte-level BPE from ``train_bpe``)."""

    def __init__(self, path: os.PathLike):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(path))
        # a literal "<|endoftext|>" in the text is text, as for the byte and tiktoken tokenizers: only
        # encode_docs marks document boundaries (tokenizers >= 0.15 has this switch; older ones split it out)
        if hasattr(self.tok, "encode_special_tokens"):
            self.tok.encode_special_tokens = True
        self.name = Path(path).name
        self.vocab_size = self.tok.get_vocab_size()
        eot = self.tok.token_to_id(EOT_TEXT)
        if eot is None:
            raise ValueError(f"{path}: the tokenizer has no {EOT_TEXT} token")
        self.eot = eot

    def encode(self, text: str) -> List[int]:
        """Token ids of ``text`` (no EOT appended; a literal ``<|endoftext|>`` is encoded as text)."""
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_docs(self, docs: Sequence[str]) -> np.ndarray:
        """Token ids of ``docs``, each document followed by the EOT id, as one 1-D array (uint16, uint32
        for a vocabulary above 65536)."""
        dtype = np.uint16 if self.vocab_size <= 65536 else np.uint32
        parts = []
        for enc in self.tok.encode_batch(list(docs), add_special_tokens=False):
            parts.append(np.asarray(enc.ids, dtype=dtype))
            parts.append(np.array([self.eot], dtype=dtype))
        return np.concatenate(parts) if parts else np.zeros(0, dtype)

    def decode(self, ids: Iterable[int]) -> str:
        """The text of ``ids``."""
        return self.tok.decode(list(ids))


def train_bpe(files: Sequence[os.PathLike], out: os.PathLike, vocab_size: int = 32000) -> HFTokenizer:
    """Train a byte-level BPE with ``tokenizers`` (settings of notes/data.md §4b) and save ``tokenizer.json``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOT_TEXT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())

    def docs():
        for f in files:
            yield from iter_documents(f)

    tok.train_from_iterator(docs(), trainer=trainer)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out))
    return HFTokenizer(out)


def default_gpt2_path() -> Path:
    """The GPT-2 rank file: ``$FP4COMPILE_GPT2``, else ``gpt2.tiktoken`` in ``SHARED_DATA``."""
    return Path(os.environ.get("FP4COMPILE_GPT2", SHARED_DATA / "gpt2.tiktoken"))


def get_tokenizer(spec: str):
    """Tokenizer from a spec: ``bytes``, ``gpt2``, a ``.tiktoken`` path or a ``tokenizers`` ``.json`` path."""
    if spec in ("bytes", "byte"):
        return ByteTokenizer()
    if spec == "gpt2":
        return TiktokenTokenizer(default_gpt2_path(), name="gpt2")
    p = Path(spec)
    if p.suffix == ".tiktoken":
        return TiktokenTokenizer(p)
    if p.suffix == ".json":
        if not p.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {p}")
        return HFTokenizer(p)
    raise ValueError(f"unknown tokenizer {spec!r}: use 'bytes', 'gpt2', a .tiktoken file or a tokenizers .json")


class VocabOnly:
    """Stands in for a tokenizer whose files are absent when every source is a pre-tokenized ``.bin``
    (e.g. on the GPU machine): it knows the vocabulary size and EOT id from the ``.json`` sidecar."""

    def __init__(self, name: str, vocab_size: int, eot: int):
        self.name, self.vocab_size, self.eot = name, vocab_size, eot

    def encode(self, text):
        """Always raises ``RuntimeError``: only the vocabulary size and EOT id are known here (``encode_docs`` and
        ``decode`` are this same method)."""
        raise RuntimeError(f"tokenizer {self.name!r} is not available here (only its vocabulary size is known)")

    encode_docs = decode = encode


def tokenizer_for_sources(spec: str, sources: Sequence[str]):
    """``get_tokenizer(spec)``, or, when its files are missing and all ``sources`` are ``.bin`` files with
    sidecars, a ``VocabOnly`` built from the sidecar (so a run on pre-tokenized data needs no tokenizer file)."""
    try:
        return get_tokenizer(spec)
    except FileNotFoundError:
        bins = [s for s in sources if s]
        if not bins or not all(s.endswith(".bin") and _bin_meta_path(Path(s)).is_file() for s in bins):
            raise
        metas = [json.loads(_bin_meta_path(Path(s)).read_text()) for s in bins]
        if len({(m["vocab_size"], m["eot"]) for m in metas}) != 1:
            raise ValueError(f"token files {bins} were made with different tokenizers")
        return VocabOnly(metas[0]["tokenizer"], metas[0]["vocab_size"], metas[0]["eot"])


def padded_vocab(vocab_size: int, multiple: int = 128) -> int:
    """Embedding rows: the vocabulary rounded up (nanoGPT's 50257 -> 50304 trick, here to 128)."""
    return -(-vocab_size // multiple) * multiple


# ----------------------------------------------------------------------------------------------------------
# raw text sources

#: Standard-library modules held out for validation (present in CPython 3.10-3.13).
STDLIB_VAL_MODULES = ("json", "email", "http", "argparse.py", "difflib.py", "textwrap.py", "fractions.py",
                      "statistics.py", "csv.py", "pprint.py", "calendar.py", "string.py")
_STDLIB_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__",
                     "turtledemo", "config-3"}


def stdlib_files(split: str = "train") -> List[Path]:
    """Sorted ``*.py`` files of the running Python's standard library for ``split`` in {train, val}.

    Tests, ``site-packages`` and IDLE are excluded; ``STDLIB_VAL_MODULES`` form the validation split.
    """
    if split not in ("train", "val"):
        raise ValueError(f"stdlib split must be 'train' or 'val', got {split!r}")
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _STDLIB_SKIP_DIRS and not d.startswith("config-"))
        for fn in sorted(filenames):
            if not fn.endswith(".py"):
                continue
            p = Path(dirpath, fn)
            top = p.relative_to(root).parts[0]
            if (top in STDLIB_VAL_MODULES) == (split == "val"):
                out.append(p)
    if not out:
        raise FileNotFoundError(f"no standard-library .py files found under {root}")
    return sorted(out)


def iter_documents(path: os.PathLike) -> Iterator[str]:
    """Documents of one text file: ``.xz`` is read with lzma; documents are separated by a line holding only
    ``<|endoftext|>`` (a file without that line is one document)."""
    path = Path(path)
    opener = lzma.open if path.suffix == ".xz" else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as f:
        buf: List[str] = []
        for line in f:
            if line.rstrip("\r\n") == EOT_TEXT:
                if buf:
                    yield "".join(buf)
                buf = []
            else:
                buf.append(line)
        if buf:
            yield "".join(buf)


def _text_files(folder: Path) -> List[Path]:
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name.endswith(TEXT_SUFFIXES))
    if not files:
        raise FileNotFoundError(f"no text files ({', '.join(TEXT_SUFFIXES)}) under {folder}")
    return files


def resolve_source(spec: str) -> List[Path]:
    """The list of files a (non-.bin) source spec stands for."""
    files: List[Path] = []
    for part in spec.split(","):
        part = part.strip()
        if part in ("stdlib", "stdlib:train", "stdlib:val"):
            files += stdlib_files("val" if part.endswith(":val") else "train")
        elif part in ("corpus", "corpus:train"):
            shards = sorted((SHARED_DATA / "corpus").glob("train-*.txt.xz"))
            if not shards:       # checked per part: an earlier part's files must not hide a missing corpus
                raise FileNotFoundError(f"no train-*.txt.xz shards in {SHARED_DATA / 'corpus'}")
            files += shards
        elif part in ("corpus:val", "corpus:brown"):
            files.append(SHARED_DATA / "corpus" / ("val.txt.xz" if part.endswith("val") else "brown.txt.xz"))
        else:
            p = Path(part)
            if p.is_dir():
                files += _text_files(p)
            elif p.is_file():
                files.append(p)
            else:
                raise FileNotFoundError(f"data source {part!r} is neither a file, a folder nor a known name "
                                        "(stdlib, stdlib:val, corpus, corpus:val, corpus:brown)")
    return files


# ----------------------------------------------------------------------------------------------------------
# token arrays


def _bin_meta_path(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def load_bin(path: os.PathLike, tokenizer=None, dtype: Optional[str] = None) -> np.ndarray:
    """Memory-map a pre-tokenized ``.bin``. The dtype comes from the ``.json`` sidecar written by
    ``tokenize`` (or ``dtype=``, default uint16); a sidecar naming a different vocabulary is an error."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"token file not found: {path}")
    meta = {}
    if _bin_meta_path(path).is_file():
        meta = json.loads(_bin_meta_path(path).read_text())
    dt = np.dtype(dtype or meta.get("dtype", "uint16"))
    if dt not in (np.dtype(np.uint16), np.dtype(np.uint32)):
        raise ValueError(f"{path}: token dtype must be uint16 or uint32, got {dt}")
    size = path.stat().st_size
    if size % dt.itemsize:
        raise ValueError(f"{path}: size {size} is not a multiple of {dt} ({dt.itemsize} bytes)")
    if tokenizer is not None and "vocab_size" in meta and meta["vocab_size"] != tokenizer.vocab_size:
        raise ValueError(f"{path} was tokenized with {meta.get('tokenizer')!r} (vocab {meta['vocab_size']}), "
                         f"but the run uses {tokenizer.name!r} (vocab {tokenizer.vocab_size})")
    arr = np.memmap(path, dtype=dt, mode="r")
    if "n_tokens" in meta and meta["n_tokens"] != len(arr):
        raise ValueError(f"{path}: {len(arr)} tokens on disk, the sidecar says {meta['n_tokens']} (truncated?)")
    return arr


def tokenize_files(files: Sequence[Path], tokenizer, max_tokens: Optional[int] = None,
                   docs_per_batch: int = 2048, progress: bool = False) -> np.ndarray:
    """Tokenize the documents of ``files`` in order (each followed by the EOT token), up to ``max_tokens``.

    Byte-level stdlib files are read as whole files (one document each)."""
    chunks: List[np.ndarray] = []
    total = 0

    def flush(docs):
        nonlocal total
        arr = tokenizer.encode_docs(docs)
        chunks.append(arr)
        total += len(arr)

    for f in files:
        docs: List[str] = []
        for doc in iter_documents(f):
            docs.append(doc)
            if len(docs) >= docs_per_batch:
                flush(docs)
                docs = []
                if max_tokens is not None and total >= max_tokens:
                    break
        if docs and (max_tokens is None or total < max_tokens):
            flush(docs)
        if progress:
            print(f"  {f.name}: {total:,} tokens", file=sys.stderr)
        if max_tokens is not None and total >= max_tokens:
            break
    out = np.concatenate(chunks) if chunks else np.zeros(0, np.uint16)
    return out[:max_tokens] if max_tokens is not None else out


@functools.lru_cache(maxsize=8)
def _cached_tokens(spec: str, tok_spec: str, max_tokens: Optional[int]) -> np.ndarray:
    return tokenize_files(resolve_source(spec), get_tokenizer(tok_spec), max_tokens)


def load_tokens(spec: str, tokenizer, tok_spec: Optional[str] = None, max_tokens: Optional[int] = None) -> np.ndarray:
    """1-D token array for a source spec (see the module docstring). ``.bin`` files are memory-mapped;
    text sources are tokenized in memory (cached per process when ``tok_spec`` names the tokenizer)."""
    if spec.endswith(".bin"):
        arr = load_bin(spec, tokenizer)
        return arr[:max_tokens] if max_tokens is not None else arr
    if tok_spec is not None:
        return _cached_tokens(spec, tok_spec, max_tokens)
    return tokenize_files(resolve_source(spec), tokenizer, max_tokens)


# ----------------------------------------------------------------------------------------------------------
# deterministic batches


class TokenBatches:
    """Deterministic (x, y) batches of ``seq_len`` tokens from a 1-D token array.

    The array is cut into ``n_windows`` non-overlapping windows of ``seq_len + 1`` tokens (the last token of
    a window is the first of the next, as targets). Global sample ``i`` is window ``perm_e[i % n_windows]``
    of epoch ``e = i // n_windows``, where ``perm_e`` is a permutation drawn from ``(seed, e)``
    (``shuffle=False``: the identity, for evaluation).

    ``batch(first, n, rank, world_size)`` returns the rows of samples ``first .. first + n·world_size - 1``
    that belong to ``rank`` (a contiguous block of ``n`` rows), so the union over ranks is the
    single-process batch and every sample is a pure function of ``(seed, index)``.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int = 0, shuffle: bool = True, name: str = "data"):
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.tokens, self.seq_len, self.seed, self.shuffle, self.name = tokens, seq_len, seed, shuffle, name
        self.n_windows = (len(tokens) - 1) // seq_len
        if self.n_windows < 1:
            raise ValueError(f"{name}: {len(tokens)} tokens are too few for one window of seq_len={seq_len}")
        self._perm_epoch, self._perm = -1, None

    def __len__(self) -> int:
        return self.n_windows

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)
            self._perm_epoch = epoch
        return self._perm

    def windows(self, first: int, n: int) -> np.ndarray:
        """Window indices of global samples ``first .. first + n - 1``."""
        idx = np.arange(first, first + n, dtype=np.int64)
        if not self.shuffle:
            return idx % self.n_windows
        out = np.empty(n, dtype=np.int64)
        for epoch in np.unique(idx // self.n_windows):
            sel = idx // self.n_windows == epoch
            out[sel] = self._permutation(int(epoch))[idx[sel] % self.n_windows]
        return out

    def batch(self, first: int, n: int, rank: int = 0, world_size: int = 1, device="cpu") -> Tuple[torch.Tensor, torch.Tensor]:
        """``rank``'s ``n`` rows of the global batch that starts at sample ``first`` (see the class docstring):
        ``(x, y)``, int64 ``[n, seq_len]`` each on ``device``, ``y`` = ``x`` shifted by one token. Raises
        ``ValueError`` unless ``0 <= rank < world_size``."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        w = self.windows(first + rank * n, n)
        T = self.seq_len
        rows = np.stack([np.asarray(self.tokens[i * T: i * T + T + 1], dtype=np.int64) for i in w])
        t = torch.from_numpy(rows)
        if device != "cpu":
            t = t.pin_memory().to(device, non_blocking=True) if torch.cuda.is_available() else t.to(device)
        return t[:, :-1], t[:, 1:]


def fingerprint(tokens: np.ndarray, sample: int = 1 << 16) -> str:
    """A cheap content hash of a token array (its length and first/last ``sample`` tokens)."""
    h = hashlib.sha256(str(len(tokens)).encode())
    h.update(np.asarray(tokens[:sample]).tobytes())
    h.update(np.asarray(tokens[-sample:]).tobytes())
    return h.hexdigest()[:16]


# ----------------------------------------------------------------------------------------------------------
# CLI: python -m fp4compile.train.data tokenize ...


def write_bin(tokens: np.ndarray, out: os.PathLike, tokenizer, sources: Sequence[str]) -> dict:
    """Write tokens as a flat binary plus a ``.json`` sidecar (dtype, count, tokenizer, vocab, sha256)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    dtype = np.uint16 if tokenizer.vocab_size <= 65536 else np.uint32
    arr = np.ascontiguousarray(tokens, dtype=dtype)
    tmp = out.with_name(out.name + ".tmp")
    arr.tofile(tmp)
    os.replace(tmp, out)
    meta = dict(dtype=np.dtype(dtype).name, n_tokens=int(len(arr)), tokenizer=tokenizer.name,
                vocab_size=int(tokenizer.vocab_size), eot=int(tokenizer.eot), sources=list(sources),
                sha256=hashlib.sha256(arr.tobytes()).hexdigest())
    _bin_meta_path(out).write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m fp4compile.train.data`` (also ``fp4compile data``): the ``tokenize`` and ``train-bpe``
    subcommands; returns exit code 0."""
    ap = argparse.ArgumentParser(prog="python -m fp4compile.train.data", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("tokenize", help="tokenize text sources into a uint16/uint32 .bin (+ .json sidecar)")
    t.add_argument("--source", default="corpus", help="corpus | corpus:val | corpus:brown | stdlib | paths,... "
                   "(default: corpus)")
    t.add_argument("--tokenizer", default="gpt2", help="bytes | gpt2 | path.tiktoken | tokenizer.json")
    t.add_argument("--out", required=True, help="output .bin path")
    t.add_argument("--max-tokens", type=int, default=None, help="stop after this many tokens")
    b = sub.add_parser("train-bpe", help="train a byte-level BPE with `tokenizers` and save tokenizer.json")
    b.add_argument("--source", default="corpus")
    b.add_argument("--vocab-size", type=int, default=32000)
    b.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    t0 = time.time()
    if args.cmd == "tokenize":
        tok = get_tokenizer(args.tokenizer)
        files = resolve_source(args.source)
        tokens = tokenize_files(files, tok, args.max_tokens, progress=True)
        meta = write_bin(tokens, args.out, tok, [str(f) for f in files])
        mb = Path(args.out).stat().st_size / 2**20
        print(f"wrote {args.out}: {meta['n_tokens']:,} {meta['dtype']} tokens ({mb:.1f} MiB, "
              f"{tok.name}) in {time.time() - t0:.1f}s")
    else:
        train_bpe(resolve_source(args.source), args.out, args.vocab_size)
        print(f"wrote {args.out} in {time.time() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
