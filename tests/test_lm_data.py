"""jaxdist_lm/data.py on small synthetic token files: read in place, checked against the
vocabulary, mixed, held out for evaluation, split into each process's rows, resumed."""

import os
import pathlib
import re
import subprocess
import sys

import grain
import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
from jaxdist_lm import data  # noqa: E402
from jaxdist_lm.run_config import RunConfig  # noqa: E402

SEQ_LEN = 8  # records of 9 ids


def records_of(tokens: np.ndarray) -> np.ndarray:
    """What data.py should read: the whole records of seq_len + 1 ids, in file order."""
    rows = len(tokens) // (SEQ_LEN + 1)
    return tokens[: rows * (SEQ_LEN + 1)].reshape(rows, SEQ_LEN + 1).astype(np.int32)


def read_all(source) -> np.ndarray:
    return np.stack([source[i] for i in range(len(source))])


def first_batches(iterator, count: int) -> list[np.ndarray]:
    return [next(iterator) for _ in range(count)]


@pytest.mark.parametrize(
    "name, dtype, vocab_size",
    [
        ("ids.bin", "uint16", 50_000),
        ("ids.bin", "uint32", 128_256),  # Llama 3's vocabulary: ids above 65,535
        ("ids.npy", "uint32", 128_256),
        ("ids.npy", "int32", 50_000),
    ],
)
def test_token_files_are_read_in_place(tmp_path, name, dtype, vocab_size):
    tokens = (np.arange(1000) * 7919 % vocab_size).astype(dtype)  # 111 records + 1
    path = tmp_path / name
    tokens.tofile(path) if name.endswith(".bin") else np.save(path, tokens)
    bin_dtype = dtype if name.endswith(".bin") else None  # a .npy's is in its header
    [source] = data.prepare(
        str(tmp_path / "dir"), SEQ_LEN, vocab_size, str(path), bin_dtype
    )
    assert isinstance(source.files[0], np.memmap)  # mapped, not loaded nor converted
    assert source.files[0].dtype == np.dtype(dtype)
    assert len(source) == 111
    assert source[0].dtype == np.int32
    np.testing.assert_array_equal(read_all(source), records_of(tokens))
    assert tokens.max() > 65_535 or vocab_size < 65_536  # uint32 ids are not cut
    # One shuffled epoch of batches holds every record once.
    [batch] = first_batches(data.batches([source], 111, slice(0, 111), seed=0), 1)
    assert sorted(map(tuple, batch)) == sorted(map(tuple, records_of(tokens)))
    assert not (tmp_path / "dir").exists()  # nothing written for a reader's tokens


def test_a_bin_needs_its_dtype_and_whole_ids(tmp_path):
    np.arange(100, dtype=np.uint16).tofile(tmp_path / "ids.bin")
    with pytest.raises(SystemExit) as raised:
        data.prepare(str(tmp_path), SEQ_LEN, 100, str(tmp_path / "ids.bin"))
    assert str(raised.value) == (
        f"--data {tmp_path / 'ids.bin'}: a raw .bin does not say its dtype; "
        "pass --data-dtype uint16 or uint32"
    )
    # 200 bytes of uint16 ids are 50 uint32 ids; 202 bytes are not a whole number.
    with open(tmp_path / "ids.bin", "ab") as file:
        file.write(b"\0\0")
    with pytest.raises(SystemExit) as raised:
        data.prepare(str(tmp_path), SEQ_LEN, 100, str(tmp_path / "ids.bin"), "uint32")
    assert str(raised.value) == (
        f"--data {tmp_path / 'ids.bin'}: 202 bytes is not a whole number of uint32 "
        "token ids"
    )


def train_flags(**given) -> RunConfig:
    """train.py's run config, with the flags that data.check_paths reads."""
    flags = dict(
        compile_only=False,
        model_config=None,
        data=None,
        data_dtype="uint16",
        seq_len=SEQ_LEN,
        checkpoint_dir=None,
        log_dir=None,
        profile=None,
    )
    return RunConfig(**(flags | given))


def write_npy_bytes(path: pathlib.Path, size: int) -> None:
    """The first ``size`` bytes of a .npy of 100 int32 ids."""
    np.save(path, np.arange(100, dtype=np.int32))
    path.write_bytes(path.read_bytes()[:size])


# name -> (how to write it, what the refusal says after "--data PATH: ", a regex)
BAD_FILES = {
    "missing.npy": (lambda p: None, "No such file or directory"),
    "empty.npy": (
        lambda p: write_npy_bytes(p, 0),
        r"is empty \(0 bytes\); write the token ids with numpy\.save",
    ),
    "text.npy": (
        lambda p: p.write_text("1 2 3\n" * 20),
        r"has no NumPy header; write the token ids with numpy\.save",
    ),
    # 50 bytes: into the header; 200: the header (128) and 18 of the 100 ids.
    "header_cut.npy": (
        lambda p: write_npy_bytes(p, 50),
        r"NumPy cannot map this \.npy \(EOF: .*\); write the token ids again with "
        r"numpy\.save",
    ),
    "ids_cut.npy": (
        lambda p: write_npy_bytes(p, 200),
        r"NumPy cannot map this \.npy \(mmap length .*\); write the token ids again "
        r"with numpy\.save",
    ),
    "floats.npy": (
        lambda p: np.save(p, np.zeros(100, np.float32)),
        r"expected a 1-D array of integer token ids, not float32 of shape \(100,\)",
    ),
    "rows.npy": (
        lambda p: np.save(p, np.zeros((10, 9), np.int32)),
        r"expected a 1-D array of integer token ids, not int32 of shape \(10, 9\)",
    ),
    "odd.bin": (
        lambda p: p.write_bytes(bytes(201)),
        "201 bytes is not a whole number of uint16 token ids",
    ),
    "folder.npy": (lambda p: p.mkdir(), "Is a directory"),
}


def refusal(tmp_path, given: str) -> str:
    """The line with which both train.py's start-up check and prepare refuse --data."""
    with pytest.raises(SystemExit) as early:
        data.check_paths(train_flags(data=given))
    with pytest.raises(SystemExit) as late:
        data.prepare(str(tmp_path), SEQ_LEN, 100, given, "uint16")
    assert str(early.value) == str(late.value)
    return str(early.value)


@pytest.mark.parametrize("name", BAD_FILES)
def test_a_bad_data_file_stops_in_one_line(tmp_path, name):
    """Alone, as one of a list, or as a shard of a directory: one line that names it."""
    write, reason = BAD_FILES[name]
    shards = tmp_path / "shards"
    shards.mkdir()
    np.arange(100, dtype=np.uint16).tofile(shards / "00.bin")
    write(shards / name)
    bad = str(shards / name)
    given = {"alone": bad, "listed": f"{shards / '00.bin'},{bad}", "shard": str(shards)}
    # A missing shard is no shard, and a directory named x.npy, given, is one of shards.
    only = {"missing.npy": ["alone", "listed"], "folder.npy": ["shard"]}
    for form in only.get(name, given):
        line = refusal(tmp_path, given[form])
        assert re.fullmatch(f"--data {re.escape(bad)}: {reason}", line), (form, line)


def test_data_entries_that_are_not_token_files(tmp_path):
    """A .txt, a folder without shards, a missing folder, an empty list entry, and
    files too short for one sequence: each refused in one line."""
    (tmp_path / "ids.txt").write_text("1 2 3")
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "ids.txt").write_text("1 2 3")
    few = tmp_path / "few"
    few.mkdir()
    np.arange(5, dtype=np.uint16).tofile(few / "00.bin")
    (few / "01.bin").touch()
    refusals = {
        f"{tmp_path}/ids.txt": f"--data {tmp_path}/ids.txt: expected a .npy or a .bin "
        "file of token ids",
        f"{tmp_path}/texts": f"--data {tmp_path}/texts: the directory has no .npy or "
        ".bin files",
        f"{tmp_path}/nothere": f"--data {tmp_path}/nothere: No such file or directory",
        f"{tmp_path}/ids.txt,": f"--data {tmp_path}/ids.txt,: an empty entry; separate "
        "files or directories with one comma, e.g. a.bin,b.bin",
        str(few): f"--data {few}/00.bin, {few}/01.bin: 5 tokens cannot fill one "
        "sequence of 9",
    }
    for given, message in refusals.items():
        assert refusal(tmp_path, given) == message
    # --compile-only reads no data: a path of the cluster's is not refused on a laptop.
    data.check_paths(train_flags(data=f"{tmp_path}/nothere", compile_only=True))


def test_directories_a_run_writes_must_be_directories(tmp_path):
    """--checkpoint-dir, --log-dir, --profile and --data-dir: a file, or a path through
    a file, is refused in one line; a new directory or a URL is not, and nothing is
    made before the run."""
    afile = tmp_path / "metrics.jsonl"
    afile.write_text("{}")
    for flag in ("--checkpoint-dir", "--log-dir", "--profile"):
        name = flag[2:].replace("-", "_")
        for path, why in (
            (afile, "is a file, not a directory"),
            (afile / "sub", f"{afile} is a file, not a directory"),
        ):
            with pytest.raises(SystemExit) as raised:
                data.check_paths(train_flags(**{name: str(path)}))
            assert str(raised.value) == f"{flag} {path}: {why}"
        for fine in (str(tmp_path / "new" / "sub"), "gs://bucket/run"):
            data.check_paths(train_flags(**{name: fine}))
    assert not (tmp_path / "new").exists()
    with pytest.raises(SystemExit) as raised:
        data.prepare(str(afile), SEQ_LEN, 2048)
    assert str(raised.value) == (
        f"--data-dir {afile}: is a file, not a directory; pass a directory to keep the "
        "corpus's tokens in, or --data"
    )


def test_model_config_must_be_a_readable_file(tmp_path):
    """Checked with --compile-only too, which builds the model from it."""
    for path, why in ((tmp_path / "none.json", "No such file"), (tmp_path, "Is a")):
        for compile_only in (False, True):
            flags = train_flags(model_config=str(path), compile_only=compile_only)
            message = f"^--model-config {re.escape(str(path))}: {why}"
            with pytest.raises(SystemExit, match=message):
                data.check_paths(flags)


def test_a_model_config_that_is_not_a_llama_config_json_stops_in_one_line(tmp_path):
    """config_from_hf: broken JSON, a list, a config without the model's sizes."""
    from jaxdist_lm import model_config

    path = tmp_path / "config.json"
    cases = {
        '{"hidden_size": 64,': "Expecting property name enclosed in double quotes",
        "[1, 2]": "not a JSON object; expected a Hugging Face config.json",
        '{"hidden_size": 64, "vocab_size": 100}': (
            "no num_attention_heads, num_hidden_layers, intermediate_size; "
            "is it a Llama config.json?"
        ),
    }
    for text, reason in cases.items():
        path.write_text(text)
        with pytest.raises(SystemExit, match=f"^{re.escape(str(path))}: ") as raised:
            model_config.config_from_hf(str(path))
        assert reason in str(raised.value) and "\n" not in str(raised.value)


@pytest.mark.skipif(
    os.geteuid() == 0, reason="root reads and writes whatever the permissions say"
)
def test_what_this_user_cannot_read_or_write(tmp_path):
    np.arange(100, dtype=np.uint16).tofile(tmp_path / "ids.bin")
    (tmp_path / "ids.bin").chmod(0)
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        with pytest.raises(SystemExit) as raised:
            data.check_paths(train_flags(data=str(tmp_path / "ids.bin")))
        assert str(raised.value) == f"--data {tmp_path}/ids.bin: Permission denied"
        with pytest.raises(SystemExit) as raised:
            data.check_paths(train_flags(log_dir=str(locked / "logs")))
        assert str(raised.value) == (
            f"--log-dir {locked}/logs: this user cannot write in {locked}"
        )
    finally:
        locked.chmod(0o700)


def test_train_py_refuses_missing_data_in_one_line(tmp_path):
    """The one subprocess: train.py's own exit, one line on stderr and status 2."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "JAXDIST"))}
    command = [
        sys.executable,
        "-m",
        "jaxdist_lm.train",
        "--data",
        str(tmp_path / "missing.npy"),
        "--compilation-cache",
        str(tmp_path / "cache"),
    ]
    result = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert (
        result.stderr == f"--data {tmp_path}/missing.npy: No such file or directory\n"
    )


def test_an_id_outside_the_vocabulary_says_where(tmp_path, monkeypatch):
    tokens = np.arange(2000, dtype=np.uint32) % 1000
    tokens[1234] = 50_000
    tokens.tofile(tmp_path / "ids.bin")
    path = str(tmp_path / "ids.bin")
    message = (
        f"token id 50000 at position 1234 of {path} is outside the vocabulary 32000"
    )
    with pytest.raises(SystemExit) as raised:  # the start-up scan of a small file
        data.prepare(str(tmp_path), SEQ_LEN, 32_000, path, "uint32")
    assert str(raised.value) == message
    # uint32 ids read as uint16: [t0, 0, t1, 0, ...] fits; uint16 read as uint32 does
    # not, and the first chunk's scan says so even in a file too large to scan whole.
    monkeypatch.setattr(data, "FULL_SCAN_TOKENS", 100)
    monkeypatch.setattr(data, "SCAN_CHUNK", 64)
    tokens[:1000].astype(np.uint16).tofile(tmp_path / "short.bin")
    with pytest.raises(SystemExit, match=r"^token id 65536 at position 0 of "):
        data.prepare(
            str(tmp_path), SEQ_LEN, 32_000, str(tmp_path / "short.bin"), "uint32"
        )
    # Too large to scan whole: the first 64 ids pass, and the record that holds the bad
    # id stops the batches when it is read (records 0-221; record 137 holds 1233-1241).
    [source] = data.prepare(str(tmp_path), SEQ_LEN, 32_000, path, "uint32")
    with pytest.raises(ValueError) as raised:
        source[137]
    assert str(raised.value) == message
    with pytest.raises(ValueError, match="^token id 50000 at position 1234 of"):
        first_batches(data.batches([source], 222, slice(0, 222), seed=0), 1)


def two_files(tmp_path) -> str:
    """a.bin's ids are below 50, b.npy's 50 or more: a record says where it came from."""
    rng = np.random.default_rng(0)  # random ids: records that differ from each other
    rng.integers(0, 50, 3000).astype(np.uint16).tofile(tmp_path / "a.bin")  # 333
    np.save(tmp_path / "b.npy", rng.integers(50, 100, 900).astype(np.int32))  # 100
    return f"{tmp_path / 'a.bin'},{tmp_path / 'b.npy'}"


def test_a_mixture_draws_in_proportion_and_resumes_exactly(tmp_path):
    sources = data.sources(str(tmp_path), SEQ_LEN, 100, two_files(tmp_path), "uint16")
    assert [len(s) for s in sources] == [333, 100]
    batches = data.batches(sources, 16, slice(0, 16), seed=0, weights="0.75,0.25")
    drawn = np.concatenate(first_batches(batches, 50))  # 800 records: b's 100 twice
    from_a = int(np.sum(drawn[:, 0] < 50))
    assert from_a == 600  # 0.75 of 800: Grain interleaves 3 of a, 1 of b
    assert len(set(map(tuple, drawn[drawn[:, 0] >= 50]))) == 100  # all of b, repeated

    # Saved after 7 batches with Grain's own checkpoint handler (train.py's, through
    # Orbax), a new iterator continues with the batches the first one read next.
    batches = data.batches(sources, 16, slice(0, 16), seed=0, weights="0.75,0.25")
    first_batches(batches, 7)
    handler = grain.checkpoint.CheckpointHandler()
    handler.save(tmp_path, args=grain.checkpoint.CheckpointSave(batches))
    expected = first_batches(batches, 5)
    resumed = data.batches(sources, 16, slice(0, 16), seed=0, weights="0.75,0.25")
    handler.restore(tmp_path, args=grain.checkpoint.CheckpointRestore(resumed))
    for got, want in zip(first_batches(resumed, 5), expected, strict=True):
        np.testing.assert_array_equal(got, want)
    # And from a batch index alone (train.py's restore on another process count).
    again = data.batches(sources, 16, slice(0, 16), seed=0, weights="0.75,0.25")
    again.set_state({"next_index": 7})
    np.testing.assert_array_equal(next(again), expected[0])

    with pytest.raises(SystemExit, match=r"^--data-weights 1: expected 2 positive"):
        data.batches(sources, 16, slice(0, 16), seed=0, weights="1")


def test_a_directory_of_shards_is_one_source(tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    parts = [np.arange(s, s + n) % 60 for s, n in [(0, 100), (7, 95), (3, 40)]]
    parts[0].astype(np.uint32).tofile(shards / "00.bin")  # 11 records, 1 id unread
    np.save(shards / "01.npy", parts[1].astype(np.uint16))  # 10 records, 5 unread
    parts[2].astype(np.uint32).tofile(shards / "02.bin")  # 4 records, 4 unread
    (shards / "README").write_text("not a shard")
    [source] = data.prepare(str(tmp_path), SEQ_LEN, 60, f"{shards}/", "uint32")
    assert len(source) == 25
    expected = np.concatenate([records_of(p) for p in parts])  # none straddles two
    np.testing.assert_array_equal(read_all(source), expected)
    [batch] = first_batches(data.batches([source], 25, slice(0, 25), seed=3), 1)
    assert sorted(map(tuple, batch)) == sorted(map(tuple, expected))


def test_the_evaluation_split_is_held_out(tmp_path):
    """The first source's last 2 x 16 records: in file order, the same on every call and
    in any row split, and never in the training batches."""
    sources = data.sources(str(tmp_path), SEQ_LEN, 100, two_files(tmp_path), "uint16")
    held = data.eval_batches(sources[0], 16, slice(0, 16), num_batches=2)
    assert [b.shape for b in held] == [(16, 9), (16, 9)]
    np.testing.assert_array_equal(np.concatenate(held), read_all(sources[0])[-32:])
    halves = [data.eval_batches(sources[0], 16, slice(r, r + 8), 2) for r in (0, 8)]
    for b in range(2):
        np.testing.assert_array_equal(
            np.concatenate([halves[0][b], halves[1][b]]), held[b]
        )
    training = data.batches(sources, 16, slice(0, 16), seed=0, held_out_batches=2)
    drawn = np.concatenate(first_batches(training, 60))  # 720 of a: 2.4 epochs of 301
    trained = set(map(tuple, drawn))
    assert len(trained & set(map(tuple, read_all(sources[0])))) == 333 - 32
    assert trained.isdisjoint(map(tuple, np.concatenate(held)))
    with pytest.raises(SystemExit, match="^30 evaluation batches of 16 need more"):
        data.eval_batches(sources[0], 16, slice(0, 16), num_batches=30)


@pytest.mark.parametrize("weights", [None, "0.75,0.25"])
def test_two_processes_rows_make_the_one_process_batch(tmp_path, weights):
    sources = data.sources(str(tmp_path), SEQ_LEN, 100, two_files(tmp_path), "uint16")
    if weights is None:
        sources = sources[:1]

    def rows(r: slice):
        return data.batches(sources, 16, r, seed=1, weights=weights)

    whole, halves = rows(slice(0, 16)), [rows(slice(0, 8)), rows(slice(8, 16))]
    for _ in range(30):  # past the end of b's first epoch
        expected = next(whole)
        np.testing.assert_array_equal(
            np.concatenate([next(h) for h in halves]), expected
        )
    with pytest.raises(ValueError, match="do not tile a global batch of 16"):
        rows(slice(0, 6))


def test_the_default_corpus_is_tokenized_once_and_read_in_place(tmp_path):
    [source] = data.prepare(str(tmp_path), 128, 2048)
    tokens = np.load(tmp_path / "pydoc-2048.npy", mmap_mode="r")
    assert tokens.dtype == np.uint16 and tokens.max() < 2048
    assert len(source) == len(tokens) // 129
    end = len(source) * 129  # the last record's end: a partial one is not read
    np.testing.assert_array_equal(source[len(source) - 1], tokens[end - 129 : end])
    mtime = (tmp_path / "pydoc-2048.npy").stat().st_mtime_ns
    data.sources(str(tmp_path), 128, 2048)
    assert (tmp_path / "pydoc-2048.npy").stat().st_mtime_ns == mtime
