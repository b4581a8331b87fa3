"""A mixture of SwiGLU experts, model.py's MLP when config.num_experts > 0: a top-k
router, GShard's capacity, DeepSeekMoE's shared experts, and the shard_map that places
dropless.py on the mesh. Shapes as in model.py's legend (T a routing group's tokens).
"""

import dataclasses
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from . import dropless
from .attention import manual_axes
from .layers import MLP, constrain, weight
from .model_config import ModelConfig

# the load-balancing loss's coefficient (Switch Transformer, arXiv:2101.03961) and the
# router z-loss's (ST-MoE, arXiv:2202.08906)
BALANCE_WEIGHT, Z_WEIGHT = 0.01, 0.001


def expert_slots(choice_RTE: jax.Array, gates_TR: jax.Array, capacity: int):
    """-> GShard's dispatch and combine (token, expert, slot), and the kept pairs;
    leading dimensions (a batch, groups) carried through."""
    *lead, R, T, E = choice_RTE.shape
    # A pair's slot is how many earlier pairs chose its expert, first choices before
    # second ones; past ``capacity`` its one-hot slot is all zero: dropped.
    flat = choice_RTE.reshape(*lead, R * T, E)
    slot_RT = ((jnp.cumsum(flat, axis=-2) - 1) * flat).sum(-1).reshape(*lead, R, T)
    slot_RTM = jax.nn.one_hot(slot_RT.astype(jnp.int32), capacity)
    dispatch_TEM = jnp.einsum("...rte,...rtm->...tem", choice_RTE, slot_RTM)
    combine_TEM = jnp.einsum(
        "...rte,...rtm,...tr->...tem", choice_RTE, slot_RTM, gates_TR
    )
    return dispatch_TEM, combine_TEM, slot_RT < capacity


class Experts(nnx.Module):
    """E SwiGLU experts, a top-k router, a capacity: -> (the output, the auxiliary
    loss); a choice that finds its expert full is dropped (GShard's dispatch)."""

    def __init__(self, config: ModelConfig, dtype: jnp.dtype, *, rngs: nnx.Rngs):
        c, self.config, self.dtype = config, config, dtype
        D, E, F = c.width, c.num_experts, c.mlp_width
        self.router = weight(rngs, (D, E), ("embed", None), D)
        # DeepSeek-V3's per-expert bias (see route), not trained by gradient
        if c.balance == "bias":
            self.router_bias = nnx.Param(jnp.zeros((E,), jnp.float32))
        self.gate = weight(rngs, (E, D, F), ("experts", "embed", "mlp"), D)
        self.up = weight(rngs, (E, D, F), ("experts", "embed", "mlp"), D)
        self.down = weight(rngs, (E, F, D), ("experts", "mlp", "embed"), F)
        # DeepSeekMoE's shared experts: one wider MLP that every token goes through
        if c.shared_experts:
            wide = dataclasses.replace(c, mlp_width=c.shared_experts * c.mlp_width)
            self.shared = MLP(wide, dtype, rngs=rngs)

    def __call__(self, x_BTD: jax.Array) -> tuple[jax.Array, jax.Array]:
        y_BTD, aux_loss = self.routed(x_BTD)
        if self.config.shared_experts:
            y_BTD += self.shared(x_BTD)
        return y_BTD, aux_loss

    def route(self, x_BGTD: jax.Array):
        """-> (gates, experts, the top-k mask, the auxiliary loss) of each token."""
        c = self.config
        E, R = c.num_experts, c.top_k
        router_DE = self.router[...].astype(jnp.float32)
        logits_BGTE = jnp.einsum("bgtd,de->bgte", x_BGTD.astype(jnp.float32), router_DE)
        probs_BGTE = jax.nn.softmax(logits_BGTE, axis=-1)
        # DeepSeek-V3's auxiliary-loss-free balance (arXiv:2412.19437, 2.1.2): a
        # per-expert bias added to the scores that choose the experts, not the gates.
        if c.balance == "bias":
            bias_E = self.router_bias[...].astype(jnp.float32)
            scores_BGTE = probs_BGTE + jax.lax.stop_gradient(bias_E)
            _, experts_BGTR = jax.lax.top_k(scores_BGTE, R)
            gates_BGTR = jnp.take_along_axis(probs_BGTE, experts_BGTR, axis=-1)
        else:
            gates_BGTR, experts_BGTR = jax.lax.top_k(probs_BGTE, R)
        # With k > 1, a token's gates are scaled to sum to 1.
        gates_BGTR /= gates_BGTR.sum(-1, keepdims=True)
        choice_BGRTE = jax.nn.one_hot(experts_BGTR.swapaxes(2, 3), E)
        # each expert's share of the choices
        load_E = choice_BGRTE.mean((0, 1, 2, 3))
        z_loss = jnp.mean(jax.nn.logsumexp(logits_BGTE, axis=-1) ** 2)
        # The bias's "loss", bias x (load - 1/E), has each expert's load above the mean
        # as gradient; optimizer.py moves the bias by its sign, --bias-rate a step.
        if c.balance == "bias":
            balance = jnp.sum(bias_E * jax.lax.stop_gradient(load_E - 1 / E))
            return gates_BGTR, experts_BGTR, choice_BGRTE, balance + Z_WEIGHT * z_loss
        # Switch's load balance, E sum_e f_e P_e
        balance = E * jnp.sum(load_E * probs_BGTE.mean((0, 1, 2)))
        aux_loss = BALANCE_WEIGHT * balance + Z_WEIGHT * z_loss
        return gates_BGTR, experts_BGTR, choice_BGRTE, aux_loss

    def routed(self, x_BTD: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The routed experts' output, and the auxiliary loss."""
        c = self.config
        B, length, D = x_BTD.shape
        E, R = c.num_experts, c.top_k
        T = min(c.group_size, length)
        G = length // T
        M = math.ceil(R * T * c.capacity_factor / E)
        x_BGTD = x_BTD.reshape(B, G, T, D)
        gates_BGTR, experts_BGTR, choice_BGRTE, aux_loss = self.route(x_BGTD)
        dispatch_BGTEM, combine_BGTEM, _ = expert_slots(choice_BGRTE, gates_BGTR, M)
        w_gate_EDF, w_up_EDF, w_down_EFD = (
            w[...].astype(self.dtype) for w in (self.gate, self.up, self.down)
        )
        # Dropless: every choice computed, sorted by expert (dropless.py).
        if c.dispatch == "dropless":
            y_BTD = dropless_experts(
                x_BTD,
                experts_BGTR.reshape(B, length, R),
                gates_BGTR.reshape(B, length, R),
                w_gate_EDF,
                w_up_EDF,
                w_down_EFD,
                exchange=c.exchange,
            )
            return y_BTD, aux_loss
        # Each device fills its rows' slots, then the slots move to their experts'
        # devices: split by expert instead of by batch row (an all-to-all on 'expert').
        local, routed = (
            (None, "batch", "act_seq", None),
            ("act_experts", "expert_batch", "act_seq", None),
        )
        x_EBGMD = constrain(
            jnp.einsum("bgtem,bgtd->ebgmd", dispatch_BGTEM.astype(self.dtype), x_BGTD),
            (*local, None),
        )
        x_EBGMD = constrain(x_EBGMD, (*routed, None))
        h_EBGMF = jax.nn.silu(
            jnp.einsum("ebgmd,edf->ebgmf", x_EBGMD, w_gate_EDF)
        ) * jnp.einsum("ebgmd,edf->ebgmf", x_EBGMD, w_up_EDF)
        h_EBGMF = constrain(h_EBGMF, (*routed, "act_mlp"))
        y_EBGMD = constrain(
            jnp.einsum("ebgmf,efd->ebgmd", h_EBGMF, w_down_EFD), (*routed, None)
        )
        # And back to their batch rows (the second all-to-all), weighted by their gates.
        y_EBGMD = constrain(y_EBGMD, (*local, None))
        y_BGTD = jnp.einsum(
            "bgtem,ebgmd->bgtd", combine_BGTEM.astype(self.dtype), y_EBGMD
        )
        return y_BGTD.reshape(x_BTD.shape), aux_loss


def only(spec: P, axes: set[str]) -> P:
    """``spec`` naming ``axes`` alone (the others: None)."""
    keep = lambda part: (
        (tuple(a for a in part if a in axes) or None)
        if isinstance(part, tuple)
        else (part if part in axes else None)
    )
    return P(*(keep(part) for part in spec))


def dropless_experts(
    x_BTD, experts_BTR, gates_BTR, w_gate_EDF, w_up_EDF, w_down_EFD, exchange="padded"
):
    """Every token's experts, nothing dropped (dropless.py), in a jax.shard_map over
    the mesh, tokens and weights as the rules split them; unwrapped outside a mesh."""
    # In float32, cast inside (dropless.in_compute_type): the sums of their gradients
    # over devices then run in float32.
    f32 = [
        a.astype(jnp.float32)
        for a in (x_BTD, gates_BTR, w_gate_EDF, w_up_EDF, w_down_EFD)
    ]
    args = (f32[0], experts_BTR, *f32[1:])
    if jax.sharding.get_abstract_mesh().empty:
        return dropless.on_device(*args, dtype=x_BTD.dtype)
    names = [
        ("batch", "act_seq", None),
        ("experts", "embed", "mlp"),
        ("experts", "mlp", "embed"),
    ]
    # the tokens' specs, then gate and up's, then down's
    specs = [nn.logical_to_mesh_axes(n) for n in names]
    # Manual over the axes that split something; the others left out of the specs, so
    # that no size-1 axis calls for a collective (check_vma holds the rest to account).
    sizes = jax.sharding.get_abstract_mesh().shape
    manual = {a for a in manual_axes(*specs) if sizes[a] > 1}
    tokens, up, down = (only(spec, manual) for spec in specs)
    expert_axis, width_axis, mlp_axis = up
    on_each = jax.shard_map(
        functools.partial(
            dropless.on_device,
            expert_axis=expert_axis,
            width_axis=width_axis,
            mlp_axis=mlp_axis,
            exchange=exchange,
            dtype=x_BTD.dtype,
        ),
        in_specs=(tokens, tokens, tokens, up, up, down),
        out_specs=tokens,
        axis_names=manual,
    )
    return on_each(*args)
