"""Text to packed token sequences in ArrayRecord files, read per process with Grain.

The default corpus is real English prose that every Python installation carries
offline: the Python language reference's topics (the stdlib's pydoc_data, about 460
kB). A byte-level BPE tokenizer (Hugging Face `tokenizers`) is trained on it once.
`--data FILE` points at a reader's own tokens instead: a `.npy` array or a nanoGPT-style
`.bin` of uint16 token ids.
"""

import os
import pathlib

import grain
import numpy as np
from array_record.python import array_record_module


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


def reader_tokens(path: str) -> np.ndarray:
    """A reader's own token ids: a .npy array, or a .bin of uint16 (nanoGPT's)."""
    if path.endswith(".npy"):
        return np.load(path, mmap_mode="r").astype(np.int32)
    if path.endswith(".bin"):
        return np.memmap(path, dtype=np.uint16, mode="r").astype(np.int32)
    raise SystemExit(
        f"--data {path}: expected a .npy or a .bin (uint16) file of token ids"
    )


def write_sequences(tokens: np.ndarray, seq_len: int, path: pathlib.Path) -> int:
    """Pack the stream into records of seq_len + 1 tokens (inputs, then targets)."""
    rows = len(tokens) // (seq_len + 1)
    if rows == 0:
        raise SystemExit(
            f"{len(tokens)} tokens cannot fill one sequence of {seq_len + 1}"
        )
    partial = path.with_suffix(f".{os.getpid()}.partial")  # processes may write at once
    writer = array_record_module.ArrayRecordWriter(str(partial), "group_size:1")
    for row in tokens[: rows * (seq_len + 1)].reshape(rows, seq_len + 1):
        writer.write(row.astype(np.int32).tobytes())
    writer.close()
    os.replace(partial, path)  # readers never see a half-written file
    return rows


def prepare(
    directory: str, seq_len: int, vocab_size: int, data: str | None
) -> pathlib.Path:
    """The packed sequences' file, written on the first call (call on one process)."""
    directory_path = pathlib.Path(directory).absolute()
    directory_path.mkdir(parents=True, exist_ok=True)
    name = pathlib.Path(data).stem if data else f"pydoc-{vocab_size}"
    path = directory_path / f"{name}-{seq_len}.array_record"
    if not path.exists():
        tokens = (
            reader_tokens(data) if data else corpus_tokens(vocab_size, directory_path)
        )
        if tokens.max() >= vocab_size:
            raise SystemExit(
                f"token id {tokens.max()} is outside the vocabulary {vocab_size}"
            )
        write_sequences(tokens, seq_len, path)
    return path


def batches(path: pathlib.Path, global_batch: int, rows: slice, seed: int):
    """A checkpointable iterator over this process's rows of each global batch.

    Global batch s is records s*B to (s+1)*B of one shuffled, repeated stream, the same
    on every process; a process reads only ``rows`` of it (the rows its devices hold),
    so the batches do not depend on how many processes there are.
    """
    block = rows.stop - rows.start
    if global_batch % block or rows.start % block:
        raise ValueError(f"rows {rows} do not tile a global batch of {global_batch}")
    dataset = (
        grain.MapDataset.source(grain.sources.ArrayRecordDataSource(str(path)))
        .map(lambda record: np.frombuffer(record, np.int32))
        .shuffle(seed=seed)
        .repeat()
        .batch(block)[rows.start // block :: global_batch // block]
    )
    return iter(dataset.to_iter_dataset())
