"""The GPU memory of an RL run, planned before it starts: what each piece of state takes, in which
phase (generation, training), and what to change when the peak does not fit.

Parameter bytes follow megatron-core's `theoretical_memory_usage.num_bytes_per_parameter` (18 a
parameter: bf16 weight, fp32 gradient, fp32 main weight and two Adam moments; the last three
divided by the data-parallel size with the distributed optimizer). Beyond it: parameter counts
of hybrid GDN layers (megatron-core's function refuses hybrid models), the engine's KV cache and
GDN states (the arithmetic of megatron-core's DynamicInferenceContext), the RL levers that move
state off the GPU during one phase, and activations of this package's layers, counted from the
tensors their backward keeps (`activation_bytes_per_token`).
"""

import math
import os
from dataclasses import dataclass, field, replace

GIB = 2**30
ADAM_MOMENTS_BYTES = 8  # exp_avg and exp_avg_sq, fp32
MAIN_PARAM_BYTES = 4  # the optimizer's fp32 copy of a bf16/fp16 weight
GRAD_BYTES = 4  # megatron-core DDP's fp32 main_grad buffer
# --optimizer-cpu-offload: megatron-core's HybridDeviceOptimizer copies each gradient to a host
# tensor of the main weight's dtype (page-locked by default) before its CPU step
HOST_GRAD_BYTES = 4
# GPU memory a run's process uses beyond torch's allocator: the CUDA context, NCCL, cuBLAS and the
# kernels' modules. Measured once (memory/beyond_torch_gib): 1.9 GiB for Qwen3.5-9B's widths at 8
# layers on an H100, a process alone on its GPU (results/README.md, "Session of 41a9c30"), a run
# the plan said fitted and that ran out of memory.
OUTSIDE_TORCH_BYTES = int(1.9 * GIB)
# Rows of logits the trainer's LM head computes at once: a [rows, vocab] chunk stays under this
# many elements (models.logprobs).
LOGITS_CHUNK_ELEMENTS = 2**27
LOGITS_BYTES_PER_ELEMENT = 16  # bf16 logits, fp32 copy, fp32 log-softmax, fp32 + bf16 gradients


@dataclass(frozen=True)
class ModelShape:
    """What memory depends on (config.from_args.model_shape_from_args reads it from the flags)."""

    layers: tuple[str, ...]
    """Megatron's layers in order, each as megatron-core's symbols: '*' attention, 'G' GDN, '-' MLP,
    'E' mixture of experts (a dense GPT layer is '*-', or '*E'; a hybrid pattern's symbols are a
    layer each)."""
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    """Padded vocabulary (Megatron's)."""
    swiglu: bool = True
    bias: bool = False
    tied: bool = False
    qk_norm: bool = False
    output_gate: bool = False
    gdn_key_heads: int = 0
    gdn_value_heads: int = 0
    gdn_key_dim: int = 0
    gdn_value_dim: int = 0
    gdn_conv_kernel: int = 0
    param_bytes: int = 2
    rotary_dim: int = 0
    """Channels of a head that RoPE rotates (--rotary-percent of the head dim); 0 without RoPE."""
    experts: int = 0
    topk: int = 0
    expert_ffn: int = 0
    shared_ffn: int = 0
    """A MoE layer's routed experts, experts a token, an expert's and the shared expert's widths."""
    shared_gate: bool = False
    """The shared expert's output scaled by the sigmoid of its own gate (--moe-shared-expert-gate)."""
    router_bytes: int = 2
    """The router's logits and probabilities: 4 with --moe-router-dtype fp32, else the params'."""
    load_balancing_loss: bool = False
    z_loss: bool = False

    def count(self, symbol: str) -> int:
        return sum(layer.count(symbol) for layer in self.layers)

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def gdn_dims(self) -> tuple[int, int, int]:
        """(all key heads' width, all value heads' width, value heads)."""
        return (self.gdn_key_heads * self.gdn_key_dim, self.gdn_value_heads * self.gdn_value_dim,
                self.gdn_value_heads)


def _linear(fan_in: int, fan_out: int, bias: bool) -> int:
    return fan_in * fan_out + (fan_out if bias else 0)


def _mlp_parameters(shape: ModelShape, ffn: int) -> int:
    h, b = shape.hidden, shape.bias
    return _linear(h, ffn * (2 if shape.swiglu else 1), b) + _linear(ffn, h, b) if ffn else 0


def layer_parameters(shape: ModelShape, symbol: str) -> int:
    """Parameters of one layer of kind `symbol`, its input norm included."""
    h, b = shape.hidden, shape.bias
    if symbol == "-":
        return h + _mlp_parameters(shape, shape.ffn)
    if symbol == "E":  # norm, router, routed experts, shared expert and its gate
        return (h + _linear(h, shape.experts, b) + shape.experts * _mlp_parameters(shape, shape.expert_ffn)
                + _mlp_parameters(shape, shape.shared_ffn) + (h if shape.shared_gate else 0))
    if symbol == "*":
        q_out = shape.q_dim * (2 if shape.output_gate else 1)
        norms = 2 * shape.head_dim if shape.qk_norm else 0
        return h + _linear(h, q_out + 2 * shape.kv_dim, b) + _linear(shape.q_dim, h, b) + norms
    if symbol == "G":
        keys, values, value_heads = shape.gdn_dims
        projected = 2 * keys + 2 * values + 2 * value_heads  # q, k, v, gate, beta, alpha
        conv = (2 * keys + values) * shape.gdn_conv_kernel
        return (h + _linear(h, projected, b) + conv + 2 * value_heads + shape.gdn_value_dim
                + _linear(values, h, b))
    raise ValueError(f"layer symbol {symbol!r}: expected '*', 'G', '-' or 'E'")


def parameter_count(shape: ModelShape) -> int:
    """Every parameter of the model: embedding, output layer unless tied, layers, final norm."""
    embeddings = shape.vocab * shape.hidden * (1 if shape.tied else 2)
    symbols = "".join(shape.layers)
    return embeddings + sum(layer_parameters(shape, s) for s in symbols) + shape.hidden


def activation_bytes_per_token(shape: ModelShape, symbol: str) -> int:
    """Bytes a layer of kind `symbol` keeps for its backward, per token, in the params dtype (fp32
    where the kernels keep fp32): the tensors each op saves, a view counted with its storage (as
    counted on megatron-core's layers in BI mode: tests/unit_tests/test_memory_saved_tensors.py)."""
    h, e = shape.hidden, shape.param_bytes
    norm = h * e + 4  # the norm's input and its fp32 1/rms
    if symbol == "-":
        return norm + (h + _mlp_elements(shape, shape.ffn)) * e  # + fc1's input
    if symbol == "E":
        return norm + _moe_bytes_per_token(shape)
    if symbol == "*":
        return norm + _attention_bytes_per_token(shape)
    keys, values, value_heads = shape.gdn_dims
    projected = 2 * keys + 2 * values + 2 * value_heads
    q_and_k = 2 * value_heads * shape.gdn_key_dim  # repeated to the value heads
    bf16 = h + projected + q_and_k + values + value_heads + 3 * values  # + core, norm out, proj in
    fp32 = 3 * value_heads + 2 * values + value_heads  # g and softplus, gate and silu, 1/rms
    return norm + bf16 * e + fp32 * 4


def _mlp_elements(shape: ModelShape, ffn: int) -> int:
    """An MLP's fc1 output and activation outputs, in elements a row: silu(gate) and the product;
    megatron-core's GLU adds its linear offset to the linear half (x + glu_linear_offset, a new
    tensor) before the product saves it."""
    return ffn * (2 if shape.swiglu else 1) + (3 * ffn if shape.swiglu else ffn)


def _moe_bytes_per_token(shape: ModelShape) -> int:
    """A MoE layer after its norm (models.moe in BI mode): the normed input (router's, shared
    expert's), each of the token's k expert rows (its copy of the input, an MLP's tensors, and
    the activation scaled by the router's probability, fc2's input), the shared expert's MLP (with
    its gate: the MLP's output and the gate's sigmoid, which their product saves); and
    the routing: the stable top-k's sort indices [E], the expert-major argsort [E] and the row
    maps [2k] in int64, the top-k's softmax [k] in fp32, the rows' probabilities [k], the
    load-balancing loss's fp32 softmax [E] (its own top-k's indices are freed in the forward),
    the z-loss's logits [E] and log-sum-exp."""
    e, k, experts, rb = shape.param_bytes, shape.topk, shape.experts, shape.router_bytes
    rows = k * (shape.hidden + _mlp_elements(shape, shape.expert_ffn) + shape.expert_ffn) * e
    shared = (_mlp_elements(shape, shape.shared_ffn) + (shape.hidden + 1 if shape.shared_gate else 0)) * e
    routing = (2 * experts + 2 * k) * 8 + k * 4 + k * rb
    losses = (experts * 4 if shape.load_balancing_loss else 0) + ((experts + 1) * rb if shape.z_loss else 0)
    return shape.hidden * e + rows + shared + routing + losses


def _attention_bytes_per_token(shape: ModelShape) -> int:
    """Attention after its norm: the QKV projection's input and output (kept by v's view), QK
    norms' inputs (contiguous copies of q and k) with their fp32 1/rms per head, RoPE's cos and
    sin (cast to the params dtype for q and for k), rotated q and k, FlashAttention's output and
    fp32 log-sum-exp, and the output gate's sigmoid and product."""
    e, q, kv = shape.param_bytes, shape.q_dim, shape.kv_dim
    qkv = q * (2 if shape.output_gate else 1) + 2 * kv
    qk_norm = (q + kv) * e + (shape.heads + shape.kv_heads) * 4 if shape.qk_norm else 0
    rotary = 4 * shape.rotary_dim * e
    attention = q + kv + q  # rotated q and k, FlashAttention's output
    gate = 2 * q if shape.output_gate else 0
    return (shape.hidden + qkv + attention + gate) * e + qk_norm + rotary + 4 * shape.heads


@dataclass(frozen=True)
class Recompute:
    """Megatron's activation recompute (--recompute-granularity/-method/-num-layers)."""

    granularity: str | None = None
    method: str | None = None
    num_layers: int = 1


def _layer_bytes(shape: ModelShape, layer: str, tokens: int) -> int:
    return tokens * sum(activation_bytes_per_token(shape, s) for s in layer)


def activation_bytes(shape: ModelShape, tokens: int, recompute: Recompute) -> int:
    """Activations of one packed micro-batch of `tokens` at their peak: the end of the forward,
    or, under full recompute, a checkpointed chunk's backward (the chunk recomputed, the layers
    after it already freed, every earlier chunk's input kept)."""
    kept, recomputing = _activation_phases(shape, tokens, recompute)
    return max(kept, recomputing)


def backward_activation_bytes(shape: ModelShape, tokens: int, recompute: Recompute, head_bytes: int) -> int:
    """What the activations add to the LM head's `head_bytes` at the backward's peak. The head's
    backward runs first, beside the activations kept through the forward; a recomputed chunk
    comes after it has freed its chunk of logits, so the two are never held together."""
    kept, recomputing = _activation_phases(shape, tokens, recompute)
    return max(kept, recomputing - head_bytes)


def _activation_phases(shape: ModelShape, tokens: int, recompute: Recompute) -> tuple[int, int]:
    """(activations kept through the forward, the most held while a checkpointed chunk is
    recomputed in the backward; 0 without full recompute)."""
    full = [_layer_bytes(shape, layer, tokens) for layer in shape.layers]
    boundary = tokens * shape.hidden * shape.param_bytes  # a checkpointed chunk's input
    if recompute.granularity != "full":
        return sum(full), 0
    n = recompute.num_layers
    if recompute.method == "block":  # the first n layers checkpointed one by one, the rest kept
        return n * boundary + sum(full[n:]), n * boundary + max(full[:n], default=0)
    chunks = [sum(full[i:i + n]) for i in range(0, len(full), n)]
    return len(chunks) * boundary, len(chunks) * boundary + max(chunks)


def logits_bytes(shape: ModelShape, tokens: int) -> int:
    """The trainer's LM head: the final hidden states, and one chunk of logits with its
    log-softmax and gradients at a time."""
    rows = min(tokens, max(1, LOGITS_CHUNK_ELEMENTS // shape.vocab))
    return tokens * shape.hidden * (2 * shape.param_bytes + 4) + rows * shape.vocab * LOGITS_BYTES_PER_ELEMENT


# ----------------------------------------------------------------------------- the engine


def kv_bytes_per_token(shape: ModelShape) -> int:
    """Keys and values of every attention layer, in the params dtype (megatron-core's block
    arithmetic, per token)."""
    return shape.param_bytes * 2 * shape.count("*") * shape.kv_dim


def decode_weight_bytes(shape: ModelShape) -> int:
    """The weights a decode step reads: all but an untied model's input embedding, of which a step
    reads one row per request."""
    input_embedding = 0 if shape.tied else shape.vocab * shape.hidden
    return (parameter_count(shape) - input_embedding) * shape.param_bytes


def gdn_state_bytes_per_request(shape: ModelShape) -> int:
    """A request's GDN states: conv [2K + V, kernel] in the params dtype, rule [HV, K, V] fp32."""
    keys, values, value_heads = shape.gdn_dims
    conv = (2 * keys + values) * shape.gdn_conv_kernel * shape.param_bytes
    return shape.count("G") * (conv + value_heads * shape.gdn_key_dim * shape.gdn_value_dim * 4)


@dataclass(frozen=True)
class EngineShape:
    """The engine's sizes (EngineConfig's)."""

    max_requests: int
    max_sequence_length: int
    block_tokens: int
    buffer_bytes: int
    cuda_graphs: bool = False


def kv_block_bytes(shape: ModelShape, engine: EngineShape) -> int:
    return kv_bytes_per_token(shape) * engine.block_tokens


def kv_blocks(shape: ModelShape, engine: EngineShape) -> tuple[int, int]:
    """(usable KV blocks, blocks one request of --inference-max-seq-length needs). megatron-core
    reserves every request slot's GDN states first, then splits the rest into blocks, one a dummy."""
    states = engine.max_requests * gdn_state_bytes_per_request(shape)
    usable = max((engine.buffer_bytes - states) // kv_block_bytes(shape, engine) - 1, 0)
    return usable, math.ceil(engine.max_sequence_length / engine.block_tokens)


def requests_held(shape: ModelShape, engine: EngineShape) -> int:
    """Requests of --inference-max-seq-length the cache holds at once (at most
    --inference-dynamic-batching-max-requests): the engine pauses requests that outgrow it."""
    usable, per_request = kv_blocks(shape, engine)
    return min(engine.max_requests, usable // per_request)


def kv_cache_problem(shape: ModelShape, engine: EngineShape, sized_by: str) -> str | None:
    """Why the engine's cache cannot run one request of --inference-max-seq-length (None: it
    can); `sized_by` names the flag that set its size."""
    usable, needed = kv_blocks(shape, engine)
    if usable >= needed:
        return None
    states = engine.max_requests * gdn_state_bytes_per_request(shape)
    return (f"{sized_by}: the KV cache of {engine.buffer_bytes / GIB:.2f} GiB holds {usable} "
            f"blocks of {engine.block_tokens} tokens after the GDN states of "
            f"--inference-dynamic-batching-max-requests {engine.max_requests} "
            f"({states / GIB:.2f} GiB), fewer than one request of --inference-max-seq-length "
            f"{engine.max_sequence_length} needs ({needed}): give the cache more memory, or "
            "lower --inference-max-seq-length or --inference-dynamic-batching-max-requests")


def engine_buffer_bytes(shape: ModelShape, engine: EngineShape) -> int:
    """What the engine holds besides its cache: under CUDA graphs, the fp32 logits of a decode
    step's requests (compat.full_precision_graph_logits)."""
    return engine.max_requests * shape.vocab * 4 if engine.cuda_graphs else 0


# ----------------------------------------------------------------------------- the plan

GENERATION, TRAINING = "generation", "training"
BOTH = (GENERATION, TRAINING)


@dataclass(frozen=True)
class Levers:
    """The flags that move memory (Megatron's names)."""

    recompute: Recompute = field(default_factory=Recompute)
    distributed_optimizer: bool = False  # --use-distributed-optimizer
    optimizer_cpu_offload: bool = False  # --optimizer-cpu-offload
    offload_optimizer_during_inference: bool = False  # --rl-offload-optimizer-during-inference
    kv_cache_mode: str = "persist"  # --rl-kv-cache-management-mode
    kv_cache_fraction: float | None = None  # --rl-kv-cache-memory-fraction
    reference_model: bool = False  # --grpo-kl-beta > 0


@dataclass(frozen=True)
class Item:
    name: str
    bytes: int
    phases: tuple[str, ...]
    note: str = ""


@dataclass
class MemoryPlan:
    items: list[Item]
    gpu_bytes: int
    outside_torch_bytes: int = 0
    """What the process holds beyond torch's tensors (RunShape.outside_torch_bytes)."""
    suggestions: list[str] = field(default_factory=list)
    requests_at_once: int = 0
    """Requests of the longest length the engine's cache holds together (requests_held)."""
    generation_waves: int = 0
    """Rounds of that many requests a step's generation takes (its decode time grows with them)."""
    host_optimizer_bytes: int = 0
    """Host memory each GPU's process takes for its optimizer (host_optimizer_bytes):
    with --optimizer-cpu-offload, or its GPU state while generating with
    --rl-offload-optimizer-during-inference."""

    def phase_bytes(self, phase: str) -> int:
        return sum(item.bytes for item in self.items if phase in item.phases)

    @property
    def peak_bytes(self) -> int:
        return max(self.phase_bytes(phase) for phase in BOTH)

    @property
    def fits(self) -> bool:
        """The peak and what the process holds beyond torch within the GPU's memory."""
        return self.peak_bytes + self.outside_torch_bytes <= self.gpu_bytes

    def item(self, name: str) -> Item:
        return next(item for item in self.items if item.name == name)

    def summary(self) -> dict:
        """GiB of each item and of the peaks, for a run's header."""
        return {**{item.name: item.bytes / GIB for item in self.items},
                **{f"peak_{phase}": self.phase_bytes(phase) / GIB for phase in BOTH},
                "peak": self.peak_bytes / GIB, "gpu": self.gpu_bytes / GIB,
                "outside_torch": self.outside_torch_bytes / GIB,
                "requests_at_once": self.requests_at_once, "generation_waves": self.generation_waves,
                "host_optimizer": self.host_optimizer_bytes / GIB}


def _per_rank(state_bytes: int, levers: Levers, data_parallel: int) -> int:
    """One rank's share of optimizer state: all of it, or 1/DP with the distributed optimizer."""
    return state_bytes // (data_parallel if levers.distributed_optimizer else 1)


def optimizer_bytes(params: int, shape: ModelShape, levers: Levers, data_parallel: int) -> int:
    """The optimizer's state on the GPU: fp32 main weights (of bf16/fp16 ones) and Adam's two
    moments, sharded over data-parallel ranks by the distributed optimizer; none offloaded."""
    if levers.optimizer_cpu_offload:
        return 0
    per_param = ADAM_MOMENTS_BYTES + (MAIN_PARAM_BYTES if shape.param_bytes < 4 else 0)
    return _per_rank(params * per_param, levers, data_parallel)


def _state_items(shape: ModelShape, levers: Levers, data_parallel: int) -> list[Item]:
    params = parameter_count(shape)
    optimizer = optimizer_bytes(params, shape, levers, data_parallel)
    where = ("on the CPU (--optimizer-cpu-offload)" if levers.optimizer_cpu_offload else
             "fp32 main weights + Adam" + (f", 1/{data_parallel} each (distributed)" if levers.distributed_optimizer else ""))
    items = [Item("weights", params * shape.param_bytes, BOTH, f"{params / 1e9:.2f}B parameters"),
             Item("gradients", params * GRAD_BYTES, BOTH, "fp32 main_grad buffer"),
             Item("optimizer", optimizer,
                  (TRAINING,) if levers.offload_optimizer_during_inference else BOTH,
                  where + (", CPU while generating" if levers.offload_optimizer_during_inference else ""))]
    if levers.reference_model:
        items.append(Item("KL reference weights", params * shape.param_bytes, (TRAINING,), "--grpo-kl-beta > 0"))
    return items


def host_optimizer_bytes(params: int, shape: ModelShape, levers: Levers, data_parallel: int) -> int:
    """The host memory a rank's optimizer takes: on the CPU route its state and the host copy of
    its gradients (torch's AdamW steps CPU tensors one at a time, so its temporaries are one
    weight's); or the state that leaves the GPU while the engine generates."""
    if levers.optimizer_cpu_offload:
        on_gpu = replace(levers, optimizer_cpu_offload=False)
        return optimizer_bytes(params, shape, on_gpu, data_parallel) + _per_rank(params * HOST_GRAD_BYTES, levers,
                                                                                 data_parallel)
    return optimizer_bytes(params, shape, levers, data_parallel) if levers.offload_optimizer_during_inference else 0


CGROUP_MEMORY_MAX = "/sys/fs/cgroup/memory.max"  # cgroup v2: a number of bytes, or "max"


def node_memory_bytes() -> int:
    """This machine's memory, or its cgroup's limit where that is lower (a container's)."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open(CGROUP_MEMORY_MAX) as f:
            limit = f.read().strip()
    except OSError:
        return physical
    return min(physical, int(limit)) if limit.isdigit() else physical


# Of a node's memory, the share its processes' optimizers may take before the plan warns: the
# processes themselves take more (CUDA, torch, a checkpoint's load). The Qwen3.5-35B-A3B 8-layer
# run's optimizer, 115.4 GiB by this count, was killed on a node of 125 GiB (results/README.md).
HOST_SHARE_WARNED = 0.85


def host_memory_warning(host_bytes: int, processes: int, machine_bytes: int) -> str | None:
    """A warning where the optimizers fit the node's memory with little left for the rest."""
    need = host_bytes * processes
    if not HOST_SHARE_WARNED * machine_bytes < need <= machine_bytes:
        return None
    return (f"warning: the optimizers of this node's {processes} training process(es) take {need / GIB:.1f} GiB "
            f"of its {machine_bytes / GIB:.1f} GiB of host memory ({need / machine_bytes:.0%}); the processes "
            "themselves take more, and the kernel kills a process that finds none left")


def host_memory_problem(host_bytes: int, processes: int, machine_bytes: int, sharded: bool) -> str | None:
    """Why `processes` ranks, each taking `host_bytes` of host memory for its optimizer (`sharded`
    over them by the distributed optimizer, or not), cannot share a node of `machine_bytes`; None
    when they fit."""
    if host_bytes * processes <= machine_bytes:
        return None
    shard = ("shard it over more GPUs (it is 1/N a process with --use-distributed-optimizer)" if sharded else
             "shard it over the GPUs (--use-distributed-optimizer)")
    return (f"the optimizer takes {host_bytes / GIB:.1f} GiB of host memory a training process (on the CPU "
            f"route, --optimizer-cpu-offload: its state and the gradients' host copy), "
            f"{host_bytes * processes / GIB:.1f} GiB for this node's {processes}; the node has "
            f"{machine_bytes / GIB:.1f} GiB: {shard}, or keep it on the GPU while training "
            "(--rl-offload-optimizer-during-inference instead)")


def optimizer_growth_before_generation(params: int, shape: ModelShape, levers: Levers,
                                       data_parallel: int) -> int:
    """How many more optimizer bytes the GPU holds while the engine generates than when it is
    built (negative: fewer). At the build the fp32 main weights are placed and Adam's moments not
    yet (they come with the first update); while generating the whole state is there, or none
    of it with --rl-offload-optimizer-during-inference; on the CPU it is never on the GPU."""
    if levers.optimizer_cpu_offload:
        return 0
    placed = _per_rank(params * (MAIN_PARAM_BYTES if shape.param_bytes < 4 else 0), levers, data_parallel)
    generating = 0 if levers.offload_optimizer_during_inference else optimizer_bytes(params, shape, levers, data_parallel)
    return generating - placed


def optimizer_step_bytes(params: int, levers: Levers, data_parallel: int, fused_adam: bool) -> int:
    """What the optimizer's step allocates on the GPU for a moment, beside the state: torch's
    AdamW (megatron-core's Adam where neither TE's nor APEX's FusedAdam is installed) writes the
    square root of Adam's second moment into a new fp32 tensor for every parameter of a group at
    once (`_multi_tensor_adam`); the fused kernels allocate none, and on the CPU route it is host
    memory."""
    if fused_adam or levers.optimizer_cpu_offload:
        return 0
    return _per_rank(params * 4, levers, data_parallel)


def kv_cache_bytes(free_bytes: int, levers: Levers, engine: EngineShape) -> int:
    """The cache a run gives the engine: --rl-kv-cache-memory-fraction of `free_bytes` (the memory
    free while it generates: free at its build, less optimizer_growth_before_generation), or the
    configured --inference-dynamic-batching-buffer-size-gb."""
    if levers.kv_cache_fraction is None:
        return engine.buffer_bytes
    return int(levers.kv_cache_fraction * max(free_bytes, 0))


@dataclass(frozen=True)
class RunShape:
    """Everything a plan depends on besides the levers."""

    model: ModelShape
    engine: EngineShape
    micro_batch_tokens: int
    data_parallel: int
    gpu_bytes: int
    requests: int = 0
    """Requests a step generates on each rank (prompts x group size)."""
    role: str = "colocated"
    """What the process holds: 'colocated' (trainer and engine on one module), or with generator
    ranks apart (--rl-generator-ranks) a 'trainer' (no engine) or a 'generator' (the weights and
    the engine only)."""
    fused_adam: bool = False
    """megatron-core's Adam is TE's or APEX's FusedAdam (installed), not torch's AdamW."""
    outside_torch_bytes: int = 0
    """GPU memory the process holds beyond torch's allocator (OUTSIDE_TORCH_BYTES for a run): not
    free for its tensors, nor for a KV cache sized by fraction of the free memory."""

    @property
    def trainer_tokens(self) -> int:
        """The largest packed micro-batch: --rl-micro-batch-tokens, or one sequence of
        --inference-max-seq-length (a longer sequence is a micro-batch of its own)."""
        return max(self.micro_batch_tokens, self.engine.max_sequence_length)


def plan_memory(run: RunShape, levers: Levers) -> MemoryPlan:
    """Every piece of GPU state by phase, and the levers that would lower the peak."""
    plan = MemoryPlan(_items(run, levers), run.gpu_bytes, run.outside_torch_bytes)
    plan.suggestions = suggestions(run, levers, plan.peak_bytes)
    if plan.fits and (fewer := fewer_recomputed_layers(run, levers, plan.peak_bytes)):
        plan.suggestions.append(fewer)
    if run.role != "generator":
        plan.host_optimizer_bytes = host_optimizer_bytes(parameter_count(run.model), run.model, levers,
                                                         run.data_parallel)
    if run.role == "trainer":
        return plan
    cache = replace(run.engine, buffer_bytes=plan.item("KV cache + GDN states").bytes)
    plan.requests_at_once = requests_held(run.model, cache)
    plan.generation_waves = math.ceil(run.requests / plan.requests_at_once) if plan.requests_at_once else 0
    if 0 < plan.requests_at_once < run.engine.max_requests:
        plan.suggestions.append(
            f"--inference-dynamic-batching-max-requests {plan.requests_at_once}: the cache holds "
            f"{plan.requests_at_once} requests of --inference-max-seq-length {run.engine.max_sequence_length}, "
            f"not {run.engine.max_requests}; the engine pauses requests that outgrow it")
    return plan


def _items(run: RunShape, levers: Levers) -> list[Item]:
    """The process's items: a colocated one's state, engine and training pieces; a trainer's
    state and training pieces; a generator's weights and engine."""
    if run.role == "generator":
        params = parameter_count(run.model)
        return _engine_items(run, levers, [Item("weights", params * run.model.param_bytes, (GENERATION,),
                                                 f"{params / 1e9:.2f}B parameters, sent by the trainer")])
    state = _state_items(run.model, levers, run.data_parallel)
    return (state if run.role == "trainer" else _engine_items(run, levers, state)) + _training_items(run, levers)


def _engine_items(run: RunShape, levers: Levers, state: list[Item]) -> list[Item]:
    """`state`, and the engine's cache (sized from what `state` leaves while generating) and buffer."""
    generating = sum(item.bytes for item in state if GENERATION in item.phases)
    extra = engine_buffer_bytes(run.model, run.engine)
    kv = kv_cache_bytes(run.gpu_bytes - run.outside_torch_bytes - generating - extra, levers, run.engine)
    kv_phases = BOTH if levers.kv_cache_mode == "persist" and run.role == "colocated" else (GENERATION,)
    return state + [
        Item("KV cache + GDN states", kv, kv_phases, f"--rl-kv-cache-management-mode {levers.kv_cache_mode}"),
        Item("engine logits buffer", extra, (GENERATION,), "CUDA graphs: fp32 logits of a decode step")]


def _training_items(run: RunShape, levers: Levers) -> list[Item]:
    """The backward's activations and LM head; then the optimizer's step, which runs once they
    are freed and so adds only what it takes beyond them."""
    shape, tokens = run.model, run.trainer_tokens
    head = logits_bytes(shape, tokens)
    backward = [
        Item("activations", backward_activation_bytes(shape, tokens, levers.recompute, head), (TRAINING,),
             f"{tokens} tokens, recompute {levers.recompute.granularity or 'none'}"
             + (f" (none: {activation_bytes(shape, tokens, Recompute()) / GIB:.2f} GiB)"
                if levers.recompute.granularity else "")),
        Item("LM head", head, (TRAINING,), "hidden states + one chunk of logits"),
    ]
    step = optimizer_step_bytes(parameter_count(shape), levers, run.data_parallel, run.fused_adam)
    beyond = max(0, step - sum(item.bytes for item in backward))
    note = ("none on the GPU (--optimizer-cpu-offload)" if levers.optimizer_cpu_offload else
            "none (TE's or APEX's FusedAdam)" if run.fused_adam else
            f"torch AdamW's sqrt(exp_avg_sq), {step / GIB:.2f} GiB, less the backward's freed tensors")
    return backward + [Item("optimizer step", beyond, (TRAINING,), note)]


def _variants(run: RunShape, levers: Levers) -> list[tuple[str, Levers]]:
    """Each lever not in use, as flags and the levers with it."""
    full = Recompute("full", "uniform", 1)
    variants = [
        ("--recompute-granularity full --recompute-method uniform --recompute-num-layers 1",
         levers.recompute == full, replace(levers, recompute=full)),
        ("--rl-kv-cache-management-mode recompute", levers.kv_cache_mode != "persist",
         replace(levers, kv_cache_mode="recompute")),
        ("--rl-offload-optimizer-during-inference", levers.offload_optimizer_during_inference,
         replace(levers, offload_optimizer_during_inference=True)),
        (f"--use-distributed-optimizer (over {run.data_parallel} GPUs)",
         levers.distributed_optimizer or run.data_parallel == 1, replace(levers, distributed_optimizer=True)),
        ("--optimizer-cpu-offload --use-precision-aware-optimizer --use-distributed-optimizer",
         levers.optimizer_cpu_offload, replace(levers, optimizer_cpu_offload=True, distributed_optimizer=True)),
    ]
    return [(flags, changed) for flags, in_use, changed in variants if not in_use]


def suggestions(run: RunShape, levers: Levers, peak: int) -> list[str]:
    """What each unused lever would make the peak, largest saving first (KV sized by fraction
    stays the same fraction of what is free)."""
    found = []
    for flags, changed in _variants(run, levers):
        other = max(sum(i.bytes for i in _items(run, changed) if p in i.phases) for p in BOTH)
        if other < peak:
            found.append((other, f"{flags}: peak {peak / GIB:.1f} -> {other / GIB:.1f} GiB"))
    if run.micro_batch_tokens > run.engine.max_sequence_length:
        half = replace(run, micro_batch_tokens=max(run.micro_batch_tokens // 2, run.engine.max_sequence_length))
        other = max(sum(i.bytes for i in _items(half, levers) if p in i.phases) for p in BOTH)
        if other < peak:
            found.append((other, f"--rl-micro-batch-tokens {half.micro_batch_tokens}: peak "
                                 f"{peak / GIB:.1f} -> {other / GIB:.1f} GiB"))
    return [text for _, text in sorted(found)]


def fewer_recomputed_layers(run: RunShape, levers: Levers, peak: int) -> str | None:
    """Under full recompute, the fewest layers megatron-core's block method recomputes (the first
    n; the rest keep their activations) while training's peak stays within `peak`: each layer
    not recomputed is a forward the backward no longer runs. None when none can be spared."""
    if levers.recompute.granularity != "full":
        return None
    layers = len(run.model.layers)
    now = layers if levers.recompute.method != "block" else min(levers.recompute.num_layers, layers)
    for n in range(now):
        fewer = Recompute("full", "block", n) if n else Recompute()
        training = sum(i.bytes for i in _items(run, replace(levers, recompute=fewer)) if TRAINING in i.phases)
        if training <= peak:
            flags = (f"--recompute-method block --recompute-num-layers {n}" if n else
                     "no --recompute-granularity")
            return (f"{flags}: {n} of {layers} layers recomputed, not {now}, and training's peak "
                    f"{training / GIB:.1f} GiB stays within the peak {peak / GIB:.1f} GiB: a faster "
                    "backward, no more memory")
    return None


def format_plan(plan: MemoryPlan) -> str:
    """The plan as a table, then whether the peak fits and what would lower it."""
    rows = [f"{'':26} {'GiB':>8}  {'generation':>10}  {'training':>8}  note"]
    for item in plan.items:
        marks = ["x" if phase in item.phases else "" for phase in BOTH]
        rows.append(f"{item.name:26} {item.bytes / GIB:8.2f}  {marks[0]:>10}  {marks[1]:>8}  {item.note}")
    rows.append(f"{'peak, generation':26} {plan.phase_bytes(GENERATION) / GIB:8.2f}")
    rows.append(f"{'peak, training':26} {plan.phase_bytes(TRAINING) / GIB:8.2f}")
    if any(item.name == "KV cache + GDN states" for item in plan.items):
        rows.append(f"engine: the cache holds {plan.requests_at_once} requests of the longest length at once; "
                    f"a step's requests generate in {plan.generation_waves} wave(s)")
    if plan.host_optimizer_bytes:
        rows.append(f"host: the optimizer takes {plan.host_optimizer_bytes / GIB:.2f} GiB of CPU memory a GPU")
    outside = (f" + {plan.outside_torch_bytes / GIB:.2f} GiB beyond torch (CUDA context, NCCL, cuBLAS, kernels)"
               if plan.outside_torch_bytes else "")
    rows.append(f"predicted peak {plan.peak_bytes / GIB:.2f} GiB{outside} of {plan.gpu_bytes / GIB:.1f} GiB: "
                + ("fits" if plan.fits else "does NOT fit"))
    if plan.suggestions:
        rows.append("levers not in use:" if plan.fits else "to make it fit:")
        rows += [f"  {text}" for text in plan.suggestions]
    return "\n".join(rows)
