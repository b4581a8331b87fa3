"""Input pipeline: TFDS data sources in, global batches sharded over ``data`` out.

Two ways to get images:

- **Offline, real images**: ``jaxdist_digits``, a TFDS dataset builder defined here over the
  1,797 handwritten digits that ship inside scikit-learn (8x8, upscaled). It is built with
  TFDS in the ``array_record`` format, which needs no TensorFlow and no network.
- **Real datasets through TFDS**: ``cifar10``, ``imagenette/320px-v2`` or ``imagenet2012``,
  once prepared in ``data_dir`` (preparing them needs the network, and TensorFlow for the
  PNG/JPEG encoding; reading the prepared ``array_record`` files does not).

``batches`` reads a source by index in a seeded order: each process reads only its own rows
of every global batch (keyed on ``jax.process_index()``), and ``jax.make_array_from_process_local_data``
stitches them into one global array sharded over the mesh's ``data`` axis.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterator, Sequence

import jax
import numpy as np
import tensorflow_datasets as tfds
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist_lessons.sharding import check_batch_divides

DIGITS = "jaxdist_digits"
DEFAULT_DATA_DIR = os.path.join(
    os.path.expanduser("~"), ".cache", "jaxdist", "tensorflow_datasets"
)


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
                pixels = np.kron(image, np.ones((scale, scale))) * (
                    255 / 16
                )  # values 0..16 -> 0..255
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
    """The offline dataset's ``split`` as a random-access source, built on first use (about a second)."""
    builder = JaxdistDigits(
        data_dir=data_dir or DEFAULT_DATA_DIR, file_format="array_record"
    )
    builder.download_and_prepare()
    return builder.as_data_source(split=split)


def source(
    name: str, split: str, data_dir: str | None = None
) -> Sequence[dict[str, np.ndarray]]:
    """A random-access source for ``name``: the offline ``jaxdist_digits`` or any prepared TFDS dataset."""
    if name == DIGITS:
        return digits_source(split, data_dir)
    try:
        return tfds.data_source(name, split=split, data_dir=data_dir, download=False)
    except (
        AssertionError,
        FileNotFoundError,
        NotImplementedError,
        tfds.core.registered.DatasetNotFoundError,
    ) as err:
        raise ValueError(
            f"TFDS dataset {name!r} is not prepared in {data_dir or 'the default data_dir'}: prepare it once with "
            f"network access (for example `tfds build {name} --file_format=array_record`), or use the offline "
            f"{DIGITS!r}"
        ) from err


@dataclasses.dataclass(frozen=True)
class Preprocess:
    """How images become model inputs: size, channels, normalisation and (for training) augmentation."""

    channels: int = 3
    image_size: int | None = (
        None  # resize (shorter side) and centre-crop to this; None keeps the size
    )
    mean: float = 0.5
    std: float = 0.25
    max_shift: int = 2  # random translation in pixels, for training batches

    def __call__(
        self, images_BHWC: np.ndarray, rng: np.random.Generator | None
    ) -> np.ndarray:
        x = images_BHWC.astype(np.float32) / 255.0
        if x.shape[-1] != self.channels:
            x = (
                np.repeat(x, self.channels, axis=-1)
                if x.shape[-1] == 1
                else x[..., : self.channels]
            )
        if rng is not None and self.max_shift:
            x = _random_shift(x, self.max_shift, rng)
        return (x - self.mean) / self.std


def _random_shift(
    x_BHWC: np.ndarray, max_shift: int, rng: np.random.Generator
) -> np.ndarray:
    """Translate each image by up to ``max_shift`` pixels each way, filling with zeros."""
    b, h, w, _ = x_BHWC.shape
    padded = np.pad(
        x_BHWC, ((0, 0), (max_shift, max_shift), (max_shift, max_shift), (0, 0))
    )
    dy, dx = rng.integers(0, 2 * max_shift + 1, size=(2, b))
    return np.stack([padded[i, dy[i] : dy[i] + h, dx[i] : dx[i] + w] for i in range(b)])


def num_batches(num_examples: int, global_batch: int, drop_remainder: bool) -> int:
    """Batches per epoch: the last, partial one is dropped or padded."""
    return (
        num_examples // global_batch
        if drop_remainder
        else math.ceil(num_examples / global_batch)
    )


def batches(
    data: Sequence[dict[str, np.ndarray]],
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
) -> Iterator[dict[str, jax.Array]]:
    """One epoch of global batches ``{'images', 'labels', 'mask'}`` sharded over ``data_axis``.

    The order depends only on ``(seed, epoch)``. With ``drop_remainder=False`` the last batch
    is padded with zero images whose ``mask`` is 0, so that no example is lost (use it for
    evaluation: padded rows would bias BatchNorm's batch statistics in training).
    """
    process_index = jax.process_index() if process_index is None else process_index
    process_count = jax.process_count() if process_count is None else process_count
    check_batch_divides(global_batch, mesh, data_axis, process_count)
    order = np.arange(len(data))
    if shuffle:
        order = np.random.default_rng((seed, epoch)).permutation(len(data))
    per_process = global_batch // process_count
    sharding = NamedSharding(mesh, P(data_axis))
    for b in range(num_batches(len(data), global_batch, drop_remainder)):
        rows = process_rows(order, b, global_batch, process_index, process_count)
        local = _load(data, rows, per_process, preprocess.image_size)
        rng = np.random.default_rng((seed, epoch, b, process_index)) if augment else None
        local["images"] = (
            preprocess(local["images"], rng) * local["mask"][:, None, None, None]
        )
        # global_shape makes a process layout that does not match the real one fail loudly.
        yield {
            k: jax.make_array_from_process_local_data(
                sharding, v, global_shape=(global_batch, *v.shape[1:])
            )
            for k, v in local.items()
        }


def process_rows(
    order: np.ndarray,
    batch_index: int,
    global_batch: int,
    process_index: int,
    process_count: int,
) -> np.ndarray:
    """The example indices process ``process_index`` reads for global batch ``batch_index``: its contiguous slice."""
    per_process = global_batch // process_count
    batch = order[batch_index * global_batch : (batch_index + 1) * global_batch]
    return batch[process_index * per_process : (process_index + 1) * per_process]


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


def _load(
    data: Sequence[dict[str, np.ndarray]],
    rows: np.ndarray,
    size: int,
    image_size: int | None = None,
) -> dict[str, np.ndarray]:
    """Read ``rows`` (resized to ``image_size`` if given) and pad with zero examples (mask 0) up to ``size``."""
    examples = [data[int(i)] for i in rows]

    def image(e):
        pixels = np.asarray(e["image"])
        return pixels if image_size is None else fit_image(pixels, image_size)

    if examples:
        images = np.stack([image(e) for e in examples])
    else:  # this process's rows all fall in the padding of the last batch
        images = np.zeros((0, *np.shape(image(data[0]))), np.uint8)
    labels = np.array([int(e["label"]) for e in examples], np.int32)
    pad = size - len(examples)
    mask = np.concatenate([np.ones(len(examples), np.float32), np.zeros(pad, np.float32)])
    images = np.concatenate([images, np.zeros((pad, *images.shape[1:]), images.dtype)])
    labels = np.concatenate([labels, np.zeros(pad, np.int32)])
    return {"images": images, "labels": labels, "mask": mask}
