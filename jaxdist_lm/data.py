"""Token ids read in place as sequences, mixed and batched per process, with Grain.

The default corpus: the Python language reference's topics (the stdlib's pydoc_data,
460 kB, offline), tokenized by a byte-level BPE. --data: .npy, raw .bin (nanoGPT's) or
directories of shards, memmapped; record i is tokens i (L + 1) to (i + 1) (L + 1).
"""

import bisect
import os
import pathlib

import grain
import numpy as np

from .run_config import RunConfig

# A full scan reads the whole file: at most this many tokens (4 GB of uint32). Measured
# on 2 CPU cores: 0.1-0.2 s per GiB in the page cache, 0.7 s per GiB from disk; 100B
# tokens (200-400 GB) would take minutes before the first step, on one process. Larger
# files rely on the check of each record as it is read (20 us per 8,193 ids).
FULL_SCAN_TOKENS = 10**9
# tokens per np.max: 64 MB of uint32 in memory at a time
SCAN_CHUNK = 2**24
BIN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
# Grain's threads read the next batches while the devices run the step; a few batches
# ahead is enough when reading one takes less than a step. Threads, not processes:
# the recipe runs under mpirun and srun, one process per host.
PREFETCH = grain.ReadOptions(num_threads=4, prefetch_buffer_size=8)


def corpus() -> list[str]:
    """The Python language reference's topics, one document each."""
    from pydoc_data.topics import topics

    return [topics[name] for name in sorted(topics)]


def train_tokenizer(texts: list[str], vocab_size: int, path: pathlib.Path):
    """A byte-level BPE tokenizer like GPT-2's, trained on ``texts``, saved as JSON."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"],
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.save(str(path))
    return tokenizer


def corpus_tokens(vocab_size: int, directory: pathlib.Path) -> np.ndarray:
    """The default corpus as one token stream, documents joined by <|endoftext|>."""
    tokenizer = train_tokenizer(
        corpus(), vocab_size, directory / f"tokenizer-{vocab_size}.json"
    )
    end = tokenizer.token_to_id("<|endoftext|>")
    ids = [id_ for doc in tokenizer.encode_batch(corpus()) for id_ in [*doc.ids, end]]
    return np.asarray(ids, np.int32)


def corpus_file(vocab_size: int, directory: str) -> pathlib.Path:
    """The default corpus's token ids as a .npy in --data-dir, tokenized on the first
    call (a directory that already holds them may be read-only)."""
    path = pathlib.Path(directory).absolute() / f"pydoc-{vocab_size}.npy"
    if not os.path.exists(path):
        if why := directory_error(directory):
            raise SystemExit(
                f"--data-dir {directory}: {why}; pass a directory to keep the "
                "corpus's tokens in, or --data"
            )
        path.parent.mkdir(parents=True, exist_ok=True)
        dtype = np.uint16 if vocab_size <= 2**16 else np.uint32
        # Each process that tokenizes writes its own file, then renames it into
        # place: readers never see a half-written file.
        partial = path.with_suffix(f".{os.getpid()}.partial")
        with open(partial, "wb") as file:
            np.save(file, corpus_tokens(vocab_size, path.parent).astype(dtype))
        os.replace(partial, path)
    return path


def directory_error(path: str) -> str | None:
    """Why this process could not make directory ``path`` and write in it, or None."""
    # A URL (gs://...) is left to its store.
    if "://" in path:
        return None
    target = pathlib.Path(path).absolute()
    # The root exists: the first of these that does is where the directory is made.
    existing = next(p for p in (target, *target.parents) if os.path.exists(p))
    if not existing.is_dir():
        where = "" if existing == target else f"{existing} "
        return f"{where}is a file, not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"this user cannot write in {existing}"
    return None


def npy_ids(path: pathlib.Path) -> np.ndarray:
    """A .npy's array, mapped in place; a file numpy.save did not write, or wrote only
    in part, stops the run in one line."""
    with open(path, "rb") as file:
        magic = file.read(len(np.lib.format.MAGIC_PREFIX))
    # np.load reads a file without the header as a pickle, and says so, misleadingly.
    if magic != np.lib.format.MAGIC_PREFIX:
        what = "is empty (0 bytes)" if not magic else "has no NumPy header"
        raise SystemExit(f"--data {path}: {what}; write the token ids with numpy.save")
    # NumPy's ValueError: a header or data cut short, or Python objects (not mappable).
    try:
        return np.load(path, mmap_mode="r")
    except ValueError as error:
        raise SystemExit(
            f"--data {path}: NumPy cannot map this .npy ({error}); write the token "
            "ids again with numpy.save"
        ) from None


def readable_size(path: pathlib.Path, flag: str = "--data") -> int:
    """The size of a file this process can open; one line if it cannot."""
    try:
        with open(path, "rb") as file:
            return os.fstat(file.fileno()).st_size
    except OSError as error:
        raise SystemExit(f"{flag} {path}: {error.strerror or error}") from None


def token_ids(path: pathlib.Path, dtype: str | None) -> np.ndarray:
    """A file's token ids, mapped in place: a .npy, or a raw .bin of ``dtype``."""
    # A missing file is reported as missing before its name is judged.
    size = readable_size(path)
    if path.suffix == ".npy":
        tokens = npy_ids(path)
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            raise SystemExit(
                f"--data {path}: expected a 1-D array of integer token ids, "
                f"not {tokens.dtype} of shape {tokens.shape}"
            )
        return tokens
    if path.suffix != ".bin":
        raise SystemExit(f"--data {path}: expected a .npy or a .bin file of token ids")
    # A .bin does not say its dtype, and a wrong guess trains on garbage: uint32 ids
    # read as uint16 give [t0, 0, t1, 0, ...].
    if dtype is None:
        raise SystemExit(
            f"--data {path}: a raw .bin does not say its dtype; "
            "pass --data-dtype uint16 or uint32"
        )
    itemsize = np.dtype(BIN_DTYPES[dtype]).itemsize
    if size % itemsize:
        raise SystemExit(
            f"--data {path}: {size} bytes is not a whole number of {dtype} token ids"
        )
    # np.memmap cannot map an empty file
    if size == 0:
        return np.zeros(0, BIN_DTYPES[dtype])
    return np.memmap(path, dtype=BIN_DTYPES[dtype], mode="r")


def outside_vocabulary(ids: np.ndarray, vocab_size: int) -> int | None:
    """The index of the first id in ``ids`` outside [0, vocab_size), or None."""
    # an unsigned file needs no second pass for ids below 0
    signed = ids.dtype.kind == "i"
    if len(ids) == 0 or (ids.max() < vocab_size and not (signed and ids.min() < 0)):
        return None
    return int(np.argmax((ids >= vocab_size) | (ids < 0)))


def vocabulary_error(token_id: int, position: int, path, vocab_size: int) -> str:
    return (
        f"token id {token_id} at position {position} of {path} "
        f"is outside the vocabulary {vocab_size}"
    )


class TokenRecords:
    """Records of seq_len + 1 token ids from one or more files (shards), read in place:
    a Grain RandomAccessDataSource whose records are checked against the vocabulary."""

    def __init__(
        self,
        paths: list[pathlib.Path],
        dtype: str | None,
        seq_len: int,
        vocab_size: int,
    ):
        self.paths, self.seq_len, self.vocab_size = paths, seq_len, vocab_size
        self.files = [token_ids(path, dtype) for path in paths]
        # ends[f]: the records of files 0..f; record i is in the first f with i < end.
        # A file's last tokens that do not fill a record are not read.
        self.ends = np.cumsum([len(t) // (seq_len + 1) for t in self.files]).tolist()
        if not self.ends or self.ends[-1] == 0:
            total = sum(len(t) for t in self.files)
            raise SystemExit(
                f"--data {', '.join(map(str, paths))}: {total} tokens cannot fill one "
                f"sequence of {seq_len + 1}"
            )

    def __len__(self) -> int:
        return self.ends[-1]

    def __getitem__(self, index: int) -> np.ndarray:
        f = bisect.bisect_right(self.ends, index)
        start = (index - (self.ends[f - 1] if f else 0)) * (self.seq_len + 1)
        ids = self.files[f][start : start + self.seq_len + 1]
        # Checked before the cast to int32, which would wrap a large uint32 id.
        bad = outside_vocabulary(ids, self.vocab_size)
        if bad is not None:
            raise ValueError(
                vocabulary_error(ids[bad], start + bad, self.paths[f], self.vocab_size)
            )
        return ids.astype(np.int32)

    def __repr__(self) -> str:
        return f"TokenRecords({[str(p) for p in self.paths]}, seq_len={self.seq_len})"


def check_vocabulary(path, tokens: np.ndarray, vocab_size: int) -> None:
    """Scan a file's ids in chunks: all of them up to FULL_SCAN_TOKENS, else the first
    chunk, which still catches a wrong --data-dtype (ids in the billions)."""
    end = len(tokens) if len(tokens) <= FULL_SCAN_TOKENS else SCAN_CHUNK
    for start in range(0, end, SCAN_CHUNK):
        chunk = tokens[start : min(start + SCAN_CHUNK, end)]
        bad = outside_vocabulary(chunk, vocab_size)
        if bad is not None:
            position = start + bad
            raise SystemExit(
                vocabulary_error(tokens[position], position, path, vocab_size)
            )


def entry_files(entry: str) -> list[pathlib.Path]:
    """The files of one --data entry: the file itself, or a directory's shards."""
    path = pathlib.Path(entry).absolute()
    # An OSError: a directory this user may not list.
    try:
        if not path.is_dir():
            return [path]
        shards = sorted(p for p in path.iterdir() if p.suffix in (".npy", ".bin"))
    except OSError as error:
        raise SystemExit(f"--data {path}: {error.strerror or error}") from None
    if not shards:
        raise SystemExit(f"--data {entry}: the directory has no .npy or .bin files")
    return shards


def data_files(data: str) -> list[list[pathlib.Path]]:
    """The files of each comma-separated --data entry."""
    entries = data.split(",")
    if "" in entries:
        raise SystemExit(
            f"--data {data}: an empty entry; separate files or directories with one "
            "comma, e.g. a.bin,b.bin"
        )
    return [entry_files(entry) for entry in entries]


def sources(
    directory: str,
    seq_len: int,
    vocab_size: int,
    data: str | None = None,
    dtype: str | None = None,
) -> list[TokenRecords]:
    """One source per comma-separated --data entry (a file, or a directory of shards),
    or the default corpus (tokenized into ``directory`` on the first call)."""
    entries = data_files(data) if data else [[corpus_file(vocab_size, directory)]]
    return [TokenRecords(files, dtype, seq_len, vocab_size) for files in entries]


def prepare(
    directory: str,
    seq_len: int,
    vocab_size: int,
    data: str | None = None,
    dtype: str | None = None,
) -> list[TokenRecords]:
    """``sources``, with every file's ids checked: call it on one process first."""
    opened = sources(directory, seq_len, vocab_size, data, dtype)
    for source in opened:
        for path, tokens in zip(source.paths, source.files):
            check_vocabulary(path, tokens, vocab_size)
    return opened


def check_paths(run: RunConfig) -> None:
    """Stop train.py in one line on a path flag that cannot work, on every process
    before the model is built, so that none waits for one that stopped."""
    if run.model_config:
        readable_size(pathlib.Path(run.model_config), "--model-config")
    if run.compile_only:
        return
    # Opened as the run opens them; prepare checks their ids against the vocabulary.
    for files in data_files(run.data) if run.data else []:
        TokenRecords(files, run.data_dtype, run.seq_len, vocab_size=0)
    written = {
        "--checkpoint-dir": run.checkpoint_dir,
        "--log-dir": run.log_dir,
        "--profile": run.profile,
    }
    for flag, path in written.items():
        if path and (why := directory_error(path)):
            raise SystemExit(f"{flag} {path}: {why}")


def parse_weights(text: str | None, count: int) -> list[float] | None:
    """--data-weights '0.7,0.3': one positive weight per --data entry."""
    if text is None:
        return None
    weights = [float(w) for w in text.split(",")]
    if len(weights) != count or min(weights) <= 0:
        raise SystemExit(
            f"--data-weights {text}: expected {count} positive weights, one per "
            "--data entry"
        )
    return weights


def training_records(source: TokenRecords, held_out: int) -> grain.MapDataset:
    """The source's records less the last ``held_out`` (the evaluation split)."""
    if held_out >= len(source):
        raise SystemExit(
            f"{held_out} held-out records leave none of {len(source)} to train on"
        )
    return grain.MapDataset.source(source)[: len(source) - held_out]


def batches(
    sources: list[TokenRecords],
    global_batch: int,
    rows: slice,
    seed: int,
    weights: str | list[float] | None = None,
    held_out_batches: int = 0,
):
    """A checkpointable iterator over this process's ``rows`` of each global batch,
    the same on any number of processes; the first source's last ``held_out_batches``
    left out."""
    block = rows.stop - rows.start
    if global_batch % block or rows.start % block:
        raise ValueError(f"rows {rows} do not tile a global batch of {global_batch}")
    if isinstance(weights, str) or weights is None:
        weights = parse_weights(weights, len(sources))
    held_out = [held_out_batches * global_batch] + [0] * (len(sources) - 1)
    streams = [
        training_records(source, out).shuffle(seed=seed + i).repeat()
        for i, (source, out) in enumerate(zip(sources, held_out))
    ]
    if len(streams) == 1:
        stream = streams[0]
    else:
        # A fixed interleaving in proportion to the weights (by default the sources'
        # sizes), indexed like one source.
        stream = grain.MapDataset.mix(
            streams, weights or [len(s) - out for s, out in zip(sources, held_out)]
        )
    dataset = stream.batch(block)[rows.start // block :: global_batch // block]
    # Grain's iterator state is the next batch's index, whatever is in its prefetch
    # buffer: a checkpoint resumes at the batch the loop would have read next.
    return iter(dataset.to_iter_dataset(read_options=PREFETCH))


def eval_batches(
    source: TokenRecords, global_batch: int, rows: slice, num_batches: int
) -> list[np.ndarray]:
    """This process's rows of the held-out batches: the source's last num_batches x
    global_batch records, in file order, the same every call."""
    first = len(source) - num_batches * global_batch
    if first <= 0:
        raise SystemExit(
            f"{num_batches} evaluation batches of {global_batch} need more than the "
            f"{len(source)} records of {', '.join(map(str, source.paths))}"
        )
    return [
        np.stack(
            [source[first + b * global_batch + r] for r in range(rows.start, rows.stop)]
        )
        for b in range(num_batches)
    ]
