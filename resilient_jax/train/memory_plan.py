"""Will a config fit a cluster? Bytes per device of each part of a run, computed without devices.

`plan(config, cluster)` traces the train state with `jax.eval_shape` (shapes and dtypes only:
nothing is allocated), maps each leaf's logical axes to mesh axes with `mesh.LOGICAL_AXIS_RULES`,
and divides by the mesh axis sizes that `topology.plan_mesh` chooses for the described cluster,
whole and after losing one or two slices (the meshes a reshape would run on). What it reports per
device, for each candidate mesh:

- **params**, **optimizer**: the device's shards of the float32 parameters and of the optimizer
  state (Adam's two moments, and the step, RNG and health counters), exactly as sharded.
- **gradients**: twice the parameter shards: the step accumulates float32 gradients over the
  microbatches (`train.step`: the scan's running sum plus the microbatch's own gradients).
- **weights**: FSDP gathers a layer's weights (sharded over `tensor` only) in the compute dtype
  before using them; XLA keeps the next layer's in flight while one computes: two layers.
- **activations**, per microbatch of `rows_per_device` sequences (`_activation_bytes`): with
  `model.remat="full"` each layer keeps only its input for the backward pass and recomputes the
  rest, one layer's full working set at a time; "save_dots" keeps the products with weights too;
  with "none" every layer keeps its working set. The working set per token counts the tensors a
  layer saves (norm outputs, q/k/v, the attention probabilities, one row of seq_len per head in
  float32 and again in the compute dtype, and the causal mask's byte, as XLA's attention
  materialises them; a fused flash kernel would not, so the estimate is high on such a backend),
  the attention output, the residual, the MLP's four [d_ff] tensors; plus the backward pass's
  float32 gradient of one layer's probabilities, and the float32 logits and their gradient.
- **checkpoint**: the device's shards of params and optimizer state, what it writes per save
  (host RAM for the local tier, storage for the persistent one).
- **save peak**: the device memory of a save step when the state is kept for the tiers
  (`checkpoint.keep_state`): the step after the save runs without donating its input, so the
  saved params + optimizer state stay alive beside the new ones: total + checkpoint. A save that
  copies the state to pinned host memory instead adds nothing on the device: its peak is total.

Against XLA's own count (`memory_analysis()` of the compiled step, float32, 8 CPU devices;
experiments/compile_depth.py) gradients + weights + activations came within 15% for gpt2_small,
llama_1b and llama_7b shapes under every remat policy but one, llama_1b with "full" (16% high:
XLA frees part of the recomputed layer sooner than the plan assumes). At tiny_cpu's size without
remat the plan is 23% low: there the temporaries of the optimizer's update and the loss, which it
does not model, are a large share of 50 MB.

A mesh fits when params + optimizer + gradients + weights + activations stay within
`HEADROOM` of the device's memory; the rest is left to XLA's temporaries and the runtime. Where
the save peak does not fit as well, `keep_state=auto` copies the state to host at a save.
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import ml_collections
from jax.sharding import PartitionSpec

from resilient_jax import mesh as mesh_lib
from resilient_jax import topology as topology_lib
from resilient_jax.config import BadInput, ConfigError
from resilient_jax.model import ModelConfig
from resilient_jax.topology import MeshPlan, Topology
from resilient_jax.train.state import logical_state

GB = 1e9
# Share of a device's memory a plan may fill; the rest is XLA's scratch, collectives' buffers and
# the runtime (a CUDA context alone takes ~0.5 GB).
HEADROOM = 0.9
CLUSTER_SYNTAX = "devices=N,memory_gb=G[,slices=S] (e.g. devices=64,memory_gb=80,slices=8)"


class ClusterSpecError(BadInput):
    """A `--cluster` description the planner cannot read."""


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    devices: int  # accelerators in all, across slices
    memory_gb: float  # memory of one device, in GB (1e9 bytes)
    slices: int = 1  # groups joined by the slow network; a failure takes out a whole one

    @property
    def devices_per_slice(self) -> int:
        return self.devices // self.slices

    def topology(self, slices: int) -> Topology:
        """`slices` of this cluster's slices as a Topology (its devices are placeholders)."""
        n = slices * self.devices_per_slice
        return Topology(
            num_slices=slices, num_processes=slices, process_index=0, devices=tuple(range(n))
        )


def parse_cluster(text: str) -> ClusterSpec:
    """`devices=N,memory_gb=G[,slices=S]`; anything else is a one-line ClusterSpecError."""

    def fail(why: str) -> ClusterSpecError:
        return ClusterSpecError(f"--cluster={text!r} is invalid: {why}; expected {CLUSTER_SYNTAX}")

    fields: dict[str, str] = {}
    for item in text.split(","):
        key, eq, value = item.strip().partition("=")
        if not eq or not key or not value:
            raise fail(f"{item.strip()!r} is not KEY=VALUE")
        if key not in ("devices", "memory_gb", "slices"):
            raise fail(f"unknown key {key!r}")
        if key in fields:
            raise fail(f"{key} given twice")
        fields[key] = value.strip()
    for key in ("devices", "memory_gb"):
        if key not in fields:
            raise fail(f"{key} is missing")
    try:
        devices, slices = int(fields["devices"]), int(fields.get("slices", "1"))
        memory_gb = float(fields["memory_gb"])
    except ValueError as e:
        raise fail(f"not a number ({e})") from None
    if devices < 1 or slices < 1 or not memory_gb > 0 or math.isinf(memory_gb):
        raise fail("devices and slices must be >= 1, memory_gb > 0")
    if devices % slices:
        raise fail(f"slices={slices} must divide devices={devices} (equal slices)")
    return ClusterSpec(devices=devices, memory_gb=memory_gb, slices=slices)


@dataclasses.dataclass(frozen=True)
class MeshMemory:
    """Bytes one device holds on one candidate mesh (see the module docstring for each part)."""

    slices: int
    plan: MeshPlan
    params: int
    optimizer: int
    gradients: int
    weights: int
    activations: int
    checkpoint: int
    capacity: int

    @property
    def total(self) -> int:
        return self.params + self.optimizer + self.gradients + self.weights + self.activations

    @property
    def fits(self) -> bool:
        return self.total <= HEADROOM * self.capacity

    @property
    def save_peak_kept(self) -> int:
        """Device bytes at a save step whose state is kept on the device for the tiers."""
        return self.total + self.checkpoint

    @property
    def keeps_state(self) -> bool:
        """Whether `checkpoint.keep_state=auto` keeps the state here (its save peak fits)."""
        return self.save_peak_kept <= HEADROOM * self.capacity


@dataclasses.dataclass(frozen=True)
class Candidate:
    """The mesh a run would use on `slices` slices, or why none exists."""

    slices: int
    memory: MeshMemory | None
    reason: str = ""


@dataclasses.dataclass(frozen=True)
class Plan:
    cluster: ClusterSpec
    num_params: int
    checkpoint_total: int  # bytes of one saved step (params + optimizer state), all shards
    candidates: tuple[Candidate, ...]  # whole cluster, then one and two slices fewer


def _mesh_axis_sizes(plan: MeshPlan) -> dict[str, int]:
    return {
        "replica": plan.replica,
        "expert": plan.expert,
        "fsdp": plan.fsdp,
        "tensor": plan.tensor,
    }


def _shard_bytes(leaf: jax.ShapeDtypeStruct, spec: PartitionSpec, sizes: dict[str, int]) -> int:
    """Bytes of the largest shard of `leaf` under mesh axes `spec` (uneven splits round up)."""
    elements = 1
    for i, dim in enumerate(leaf.shape):
        axes = spec[i] if i < len(spec) else None
        axes = (axes,) if isinstance(axes, str) else (axes or ())
        elements *= -(-dim // math.prod(sizes[a] for a in axes))
    return elements * leaf.dtype.itemsize


def _tree_shard_bytes(abstract, mesh_specs, sizes: dict[str, int]) -> int:
    is_spec = lambda x: isinstance(x, PartitionSpec)
    leaves = jax.tree.leaves(
        jax.tree.map(lambda s, a: _shard_bytes(a, s, sizes), mesh_specs, abstract, is_leaf=is_spec)
    )
    return int(sum(leaves))


def _mlp_kinds(m: ModelConfig) -> list[bool]:
    """For each layer, whether its MLP is a mixture of experts."""
    return [m.moe.is_moe_layer(i) for i in range(m.num_layers)]


def _layer_weight_bytes(m: ModelConfig, tensor: int, expert: int) -> int:
    """The largest block's weights in the compute dtype, gathered over fsdp, split over tensor
    (and a mixture of experts' experts over `expert`: each device gathers only its own)."""
    attention = m.d_model * m.head_dim * (2 * m.num_heads + 2 * m.num_kv_heads)
    moe = m.moe
    mlp = {
        False: 3 * m.d_model * m.d_ff,
        True: m.d_model * moe.num_experts + moe.num_experts // expert * 3 * m.d_model * moe.d_ff,
    }
    largest = max(mlp[kind] for kind in _mlp_kinds(m))
    return (attention + largest) // tensor * m.dtype.itemsize


def _activation_bytes(m: ModelConfig, seq_len: int, rows: int, tensor: int) -> int:
    """Activation bytes of one microbatch of `rows` sequences on one device (module docstring).
    A mixture-of-experts layer's MLP tensors are per routed slot (top_k x capacity_factor per
    token), the tokens in and out of the experts, and its dispatch, combine and per-choice masks
    ([experts, capacity] per token each)."""
    d, e, t, moe, size = m.d_model, m.head_dim, tensor, m.moe, m.dtype.itemsize
    attention = (
        4 * d  # block input, attention norm output, residual after attention, MLP norm output
        + (m.num_heads + 2 * m.num_kv_heads) * e / t  # q, k, v
        + m.num_heads * e / t  # attention output before its projection
    ) * size + m.num_heads * seq_len / t * (4 + size + 1)
    # The attention probabilities, a row of seq_len per head, twice: XLA's attention
    # (`jax.nn.dot_product_attention`) keeps its float32 softmax output for the softmax's backward
    # pass and the copy in the compute dtype that multiplies the values; and the causal mask,
    # broadcast to every row and head, one byte each, for the masking's backward pass.
    mlp = {False: 4 * m.d_ff / t * size}  # gate pre-activation, its silu, up, their product
    if moe.num_experts:
        slots = moe.num_experts * moe.capacity(seq_len) / seq_len  # expert slots per token
        masks = (2 + moe.top_k) * moe.num_experts * moe.capacity(seq_len)  # [E, C] per token
        mlp[True] = (4 * moe.d_ff * slots / t + 2 * d * slots + masks) * size
    working_sets = [attention + mlp[kind] for kind in _mlp_kinds(m)]
    # The layer whose backward pass runs also holds the gradient of its attention probabilities,
    # in float32: the largest of its gradients on long sequences.
    backward = m.num_heads * seq_len / t * 4
    if m.remat == "none":
        per_token = sum(working_sets) + backward
    else:
        # Each layer keeps its input (the scan's carry) and, with "save_dots", the products with
        # weights: q, k, v, the attention output projection, and the MLP's gate, up and down (a
        # mixture of experts' expert products batch over experts and are recomputed; its router
        # logits are kept). One layer's whole working set exists again while it is recomputed.
        kept = {False: d, True: d}
        if m.remat == "save_dots":
            projections = (m.num_heads + 2 * m.num_kv_heads) * e / t + d
            kept = {False: d + projections + 2 * m.d_ff / t + d}
            kept[True] = d + projections + moe.num_experts
        per_token = sum(kept[kind] for kind in _mlp_kinds(m)) * size + max(working_sets)
        per_token += backward
    per_token += 2 * 4 * m.vocab_size / t  # float32 logits and their gradient
    return int(rows * seq_len * per_token)


def mesh_memory(
    config: ml_collections.ConfigDict, plan: MeshPlan, slices: int, capacity: int, state=None
) -> MeshMemory:
    """Bytes per device of `config` on the mesh `plan` (`state`: `logical_state(config)`)."""
    abstract, logical = state if state is not None else logical_state(config)
    mesh_specs = nn.logical_to_mesh(logical, mesh_lib.LOGICAL_AXIS_RULES)
    sizes = _mesh_axis_sizes(plan)
    params = _tree_shard_bytes(abstract.params, mesh_specs.params, sizes)
    others = _tree_shard_bytes(abstract, mesh_specs, sizes) - params
    m = ModelConfig.from_config(config.model)
    return MeshMemory(
        slices=slices,
        plan=plan,
        params=params,
        optimizer=others,
        gradients=2 * params,
        weights=2 * _layer_weight_bytes(m, plan.tensor, plan.expert),
        activations=_activation_bytes(m, config.data.seq_len, plan.rows_per_device, plan.tensor),
        checkpoint=params + others,
        capacity=capacity,
    )


def plan(config: ml_collections.ConfigDict, cluster: ClusterSpec) -> Plan:
    """Memory per device on the whole cluster and after losing one or two slices.

    Raises ConfigError when the config does not fit the whole cluster's devices at all (axes or
    batch that do not divide); a reshape that has no mesh is reported as a candidate's reason."""
    state = logical_state(config)
    abstract, _ = state
    capacity = int(cluster.memory_gb * GB)
    candidates = []
    for lost in range(3):
        slices = cluster.slices - lost
        if slices < 1:
            break
        try:
            mesh_plan = topology_lib.plan_mesh(config, cluster.topology(slices), strict=lost == 0)
        except ConfigError as e:
            if lost == 0:
                raise
            candidates.append(Candidate(slices, None, str(e)))
            continue
        candidates.append(
            Candidate(slices, mesh_memory(config, mesh_plan, slices, capacity, state))
        )
    total = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(abstract))
    return Plan(
        cluster=cluster,
        num_params=sum(leaf.size for leaf in jax.tree.leaves(abstract.params)),
        checkpoint_total=int(total),
        candidates=tuple(candidates),
    )


def format_plan(result: Plan) -> str:
    """The plan as a table, one row per candidate mesh, sizes in GB per device."""
    c = result.cluster
    lines = [
        f"{result.num_params / 1e9:.2f}B parameters; one checkpoint "
        f"{result.checkpoint_total / GB:.1f} GB; {c.devices} devices in {c.slices} slice(s) "
        f"of {c.devices_per_slice}, "
        f"{c.memory_gb:g} GB each (plans fill at most {HEADROOM:.0%})",
        "GB per device:",
    ]
    header = (
        f"{'slices':>6} {'mesh r x f x t':>14} {'micro':>5} {'rows':>4} {'params':>7} "
        f"{'optim':>7} {'grads':>7} {'weights':>7} {'activ':>7} {'total':>7} {'ckpt':>7}  fits"
        f"  {'save peak':>9}  save keeps state"
    )
    lines.append(header)
    for cand in result.candidates:
        mem = cand.memory
        if mem is None:
            lines.append(f"{cand.slices:>6} no mesh: {cand.reason}")
            continue
        p = mem.plan
        sizes = (
            mem.params,
            mem.optimizer,
            mem.gradients,
            mem.weights,
            mem.activations,
            mem.total,
            mem.checkpoint,
        )
        lines.append(
            f"{cand.slices:>6} {f'{p.replica}x{p.fsdp}x{p.tensor}':>14} {p.microbatches:>5} "
            f"{p.rows_per_device:>4} "
            + " ".join(f"{b / GB:7.2f}" for b in sizes)
            + f"  {'yes' if mem.fits else 'NO':>4}  {mem.save_peak_kept / GB:9.2f}"
            + f"  {'yes' if mem.keeps_state else 'no: copies to host'}"
        )
    lines.append(
        "save peak: total + ckpt, a save step with the state kept on the device for the tiers; "
        "checkpoint.keep_state=auto keeps it only where that fits, else copies it to host "
        "(peak = total)"
    )
    return "\n".join(lines)
