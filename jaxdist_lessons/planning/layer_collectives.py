"""One layer's collectives for the strategies of chapters 11_pipelines_mesh_shape to 13_experts, as the ``Transfer`` records
that ``comms`` reads from a compiled program (``transfers_from_hlo`` reads them): tensor
parallelism's all-reduce, or Megatron sequence parallelism's all-gather and reduce-scatter;
context parallelism's ring permutes, all-gather of K and V, or Ulysses's all-to-alls; and the
experts' dispatch and combine. ``costmodel`` adds up a step's from them.
"""

from __future__ import annotations

from jaxdist_lessons import comms, experts, sequence
from jaxdist_lessons._checks import positive_int
from jaxdist_lessons.traffic import Transfer


def transfers_from_hlo(hlo_text: str) -> list[Transfer]:
    """The collectives of a compiled program (``comms.collectives``) as ``Transfer`` records."""
    return [
        Transfer(c.kind, c.bytes, c.group_size, c.name)
        for c in comms.collectives(hlo_text)
    ]


def tensor_parallel_transfers(
    activation_bytes: float, tensor: int, sequence_parallel: bool = False
) -> list[Transfer]:
    """One Megatron all-reduce site: an all-reduce of the activation over ``tensor`` devices, or, with
    sequence parallelism, an all-gather of it and a reduce-scatter into ``1/tensor`` of it.

    ``activation_bytes`` is the whole activation one device computes a partial sum of (its tokens x
    width x itemsize). A ring sends the same bytes either way: ``2 (t-1)/t`` of the activation.
    """
    if not sequence_parallel:
        return [
            Transfer(
                "all-reduce", activation_bytes, tensor, "activations (tensor parallel)"
            )
        ]
    return [
        Transfer(
            "all-gather", activation_bytes, tensor, "activations (sequence parallel)"
        ),
        Transfer(
            "reduce-scatter",
            activation_bytes / tensor,
            tensor,
            "activations (sequence parallel)",
        ),
    ]


def context_parallel_transfers(
    kind: str,
    batch: int,
    seq_len: int,
    heads: int,
    head_dim: int,
    num_devices: int,
    itemsize: int = 4,
) -> list[Transfer]:
    """One causal attention's forward collectives with the sequence split over ``num_devices`` (chapter 12_long_sequences).

    ``kind`` is a key of ``sequence.ATTENTIONS``. ``heads`` are the K/V heads (all of them for
    Ulysses, whose Q, K, V and output have as many). With ``block`` one device's share of K (or V):
    ring attention permutes K and V ``n-1`` times each; all-gather-KV gathers K and V whole;
    Ulysses sends Q, K, V and the output through one all-to-all each, of ``block`` bytes.
    """
    n = positive_int("num_devices", num_devices)
    whole = sequence.kv_bytes(batch, seq_len, heads, head_dim, itemsize) // 2  # K or V
    block = whole // n
    if kind == "ring":
        return [
            Transfer("collective-permute", block, None, "K or V to the next device")
        ] * (2 * (n - 1))
    if kind == "all-gather KV":
        return [Transfer("all-gather", whole, n, "K or V, gathered")] * 2
    if kind == "Ulysses":
        return [Transfer("all-to-all", block, n, "Q, K, V to heads; output back")] * 4
    raise ValueError(
        f"unknown attention {kind!r}; allowed: {', '.join(sequence.ATTENTIONS)}"
    )


def expert_parallel_transfers(
    tokens_per_device: int,
    num_experts: int,
    top_k: int,
    capacity_factor: float,
    width: int,
    expert_devices: int,
    itemsize: int = 4,
) -> list[Transfer]:
    """One mixture-of-experts layer's forward collectives over an ``expert`` axis (chapter 13_experts).

    Each device fills a buffer of ``E x C`` slots of ``width`` (``experts.capacity`` of its own
    tokens), all-to-alls it to the experts' devices (dispatch), and the results come back the same
    way (combine). The backward pass sends the gradients the same two ways again.
    """
    slots = experts.capacity(tokens_per_device, num_experts, top_k, capacity_factor)
    buffer = experts.all_to_all_bytes(num_experts, slots, width, itemsize)
    return [
        Transfer(
            "all-to-all", buffer, expert_devices, "tokens to their experts (dispatch)"
        ),
        Transfer("all-to-all", buffer, expert_devices, "results home (combine)"),
    ]
