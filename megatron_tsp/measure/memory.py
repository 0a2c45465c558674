"""Memory planner: one training step of one rank of the real model, at full size, on no memory.

``plan(values, mode)`` builds the configured model with megatron-core (the TSP spec, or the
stock modules of a TP / TP+SP / TP x CP baseline with the same memory-efficient attention),
wraps it in DDP with the configured optimizer, and runs one full training step of rank 0 of
a ``world_size`` job under ``FakeTensorMode`` with torch's ``fake`` process-group backend:
every tensor has its real shape and dtype and no storage, every collective is a no-op. A
dispatch mode tracks every storage alive during the step and attributes the peak to

* ``parameters``, ``gradients`` (megatron's grad buffers), ``optimizer`` (states and fp32
  main weights) by identity, after the model and optimizer are built;
* ``activations``: tensors autograd saves for backward (forward and recomputation);
* ``communication``: receive buffers of collectives (gathered activations or K/V,
  streamed weight shards) while they live;
* ``temporaries``: everything else (outputs in flight, gradients of activations, ...).

The tracker (:mod:`tracker`) also applies torch's FLOP formulas to every op, and the step
runs under :func:`counts.count_collectives`, so one plan also yields FLOPs
and bytes moved per process group. Values do not exist: a
data-dependent scalar (a loss or norm read with ``.item()``) reads as 1.

A mixture-of-experts model is planned with balanced routing (:func:`balanced_routing`):
how many tokens each expert gets is decided by the data, which fake tensors do not have.
"""

from __future__ import annotations

import contextlib
import copy
import math
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

from megatron_tsp.core.attention import TSPSelfAttention
from megatron_tsp.core.head_groups import PLANNED_SMS, planned_multiprocessors
from megatron_tsp.core.mlp import TSPMLP
from megatron_tsp.core.parallel_state import destroy_model_parallel
from megatron_tsp.core.sizes import DEFAULT_CP, ParallelSizes
from megatron_tsp.device import CPU, Device
from megatron_tsp.env import run_record, shown_path
from megatron_tsp.measure import counts, figures, fsdp
from megatron_tsp.measure.distributed import fake_world
from megatron_tsp.measure.tracker import CATEGORIES, GIB, OPTIMIZER, SavedTensors, StorageTracker, without_optimizer
from megatron_tsp.run import config as cfg
from megatron_tsp.run import step
from megatron_tsp.run.build import build, initialize
from megatron_tsp.run.data import make_batch
from megatron_tsp.run.modes import Mode, check_layouts, get_mode


def activation_terms(args, mode: str, fused_norm: bool = True) -> Dict[str, Dict[str, float]]:
    """Bytes one layer keeps for backward on one rank, term by term, for ``tsp``, ``tp-sp`` and
    ``tp-sp-ring`` without recompute: ``{"formula": ..., "implementation": ...}``.

    ``formula`` is Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
    Transformer Models", eq. 2 with sequence parallelism, ``sbh(34 + 5as/h)/t``) written
    tensor by tensor, for a flash-style attention kernel (no score matrix: the ``5as/h`` term
    becomes the kernel's output and log-sum-exp) and no dropout (no masks: 34 becomes 32),
    with grouped-query K/V and SwiGLU's doubled fc1 output. The ring MLP (TSP's, and
    tp-sp-ring's) keeps the same tensors but the MLP activation's output, which its backward
    recomputes from the fc1 output (mlp.py).

    ``implementation`` holds what the measured modules keep beyond the formula (each checked
    in ``tests/test_memory.py``): a fused norm (``fused_norm``: TransformerEngine's, apex's
    or TSP's RMSNorm) keeps an fp32 statistic per token besides its input; torch's own
    RMSNorm with fp32 weights (megatron's torch fallback) keeps fp32 copies of its input and
    of the normalised product instead of the input, and the statistic; megatron's unfused
    SwiGLU keeps ``silu(x1)`` and ``x2 + offset`` for the product; megatron's RoPE keeps
    rotated copies of Q and K (the unrotated QKV output stays alive too, as V is a view of
    it) and bf16 cos/sin tables for the whole sequence; TSP keeps only the cos/sin tables of
    its own tokens.
    """
    e = 2 if args.bf16 or args.fp16 else 4
    t = ParallelSizes.of(args).tensor_slot
    s, b, h, d = args.seq_length, args.micro_batch_size, args.hidden_size, args.kv_channels
    a, g, f = args.num_attention_heads, args.num_query_groups, args.ffn_hidden_size
    tokens = s * b / t  # SP and TSP: each rank holds 1/t of the sequence, or of the hidden dims
    formula = {
        "norm inputs (2 norms)": 2 * e * tokens * h,
        "QKV input": e * tokens * h,
        "Q, K, V": e * tokens * d * (a + 2 * g),
        "attention output (flash O)": e * tokens * d * a,
        "log-sum-exp (fp32)": 4 * tokens * a,
        "MLP input": e * tokens * h,
        "fc1 output": e * tokens * f * (2 if args.swiglu else 1),
    }
    tsp_attention = get_mode(mode).tsp_layers
    ring_mlp = tsp_attention or args.ring_mlp  # TSP's MLP is the ring
    if not ring_mlp:
        formula["activation output (fc2 input)"] = e * tokens * f
    implementation = {}
    if args.normalization == "RMSNorm" and fused_norm:
        implementation["RMSNorm: fp32 rstd per token (2 norms)"] = 2 * 4 * tokens
    elif args.normalization == "RMSNorm":
        implementation["torch RMSNorm: fp32 input and product, not bf16 input; fp32 rstd"] = (
            2 * (8 - e) * tokens * h + 2 * 4 * tokens)
    if args.swiglu and not ring_mlp:
        implementation["unfused SwiGLU: silu(x1) and x2 + offset, kept by the product"] = 2 * e * tokens * f
    if args.position_embedding_type == "rope":
        if tsp_attention:
            implementation["RoPE: cos/sin tables (own tokens)"] = 2 * e * tokens * d
        else:
            implementation["RoPE: rotated Q and K copies"] = e * tokens * d * (a + g)
            implementation["RoPE: cos/sin tables (whole sequence)"] = 4 * e * s * d
    return {"formula": formula, "implementation": implementation}


@contextlib.contextmanager
def _valueless() -> Iterator[None]:
    """Fake tensors have no values: make megatron's value bookkeeping a no-op. RNG states
    (dropout forks, activation-checkpoint replays) are not saved or restored, the gradient
    norm (a scalar; megatron's torch fallback reads values) is 1, and the MoE dispatcher's
    tokens per expert are known (:data:`BALANCED_ROUTING`)."""
    from megatron.core.optimizer import optimizer as moptimizer
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher as Dispatcher

    saved = (mrandom._get_all_rng_states, mrandom._set_all_rng_states, moptimizer.get_grad_norm_fp32,
             Dispatcher.preprocess)
    mrandom._get_all_rng_states = lambda: (None, None, None)
    mrandom._set_all_rng_states = lambda *states: None
    moptimizer.get_grad_norm_fp32 = lambda *args, **kwargs: 1.0
    Dispatcher.preprocess = _known_expert_counts(Dispatcher.preprocess)
    mrandom.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    try:
        yield
    finally:
        (mrandom._get_all_rng_states, mrandom._set_all_rng_states, moptimizer.get_grad_norm_fp32,
         Dispatcher.preprocess) = saved
        mrandom.initialize_rng_tracker(force_reset=True)


# The routing a mixture-of-experts model is planned with: megatron's own drop-and-pad at
# capacity factor 1 gives every expert exactly T k / E of the T tokens a rank routes (top k
# of E experts), which is balanced routing, and static shapes (the dropless dispatcher sizes
# its all-to-all from the router's choices). The real step of the same settings is the same
# step (tests/test_memory.py). A dropless run computes the same expert FLOPs over all ranks,
# on some more and on some fewer as the router spreads tokens, and its all-to-all moves
# (D-1)/D of the routed tokens only on average, where experts are chosen independently of
# which rank holds a token.
BALANCED_ROUTING = {"moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True}


def balanced_routing(args, per_layer: bool = False) -> None:
    """Plan ``args``' experts (if any) with :data:`BALANCED_ROUTING`; one line for what the
    planner does not plan of them."""
    if not args.num_experts:
        return
    if args.moe_token_dispatcher_type != "alltoall":
        raise cfg.ConfigError(f"'moe_token_dispatcher_type' {args.moe_token_dispatcher_type}: the planner plans "
                              "mixture-of-experts models with the alltoall dispatcher only; plan with alltoall")
    if per_layer:
        raise cfg.ConfigError("--per-layer: the activation formula it compares against is a dense layer's; plan "
                              "mixture-of-experts models without --per-layer")
    for key, value in BALANCED_ROUTING.items():
        setattr(args, key, value)


def _known_expert_counts(preprocess):
    """The dispatcher's tokens per local expert, which its experts read with ``.tolist()``:
    under drop-and-pad a constant of the settings, made a real tensor so that it has values
    (:data:`BALANCED_ROUTING`)."""
    def with_values(self, routing_map):
        counts = preprocess(self, routing_map)
        if not self.drop_and_pad:
            return counts
        with unset_fake_temporarily():
            return torch.full(tuple(counts.shape), self.capacity * self.tp_size * self.ep_size, dtype=torch.long)

    return with_values


def _create_adam_moments(optimizer) -> None:
    """Create Adam's moments the way megatron does before loading a checkpoint: one step
    of the inner optimizer on zero gradients."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt.optimizer
        for group in inner.param_groups:
            for param in group["params"]:
                param.grad = torch.zeros_like(param)
        inner.step()
        inner.zero_grad()


def _optimizer_tensors(optimizer) -> List[torch.Tensor]:
    tensors = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt.optimizer
        for group in inner.param_groups:
            tensors.extend(group["params"])  # fp32 main weights (or views of the model's)
        for state in inner.state.values():
            tensors.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    return tensors


def plan(values: Dict, mode: str, world_size: Optional[int] = None, cp: int = DEFAULT_CP,
         attention_backend: str = "auto", per_layer: bool = False, device: Device = CPU,
         fused_norm: bool = True, largest: int = 0, rank: int = 0, multiprocessors: int = PLANNED_SMS) -> Dict:
    """Peak memory by category, FLOPs and communication of one training step of rank ``rank``
    (default 0) of a ``world_size`` job (default: one replica), at full size, under
    FakeTensorMode; with
    ``per_layer``, also every tensor the first layer keeps for backward (``saved_per_layer``);
    with ``largest``, the ``largest`` biggest storages alive at the peak (``largest_at_peak``).

    ``device``: where the fake tensors live. The CPU plans the same step anywhere; ``cuda``
    runs the GPU code path (GPU initialisation, GPU attention kernels through their meta
    functions, every collective checked to move GPU tensors) and needs a CUDA runtime, real
    or the tests' stand-in. ``fused_norm``: see :func:`megatron_tsp.core.norm.implementation`.
    ``multiprocessors``: the planned GPU's SMs or CUs (TSP's head groups per attention call)."""
    mode = get_mode(mode)
    # Built where it runs: FakeTensorMode cannot move a module between devices, and where the
    # weights were initialised does not change the step's memory.
    args = mode.args(dict(values, use_cpu_initialization=False), cp)
    balanced_routing(args, per_layer)
    sizes = cfg.sizes(args, world_size)
    fsdp_run = args.use_torch_fsdp2  # modelled from DDP's plan of the same layers (measure/fsdp.py)
    if fsdp_run:
        args = fsdp.planned_as(args)
    with fake_world(sizes.world_size, rank), counts.devices_checked(device.torch), \
            planned_multiprocessors(multiprocessors):
        result = _run(args, mode, sizes.world_size, StorageTracker(fake_scalars=True, detail=largest),
                      attention_backend, device, fake=True, per_layer=per_layer, fused_norm=fused_norm,
                      fsdp_units=fsdp_run)
    return fsdp.sharded(result, result.pop("fsdp_units"), sizes.dp * sizes.cp) if fsdp_run else result


def measure(values: Dict, mode: str, device: Device, cp: int = DEFAULT_CP, attention_backend: str = "auto",
            balanced: bool = False) -> Dict:
    """The same step for real, on this rank of the current process group (the planner's
    check: with real tensors the tracker must see what it sees under FakeTensorMode;
    ``balanced``: experts routed as the planner plans them, :data:`BALANCED_ROUTING`, rather
    than as the model routes them)."""
    mode = get_mode(mode)
    args = mode.args(values, cp)
    if balanced:
        balanced_routing(args)
    return _run(args, mode, dist.get_world_size(), StorageTracker(fake_scalars=False), attention_backend, device,
                fake=False)


def _run(args, mode: Mode, world_size: int, tracker: StorageTracker, attention_backend: str, device: Device,
         fake: bool, per_layer: bool = False, fused_norm: bool = True, fsdp_units: bool = False) -> Dict:
    # Fake tensors have no values to seed; megatron's RNG bookkeeping is off (_valueless). The
    # communicators' warm-up moves fake tensors too.
    with FakeTensorMode() if fake else contextlib.nullcontext():
        initialize(args, device, seed=not fake, create_gloo_process_groups=False)
    saved = SavedTensors(tracker) if per_layer else None
    try:
        static, flops, records, units, calls = _step(args, mode, tracker, attention_backend, device, fake, saved,
                                                      fused_norm)
    finally:
        destroy_model_parallel()
    extra = {"saved_per_layer": saved.layer()} if saved else {}
    if fsdp_units:
        extra["fsdp_units"] = units
    if tracker.detail:
        extra["largest_at_peak"] = [{"gib": gib, "category": category, "made_by": op}
                                    for gib, category, op in tracker.peak_largest]
    return {**extra,
        "parallel": dict(cfg.sizes(args, world_size).as_dict(), sequence_parallel=args.sequence_parallel),
        **calls,
        "peak_gib": tracker.peak / GIB,
        "by_category_gib": {c: tracker.peak_by_category[c] / GIB for c in CATEGORIES},
        "peak_at": tracker.peak_op,
        "static_gib": static / GIB,
        "flops_per_rank": flops["total"],
        "attention_flops_per_rank": flops["attention"],
        "memory_bytes_per_rank": flops["memory_bytes"],
        "memory_bytes_by_op": flops["memory_bytes_by_op"],
        "launches_by_op": flops["launches_by_op"],
        "attention_kernel_calls": flops["attention_kernel_calls"],
        "by_phase": flops["by_phase"],
        "comm_bytes_received": counts.totals(records),
        "comm": counts.as_dict(records),
    }


def _step(args, mode: Mode, tracker, attention_backend, device: Device, fake: bool = True,
          saved_log: Optional[SavedTensors] = None, fused_norm: bool = True):
    """Build model and optimizer and run one step under ``tracker``; with ``fake``, under
    FakeTensorMode (else for real, to check the planner against); ``saved_log`` records what
    autograd keeps."""
    valueless = (_valueless(), FakeTensorMode(allow_non_fake_inputs=True)) if fake else ()
    with contextlib.ExitStack() as stack:
        for ctx in valueless + (tracker,):
            stack.enter_context(ctx)
        # No gradient clipping: megatron's torch fallback for the norm reads values (scalars,
        # no memory to speak of). No gloo groups: the fake backend has no peers.
        _, model, optimizer = build(args, device, mode, attention_backend, clip_grad=0.0,
                                    use_gloo_process_groups=False, transformer_engine=False, fused_norm=fused_norm)
        _create_adam_moments(optimizer)  # steady state: Adam moments exist
        chunk = model[0]
        units = fsdp.unit_bytes(step.unwrap(chunk))
        # DDP's buffers; a real torch FSDP2 step (the benchmark's cp-fsdp) keeps its shards in its
        # parameters (DTensors: their local tensors) and makes its gradients in the step
        buffers = chunk.buffers + chunk.expert_parallel_buffers if isinstance(chunk, DistributedDataParallel) else []
        tracker.tag([b.grad_data for b in buffers], "gradients", only_from=None)
        tracker.tag([getattr(p, "_local_tensor", p) for p in chunk.module.parameters()] + list(chunk.module.buffers()),
                    "parameters", only_from=None)
        param_buffers = [b.param_data for b in buffers if b.param_data is not None]
        tracker.tag(param_buffers, "parameters", only_from=None)
        tracker.tag(_optimizer_tensors(optimizer), "optimizer", only_from=("temporaries",))
        # Whatever else the build left alive (the build's own transients are gone).
        static = sum(tracker.live.values())
        tracker.reset_peak()

        batch = make_batch(args.micro_batch_size, args.seq_length, args.vocab_size, 0, device.torch)

        def pack(t):
            tracker.tag([t], "activations", only_from=("temporaries", "communication"))
            if saved_log is not None:
                saved_log.saved(t)
            return t

        saved = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        if saved_log is not None:
            saved_log.watch(chunk.module)
            stack.enter_context(saved_log)

        def receive(t):
            tracker.tag([t], "communication", only_from=("temporaries",))

        flops_before, attention_before, bytes_before = tracker.flops, tracker.attention_flops, tracker.memory_bytes
        by_op_before = dict(tracker.memory_bytes_by_op)
        launches_before, kernel_calls_before = dict(tracker.launches_by_op), tracker.attention_kernel_calls
        tracker.by_phase = {}
        optimizer_step = optimizer.step

        def counted_apart():  # a GPU's multi-tensor Adam launches a few kernels, not these (tracker.py)
            with tracker.section(OPTIMIZER):
                return optimizer_step()

        optimizer.step = counted_apart
        with saved, counts.count_collectives(on_output=receive) as records:
            result = step.train_step(model, optimizer, [batch], 1, args.seq_length, args.micro_batch_size,
                                     batch_transform=mode.batch_transform(args))
            step.global_losses([result["loss"]])
    by_op = {op: moved - by_op_before.get(op, 0) for op, moved in tracker.memory_bytes_by_op.items()}
    flops = {"total": tracker.flops - flops_before, "attention": tracker.attention_flops - attention_before,
             "memory_bytes": tracker.memory_bytes - bytes_before,
             "memory_bytes_by_op": {op: moved for op, moved in by_op.items() if moved},
             "launches_by_op": {op: n - launches_before.get(op, 0) for op, n in tracker.launches_by_op.items()
                                if n > launches_before.get(op, 0)},
             "attention_kernel_calls": tracker.attention_kernel_calls - kernel_calls_before,
             "by_phase": tracker.by_phase}
    return static, flops, records, units, tsp_calls(step.unwrap(chunk))


def tsp_calls(model) -> Dict[str, Optional[int]]:
    """How ``model``'s TSP layers ran their last step, as their layer chain (one a model)
    recorded it: the stages of an attention pass (D over its head groups per call) and the
    MLP's shards per call; None where the model has no such layer."""
    attention = next((m for m in model.modules() if isinstance(m, TSPSelfAttention)), None)
    mlp = next((m for m in model.modules() if isinstance(m, TSPMLP)), None)
    stages = attention.chain.attention_stages if attention is not None else None
    return {"attention_stages": stages,
            "head_groups_per_call": attention.tsp_group.size() // stages if stages else None,
            "mlp_shards_per_call": mlp.shards_per_call() if mlp is not None else None}


def planned_layers(values: Dict) -> Tuple[int, int]:
    """The two layer counts a model is planned at to extrapolate it linearly in its layers:
    two and three recompute units (full uniform recompute of k layers: 2k and 3k), or, with
    full block recompute of its first k layers, k+2 and k+3 (from there on every layer
    added is one that is not recomputed; with one such layer, k+1, the peak can fall in its
    backward rather than the forward: TSP's tiny model at k=3), or k+1 and k+2 for a model
    of k+1 layers. Not 1: a one-layer model's peak can fall at
    another point of the step than a deeper one's, and a line through 1 and 2 layers then
    has the wrong slope (the 7B's ring MLP at 128K with full recompute: +1.7 GiB at 32
    layers). A layer pattern of period p (:func:`layer_period`: sliding windows with every
    p-th layer global, MoE layers every p-th layer): the
    step between the counts is a whole period (units of u = lcm(p, k) layers), and the first
    count leaves the model's layers a whole number of steps beyond it (2u and 3u where u
    divides them; block recompute from k+1 on), so the line meets the model's own pattern."""
    k = values.get("recompute_num_layers") or 1
    period = layer_period(values)
    layers = values.get("num_layers") or cfg.ARGUMENTS["num_layers"].default
    full = values.get("recompute_granularity") == "full"
    block = full and values.get("recompute_method") == "block"
    if block and k < layers:
        if period > 1:
            low = k + 1 + (layers - k - 1) % period
            return low, low + period
        low = max(2, min(k + 2, layers))
        return low, low + 1
    unit = k if full and values.get("recompute_method") == "uniform" else 1
    if period > 1:
        if block:  # every layer recomputed: plans of no more layers than the first k
            return max(1, layers - period), layers
        unit = math.lcm(unit, period)
        low = 2 * unit + (layers - 2 * unit) % unit
        return low, low + unit
    return 2 * unit, 3 * unit


def layer_period(values: Dict) -> int:
    """Layers per period of the model's layer pattern, from its first layer: local and
    global attention (``window_attn_skip_freq`` p where a window is set: every p-th layer
    attends to every key), and MoE and dense layers (``moe_layer_freq``: every n-th layer
    is a mixture-of-experts layer); 1 where every layer is alike."""
    window = values.get("window_attn_skip_freq")
    window = window if values.get("window_size") and isinstance(window, int) and window > 1 else 1
    moe = values.get("moe_layer_freq") if values.get("num_experts") else 1
    return math.lcm(window, moe if isinstance(moe, int) and moe > 1 else 1)


def first_and_last_rank_plans(values: Dict, mode: str, world_size: Optional[int] = None, cp: int = DEFAULT_CP,
                              fused_norm: bool = True, multiprocessors: int = PLANNED_SMS
                              ) -> Dict[int, Tuple[Dict, Dict]]:
    """``{rank: (plan, plan)}`` at :func:`planned_layers` with a GPU's kernels, for the first
    and the last rank of a model-parallel group: TSP's ranks do different attention work
    around the same FLOPs (blocks, merges, key rows no block touches), and these two bound it."""
    last = ParallelSizes.of(get_mode(mode).values(values, cp)).within_a_stage - 1
    return {rank: tuple(plan(dict(copy.deepcopy(values), num_layers=n), mode, world_size, cp,
                             attention_backend="gpu", fused_norm=fused_norm, rank=rank,
                             multiprocessors=multiprocessors)
                        for n in planned_layers(values))
            for rank in sorted({0, last})}


def slowest_rank(plans: Dict[int, Tuple[Dict, Dict]]) -> int:
    """The rank whose layer moves the most memory-bound bytes (the first on a tie)."""
    return max(plans, key=lambda r: (plans[r][1]["memory_bytes_per_rank"] - plans[r][0]["memory_bytes_per_rank"], -r))


def _per_layer(fewer: Dict[str, float], more: Dict[str, float], layers: int) -> Dict[str, float]:
    """What one layer adds, key by key: the difference of two plans ``layers`` layers apart."""
    return {key: (more.get(key, 0) - fewer.get(key, 0)) / layers for key in set(fewer) | set(more)}


def by_op_per_layer(values: Dict, mode: str, world_size: Optional[int] = None, cp: int = DEFAULT_CP,
                    fused_norm: bool = True) -> Dict:
    """What one layer adds to a step, op by op (the difference of the :func:`planned_layers`
    plans, per layer) on the slowest rank: memory-bound bytes (``total_gb``, ``by_op_gb``,
    largest first) and kernel launches (``launches``, ``launches_by_op``, most first: a GPU's,
    the optimizer step's per-tensor ones apart, ``optimizer_launches_per_tensor``: tracker.py;
    ``attention_kernel_calls``; ``collective_calls``: the collectives and point-to-point
    transfers a layer adds, counted apart: :mod:`~megatron_tsp.measure.tracker`)."""
    plans = first_and_last_rank_plans(values, mode, world_size, cp, fused_norm)
    rank = slowest_rank(plans)
    low, high = planned_layers(values)
    fewer, more = plans[rank]
    diff = _per_layer(fewer["memory_bytes_by_op"], more["memory_bytes_by_op"], high - low)
    launches = _per_layer(fewer["launches_by_op"], more["launches_by_op"], high - low)
    device_launches = without_optimizer(launches)
    calls = [sum(e["calls"] for phases in p["comm"].values() for prims in phases.values() for e in prims.values())
             for p in (fewer, more)]
    return {"rank": rank, "total_gb": sum(diff.values()) / 1e9,
            "by_op_gb": {op: b / 1e9 for op, b in sorted(diff.items(), key=lambda kv: -kv[1]) if abs(b) >= 1e6},
            "launches": sum(device_launches.values()),
            "launches_by_op": {op: n for op, n in sorted(device_launches.items(), key=lambda kv: (-kv[1], kv[0])) if n},
            "optimizer_launches_per_tensor": sum(launches.values()) - sum(device_launches.values()),
            "attention_kernel_calls": (more["attention_kernel_calls"] - fewer["attention_kernel_calls"]) / (high - low),
            "collective_calls": (calls[1] - calls[0]) / (high - low)}


def bytes_by_op_table(result: Dict, rows: int = 20) -> str:
    modes = [m for m in result["modes"] if "by_op" in result["modes"][m]]
    lines = ["Memory-bound bytes per layer, by op (GB; the difference of two plans, slowest rank):", ""]
    for mode in modes:
        r = result["modes"][mode]["by_op"]
        lines.append(f"{mode} (rank {r['rank']}): {r['total_gb']:.2f} GB per layer")
        lines += [f"  {op:48s} {gb:8.2f}" for op, gb in list(r["by_op_gb"].items())[:rows]]
    return "\n".join(lines)


def launches_table(result: Dict, rows: int = 20) -> str:
    modes = [m for m in result["modes"] if "by_op" in result["modes"][m]]
    lines = ["Kernel launches per layer, by op (counted on the planned step; the difference of two plans, "
             "slowest rank):", ""]
    for mode in modes:
        r = result["modes"][mode]["by_op"]
        lines.append(f"{mode} (rank {r['rank']}): {r['launches']:.0f} launches per layer, of which "
                     f"{r['attention_kernel_calls']:.0f} attention kernel calls; {r['collective_calls']:.0f} "
                     f"collective calls besides; apart, the optimizer step's "
                     f"{r['optimizer_launches_per_tensor']:.0f} per tensor (a GPU's multi-tensor Adam: a few a step)")
        lines += [f"  {op:48s} {n:8.0f}" for op, n in list(r["launches_by_op"].items())[:rows]]
    return "\n".join(lines)


def plan_modes(config_path: str, modes: List[str], world_size: Optional[int] = None, cp: int = DEFAULT_CP,
               overrides: Optional[Dict] = None, per_layer: bool = False, fused_norm: bool = True,
               largest: int = 0, by_op: bool = False) -> Dict:
    values = cfg.load_config(config_path)
    values.update(overrides or {})
    check_layouts(values, modes, world_size, cp, "--world-size")  # before the first (slow) plan
    # a GPU's attention kernels (the planner plans GPUs), on fake tensors wherever they live
    results = {name: plan(copy.deepcopy(values), name, world_size, cp, attention_backend="gpu", per_layer=per_layer,
                          fused_norm=fused_norm, largest=largest)
               for name in modes}
    if by_op:
        for name, r in results.items():
            r["by_op"] = by_op_per_layer(values, name, world_size, cp, fused_norm)
    if per_layer:
        for name, r in results.items():
            args = get_mode(name).args(values, cp)
            # the formula's layouts: every activation sharded over the sequence (SP or TSP), no CP
            if args.recompute_granularity is None and args.sequence_parallel and args.context_parallel_size == 1:
                r["activation_terms"] = activation_terms(args, name, fused_norm)
    seq = get_mode(modes[0]).args(values, cp).seq_length
    return {"setup": run_record(config=config_path, world_size=world_size, fused_norm=fused_norm),
            "config": shown_path(config_path), "seq_length": seq, "fused_norm": fused_norm, "modes": results}


def table(result: Dict) -> str:
    lines = [f"config {result['config']}, seq_length {result['seq_length']} (GiB = 2^30 bytes, rank 0)",
             "| mode | layout | peak GiB | " + " | ".join(CATEGORIES) + " | TFLOP/rank |",
             "|---|---|---|" + "---|" * len(CATEGORIES) + "---|"]
    for mode, r in result["modes"].items():
        p = r["parallel"]
        layout = (f"tsp{p['tsp']} tp{p['tp']} cp{p['cp']} pp{p['pp']} dp{p['dp']}"
                  + (" sp" if p["sequence_parallel"] else ""))
        cats = " | ".join(f"{r['by_category_gib'][c]:.2f}" for c in CATEGORIES)
        lines.append(f"| {mode} | {layout} | {r['peak_gib']:.2f} | {cats} | {r['flops_per_rank'] / 1e12:.1f} |")
    return "\n".join(lines)


def largest_table(result: Dict) -> str:
    """The biggest storages alive at each mode's peak: what to look at when a peak surprises."""
    lines = []
    for mode, r in result["modes"].items():
        lines += [f"\n{mode}: the largest storages alive at the peak ({r['peak_at']}) on rank 0",
                  "| MiB | category | made by |", "|---|---|---|"]
        lines += [f"| {row['gib'] * 1024:.1f} | {row['category']} | {row['made_by']} |" for row in r["largest_at_peak"]]
    return "\n".join(lines)


def per_layer_table(result: Dict) -> str:
    """Every storage the first layer keeps for backward, per mode, and the analytic formula."""
    lines = []
    for mode, r in result["modes"].items():
        rows = r["saved_per_layer"]
        total = sum(row["bytes"] for row in rows)
        lines += [f"\n{mode}: what layer 0 keeps for backward on rank 0 ({total / 2**20:.1f} MiB)",
                  "| module | made by | shape | dtype | MiB |", "|---|---|---|---|---|"]
        lines += [f"| {row['module']} | {row['op']} | {row['shape']} | {row['dtype']} | {row['bytes'] / 2**20:.1f} |"
                  for row in rows]
        terms = r.get("activation_terms")
        if terms:
            formula, impl = sum(terms["formula"].values()), sum(terms["implementation"].values())
            lines.append(f"formula (Korthikanti et al., flash, no dropout) {formula / 2**20:.1f} MiB"
                         + "".join(f"; + {k} {v / 2**20:.1f}" for k, v in terms["implementation"].items())
                         + f" = {(formula + impl) / 2**20:.1f} MiB; measured / that = {total / (formula + impl):.3f}")
    return "\n".join(lines)


def plot(result: Dict, path: str) -> None:
    plt = figures.pyplot("--plot")

    modes = list(result["modes"])
    fig, ax = plt.subplots(figsize=(1.6 * len(modes) + 3, 4.5))
    bottom = [0.0] * len(modes)
    for category in CATEGORIES:
        heights = [result["modes"][m]["by_category_gib"][category] for m in modes]
        ax.bar(modes, heights, bottom=bottom, label=category)
        bottom = [b + h for b, h in zip(bottom, heights)]
    for i, m in enumerate(modes):
        ax.text(i, bottom[i], f"{result['modes'][m]['peak_gib']:.1f}", ha="center", va="bottom")
    ax.set_ylabel("peak memory of rank 0 (GiB)")
    ax.set_title(f"{result['config']} (S={result['seq_length']})")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
