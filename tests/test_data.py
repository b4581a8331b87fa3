"""The input pipeline: the offline TFDS dataset, sharded global batches, determinism, per-process slices."""

import functools
import os

import jax
import numpy as np
import pytest
import tensorflow_datasets as tfds
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from sklearn.datasets import load_digits

from jaxdist_lessons import data
from jaxdist_lessons.mesh import mesh_shape

N = jax.device_count()
MAX_SHIFT = data.Preprocess().max_shift


@functools.cache
def digits(split):
    return data.source(data.DIGITS, split, data_dir=str(pytest.digits_dir))


@pytest.fixture(scope="module", autouse=True)
def digits_dir(tmp_path_factory):
    pytest.digits_dir = tmp_path_factory.mktemp("tfds")


def test_offline_dataset_is_scikit_learns_digits_built_by_tfds_as_array_record():
    train, test = digits("train"), digits("test")
    assert (len(train), len(test)) == (1437, 360)
    assert type(train).__name__ == "ArrayRecordDataSource"
    reference = load_digits()
    upscaled = lambda i: (
        (np.kron(reference.images[i], np.ones((4, 4))) * (255 / 16))
        .round()
        .astype(np.uint8)
    )
    index = {
        (upscaled(i).tobytes(), int(reference.target[i])): i
        for i in range(len(reference.images))
    }
    for split, source in [("train", train), ("test", test)]:
        found = set()
        for k in range(len(source)):
            example = source[k]
            assert (
                example["image"].shape == (32, 32, 1)
                and example["image"].dtype == np.uint8
            )
            found.add(
                index[(example["image"][..., 0].tobytes(), int(example["label"]))]
            )
        # every 5th digit is held out for testing; the rest train
        expected = {
            i for i in range(len(reference.images)) if (i % 5 == 0) == (split == "test")
        }
        assert len(source) == len(expected)
        assert found <= expected


def test_batches_are_global_arrays_sharded_over_data():
    mesh = jax.make_mesh(
        mesh_shape(N, data=-1, tensor=2) if N > 1 else (1, 1),
        ("data", "tensor"),
        axis_types=(AxisType.Explicit,) * 2,
    )
    batch = next(data.batches(digits("train"), 8 * N, mesh, seed=0))
    assert (
        batch["images"].shape == (8 * N, 32, 32, 3)
        and batch["images"].dtype == np.float32
    )
    assert batch["labels"].shape == (8 * N,) and batch["labels"].dtype == np.int32
    assert batch["images"].sharding.spec == P("data")
    ways = mesh.shape["data"]
    assert {s.data.shape for s in batch["images"].addressable_shards} == {
        (8 * N // ways, 32, 32, 3)
    }
    assert float(batch["mask"].sum()) == 8 * N


def labels_of(batches):
    return np.concatenate([np.asarray(b["labels"]) for b in batches])


def test_order_is_deterministic_for_a_seed_and_changes_with_the_epoch():
    mesh = jax.make_mesh((N,), ("data",), axis_types=(AxisType.Explicit,))
    source = digits("test")
    run = lambda **kw: labels_of(data.batches(source, 4 * N, mesh, **kw))
    np.testing.assert_array_equal(run(seed=3, epoch=1), run(seed=3, epoch=1))
    assert not np.array_equal(run(seed=3, epoch=1), run(seed=3, epoch=2))
    assert not np.array_equal(run(seed=3, epoch=1), run(seed=4, epoch=1))
    in_order = run(shuffle=False)
    np.testing.assert_array_equal(
        in_order, [int(source[i]["label"]) for i in range(len(in_order))]
    )


@pytest.mark.parametrize("drop_remainder", [True, False])
def test_remainder_is_dropped_or_padded_and_masked(drop_remainder):
    mesh = jax.make_mesh((N,), ("data",), axis_types=(AxisType.Explicit,))
    # 360 examples: a partial last batch for N >= 2
    source, global_batch = (
        digits("test"),
        16 * N,
    )
    batches = list(
        data.batches(
            source, global_batch, mesh, shuffle=False, drop_remainder=drop_remainder
        )
    )
    assert len(batches) == data.num_batches(len(source), global_batch, drop_remainder)
    seen = sum(float(b["mask"].sum()) for b in batches)
    if drop_remainder:
        assert seen == len(source) // global_batch * global_batch
    else:
        assert seen == len(source)
        last = batches[-1]
        padded = np.asarray(last["mask"]) == 0
        assert padded.sum() == len(batches) * global_batch - len(source)
        assert np.all(np.asarray(last["images"])[padded] == 0)


# Example i has label i and an image that shows where a shift moved it.
INDEXED = [
    {
        "image": np.pad(
            np.full((4, 4, 1), 1 + i % 250, np.uint8), ((2, 2), (2, 2), (0, 0))
        ),
        "label": i,
    }
    for i in range(100)
]


def layout_batches(process_count, **kwargs):
    """Every global batch as the processes' local batches put side by side, process by process."""
    per_process = [
        list(
            data.loader(
                INDEXED, 24, process_index=p, process_count=process_count, **kwargs
            )
        )
        for p in range(process_count)
    ]
    return [
        {k: np.concatenate([local[k] for local in locals_]) for k in locals_[0]}
        for locals_ in zip(*per_process, strict=True)
    ]


def by_example(batch):
    """A batch's rows keyed by example (its label), padding left out."""
    real = batch["mask"] == 1
    return {
        int(label): image
        for label, image in zip(batch["labels"][real], batch["images"][real])
    }


@pytest.mark.parametrize(
    "options",
    [
        dict(seed=3, epoch=1, augment=True),
        dict(shuffle=False, drop_remainder=False),
    ],
)
def test_every_process_layout_reads_the_same_global_batches(options):
    # 1, 2, 4 and 3 processes (24 is a multiple of each), simulated by process index and count.
    reference = layout_batches(1, **options)
    assert len(reference) == data.num_batches(
        100, 24, options.get("drop_remainder", True)
    )
    seen = [label for batch in reference for label in by_example(batch)]
    assert (
        len(seen)
        == len(set(seen))
        == (96 if options.get("drop_remainder", True) else 100)
    )
    for process_count in (2, 4, 3):
        batches = layout_batches(process_count, **options)
        assert len(batches) == len(reference)
        for got, expected in zip(batches, reference):
            got, expected = by_example(got), by_example(expected)
            assert got.keys() == expected.keys(), process_count  # the same examples
            for label in got:  # identically augmented
                np.testing.assert_array_equal(got[label], expected[label])


def test_each_process_reads_only_its_share():
    # Grain's sharding: process p of P reads examples p, p + P, ... of the shuffled order.
    order = [
        int(b["labels"][i]) for b in layout_batches(1, shuffle=True) for i in range(24)
    ]
    for process_count in (2, 4, 3):
        for p in range(process_count):
            local = data.loader(
                INDEXED, 24, process_index=p, process_count=process_count
            )
            mine = [int(label) for batch in local for label in batch["labels"]]
            assert mine == order[p::process_count]


def test_a_process_layout_that_is_not_the_real_one_fails_loudly():
    mesh = jax.make_mesh((N,), ("data",), axis_types=(AxisType.Explicit,))
    with pytest.raises(
        ValueError, match="global_shape should be None or equal to local_data.shape"
    ):
        next(
            data.batches(digits("test"), 2 * N, mesh, process_index=0, process_count=2)
        )


def test_augmentation_is_seeded_and_only_shifts():
    mesh = jax.make_mesh((N,), ("data",), axis_types=(AxisType.Explicit,))
    source = digits("train")
    first = lambda **kw: np.asarray(
        next(data.batches(source, 2 * N, mesh, seed=1, **kw))["images"]
    )
    plain, shifted, again = (
        first(augment=False),
        first(augment=True),
        first(augment=True),
    )
    np.testing.assert_array_equal(shifted, again)
    assert not np.array_equal(plain, shifted)
    background = (0 - data.Preprocess().mean) / data.Preprocess().std

    def translations(image, s=MAX_SHIFT):
        padded = np.pad(image, ((s, s), (s, s), (0, 0)), constant_values=background)
        h, w = image.shape[:2]
        return [
            padded[y : y + h, x : x + w]
            for y in range(2 * s + 1)
            for x in range(2 * s + 1)
        ]

    # each image is the plain one, translated and zero-filled
    for p, s in zip(plain, shifted):
        assert any(np.allclose(s, t) for t in translations(p))


def test_real_tfds_datasets_through_mock_data():
    mesh = jax.make_mesh((N,), ("data",), axis_types=(AxisType.Explicit,))
    with tfds.testing.mock_data(num_examples=4 * N):
        cifar = data.source("cifar10", "train")
        batch = next(data.batches(cifar, 2 * N, mesh))
        assert batch["images"].shape == (2 * N, 32, 32, 3)
        # images of varying sizes
        imagenette = data.source("imagenette/320px-v2", "train")
        batch = next(
            data.batches(
                imagenette, 2 * N, mesh, preprocess=data.Preprocess(image_size=24)
            )
        )
        assert batch["images"].shape == (2 * N, 24, 24, 3)


def write_split_metadata(data_dir, name, splits):
    """The ``dataset_info.json`` a prepared dataset has, with these splits: what TFDS's mock reads them from."""
    builder = tfds.builder(name, data_dir=str(data_dir), file_format="array_record")
    builder.info.set_splits(
        tfds.core.SplitDict(
            [
                tfds.core.SplitInfo(name=s, shard_lengths=[4], num_bytes=0)
                for s in splits
            ]
        )
    )
    os.makedirs(builder.data_dir, exist_ok=True)
    builder.info.write_to_directory(builder.data_dir)


def test_the_held_out_split_is_validation_where_there_is_one_else_test(tmp_path):
    # The splits of the TFDS catalog: cifar10 has train and test, imagenette train and validation.
    write_split_metadata(tmp_path, "cifar10", ["train", "test"])
    write_split_metadata(tmp_path, "imagenette/320px-v2", ["train", "validation"])
    write_split_metadata(tmp_path, "mnist", ["train"])
    mock = tfds.testing.mock_data(
        num_examples=4, policy=tfds.testing.MockPolicy.USE_FILES, data_dir=str(tmp_path)
    )
    with mock:
        assert data.eval_split("cifar10") == "test"
        assert data.eval_split("imagenette/320px-v2") == "validation"
        assert len(data.source("imagenette/320px-v2", "validation")) == 4
        with pytest.raises(
            ValueError, match=r"'mnist' has no 'validation' or 'test' split"
        ):
            data.eval_split("mnist")
    assert data.eval_split(data.DIGITS, data_dir=str(pytest.digits_dir)) == "test"
    with pytest.raises(ValueError, match="TFDS dataset 'cifar10' is not prepared"):
        data.eval_split("cifar10", data_dir=str(tmp_path / "empty"))


def test_fit_image():
    image = np.arange(40 * 60 * 3, dtype=np.uint8).reshape(40, 60, 3)
    assert data.fit_image(image, 20).shape == (20, 20, 3)
    assert data.fit_image(image[..., :1], 80).shape == (80, 80, 1)


def test_errors_name_the_fix(tmp_path):
    with pytest.raises(
        ValueError,
        match="TFDS dataset 'cifar10' is not prepared in .*: prepare it once with network "
        "access .*or use the offline 'jaxdist_digits'",
    ):
        data.source("cifar10", "train", data_dir=str(tmp_path))
    mesh = jax.make_mesh((N,), ("data",), axis_types=(AxisType.Explicit,))
    if N > 1:
        with pytest.raises(
            ValueError,
            match=f"global batch: a batch of {N + 1} does not split over the {N} devices of mesh axes 'data'",
        ):
            next(data.batches(digits("test"), N + 1, mesh))
    with pytest.raises(
        ValueError, match="global_batch must be a positive integer, got 0"
    ):
        next(data.batches(digits("test"), 0, mesh))
    with pytest.raises(ValueError, match=r"mesh \{'data': \d+\} has no axis 'batch'"):
        next(data.batches(digits("test"), N, mesh, data_axis="batch"))
