"""jaxdist_lm/convert.py against transformers' Llama, the reference implementation.

A small random LlamaForCausalLM (PyTorch, CPU, float32) is saved as safetensors,
converted to the recipe's checkpoint and back: the recipe's logits equal transformers'
(eager attention) to 1e-4, the way back gives the same tensors exactly, and train.py
resumes from the converted checkpoint and trains. Those parity tests need
requirements-parity.txt (torch, transformers) and skip without it; the others (the
command line, config.json) need requirements.txt alone, as convert.py does.
"""

import contextlib
import dataclasses
import io
import json
import pathlib
import shutil

import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
from safetensors import numpy as safetensors_numpy

try:
    import torch
    import transformers
except ImportError:
    torch = transformers = None
parity = pytest.mark.skipif(
    transformers is None, reason="needs requirements-parity.txt (torch, transformers)"
)

ROOT = pathlib.Path(__file__).resolve().parents[1]
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxdist_lm import (  # noqa: E402
    convert,
    model_config,
    train,
)
from jaxdist_lm import hf_tensors as hf_lib  # noqa: E402
from jaxdist_lm import model as model_lib  # noqa: E402

# Llama 3.1's rope_scaling (meta-llama/Llama-3.1-8B, config.json); with head_dim 16 and
# theta 500,000 its 8 frequencies fall in all three bands (kept, blended, divided).
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
CASES = {
    "untied": {"tie_word_embeddings": False},
    # heads of 32 where the width gives 4 x 16 (Gemma's, Qwen3's shapes)
    "head_dim": {"tie_word_embeddings": False, "head_dim": 32},
    "tied_llama3_rope": {
        "tie_word_embeddings": True,
        "rope_scaling": LLAMA3_SCALING,
        "rope_theta": 500_000.0,
        "max_position_embeddings": 131_072,
    },
}
VOCAB = 384


def hf_llama(directory: pathlib.Path, **extra) -> "transformers.LlamaForCausalLM":
    """A random 2-layer Llama with grouped-query attention, saved in ``directory``."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        rms_norm_eps=1e-5,
        # 5x the default 0.02: logits of about 1, so that the RoPE scaling left out
        # moves them by 0.09, not 1e-4 (measured)
        initializer_range=0.1,
        attn_implementation="eager",
        **extra,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms start at 1: random scales make the test stricter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    model.save_pretrained(directory, safe_serialization=True)
    return model


def restore_state(checkpoint: pathlib.Path, step: int = 0) -> dict:
    """A step's whole state item as NumPy arrays, through Orbax's own restore."""
    path = (checkpoint / str(step) / "state").absolute()
    tree = ocp.PyTreeCheckpointHandler().metadata(path).tree
    with ocp.PyTreeCheckpointer() as checkpointer:
        as_numpy = jax.tree.map(
            lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree
        )
        return checkpointer.restore(
            path, args=ocp.args.PyTreeRestore(restore_args=as_numpy)
        )


@pytest.fixture(scope="module", params=sorted(CASES))
def converted(request, tmp_path_factory):
    """(case, the transformers model, its directory, the recipe checkpoint)."""
    top = tmp_path_factory.mktemp(request.param)
    hf_dir, checkpoint = top / "hf", top / "checkpoint"
    model = hf_llama(hf_dir, **CASES[request.param])
    convert.main(["from-hf", str(hf_dir), str(checkpoint)])
    return request.param, model, hf_dir, checkpoint


@parity
def test_logits_match_transformers(converted):
    case, hf_model, hf_dir, checkpoint = converted
    config = model_config.config_from_hf(str(hf_dir / "config.json"))
    assert config.tie_embeddings == (case == "tied_llama3_rope")
    assert (config.rope_scaling is not None) == (case == "tied_llama3_rope")
    assert config.head_width == (32 if case == "head_dim" else 16)
    params = restore_state(checkpoint)["params"]
    tokens = np.random.default_rng(0).integers(0, VOCAB, (3, 128))
    with torch.no_grad():
        expected = hf_model(torch.tensor(tokens)).logits.numpy()

    def logits(config: model_config.ModelConfig, params: dict) -> np.ndarray:
        model = model_lib.abstract(config, jnp.float32, "none")
        return np.asarray(model_lib.with_params(model, params)(jnp.asarray(tokens))[0])

    np.testing.assert_allclose(logits(config, params), expected, atol=1e-4, rtol=0)
    # The test can fail: Meta's pairing of RoPE's features (q and k's rows as Meta
    # stores them, before transformers' permute) and, for Llama 3.1, unscaled
    # frequencies move the logits by 1e-2 or more (measured: 0.03 and 0.09).
    meta = jax.tree_util.tree_map_with_path(
        lambda path, w: pair_neighbours(w) if path[-1].key in ("query", "k") else w,
        params,
    )
    assert np.abs(logits(config, meta) - expected).max() > 1e-2
    if config.rope_scaling:
        unscaled = dataclasses.replace(config, rope_scaling=None)
        assert np.abs(logits(unscaled, params) - expected).max() > 1e-2


def pair_neighbours(w: np.ndarray) -> np.ndarray:
    """Each head's features reordered so that rotate_half's pairs (i, i + A/2) become
    neighbours (2i, 2i + 1): the inverse of transformers' permute, Meta's layout."""
    *lead, width = w.shape  # the last axis: A
    return w.reshape(*lead, 2, width // 2).swapaxes(-1, -2).reshape(w.shape)


@parity
def test_round_trip_gives_the_same_tensors(converted, tmp_path):
    _, _, hf_dir, checkpoint = converted
    convert.main(["to-hf", str(checkpoint), str(tmp_path)])
    original = safetensors_numpy.load_file(hf_dir / "model.safetensors")
    back = safetensors_numpy.load_file(tmp_path / "model.safetensors")
    assert sorted(back) == sorted(original)
    for name, tensor in original.items():
        assert back[name].dtype == tensor.dtype, name
        np.testing.assert_array_equal(back[name], tensor, err_msg=name)
    assert json.loads((tmp_path / "config.json").read_text()) == json.loads(
        (hf_dir / "config.json").read_text()
    )
    reloaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    assert reloaded.config.tie_word_embeddings == ("lm_head.weight" not in original)


@parity
def test_train_resumes_from_the_converted_checkpoint(converted, tmp_path):
    """train.py finds step 0 (no data item: the iterator starts at the step), with
    the optimizer's fresh state, and trains one step from Llama's weights."""
    case, _, hf_dir, converted_checkpoint = converted
    checkpoint = tmp_path / "checkpoint"  # a copy: the run saves its step 1 there
    shutil.copytree(converted_checkpoint, checkpoint)
    tokens = np.random.default_rng(1).integers(0, VOCAB, 4096).astype(np.int32)
    np.save(tmp_path / "tokens.npy", tokens)
    argv = [
        "--model-config",
        str(hf_dir / "config.json"),
        "--checkpoint-dir",
        str(checkpoint),
        "--steps",
        "1",
        "--global-batch",
        "8",
        "--seq-len",
        "32",
        "--mesh",
        "fsdp=-1",
        "--data",
        str(tmp_path / "tokens.npy"),
        "--data-dir",
        str(tmp_path / "data"),
        "--checkpoint-every",
        "1000",
    ]
    args = train.parse_args(argv)
    mesh, model, tx, step, shapes, init = train.setup(args)
    manager = train.checkpoint_manager(
        args.checkpoint_dir, args.keep, args.checkpoint_every
    )
    batches = train.data.batches(
        train.data.prepare(args.data_dir, args.seq_len, VOCAB, args.data),
        args.global_batch,
        slice(0, args.global_batch),
        args.seed,
    )
    state, _ = train.restore(manager, shapes, batches)
    manager.close()
    assert int(state.step) == 0
    fresh = tx.init(state.params)  # the optimizer's state before any update
    assert jax.tree.all(
        jax.tree.map(
            lambda a, b: bool(np.all(np.asarray(a) == b)), state.opt_state, fresh
        )
    )
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        train.train(args, mesh, model, step, shapes, init)
    assert "resumed from step 0" in out.getvalue()
    assert "step 1 loss" in out.getvalue()
    loss = float(out.getvalue().split("step 1 loss ")[1].split()[0])
    assert loss < np.log(VOCAB) + 2  # a random Llama on random tokens: about ln V
    if case == "tied_llama3_rope":
        return
    # to-hf reads train.py's own step 1 (once: the tied case reads the same way):
    # arrays in chunks of its mesh's shards, each chunk spanning every layer.
    convert.main(["to-hf", str(checkpoint), str(tmp_path / "back")])
    trained = restore_state(checkpoint, 1)["params"]
    back = safetensors_numpy.load_file(tmp_path / "back" / "model.safetensors")
    for t in convert.hf_tensors(model.config):
        leaf = convert.get_path(trained, t.path)
        expected = t.back(leaf if t.layer is None else leaf[t.layer], model.config)
        np.testing.assert_array_equal(back[t.name], expected, err_msg=t.name)


def test_config_json_of_the_hub_and_head_dim(tmp_path):
    """The Hub's Llama 3.x spelling (rope_theta, rope_scaling: transformers 4) reads as
    transformers 5's rope_parameters does; a head_dim that is not D/N is kept."""
    hub = {
        "model_type": "llama",
        "vocab_size": 128256,
        "num_hidden_layers": 16,
        "hidden_size": 2048,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 8192,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
        "head_dim": 64,
        "rope_scaling": {**LLAMA3_SCALING, "factor": 32.0},
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hub))
    config = model_config.config_from_hf(str(path))
    assert config == dataclasses.replace(
        model_config.PRESETS["1b"],
        norm_eps=1e-5,
        rope_scaling=model_config.RopeScaling(32.0, 1.0, 4.0, 8192),
    )
    path.write_text(json.dumps({**hub, "head_dim": 128}))
    wide = model_config.config_from_hf(str(path))
    assert (wide.head_dim, wide.head_width) == (128, 128)
    assert model_config.config_to_hf(wide)["head_dim"] == 128


@parity
def test_rope_frequencies_match_transformers():
    """Llama 3.1's scaled frequencies, against transformers' own function."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.LlamaConfig(
        hidden_size=2048,
        num_attention_heads=16,
        rope_theta=500_000.0,
        rope_scaling=LLAMA3_SCALING,
    )
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    scaling = model_config.RopeScaling(8.0, 1.0, 4.0, 8192)
    ours = model_lib.rope_frequencies(64, 500_000.0, scaling)
    np.testing.assert_allclose(np.asarray(ours), expected.numpy(), rtol=1e-6)
    unscaled = model_lib.rope_frequencies(64, 500_000.0)
    assert not np.allclose(np.asarray(ours), np.asarray(unscaled))


@parity
def test_sharded_bfloat16_checkpoint_round_trip(tmp_path, monkeypatch):
    """As the Hub's Llamas come: bfloat16, in shards named by
    model.safetensors.index.json. from-hf of the shards gives the state that from-hf of
    one file gives, written a block at a time (blocks of 4 KiB here: a layer, or rows of
    the embeddings, each); to-hf writes shards again, which transformers loads. Float32
    holds every bfloat16 value, so the tensors come back exact, in bfloat16."""
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    # Saved float32, then again in bfloat16, whole and sharded.
    hf_llama(single)
    model = transformers.LlamaForCausalLM.from_pretrained(single, dtype=torch.bfloat16)
    model.save_pretrained(single, safe_serialization=True)
    model.save_pretrained(sharded, safe_serialization=True, max_shard_size="60KB")
    index = json.loads((sharded / convert.INDEX).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and not (sharded / "model.safetensors").exists()
    convert.main(["from-hf", str(single), str(tmp_path / "from_single")])
    monkeypatch.setattr(hf_lib, "BLOCK_BYTES", 4096)
    # Every read of the shards, to check that none holds more than a block: 4 KiB, or
    # one layer's tensor where that is larger, never a whole stacked leaf or table.
    reads, read_rows = [], convert.read_rows
    monkeypatch.setattr(
        convert, "read_rows", lambda *a: reads.append(read_rows(*a)) or reads[-1]
    )
    convert.main(["from-hf", str(sharded), str(tmp_path / "from_shards")])
    tensors = {
        n: np.prod(s) * 4
        for n, s in hf_lib.file_shapes(hf_lib.tensor_files(sharded)).items()
    }
    layer_tensor = max(b for n, b in tensors.items() if ".layers." in n)
    assert max(r.nbytes for r in reads) <= max(4096, layer_tensor)
    assert layer_tensor < tensors["model.embed_tokens.weight"]
    assert sum(r.nbytes for r in reads) == sum(tensors.values())
    whole = restore_state(tmp_path / "from_single")
    blocks = restore_state(tmp_path / "from_shards")
    assert jax.tree.structure(blocks) == jax.tree.structure(whole)
    jax.tree.map(
        lambda a, b: np.testing.assert_array_equal(a, b, strict=True), blocks, whole
    )
    assert blocks["params"]["layers"]["mlp"]["up"]["kernel"].dtype == np.float32

    out = tmp_path / "out"
    convert.main(
        ["to-hf", str(tmp_path / "from_shards"), str(out), "--max-shard-size", "60KB"]
    )
    back_index = json.loads((out / convert.INDEX).read_text())
    files = sorted(set(back_index["weight_map"].values()))
    assert files == [
        f"model-{i:05d}-of-{len(files):05d}.safetensors"
        for i in range(1, len(files) + 1)
    ]
    assert max((out / f).stat().st_size for f in files) < 60_000 + 4096
    back = {}
    for file in files:
        back |= safetensors_numpy.load_file(out / file)
    original = {}
    for shard in shards:
        original |= safetensors_numpy.load_file(sharded / shard)
    assert sorted(back) == sorted(original) == sorted(back_index["weight_map"])
    for name, tensor in original.items():
        assert back[name].dtype == tensor.dtype == ml_dtypes.bfloat16, name
        np.testing.assert_array_equal(back[name], tensor, err_msg=name)
    assert back_index["metadata"]["total_size"] == sum(t.nbytes for t in back.values())
    reloaded = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    expected = model.state_dict()
    for name, tensor in reloaded.state_dict().items():
        assert torch.equal(tensor, expected[name]), name


def test_command_line_needs_requirements_txt_alone(capsys):
    """convert.py's imports (this module's, at collection) and its parser: what
    `python -m jaxdist_lm.convert --help` runs, without torch or transformers."""
    with pytest.raises(SystemExit) as stop:
        convert.parse_args(["to-hf", "--help"])
    assert stop.value.code == 0
    assert "--max-shard-size" in capsys.readouterr().out
    sizes = {"5GB": 5 * 10**9, "2GiB": 2 * 2**30, "60KB": 60_000, "1000": 1000}
    for text, size in sizes.items():
        args = convert.parse_args(["to-hf", "in", "out", "--max-shard-size", text])
        assert args.max_shard_size == size
    with pytest.raises(SystemExit) as stop:
        convert.parse_args(["to-hf", "in", "out", "--max-shard-size", "5XB"])
    assert stop.value.code == 2
    assert capsys.readouterr().err.endswith(
        "argument --max-shard-size: '5XB': expected a size such as 5GB, 500MB or 2GiB\n"
    )


def refusal(argv: list[str]) -> str:
    """convert.py's one-line refusal of ``argv`` (``__main__`` prints it, status 2)."""
    with pytest.raises(SystemExit) as stop:
        convert.main(argv)
    return stop.value.code


def test_refusals_say_what_is_missing(tmp_path):
    """One line each, before any work: no config.json, no weights, no checkpoint."""
    hf_dir, checkpoint = tmp_path / "hf", tmp_path / "checkpoint"
    hf_dir.mkdir()
    from_hf = ["from-hf", str(hf_dir), str(checkpoint)]
    assert refusal(from_hf) == f"{hf_dir}: no config.json"
    config = model_config.config_to_hf(model_config.PRESETS["tiny"])
    (hf_dir / "config.json").write_text(json.dumps(config))
    assert refusal(from_hf) == (
        f"{hf_dir}: no model.safetensors and no model.safetensors.index.json"
    )
    to_hf = ["to-hf", str(checkpoint), str(tmp_path / "out"), "--model", "tiny"]
    assert refusal(to_hf) == f"{checkpoint} has no checkpoint"
    assert not checkpoint.exists()


@pytest.mark.parametrize("preset", sorted(model_config.PRESETS))
def test_a_presets_config_json_reads_back_as_the_preset(preset, tmp_path):
    """to-hf --model PRESET writes model_config.config_to_hf's config.json: the same shape."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(model_config.config_to_hf(model_config.PRESETS[preset])))
    assert model_config.config_from_hf(str(path)) == model_config.PRESETS[preset]
