"""Input pipeline: TFDS data sources in, global batches sharded over ``data`` out, through Grain.

Two ways to get images:

- **Offline, real images**: ``jaxdist_digits``, a TFDS dataset builder defined here over the
  1,797 handwritten digits that ship inside scikit-learn (8x8, upscaled). It is built with
  TFDS in the ``array_record`` format, which needs no TensorFlow and no network.
- **Real datasets through TFDS**: ``cifar10``, ``imagenette/320px-v2`` or ``imagenet2012``,
  once prepared in ``data_dir`` (preparing them needs the network, and TensorFlow for the
  PNG/JPEG encoding; reading the prepared ``array_record`` files does not).

``loader`` is a Grain pipeline over the TFDS data source: an ``IndexSampler`` shuffled by
``(seed, epoch)``, a ``DataLoader`` sharded by process (``ShardOptions``: process ``p`` of ``P``
reads examples ``p, p + P, p + 2P, ...`` of the shuffled order), per-example decoding and
augmentation, and batching per process. ``batches`` hands each process's batches to
``jax.make_array_from_process_local_data``, which stitches them into one global array sharded over
the mesh's ``data`` axis. Global batch ``b`` holds examples ``b G .. (b + 1) G - 1`` of the shuffled
order whatever the number of processes, and each example's augmentation is seeded by that
position, so every process layout trains on the same examples, identically augmented; only the
order of the rows within a batch follows the processes.

Shape suffixes: see jaxdist_lessons.models.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterator, Sequence
from typing import Any, NotRequired, TypedDict

import grain
import jax
import numpy as np
import tensorflow_datasets as tfds
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist_lessons._checks import positive_int
from jaxdist_lessons.sharding import check_batch_divides

DIGITS = "jaxdist_digits"
DEFAULT_DATA_DIR = os.path.join(
    os.path.expanduser("~"), ".cache", "jaxdist", "tensorflow_datasets"
)


class Batch(TypedDict):
    """The one batch type of the book: a dict of arrays sharing their leading (batch) size."""

    images: Any  # (B, H, W, C) float32
    labels: Any  # (B,) int32 class ids
    mask: NotRequired[Any]  # (B,) float32: 1 for a real example, 0 for padding


class JaxdistDigits(tfds.core.GeneratorBasedBuilder):
    """scikit-learn's handwritten digits, upscaled to 32x32 grey images; 4 of every 5 for training."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {
        "1.0.0": "8x8 digits from scikit-learn, upscaled 4x by pixel repetition."
    }
    IMAGE_SIZE = 32

    def _info(self) -> tfds.core.DatasetInfo:
        # A Tensor feature, not Image: encoding PNGs would need TensorFlow.
        return tfds.core.DatasetInfo(
            builder=self,
            description="1,797 handwritten digits (UCI ML digits via scikit-learn), as 32x32x1 uint8 images.",
            features=tfds.features.FeaturesDict(
                {
                    "image": tfds.features.Tensor(
                        shape=(self.IMAGE_SIZE, self.IMAGE_SIZE, 1), dtype=np.uint8
                    ),
                    "label": tfds.features.ClassLabel(num_classes=10),
                }
            ),
            supervised_keys=("image", "label"),
        )

    def _split_generators(self, dl_manager):
        return {
            "train": self._generate_examples(test=False),
            "test": self._generate_examples(test=True),
        }

    def _generate_examples(self, test: bool):
        from sklearn.datasets import load_digits

        digits = load_digits()
        scale = self.IMAGE_SIZE // digits.images.shape[1]
        for i, (image, label) in enumerate(zip(digits.images, digits.target)):
            if (i % 5 == 0) == test:
                # values 0..16 -> 0..255
                pixels = np.kron(image, np.ones((scale, scale))) * (255 / 16)
                yield (
                    i,
                    {
                        "image": pixels.round().astype(np.uint8)[..., None],
                        "label": int(label),
                    },
                )


def digits_source(
    split: str, data_dir: str | None = None
) -> Sequence[dict[str, np.ndarray]]:
    """The offline dataset's ``split`` as a random-access source, built on first use (about a second).

    With several processes, process 0 builds the files while the others wait at a barrier.
    """
    data_dir = data_dir or DEFAULT_DATA_DIR
    if jax.process_index() == 0:
        JaxdistDigits(
            data_dir=data_dir, file_format="array_record"
        ).download_and_prepare()
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("jaxdist_digits prepared")
    builder = JaxdistDigits(data_dir=data_dir, file_format="array_record")
    return builder.as_data_source(split=split)


def _not_prepared(name: str, data_dir: str | None) -> ValueError:
    return ValueError(
        f"TFDS dataset {name!r} is not prepared in {data_dir or 'the default data_dir'}: prepare it once with "
        f"network access (for example `tfds build {name} --file_format=array_record`), or use the offline "
        f"{DIGITS!r}"
    )


_MISSING = (
    AssertionError,
    FileNotFoundError,
    NotImplementedError,
    tfds.core.registered.DatasetNotFoundError,
)


def source(
    name: str, split: str, data_dir: str | None = None
) -> Sequence[dict[str, np.ndarray]]:
    """A random-access source for ``name``: the offline ``jaxdist_digits`` or any prepared TFDS dataset."""
    if name == DIGITS:
        return digits_source(split, data_dir)
    try:
        return tfds.data_source(name, split=split, data_dir=data_dir, download=False)
    except _MISSING as err:
        raise _not_prepared(name, data_dir) from err


def eval_split(name: str, data_dir: str | None = None) -> str:
    """The held-out split to evaluate on: ``validation`` where the dataset has one, else ``test``.

    Read from the builder's ``info.splits``: cifar10 has ``train`` and ``test``, imagenette ``train``
    and ``validation``.
    """
    if name == DIGITS:
        digits_source("train", data_dir)  # built on first use
        builder = JaxdistDigits(
            data_dir=data_dir or DEFAULT_DATA_DIR, file_format="array_record"
        )
    else:
        try:
            builder = tfds.builder(name, data_dir=data_dir)
        except _MISSING as err:
            raise _not_prepared(name, data_dir) from err
    splits = list(builder.info.splits)
    if not splits:
        raise _not_prepared(name, data_dir)
    for split in ("validation", "test"):
        if split in splits:
            return split
    raise ValueError(
        f"TFDS dataset {name!r} has no 'validation' or 'test' split, only {splits}: hold out part of "
        "'train' with a split like 'train[90%:]'"
    )


@dataclasses.dataclass(frozen=True)
class Preprocess:
    """How images become model inputs: size, channels, normalisation and (for training) augmentation."""

    channels: int = 3
    # resize (shorter side) and centre-crop to this; None keeps the size
    image_size: int | None = None
    mean: float = 0.5
    std: float = 0.25
    max_shift: int = 2  # random translation in pixels, for training batches

    def decode(self, example: dict[str, Any]) -> dict[str, np.ndarray]:
        """One TFDS example as ``{'images', 'labels', 'mask'}``: resized, in ``[0, 1]``, not yet normalised."""
        pixels = np.asarray(example["image"])
        if self.image_size is not None:
            pixels = fit_image(pixels, self.image_size)
        x = pixels.astype(np.float32) / 255.0
        if x.shape[-1] != self.channels:
            x = (
                np.repeat(x, self.channels, axis=-1)
                if x.shape[-1] == 1
                else x[..., : self.channels]
            )
        return {
            "images": x,
            "labels": np.int32(example["label"]),
            "mask": np.float32(example.get("mask", 1.0)),
        }

    def normalize(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Standardise a batch's images; padded rows (mask 0) become zeros."""
        images = (batch["images"] - self.mean) / self.std
        return {**batch, "images": images * batch["mask"][:, None, None, None]}


class _Decode(grain.transforms.Map):
    def __init__(self, preprocess: Preprocess):
        self.preprocess = preprocess

    def map(self, element: dict[str, Any]) -> dict[str, np.ndarray]:
        return self.preprocess.decode(element)


class _RandomShift(grain.transforms.RandomMap):
    """Translate an image by up to ``max_shift`` pixels each way, filling with zeros."""

    def __init__(self, max_shift: int):
        self.max_shift = max_shift

    def random_map(
        self, element: dict[str, np.ndarray], rng: np.random.Generator
    ) -> dict[str, np.ndarray]:
        s, image_HWC = self.max_shift, element["images"]
        h, w, _ = image_HWC.shape
        padded = np.pad(image_HWC, ((s, s), (s, s), (0, 0)))
        dy, dx = rng.integers(0, 2 * s + 1, size=2)
        return {**element, "images": padded[dy : dy + h, dx : dx + w]}


class _Normalize(grain.transforms.Map):
    def __init__(self, preprocess: Preprocess):
        self.preprocess = preprocess

    def map(self, element: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.preprocess.normalize(element)


class _Padded(Sequence):
    """``data`` followed by zero examples with mask 0, up to ``size`` examples."""

    def __init__(self, data: Sequence[dict[str, Any]], size: int):
        self.data, self.size = data, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, Any]:
        if index < len(self.data):
            return self.data[index]
        blank = np.zeros_like(np.asarray(self.data[0]["image"]))
        return {"image": blank, "label": 0, "mask": 0.0}


def num_batches(num_examples: int, global_batch: int, drop_remainder: bool) -> int:
    """Batches per epoch: the last, partial one is dropped or padded."""
    return (
        num_examples // global_batch
        if drop_remainder
        else math.ceil(num_examples / global_batch)
    )


def epoch_seed(seed: int, epoch: int) -> int:
    """A 32-bit seed (what Grain takes) drawn from ``(seed, epoch)``."""
    return int(np.random.SeedSequence([seed, epoch]).generate_state(1)[0])


def loader(
    data: Sequence[dict[str, Any]],
    global_batch: int,
    *,
    seed: int = 0,
    epoch: int = 0,
    shuffle: bool = True,
    augment: bool = False,
    drop_remainder: bool = True,
    preprocess: Preprocess = Preprocess(),
    process_index: int | None = None,
    process_count: int | None = None,
) -> grain.DataLoader:
    """One epoch of this process's share of every global batch, as numpy ``Batch``es.

    A Grain pipeline. The order depends only on ``(seed, epoch)``. With
    ``drop_remainder=False`` zero examples whose ``mask`` is 0 pad the data to whole
    batches, so that no example is lost (use it for evaluation: padded rows would bias
    BatchNorm's batch statistics in training).
    """
    process_index = jax.process_index() if process_index is None else process_index
    process_count = jax.process_count() if process_count is None else process_count
    positive_int("global_batch", global_batch)
    if global_batch % process_count:
        raise ValueError(
            f"global batch {global_batch} must be a multiple of the "
            f"{process_count} processes"
        )
    records = data
    if not drop_remainder:
        records = _Padded(
            data, num_batches(len(data), global_batch, False) * global_batch
        )
    sampler = grain.samplers.IndexSampler(
        len(records), shuffle=shuffle, seed=epoch_seed(seed, epoch), num_epochs=1
    )
    shift = (
        [_RandomShift(preprocess.max_shift)] if augment and preprocess.max_shift else []
    )
    return grain.DataLoader(
        data_source=records,
        sampler=sampler,
        operations=[
            _Decode(preprocess),
            *shift,
            grain.transforms.Batch(global_batch // process_count, drop_remainder=True),
            _Normalize(preprocess),
        ],
        shard_options=grain.sharding.ShardOptions(process_index, process_count),
        worker_count=0,
    )


def batches(
    data: Sequence[dict[str, Any]],
    global_batch: int,
    mesh: Mesh,
    *,
    seed: int = 0,
    epoch: int = 0,
    shuffle: bool = True,
    augment: bool = False,
    drop_remainder: bool = True,
    preprocess: Preprocess = Preprocess(),
    data_axis: str = "data",
    process_index: int | None = None,
    process_count: int | None = None,
) -> Iterator[Batch]:
    """One epoch of global ``Batch``es sharded over ``data_axis``, from ``loader``'s per-process batches."""
    process_count = jax.process_count() if process_count is None else process_count
    check_batch_divides(global_batch, mesh, data_axis, process_count)
    sharding = NamedSharding(mesh, P(data_axis))
    local_batches = loader(
        data,
        global_batch,
        seed=seed,
        epoch=epoch,
        shuffle=shuffle,
        augment=augment,
        drop_remainder=drop_remainder,
        preprocess=preprocess,
        process_index=process_index,
        process_count=process_count,
    )
    for local in local_batches:
        # global_shape makes a process layout that does not match the real one fail loudly.
        yield {
            k: jax.make_array_from_process_local_data(
                sharding, v, global_shape=(global_batch, *v.shape[1:])
            )
            for k, v in local.items()
        }


def input_shape(
    data: Sequence[dict[str, Any]], preprocess: Preprocess
) -> tuple[int, ...]:
    """The shape of one model input (``H, W, C``) after ``preprocess``."""
    return preprocess.decode(data[0])["images"].shape


def split_rows(
    batch: Any,
    pieces: int,
    *,
    strided: bool = False,
    devices: int = 1,
    what: str = "pieces",
) -> Any:
    """Every leaf ``(B, ...)`` as ``(pieces, B // pieces, ...)``: piece ``i`` holds a block of rows, or rows ``i, i + pieces, ...``.

    ``devices``: inside ``shard_map`` the batch is one device's rows, of ``devices`` sharing the
    global batch; the error then names the global batch that works. ``what`` names the pieces in it.
    """
    positive_int("pieces", pieces)
    rows = {x.shape[0] for x in jax.tree.leaves(batch)}
    if len(rows) != 1:
        raise ValueError(
            f"every leaf of the batch needs the same leading size, got {sorted(rows)}"
        )
    (size,) = rows
    if size % pieces:
        if devices == 1:
            raise ValueError(
                f"a batch of {size} rows does not split into {pieces} equal {what}: "
                f"make the batch a multiple of {pieces}"
            )
        raise ValueError(
            f"each device's {size} rows do not split into {pieces} equal {what}: "
            f"make the global batch a multiple of {pieces} x {devices} devices = {pieces * devices}"
        )
    if strided:
        return jax.tree.map(
            lambda x: x.reshape(size // pieces, pieces, *x.shape[1:]).swapaxes(0, 1),
            batch,
        )
    return jax.tree.map(
        lambda x: x.reshape(pieces, size // pieces, *x.shape[1:]), batch
    )


def fit_image(image_HWC: np.ndarray, size: int) -> np.ndarray:
    """Resize so the shorter side is ``size``, then crop the centre ``size x size``."""
    from PIL import Image

    h, w = image_HWC.shape[:2]
    scale = size / min(h, w)
    new_h, new_w = max(size, round(h * scale)), max(size, round(w * scale))
    squeeze = image_HWC.shape[-1] == 1
    pil = Image.fromarray(image_HWC[..., 0] if squeeze else image_HWC).resize(
        (new_w, new_h), Image.BILINEAR
    )
    out = np.asarray(pil)[..., None] if squeeze else np.asarray(pil)
    top, left = (new_h - size) // 2, (new_w - size) // 2
    return out[top : top + size, left : left + size]
