"""Figures for the book, made by functions so that tests can check what they draw.

Shape suffixes: see jaxdist_lessons.models.
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import matplotlib.pyplot as plt
import numpy as np
from jax.sharding import Mesh, NamedSharding
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from jaxdist_lessons import comms, hardware, memory, pipeline
from jaxdist_lessons import sharding as sharding_lib
from jaxdist_lessons.planning import costmodel, roofline

if TYPE_CHECKING:
    from jaxdist_lessons import profiling as profiling_lib
    from jaxdist_lessons import train as train_lib


def show(fig: Figure, dpi: int = 110) -> None:
    """Display ``fig`` in the notebook as a PNG, whatever matplotlib's backend, then close it.

    A figure left for the inline backend to show disappears under ``MPLBACKEND=Agg`` (as in CI,
    which builds the HTML book): chapters display each figure explicitly. Closing it keeps the
    inline backend from showing it a second time.
    """
    from IPython.display import Image, display

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi, bbox_inches="tight")
    plt.close(fig)
    display(Image(data=buffer.getvalue(), format="png"))


def memory_vs_model_size(
    accelerators: Sequence[str] = tuple(hardware.CHIPS),
    min_params: float = 1e8,
    max_params: float = 1e12,
    marks: Mapping[str, float] | None = None,
) -> Figure:
    """Memory needed against parameter count, weights only (fp32) and Adam training, beside accelerators.

    Each accelerator's memory is a horizontal line; a model to the right of where a curve
    crosses that line does not fit on one such device. ``marks`` labels named models.
    """
    if not 0 < min_params < max_params:
        raise ValueError(
            f"need 0 < min_params < max_params, got {min_params!r}, {max_params!r}"
        )
    marks = {"GPT-3 175B": 175e9} if marks is None else marks
    params = np.logspace(np.log10(min_params), np.log10(max_params), 200)
    fig, ax = plt.subplots(figsize=(8, 5))
    curves = {
        "weights only, fp32 (4 B/param)": memory.weights_bytes(1, "fp32"),
        "training with Adam, fp32 (16 B/param)": memory.bytes_per_param("adam", "fp32"),
    }
    for label, per_param in curves.items():
        ax.plot(params, params * per_param, linewidth=2.5, label=label)
    # each chip once, smallest memory first
    by_capacity = hardware.by_memory(accelerators)
    for i, (capacity, chips) in enumerate(by_capacity.items()):
        label = " / ".join(c.name for c in chips)
        ax.axhline(capacity, linestyle="--", linewidth=1, color="0.45", label=label)
        right = i % 2 == 0  # alternate sides so that close capacities do not overlap
        ax.annotate(
            label,
            (params[-1] if right else params[0], capacity),
            xytext=(-4 if right else 4, 2),
            textcoords="offset points",
            ha="right" if right else "left",
            va="bottom",
            fontsize=8,
            color="0.25",
        )
    for name, count in marks.items():
        ax.axvline(count, color="tab:red", linewidth=0.8, alpha=0.6)
        ax.annotate(
            name,
            (count, params[0] * 4),
            rotation=90,
            ha="right",
            va="bottom",
            color="tab:red",
        )
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="parameters",
        ylabel="bytes",
        title="Memory needed vs. one accelerator's memory",
    )
    ax.grid(True, which="major", alpha=0.3)
    curve_lines = ax.get_lines()[: len(curves)]
    ax.legend(handles=curve_lines, fontsize=9, loc="upper left")
    fig.tight_layout()
    return fig


def memory_breakdown(
    shares: Mapping[str, memory.TrainingMemory],
    unit: str = "GB",
    accelerator: str | None = None,
) -> Figure:
    """Stacked bars, one per strategy: the bytes of params, grads, optimizer, master weights and activations.

    With ``accelerator``, a dashed line marks that device's memory.
    """
    if not shares:
        raise ValueError("memory_breakdown needs at least one strategy")
    scale = {"GB": hardware.GB, "GiB": hardware.GiB, "MB": 10**6, "MiB": 2**20}.get(
        unit
    )
    if scale is None:
        raise ValueError(f"unknown unit {unit!r}; allowed: GB, GiB, MB, MiB")
    parts = [f.name for f in dataclasses.fields(memory.TrainingMemory)]
    fig, ax = plt.subplots(figsize=(8, 4))
    names = list(shares)
    bottom = np.zeros(len(names))
    for part in parts:
        heights = np.array([getattr(shares[n], part) for n in names]) / scale
        ax.bar(names, heights, bottom=bottom, label=part)
        bottom += heights
    if accelerator is not None:
        capacity = hardware.chip(accelerator).memory_bytes / scale
        ax.axhline(
            capacity,
            color="black",
            linestyle="--",
            linewidth=1,
            label=f"{accelerator} memory",
        )
    ax.set(ylabel=f"{unit} per device", title="What each device holds")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def _device_color(device_id: int):
    return plt.cm.tab20(device_id % 20)


def draw_mesh(mesh: Mesh, title: str | None = None) -> Figure:
    """The device grid of a 1-D or 2-D mesh: one box per device, with its id and coordinates."""
    if mesh.devices.ndim > 2:
        raise ValueError(
            f"draw_mesh draws 1-D and 2-D meshes; this one has shape {dict(mesh.shape)}"
        )
    grid = mesh.devices.reshape(1, -1) if mesh.devices.ndim == 1 else mesh.devices
    rows, cols = grid.shape
    names = list(mesh.axis_names)
    fig, ax = plt.subplots(figsize=(1.6 * cols + 1.2, 1.1 * rows + 1.0))
    for r, c in np.ndindex(grid.shape):
        device = grid[r, c]
        ax.add_patch(
            Rectangle(
                (c, rows - 1 - r),
                0.92,
                0.88,
                facecolor=_device_color(device.id),
                alpha=0.55,
                edgecolor="black",
            )
        )
        coords = (c,) if mesh.devices.ndim == 1 else (r, c)
        label = ", ".join(f"{n}={i}" for n, i in zip(names, coords))
        ax.text(
            c + 0.46,
            rows - 1 - r + 0.44,
            f"device {device.id}\n{label}",
            ha="center",
            va="center",
            fontsize=8,
        )
    ax.set_xlim(-0.1, cols + 0.02)
    ax.set_ylim(-0.1, rows + 0.02)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_xlabel(f"{names[-1]} ({mesh.shape[names[-1]]}) \u2192")
    if mesh.devices.ndim == 2:
        ax.set_ylabel(f"\u2190 {names[0]} ({mesh.shape[names[0]]})")
    ax.set_title(
        title
        or f"Mesh {dict(mesh.shape)}, axis types {tuple(t.name for t in mesh.axis_types)}",
        fontsize=10,
    )
    for spine in ax.spines.values():
        spine.set_visible(False)
    fig.tight_layout()
    return fig


def draw_sharding(
    shape: Sequence[int], sharding: NamedSharding, title: str | None = None
) -> Figure:
    """A 1-D or 2-D array's blocks, each coloured by (and labelled with) the devices that hold it."""
    shape = tuple(shape)
    if len(shape) not in (1, 2):
        raise ValueError(f"draw_sharding draws 1-D and 2-D arrays; got shape {shape}")
    held = sharding_lib.blocks(shape, sharding)
    rows, cols = (1, shape[0]) if len(shape) == 1 else shape
    fig, ax = plt.subplots(
        figsize=(
            min(10, 2 + 6 * cols / max(rows, cols)),
            min(6, 1.5 + 4 * rows / max(rows, cols)),
        )
    )
    for block, device_ids in held.items():
        (r0, r1), (c0, c1) = ((0, 1), block[0]) if len(shape) == 1 else block
        ax.add_patch(
            Rectangle(
                (c0, rows - r1),
                c1 - c0,
                r1 - r0,
                facecolor=_device_color(device_ids[0]),
                alpha=0.6,
                edgecolor="black",
                linewidth=1.5,
            )
        )
        ax.text(
            (c0 + c1) / 2,
            rows - (r0 + r1) / 2,
            ",".join(map(str, device_ids)),
            ha="center",
            va="center",
            fontsize=9,
        )
    ax.set_xlim(0, cols)
    ax.set_ylim(0, rows)
    ax.set_xticks([0, cols])
    ax.set_yticks(
        [] if len(shape) == 1 else [0, rows], [] if len(shape) == 1 else [rows, 0]
    )
    spec = getattr(sharding, "spec", "")
    ax.set_title(
        title or f"shape {shape}, {spec}: {len(held)} block(s), labelled by device id",
        fontsize=10,
    )
    fig.tight_layout()
    return fig


def ring_all_reduce(num_devices: int = 4) -> Figure:
    """A ring all-reduce: the ring of devices, then which chunk each device sends at each step of each phase."""
    schedule = comms.ring_all_reduce_schedule(num_devices)
    n = num_devices
    fig, axes = plt.subplots(
        1, 3, figsize=(12, 3.8), gridspec_kw={"width_ratios": [1, 1.2, 1.2]}
    )
    ring = axes[0]
    angles = np.pi / 2 - 2 * np.pi * np.arange(n) / n
    xy = np.stack([np.cos(angles), np.sin(angles)], axis=1)
    for i in range(n):
        ring.add_patch(
            plt.Circle(
                xy[i], 0.22, facecolor=_device_color(i), alpha=0.6, edgecolor="black"
            )
        )
        ring.text(*xy[i], str(i), ha="center", va="center", fontsize=11)
        if n > 1:
            start, end = xy[i], xy[(i + 1) % n]
            direction = (end - start) / np.linalg.norm(end - start)
            ring.annotate(
                "",
                xy=end - 0.25 * direction,
                xytext=start + 0.25 * direction,
                arrowprops=dict(arrowstyle="->", color="0.3"),
            )
    ring.set(
        xlim=(-1.4, 1.4),
        ylim=(-1.4, 1.4),
        aspect="equal",
        title=f"{n} devices in a ring",
    )
    ring.axis("off")
    for ax, (phase, steps) in zip(axes[1:], schedule.items()):
        grid = np.array([[chunk for _, _, chunk in step] for step in steps]).reshape(
            len(steps), n
        )
        for s, i in np.ndindex(grid.shape):
            ax.add_patch(
                Rectangle(
                    (i, len(steps) - 1 - s),
                    0.95,
                    0.9,
                    facecolor=plt.cm.Pastel1(grid[s, i] % 9),
                    edgecolor="0.4",
                )
            )
            ax.text(
                i + 0.47,
                len(steps) - 1 - s + 0.45,
                f"chunk {grid[s, i]}",
                ha="center",
                va="center",
                fontsize=8,
            )
        ax.set(
            xlim=(0, n),
            ylim=(0, max(1, len(steps))),
            xlabel="sending device",
            title=f"{phase}: {len(steps)} steps of 1/{n} each",
        )
        ax.set_xticks(np.arange(n) + 0.47, [str(i) for i in range(n)])
        ax.set_yticks(
            np.arange(len(steps)) + 0.45,
            [f"step {len(steps) - k}" for k in range(len(steps))],
        )
    fig.suptitle(
        f"Ring all-reduce: every device sends 2(N-1)/N = {2 * (n - 1) / n:.2f} times the data",
        fontsize=11,
    )
    fig.tight_layout()
    return fig


def training_curves(histories: Mapping[str, train_lib.History]) -> Figure:
    """Training loss per step and held-out accuracy per epoch, one line per run."""
    if not histories:
        raise ValueError("training_curves needs at least one history")
    fig, (loss_ax, acc_ax) = plt.subplots(1, 2, figsize=(11, 3.8))
    for name, history in histories.items():
        loss_ax.plot(
            [r["step"] for r in history.train],
            [r["loss"] for r in history.train],
            label=name,
            alpha=0.8,
        )
        if history.eval:
            acc_ax.plot(
                [r["step"] for r in history.eval],
                [r["accuracy"] for r in history.eval],
                "o-",
                label=name,
            )
    loss_ax.set(xlabel="step", ylabel="training loss (batch)", title="Loss")
    acc_ax.set(
        xlabel="step",
        ylabel="held-out accuracy",
        ylim=(0, 1),
        title="Accuracy after each epoch",
    )
    for ax in (loss_ax, acc_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def image_grid(
    images_BHWC: np.ndarray, labels: Sequence[int], columns: int = 8
) -> Figure:
    """A grid of images with their labels (the first channel, as grey levels)."""
    images_BHWC = np.asarray(images_BHWC)
    if images_BHWC.ndim != 4 or len(images_BHWC) != len(labels):
        raise ValueError(
            f"need images (B, H, W, C) and B labels; got {images_BHWC.shape} and {len(labels)} labels"
        )
    rows = max(1, -(-len(images_BHWC) // columns))
    fig, axes = plt.subplots(
        rows, columns, figsize=(1.2 * columns, 1.35 * rows), squeeze=False
    )
    for ax in axes.flat:
        ax.axis("off")
    for ax, image, label in zip(axes.flat, images_BHWC, labels):
        ax.imshow(image[..., 0], cmap="gray_r")
        ax.set_title(str(int(label)), fontsize=9)
    fig.tight_layout()
    return fig


def profile_timeline(
    events: Sequence[profiling_lib.OpEvent], title: str = "Profile"
) -> Figure:
    """Each device's operations on a time line, compute apart from collectives (``profiling.read_trace`` events).

    Left: one row per device, one bar per HLO operation, coloured by kind. Right: the time
    each device spent in each kind.
    """
    if not events:
        raise ValueError(
            "profile_timeline needs at least one event (did the trace capture any XLA operations?)"
        )
    colors = {"compute": "tab:blue", "collective": "tab:orange"}
    start = min(e.start_us for e in events)
    device_ids = sorted({e.device for e in events})
    row = {d: i for i, d in enumerate(device_ids)}
    fig, (line_ax, bar_ax) = plt.subplots(
        1,
        2,
        figsize=(12, 0.45 * len(device_ids) + 2.2),
        gridspec_kw={"width_ratios": [3, 1]},
    )
    for kind, color in colors.items():
        spans = [e for e in events if e.kind == kind]
        for d in device_ids:
            bars = [
                ((e.start_us - start) / 1e3, e.duration_us / 1e3)
                for e in spans
                if e.device == d
            ]
            line_ax.broken_barh(
                bars,
                (row[d] - 0.4, 0.8),
                facecolors=color,
                label=kind if d == device_ids[0] else None,
            )
    line_ax.set(
        xlabel="time (ms)",
        ylabel="device",
        title=title,
        yticks=range(len(device_ids)),
        yticklabels=[str(d) for d in device_ids],
    )
    line_ax.invert_yaxis()
    line_ax.legend(loc="upper right", fontsize=8)
    left = np.zeros(len(device_ids))
    for kind, color in colors.items():
        ms = np.array(
            [
                sum(e.duration_us for e in events if e.device == d and e.kind == kind)
                / 1e3
                for d in device_ids
            ]
        )
        bar_ax.barh(range(len(device_ids)), ms, left=left, color=color, label=kind)
        left += ms
    bar_ax.set(
        xlabel="total time (ms)",
        title="Time by kind",
        yticks=range(len(device_ids)),
        yticklabels=[str(d) for d in device_ids],
    )
    bar_ax.invert_yaxis()
    fig.tight_layout()
    return fig


def cost_estimates(
    results: Mapping[str, list[roofline.Estimate]], hw: hardware.Chip | str
) -> Figure:
    """``roofline.estimates``' predicted step time (compute and communication stacked) and memory per device, one column per model."""
    hw = hardware.chip(hw) if isinstance(hw, str) else hw
    fig, axes = plt.subplots(
        2, len(results), figsize=(3.6 * len(results), 6), squeeze=False
    )
    for col, (name, row) in enumerate(results.items()):
        labels = [e.layout.label for e in row]
        x = range(len(row))
        time_ax, mem_ax = axes[0][col], axes[1][col]
        compute = [e.compute_s * 1e3 for e in row]
        comm = [e.comm_s * 1e3 for e in row]
        time_ax.bar(x, compute, color="tab:blue", label="compute")
        time_ax.bar(x, comm, bottom=compute, color="tab:orange", label="communication")
        for i, e in enumerate(row):
            if e.problems:  # a layout the model's sizes do not divide: hatch it
                time_ax.bar(
                    i, compute[i] + comm[i], fill=False, hatch="//", edgecolor="gray"
                )
        time_ax.set_title(name)
        time_ax.set_ylabel("ms per step")
        mem_ax.bar(
            x,
            [e.state_bytes / hardware.GB for e in row],
            color="tab:green",
            label="state",
        )
        mem_ax.bar(
            x,
            [e.activation_bytes / hardware.GB for e in row],
            bottom=[e.state_bytes / hardware.GB for e in row],
            color="tab:olive",
            label="activations",
        )
        mem_ax.axhline(
            hw.memory_bytes / hardware.GB,
            color="red",
            linestyle="--",
            label=f"{hw.name}",
        )
        mem_ax.set_ylabel("GB per device")
        for ax in (time_ax, mem_ax):
            ax.set_xticks(list(x), labels, rotation=30, fontsize=8)
    axes[0][0].legend(fontsize=8)
    axes[1][0].legend(fontsize=8)
    fig.suptitle(
        f"Predicted per device on {row[0].layout.devices} x {hw.name} (hatched: does not split evenly)"
    )
    fig.tight_layout()
    return fig


def cost_speedups(
    specs: Sequence[costmodel.TransformerSpec],
    base: costmodel.Layout,
    others: Sequence[costmodel.Layout],
    hw: hardware.Chip | str,
    global_batches: Sequence[int],
    claim: float | None = None,
) -> Figure:
    """``costmodel``'s predicted speedup of each ``other`` layout over ``base`` against the batch per device, one panel per model.

    Solid: no overlap of compute and communication; dashed: perfect overlap.
    """
    hw = hardware.chip(hw) if isinstance(hw, str) else hw
    fig, axes = plt.subplots(
        1, len(specs), figsize=(4.2 * len(specs), 3.4), squeeze=False
    )
    per_device = [b / base.devices for b in global_batches]
    for ax, spec in zip(axes[0], specs):
        for i, other in enumerate(others):
            color = f"C{i}"
            for overlapped, style in ((False, "-"), (True, "--")):
                values = roofline.speedups_over_batch(
                    spec, base, other, hw, global_batches, overlapped
                )
                ax.plot(
                    per_device,
                    values,
                    style,
                    color=color,
                    label=f"{other.label} over {base.label}"
                    if not overlapped
                    else None,
                )
        ax.axhline(1.0, color="gray", linewidth=0.8)
        if claim is not None:
            ax.axhline(
                claim, color="red", linestyle=":", label=f"the article's {claim}x"
            )
        ax.set_xscale("log", base=2)
        ax.set_xlabel(
            f"{'images' if spec.logits_per_token == 0 else 'sequences'} per device"
        )
        ax.set_ylabel("predicted speedup")
        ax.set_title(spec.name)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(
        f"{base.devices} x {hw.name} (solid: no overlap, dashed: full overlap)",
        fontsize=10,
    )
    fig.tight_layout()
    return fig


def pipeline_schedule(
    num_stages: int, num_microbatches: int, kind: str = "gpipe", virtual: int = 2
) -> Figure:
    """A ``pipeline`` schedule (``"gpipe"``, ``"1f1b"`` or ``"interleaved"``) as a chart: one row per device, one column per tick.

    Forwards are pale, backwards dark; each box names its microbatch (``3.1``: microbatch 3 in
    the device's second virtual stage); idle slots are blank.
    """
    builders = {
        "gpipe": lambda: pipeline.gpipe_schedule(num_stages, num_microbatches),
        "1f1b": lambda: pipeline.one_f_one_b_schedule(num_stages, num_microbatches),
        "interleaved": lambda: pipeline.interleaved_schedule(
            num_stages, num_microbatches, virtual
        ),
    }
    if kind not in builders:
        raise ValueError(f"kind must be one of {sorted(builders)}, got {kind!r}")
    table = builders[kind]()
    fig, ax = plt.subplots(figsize=(0.3 * len(table) + 1.5, 0.45 * num_stages + 1.2))
    colors = plt.get_cmap("tab10")
    for tick, row in enumerate(table):
        for device, op in enumerate(row):
            if op is None:
                continue
            y = num_stages - 1 - device
            backward = op.kind == "B"
            ax.add_patch(
                Rectangle(
                    (tick, y),
                    0.95,
                    0.9,
                    color=colors(op.micro % 10),
                    alpha=0.9 if backward else 0.35,
                )
            )
            label = (
                str(op.micro)
                if kind != "interleaved"
                else f"{op.micro}.{op.stage // num_stages}"
            )
            ax.text(tick + 0.47, y + 0.45, label, ha="center", va="center", fontsize=6)
    ax.set_xlim(0, len(table))
    ax.set_ylim(0, num_stages)
    step = max(1, len(table) // 20)
    ax.set_xticks(
        [t + 0.5 for t in range(0, len(table), step)],
        [str(t) for t in range(0, len(table), step)],
        fontsize=7,
    )
    ax.set_yticks(
        [num_stages - 1 - s + 0.45 for s in range(num_stages)],
        [f"device {s}" for s in range(num_stages)],
    )
    ax.set_xlabel("tick (pale: forward, dark: backward)")
    name = {
        "gpipe": "GPipe",
        "1f1b": "1F1B",
        "interleaved": f"interleaved 1F1B, v = {virtual}",
    }[kind]
    peak = max(pipeline.in_flight(table))
    ax.set_title(
        f"{name}, {num_stages} stages x {num_microbatches} microbatches: "
        f"bubble {pipeline.idle_fraction(table):.0%}, at most {peak} in flight",
        fontsize=10,
    )
    fig.tight_layout()
    return fig


def process_collectives(
    process_grid: np.ndarray,
    axis_names: Sequence[str],
    groups: Mapping[str, Sequence[Sequence[int]]],
) -> Figure:
    """A 2-D mesh's devices coloured by the process that owns them, one panel per collective.

    ``process_grid`` holds the owning process at each mesh position (``multihost.process_grid``);
    ``groups[name]`` are a collective's replica groups as mesh positions (``hlo.replica_group_lists``).
    A group drawn solid red crosses processes (gloo, DCN, the network); dashed green stays inside one.
    """
    grid = np.asarray(process_grid)
    if grid.ndim != 2 or len(axis_names) != 2:
        raise ValueError(
            f"process_collectives draws 2-D meshes; got shape {grid.shape}"
        )
    rows, cols = grid.shape
    owner = grid.reshape(-1)
    fig, axes = plt.subplots(
        1,
        len(groups),
        figsize=(2.2 + 1.3 * cols * len(groups), 1.2 + 1.1 * rows),
        squeeze=False,
    )
    for ax, (name, name_groups) in zip(axes[0], groups.items()):
        for position, process in enumerate(owner):
            r, c = divmod(position, cols)
            ax.add_patch(
                Rectangle(
                    (c - 0.4, rows - 1 - r - 0.35),
                    0.8,
                    0.7,
                    facecolor=plt.cm.Pastel2(process % 8),
                    edgecolor="black",
                )
            )
            ax.text(  # above the lines drawn below, on the box's own colour: never crossed
                c,
                rows - 1 - r + 0.17,
                f"process {process}, device {position}",
                ha="center",
                va="center",
                fontsize=7,
                zorder=3,
                bbox={
                    "facecolor": plt.cm.Pastel2(process % 8),
                    "edgecolor": "none",
                    "pad": 1,
                },
            )
        crossing = 0
        for k, group in enumerate(name_groups):
            crosses = len({int(owner[i]) for i in group}) > 1
            crossing += crosses
            ys, xs = zip(*(divmod(i, cols) for i in group))
            offset = 0.12 * (k - (len(name_groups) - 1) / 2) / max(1, len(name_groups))
            ax.plot(
                np.array(xs) + offset,
                rows - 1 - np.array(ys) - 0.12 + offset,
                color="tab:red" if crosses else "tab:green",
                linestyle="-" if crosses else "--",
                linewidth=2.5,
                marker="o",
                label="crosses processes" if crosses else "inside one process",
            )
        handles, labels = ax.get_legend_handles_labels()
        unique = dict(zip(labels, handles))
        ax.legend(
            unique.values(),
            unique.keys(),
            fontsize=7,
            loc="upper center",
            bbox_to_anchor=(0.5, -0.02),
            ncol=2,
        )
        ax.set(xlim=(-0.6, cols - 0.4), ylim=(-0.6, rows - 0.4), xticks=[], yticks=[])
        ax.set_xlabel(f"{axis_names[1]} \u2192", fontsize=8, labelpad=22)
        ax.set_ylabel(f"\u2190 {axis_names[0]}", fontsize=8)
        ax.set_title(
            f"all-reduce over {name!r}: {crossing} of {len(name_groups)} groups cross processes",
            fontsize=9,
        )
    fig.tight_layout()
    return fig


def memory_measured_vs_predicted(
    measured: Mapping[str, Mapping[str, float]],
    predicted: Mapping[str, Mapping[str, float]],
    unit: str = "MB",
) -> Figure:
    """Bytes per device per strategy: a measured bar (solid) beside a predicted one (hatched), each stacked by part.

    ``measured[strategy]`` and ``predicted[strategy]`` map a part ("parameters", "temporaries"...) to
    bytes; a part keeps its colour in both bars.
    """
    if not measured or set(measured) != set(predicted):
        raise ValueError(
            f"need the same strategies measured and predicted, got {list(measured)} and {list(predicted)}"
        )
    scale = {"B": 1, "kB": 10**3, "MB": 10**6, "GB": hardware.GB}.get(unit)
    if scale is None:
        raise ValueError(f"unknown unit {unit!r}; allowed: B, kB, MB, GB")
    names = list(measured)
    parts = list(
        dict.fromkeys(
            p for bars in (measured, predicted) for s in names for p in bars[s]
        )
    )
    colour = {part: plt.cm.tab10(i % 10) for i, part in enumerate(parts)}
    fig, ax = plt.subplots(figsize=(1.0 + 2.2 * len(names), 4.5))
    x = np.arange(len(names))
    for offset, kind, bars, hatch in [
        (-0.2, "measured", measured, None),
        (0.2, "predicted", predicted, "//"),
    ]:
        bottom = np.zeros(len(names))
        for part in parts:
            heights = np.array([bars[s].get(part, 0) for s in names]) / scale
            if not heights.any():
                continue
            ax.bar(
                x + offset,
                heights,
                width=0.38,
                bottom=bottom,
                color=colour[part],
                hatch=hatch,
                edgecolor="white" if hatch else None,
                label=f"{kind}: {part}",
            )
            bottom += heights
    ax.set_xticks(x, [f"{s}\n(measured | predicted)" for s in names], fontsize=8)
    ax.set(ylabel=f"{unit} per device", title="What each device holds during a step")
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    return fig


def lm_scale(
    rows: Sequence[Mapping], memory_lines: Mapping[str, float] | None = None
) -> Figure:
    """Memory per device (top) and collective bytes per step (bottom) of compiled LM steps.

    ``rows`` are ``benchmarks/lm_scale.py``'s: each has ``model``, ``devices``, ``strategy``,
    ``total`` (GB per device) and ``collectives`` (bytes per kind). One column per model, one group
    of bars per device count, one bar per strategy; ``memory_lines`` maps a label ("H100 80 GB") to
    GB, drawn as dashed lines on the memory panels. Both axes are logarithmic.
    """
    if not rows:
        raise ValueError("need at least one row")
    models = list(dict.fromkeys(r["model"] for r in rows))
    counts = sorted({r["devices"] for r in rows})
    strategies = list(dict.fromkeys(r["strategy"] for r in rows))
    found = {(r["model"], r["devices"], r["strategy"]): r for r in rows}
    fig, axes = plt.subplots(
        2, len(models), figsize=(3.6 * len(models), 6.2), squeeze=False
    )
    width = 0.8 / len(strategies)
    for column, model in enumerate(models):
        for i, strategy in enumerate(strategies):
            picked = [found.get((model, n, strategy)) for n in counts]
            x = np.arange(len(counts)) + (i - (len(strategies) - 1) / 2) * width
            memory_gb = [r["total"] if r else np.nan for r in picked]
            sent_gb = [
                sum(r["collectives"].values()) / 1e9 if r else np.nan for r in picked
            ]
            colour = plt.cm.tab10(i % 10)
            axes[0, column].bar(x, memory_gb, width, color=colour, label=strategy)
            axes[1, column].bar(x, sent_gb, width, color=colour, label=strategy)
        for row, ylabel in enumerate(["GB per device", "collective GB per step"]):
            ax = axes[row, column]
            ax.set_yscale("log")
            ax.set_xticks(
                np.arange(len(counts)), [f"{n} devices" for n in counts], fontsize=8
            )
            if column == 0:
                ax.set_ylabel(ylabel)
        axes[0, column].set_title(f"{model}: memory per device")
        axes[1, column].set_title(f"{model}: bytes per step")
        for k, (label, gb) in enumerate((memory_lines or {}).items()):
            axes[0, column].axhline(
                gb, color="0.3", linestyle=("--", ":")[k % 2], lw=1, label=label
            )
    axes[0, 0].legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    return fig


def loss_curves(curves: Mapping[str, Sequence[float]], title: str = "") -> Figure:
    """Each run's training loss by step (left) and each run's gap to the first (right)."""
    if not curves:
        raise ValueError("loss_curves needs at least one curve")
    fig, (loss_ax, gap_ax) = plt.subplots(1, 2, figsize=(11, 3.6))
    first = np.asarray(next(iter(curves.values())))
    for name, losses in curves.items():
        steps = np.arange(1, len(losses) + 1)
        loss_ax.plot(steps, losses, label=name, alpha=0.8)
        gap_ax.plot(steps, np.asarray(losses) - first, label=name, alpha=0.8)
    loss_ax.set(xlabel="step", ylabel="training loss", title=title or "Loss")
    gap_ax.set(xlabel="step", ylabel="loss - first run's", title="Gap to the first")
    for ax in (loss_ax, gap_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def memory_vs_sequence(
    seq_lens: Sequence[int], memory: Mapping[str, Sequence[float]], unit: str = "GB"
) -> Figure:
    """Bytes per device against sequence length, one line per way of running attention, both axes log.

    ``memory[name]`` holds one value in bytes per entry of ``seq_lens``.
    """
    if not memory or any(len(v) != len(seq_lens) for v in memory.values()):
        raise ValueError("need one value per sequence length for every line")
    scale = {"MB": 10**6, "GB": hardware.GB}.get(unit)
    if scale is None:
        raise ValueError(f"unknown unit {unit!r}; allowed: MB, GB")
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for i, (name, values) in enumerate(memory.items()):
        ax.plot(
            seq_lens,
            np.asarray(values) / scale,
            marker="o",
            label=name,
            color=plt.cm.tab10(i % 10),
        )
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="sequence length (tokens)",
        ylabel=f"{unit} per device",
        title="Attention forward + backward: temporaries",
    )
    ax.set_xticks(list(seq_lens), [f"{t // 1024}k" for t in seq_lens])
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


# --- Chapter 13_experts: mixture of experts ------------------------------------------------------------


def dropped_tokens(
    capacity_factors: Sequence[float], curves: Mapping[str, Sequence[float]]
) -> Figure:
    """The share of (token, choice) pairs dropped against the capacity factor, one line per curve.

    ``curves`` maps a label ("k=1, uniform") to one dropped fraction per capacity factor.
    """
    if not curves:
        raise ValueError("need at least one curve")
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for i, (label, values) in enumerate(curves.items()):
        if len(values) != len(capacity_factors):
            raise ValueError(
                f"curve {label!r} has {len(values)} values for {len(capacity_factors)} capacity factors"
            )
        style = "-" if "k=1" in label else "--"
        ax.plot(
            capacity_factors,
            values,
            style,
            marker="o",
            ms=3,
            color=plt.cm.tab10(i % 10),
            label=label,
        )
    ax.axvline(1.0, color="0.6", lw=0.8)
    ax.set(
        xlabel="capacity factor",
        ylabel="share of (token, choice) pairs dropped",
        title="Tokens dropped at the expert capacity",
        ylim=(0, None),
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
