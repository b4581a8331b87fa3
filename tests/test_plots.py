import matplotlib

matplotlib.use("Agg")

import jax
import matplotlib.pyplot as plt
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from matplotlib.patches import Rectangle

from jaxdist_lessons import comms, memory, plots, sharding
from jaxdist_lessons import mesh as mesh_lib
from jaxdist_lessons.planning import costmodel, roofline


def test_memory_vs_model_size_draws_two_curves_and_one_line_per_accelerator():
    fig = plots.memory_vs_model_size(accelerators=["A100 80GB", "H100 80GB", "TPU v5e"])
    ax = fig.axes[0]
    lines = {line.get_label(): line for line in ax.get_lines()}
    # two curves, two capacities (80 GB is shared), one mark
    assert len(lines) == 2 + 2 + 1
    weights = lines["weights only, fp32 (4 B/param)"]
    adam = lines["training with Adam, fp32 (16 B/param)"]
    np.testing.assert_allclose(weights.get_ydata(), 4 * weights.get_xdata())
    np.testing.assert_allclose(adam.get_ydata(), 16 * adam.get_xdata())
    assert lines["A100 80GB / H100 80GB"].get_ydata()[0] == 80e9
    assert lines["TPU v5e"].get_ydata()[0] == 16e9
    assert [t.get_text() for t in ax.texts] == [
        "TPU v5e",
        "A100 80GB / H100 80GB",
        "GPT-3 175B",
    ]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == list(lines)[:2]
    assert ax.get_xscale() == ax.get_yscale() == "log"
    plt.close(fig)


def test_memory_vs_model_size_rejects_an_empty_range():
    with pytest.raises(ValueError, match="need 0 < min_params < max_params"):
        plots.memory_vs_model_size(min_params=1e9, max_params=1e8)


def test_memory_breakdown_stacks_each_part_per_strategy():
    state = memory.training_state_bytes(7e9, "adam", "mixed")
    shares = {s: memory.per_device(state, s, 8) for s in ["data", "zero1", "fsdp"]}
    fig = plots.memory_breakdown(shares, accelerator="H100 80GB")
    ax = fig.axes[0]
    assert [line.get_ydata()[0] for line in ax.get_lines()] == [80]
    tops = {}
    for container in ax.containers:
        for name, bar in zip(shares, container):
            tops[name] = max(tops.get(name, 0), bar.get_y() + bar.get_height())
    assert [c.get_label() for c in ax.containers] == [
        "params",
        "grads",
        "optimizer",
        "master",
        "activations",
    ]
    assert tops == pytest.approx({name: shares[name].total / 1e9 for name in shares})
    plt.close(fig)


def test_memory_breakdown_bad_unit():
    with pytest.raises(ValueError, match="unknown unit 'TB'"):
        plots.memory_breakdown({"data": memory.training_state_bytes(1)}, unit="TB")


N = jax.device_count()


def rectangles(fig):
    return [p for p in fig.axes[0].patches if isinstance(p, Rectangle)]


@pytest.mark.parametrize(
    "shape, names", [((N,), ("data",)), ((N // 2, 2), ("data", "tensor"))]
)
def test_draw_mesh_has_one_labelled_box_per_device(shape, names):
    m = jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * len(names))
    fig = plots.draw_mesh(m)
    assert len(rectangles(fig)) == N
    texts = [t.get_text() for t in fig.axes[0].texts]
    coords = mesh_lib.device_coordinates(m)
    for device_id, where in coords.items():
        label = f"device {device_id}\n" + ", ".join(
            f"{k}={v}" for k, v in where.items()
        )
        assert label in texts
    plt.close(fig)


def test_draw_mesh_rejects_more_than_two_axes():
    m = jax.make_mesh(
        (N // 2, 2, 1),
        ("data", "tensor", "pipeline"),
        axis_types=(AxisType.Explicit,) * 3,
    )
    with pytest.raises(ValueError, match="draw_mesh draws 1-D and 2-D meshes"):
        plots.draw_mesh(m)


@pytest.mark.parametrize(
    "shape, spec",
    [
        ((4 * N,), P("data")),
        ((4 * N,), P()),
        ((2 * N, 4), P("data", "tensor")),
        ((2 * N, 4), P(None, "tensor")),
        ((2 * N, 4), P(("data", "tensor"))),
    ],
)
def test_draw_sharding_draws_one_block_per_shard(shape, spec):
    m = jax.make_mesh(
        (N // 2, 2), ("data", "tensor"), axis_types=(AxisType.Explicit,) * 2
    )
    s = NamedSharding(m, spec)
    fig = plots.draw_sharding(shape, s)
    held = sharding.blocks(shape, s)
    assert len(rectangles(fig)) == len(held)
    assert sorted(t.get_text() for t in fig.axes[0].texts) == sorted(
        ",".join(map(str, ids)) for ids in held.values()
    )
    plt.close(fig)


def test_draw_sharding_rejects_3d_arrays():
    m = jax.make_mesh((N,), ("data",), axis_types=(AxisType.Explicit,))
    with pytest.raises(
        ValueError,
        match=r"draw_sharding draws 1-D and 2-D arrays; got shape \(2, 2, 2\)",
    ):
        plots.draw_sharding((2, 2, 2), NamedSharding(m, P()))


@pytest.mark.parametrize("n", [2, 4, 8])
def test_ring_all_reduce_draws_the_ring_and_the_schedule(n):
    from matplotlib.patches import Circle

    fig = plots.ring_all_reduce(n)
    ring, scatter, gather = fig.axes
    assert len([p for p in ring.patches if isinstance(p, Circle)]) == n
    schedule = comms.ring_all_reduce_schedule(n)
    for ax, phase in [(scatter, "reduce-scatter"), (gather, "all-gather")]:
        labels = sorted(t.get_text() for t in ax.texts)
        assert labels == sorted(
            f"chunk {c}" for step in schedule[phase] for _, _, c in step
        )
    plt.close(fig)


def test_training_curves_one_line_per_run():
    from jaxdist_lessons.train import History

    runs = {
        "data parallel": History(
            train=[{"step": i, "loss": 2.0 - 0.1 * i} for i in range(5)],
            eval=[{"step": 5, "accuracy": 0.8}],
        ),
        "hybrid": History(
            train=[{"step": i, "loss": 2.1 - 0.1 * i} for i in range(5)], eval=[]
        ),
    }
    fig = plots.training_curves(runs)
    loss_ax, acc_ax = fig.axes
    assert [line.get_label() for line in loss_ax.get_lines()] == [
        "data parallel",
        "hybrid",
    ]
    np.testing.assert_allclose(
        loss_ax.get_lines()[0].get_ydata(), [2.0, 1.9, 1.8, 1.7, 1.6]
    )
    assert [line.get_label() for line in acc_ax.get_lines()] == ["data parallel"]
    plt.close(fig)
    with pytest.raises(ValueError, match="at least one history"):
        plots.training_curves({})


def test_image_grid():
    fig = plots.image_grid(np.zeros((10, 8, 8, 1)), list(range(10)), columns=4)
    assert len(fig.axes) == 12 and sum(1 for ax in fig.axes if ax.images) == 10
    assert [ax.get_title() for ax in fig.axes[:3]] == ["0", "1", "2"]
    plt.close(fig)
    with pytest.raises(ValueError, match="need images"):
        plots.image_grid(np.zeros((2, 8, 8)), [0, 1])


def test_plot_has_a_time_and_a_memory_panel_per_model():
    specs = [costmodel.MODELS["ViT-B/16"], costmodel.MODELS["GPT-2 (124M)"]]
    fig = plots.cost_estimates(
        roofline.estimates(specs, costmodel.article_layouts(8), "A100 40GB"),
        "A100 40GB",
    )
    axes = fig.get_axes()
    assert (
        len(axes) == 4
        and axes[0].get_title() == "ViT-B/16"
        and axes[1].get_title() == "GPT-2 (124M)"
    )
    assert [t.get_text() for t in axes[0].get_xticklabels()] == [
        "(8,1)",
        "(4,2)",
        "(2,4)",
        "(1,8)",
        "FSDP 8",
    ]


def test_speedup_figure_has_a_solid_and_a_dashed_line_per_layout():
    spec = costmodel.MODELS["ViT-B/16"]
    others = [costmodel.Layout(data=4, tensor=2), costmodel.Layout(fsdp=8)]
    fig = plots.cost_speedups(
        [spec], costmodel.Layout(data=8), others, "A100 40GB", [8, 64, 512], claim=1.8
    )
    (ax,) = fig.get_axes()
    curves = [line for line in ax.get_lines() if len(line.get_xdata()) == 3]
    assert [line.get_linestyle() for line in curves] == ["-", "--", "-", "--"]
    assert list(curves[0].get_xdata()) == [1, 8, 64]  # images per device
    expected = roofline.speedups_over_batch(
        spec, costmodel.Layout(data=8), others[0], "A100 40GB", [8, 64, 512]
    )
    assert list(curves[0].get_ydata()) == pytest.approx(expected)


def test_schedule_figure_draws_one_box_per_busy_slot():
    fig = plots.pipeline_schedule(4, 6)
    (ax,) = fig.get_axes()
    # a forward and a backward per microbatch and stage; (S-1)/(M+S-1) = 3/9 idle
    assert len(ax.patches) == 2 * 4 * 6 and "bubble 33%" in ax.get_title()
    assert "at most 6 in flight" in ax.get_title()
    assert [t.get_text() for t in ax.get_yticklabels()] == [
        f"device {s}" for s in range(4)
    ]


@pytest.mark.parametrize(
    "kind, boxes, title",
    [
        ("1f1b", 2 * 4 * 8, "bubble 27%, at most 4"),
        ("interleaved", 2 * 2 * 4 * 8, "bubble 16%, at most 11"),
    ],
)
def test_schedule_figure_for_1f1b_and_interleaved(kind, boxes, title):
    (ax,) = plots.pipeline_schedule(4, 8, kind).get_axes()
    assert len(ax.patches) == boxes and title in ax.get_title()
    with pytest.raises(ValueError, match="kind must be one of"):
        plots.pipeline_schedule(4, 8, "zero-bubble")


def test_memory_measured_vs_predicted_stacks_a_solid_and_a_hatched_bar_per_strategy():
    measured = {
        "data": {"parameters": 4e6, "optimizer state": 8e6, "temporaries": 9e6},
        "fsdp": {"parameters": 1e6, "optimizer state": 2e6, "temporaries": 3e6},
    }
    predicted = {
        "data": {"parameters": 4e6, "optimizer state": 8e6, "gathered weights": 0},
        "fsdp": {"parameters": 1e6, "optimizer state": 2e6, "gathered weights": 2e6},
    }
    fig = plots.memory_measured_vs_predicted(measured, predicted)
    ax = fig.axes[0]
    labels = [c.get_label() for c in ax.containers]
    assert labels == [
        "measured: parameters",
        "measured: optimizer state",
        "measured: temporaries",
        "predicted: parameters",
        "predicted: optimizer state",
        "predicted: gathered weights",
    ]
    tops = {}
    for container in ax.containers:
        kind = container.get_label().split(":")[0]
        for name, bar in zip(measured, container):
            key = (kind, name)
            tops[key] = max(tops.get(key, 0), bar.get_y() + bar.get_height())
            assert (bar.get_hatch() is not None) == (kind == "predicted")
    assert tops == pytest.approx(
        {("measured", "data"): 21, ("measured", "fsdp"): 6}
        | {("predicted", "data"): 12, ("predicted", "fsdp"): 5}
    )
    # A part keeps its colour in both bars.
    colours = {c.get_label(): c.patches[0].get_facecolor() for c in ax.containers}
    assert colours["measured: parameters"] == colours["predicted: parameters"]
    plt.close(fig)


def test_memory_measured_vs_predicted_needs_the_same_strategies():
    with pytest.raises(ValueError, match="need the same strategies"):
        plots.memory_measured_vs_predicted({"data": {"parameters": 1}}, {})


def test_lm_scale_draws_one_bar_per_strategy_and_device_count():
    rows = [
        {
            "model": m,
            "devices": n,
            "strategy": s,
            "total": t * n,
            "collectives": {"all-gather": 1e9 * t},
        }
        for m in ("1b", "8b")
        for n in (8, 64)
        for t, s in ((1.0, "DP"), (2.0, "FSDP"))
    ]
    fig = plots.lm_scale(rows, memory_lines={"H100 80 GB": 80})
    assert [ax.get_title() for ax in fig.axes] == [
        "1b: memory per device",
        "8b: memory per device",
        "1b: bytes per step",
        "8b: bytes per step",
    ]
    memory_8b = fig.axes[1]
    heights = {c.get_label(): [b.get_height() for b in c] for c in memory_8b.containers}
    assert heights == {"DP": [8.0, 64.0], "FSDP": [16.0, 128.0]}
    sent_1b = fig.axes[2]
    assert [b.get_height() for b in sent_1b.containers[1]] == [2.0, 2.0]
    assert [line.get_label() for line in memory_8b.get_lines()] == ["H100 80 GB"]
    assert memory_8b.get_yscale() == "log"


def test_lm_scale_needs_rows():
    with pytest.raises(ValueError, match="at least one row"):
        plots.lm_scale([])


def test_memory_vs_sequence_draws_one_line_per_attention():
    fig = plots.memory_vs_sequence(
        [8192, 32768], {"one device": [2e9, 8e9], "ring": [1e9, 4e9]}, unit="GB"
    )
    ax = fig.axes[0]
    lines = {line.get_label(): line.get_ydata().tolist() for line in ax.get_lines()}
    assert lines == {
        "one device": [2.0, 8.0],
        "ring": [1.0, 4.0],
    }
    assert (ax.get_xscale(), ax.get_yscale()) == ("log", "log")
    assert [t.get_text() for t in ax.get_xticklabels()] == ["8k", "32k"]
    with pytest.raises(ValueError, match="one value per sequence length"):
        plots.memory_vs_sequence([8192], {"ring": [1.0, 2.0]})


# --- dropped_tokens (chapter 13_experts) ---------------------------------------------------------------


def test_dropped_tokens_draws_one_line_per_curve():
    factors = [0.5, 1.0, 2.0]
    curves = {"k=1, uniform": [0.5, 0.2, 0.0], "k=2, skewed": [0.6, 0.4, 0.1]}
    fig = plots.dropped_tokens(factors, curves)
    ax = fig.axes[0]
    lines = [line for line in ax.get_lines() if line.get_label() in curves]
    assert [line.get_label() for line in lines] == list(curves)
    assert lines[1].get_ydata().tolist() == [0.6, 0.4, 0.1]
    assert lines[0].get_linestyle() == "-" and lines[1].get_linestyle() == "--"
    assert ax.get_title() == "Tokens dropped at the expert capacity"
    plt.close(fig)


def test_dropped_tokens_checks_its_curves():
    with pytest.raises(ValueError, match="at least one curve"):
        plots.dropped_tokens([1.0], {})
    with pytest.raises(ValueError, match="has 1 values for 2 capacity factors"):
        plots.dropped_tokens([1.0, 2.0], {"k=1": [0.1]})


def test_loss_curves_draw_each_run_and_its_gap_to_the_first():
    fig = plots.loss_curves({"float32": [3.0, 2.0, 1.5], "bfloat16": [3.0, 2.1, 1.4]})
    loss_ax, gap_ax = fig.axes
    assert [line.get_label() for line in loss_ax.get_lines()] == ["float32", "bfloat16"]
    np.testing.assert_allclose(gap_ax.get_lines()[1].get_ydata(), [0.0, 0.1, -0.1])
    np.testing.assert_allclose(gap_ax.get_lines()[0].get_ydata(), [0.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="at least one curve"):
        plots.loss_curves({})
