"""Performance model: per-rank step time from counted FLOPs and bytes on a hardware profile.

Counts come from the memory planner's fake step of the real model (``memory.plan``): FLOPs
(attention separately) and the bytes and calls of every collective per process group and
phase. To sweep sequence lengths cheaply the model is planned at 2 and 3 layers and
extrapolated linearly in the layer count (exact: layers are identical;
``memory.planned_layers`` says which, and why not 1).

Time of one micro-batch step on one rank:

    device   = matmul FLOPs / (peak x matmul_efficiency) + GEMM calls x matmul_call_us
               + attention FLOPs / (peak x attention_efficiency) + attention calls x attention_call_us
               + memory-bound bytes / hbm bandwidth
    host     = kernel launches x host_us_per_launch
    compute  = max(device, host)                       (per phase: the host runs ahead of the GPU)
    comm[g]  = sum over primitives p of bytes[g, p] / bandwidth(g, p) + calls[g] x latency(g)
               (intra- or inter-node link; a calibrated link has a bandwidth per primitive)
    step     = max(compute, hidden) + exposed

A call's fixed cost is its kernel's efficiency by size: a GEMM of F FLOPs runs at
``matmul_efficiency x F / (F + F_half)``, F_half = matmul_call_us x peak x matmul_efficiency
(attention likewise), so that many small calls cost more than one large one of the same
FLOPs. The host cost is everything the host spends per launched kernel (Python, autograd,
the dispatcher, the launch): a step of many small kernels is host-bound. The three are
calibrated from the H200's measurements (:func:`launch_prices`; docs/measuring.md).

where ``hidden`` is the traffic a mode overlaps with compute in the scenario and ``exposed``
the rest (the data-parallel gradient reduce hides only with ``--overlap-grad-reduce``).
Traffic that can only hide behind attention (TSP's K/V exchange runs while the previous head
group attends; the CP K/V exchange of TP x CP) is hidden up to the attention time and
exposed beyond it (:class:`modes.Mode`); where TSP's attention runs a pass in one stage (every
head group in one call, short S) nothing attends beside its K/V, and it is all exposed.
Scenarios (:data:`SCENARIOS`):

* ``overlap``: every mode hides what it can: TSP its weight streams and K/V exchange (built
  into its layers), TP and TP+SP their tensor-parallel all-gathers/reduce-scatters
  (TransformerEngine's userbuffer overlap, ``--tp-comm-overlap``), TP x CP also its CP
  exchange (ring attention), all of them the data-parallel gradient reduce;
* ``no_tp_overlap``: as above, but the baselines' tensor-parallel traffic is exposed, which
  is megatron's default (``--tp-comm-overlap`` off, and the only choice without
  TransformerEngine), and so is TP x CP's K/V exchange (without TransformerEngine the
  baseline all-gathers K/V before it attends); TSP is unchanged: its overlap needs no
  TransformerEngine;
* ``no_overlap``: nothing is hidden.

Memory-bound bytes are what the ops without a FLOP formula read and write (elementwise ops,
norms, copies, the optimizer step), op by op as the step runs them unfused: fused kernels
(TransformerEngine, apex) move fewer, so on GPUs this term is an upper bound.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from megatron_tsp.core.head_groups import PLANNED_SMS
from megatron_tsp.core.sizes import DEFAULT_CP
from megatron_tsp.env import run_record, shown_path
from megatron_tsp.measure import memory
from megatron_tsp.measure.tracker import PHASE_COUNTS, without_optimizer
from megatron_tsp.run import config as cfg
from megatron_tsp.run import flops as flops_formula
from megatron_tsp.run.data import padded_vocab
from megatron_tsp.run.modes import REFERENCE, SUBJECT, check_layouts, get_mode

INTRA_NODE_GROUPS = ("tsp", "tp", "cp", "tp_cp", "tsp_weight", "ep")  # experts fold onto the model-parallel ranks
SCENARIOS = ("overlap", "no_tp_overlap", "no_overlap")
# A setting fits a GPU when its planned peak is at most the memory less a reserve for what the
# planner does not see (CUDA context, the collective library's buffers, allocator fragmentation).
RESERVE_FRACTION = 0.05
RESERVE_GIB = 2.0
CHOOSE_BY = "overlap"  # predict chooses TSP's calls by it: TSP overlaps without TransformerEngine


def overlapped(mode: str, scenario: str, overlap_grad_reduce: bool):
    """The groups whose traffic ``mode`` hides behind compute in ``scenario``."""
    if scenario == "no_overlap":
        return ()
    return get_mode(mode).overlapped(scenario == "overlap", overlap_grad_reduce)


@dataclass(frozen=True)
class Hardware:
    name: str
    gpus_per_node: int
    memory_gib: float
    peak_tflops: float
    matmul_efficiency: float
    attention_efficiency: float
    hbm_gbs: float
    intra_node_gbs: float
    inter_node_gbs: float
    intra_node_latency_us: float
    inter_node_latency_us: float
    # a measured profile (`megatron-tsp calibrate`): link name -> {gbs, latency_us, ...}, and
    # what was measured
    links: Optional[Dict] = None
    measured: Optional[Dict] = None
    # GB/s received per rank by primitive, where it differs from the link's (a calibrated link)
    primitive_gbs: Optional[Dict] = None
    # The share of the baselines' tensor-parallel traffic TransformerEngine's TP overlap
    # (userbuffers, --tp-comm-overlap) hides behind GEMMs: docs/measuring.md says why 0.7.
    te_tp_overlap_hidden: float = 0.7
    # Streaming multiprocessors (NVIDIA) or compute units (AMD): how many thread blocks fill
    # the GPU, which sets TSP's head groups per attention call (core.head_groups.head_groups_per_call)
    multiprocessors: int = PLANNED_SMS
    # Launch prices (module docstring; 0: not calibrated, the GPU computes at its efficiencies)
    host_us_per_launch: float = 0.0
    matmul_call_us: float = 0.0
    attention_call_us: float = 0.0

    @property
    def usable_gib(self) -> float:
        """The memory a planned peak may take (:data:`RESERVE_FRACTION`, :data:`RESERVE_GIB`)."""
        return self.memory_gib * (1 - RESERVE_FRACTION) - RESERVE_GIB

    def at_link(self, name: str) -> "Hardware":
        """This profile with every link at the calibrated ``name`` (a rate-limited CPU link)."""
        if not self.links or name not in self.links:
            raise cfg.ConfigError(f"--link {name!r}: profile {self.name} has no such calibrated link; it has "
                                  f"{', '.join(self.links or {}) or 'none'} (megatron-tsp calibrate --link ...)")
        link = self.links[name]
        return dataclasses.replace(self, intra_node_gbs=link["gbs"], inter_node_gbs=link["gbs"],
                                   intra_node_latency_us=link["latency_us"], inter_node_latency_us=link["latency_us"],
                                   primitive_gbs=link.get("by_primitive_gbs"))


LAUNCH_PRICES = ("host_us_per_launch", "matmul_call_us", "attention_call_us")
# the attention kernels' ops in torch's profiler (forward and backward)
ATTENTION_KERNEL_OPS = ("aten::_flash_attention", "aten::_cudnn_attention", "aten::_efficient_attention")
_OPTIONAL_KEYS = ("links", "measured", "primitive_gbs", "te_tp_overlap_hidden", "multiprocessors") + LAUNCH_PRICES
_FRACTIONS = ("matmul_efficiency", "attention_efficiency", "te_tp_overlap_hidden")
_HARDWARE_KEYS = tuple(k for k in Hardware.__dataclass_fields__ if k not in _OPTIONAL_KEYS)


def load_hardware(path: str) -> Hardware:
    """A hardware profile (``configs/hardware/*.yaml``); one ConfigError line naming the file
    and the key when it is missing, not YAML, or lacks or mistypes a key."""
    values = cfg.read_yaml(path)
    if not isinstance(values, dict):
        raise cfg.ConfigError(f"{path}: a hardware profile is a mapping of {', '.join(_HARDWARE_KEYS)}")
    missing = [k for k in _HARDWARE_KEYS if k not in values]
    unknown = [k for k in values if k not in _HARDWARE_KEYS + _OPTIONAL_KEYS]
    if missing or unknown:
        what = f"missing {', '.join(missing)}" if missing else f"unknown key(s) {', '.join(unknown)}"
        raise cfg.ConfigError(f"{path}: {what}; a hardware profile has the keys of configs/hardware/h100.yaml")
    for key, value in values.items():
        if key == "name":
            continue
        if key == "multiprocessors":
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise cfg.ConfigError(f"{path}: '{key}' is the GPU's count of SMs or CUs, a positive whole number "
                                      f"(got {value!r})")
            continue
        if key in _OPTIONAL_KEYS and key not in _FRACTIONS + LAUNCH_PRICES:
            if not isinstance(value, dict):
                raise cfg.ConfigError(f"{path}: '{key}' must be a mapping (megatron-tsp calibrate writes it)")
            continue
        number = not isinstance(value, bool) and isinstance(value, (int, float))
        if key in LAUNCH_PRICES:  # 0 allowed: not calibrated
            if not number or not 0 <= value < float("inf"):
                raise cfg.ConfigError(f"{path}: '{key}' is microseconds, a number >= 0 (got {value!r})")
            continue
        if key == "te_tp_overlap_hidden":  # 0 allowed: TransformerEngine hides nothing
            if not number or not 0 <= value <= 1:
                raise cfg.ConfigError(f"{path}: '{key}' is a fraction in [0, 1] (got {value!r}; 0.7 means 70%)")
            continue
        if not number or not 0 < value < float("inf"):
            raise cfg.ConfigError(f"{path}: '{key}' must be a positive number (got {value!r})")
        if key in _FRACTIONS and not value <= 1:
            raise cfg.ConfigError(f"{path}: '{key}' is a fraction in (0, 1] (got {value!r}; 0.7 means 70%)")
    return Hardware(**values)


def _sub(a: Dict, b: Dict, scale: float = 1.0) -> Dict:
    """a - scale*b, recursively over nested dicts of numbers."""
    out = {}
    for key in set(a) | set(b):
        x, y = a.get(key, 0), b.get(key, 0)
        out[key] = _sub(x if isinstance(x, dict) else {}, y if isinstance(y, dict) else {}, scale) \
            if isinstance(x, dict) or isinstance(y, dict) else x - scale * y
    return out


def _axpy(base: Dict, per_layer: Dict, layers: int) -> Dict:
    return _sub(base, per_layer, -layers)


_COUNTS: Dict[str, Dict] = {}  # layer_counts of this process, by their arguments


def layer_counts(values: Dict, mode: str, world_size: Optional[int] = None, cp: int = DEFAULT_CP,
                 fused_norm: bool = True, multiprocessors: int = PLANNED_SMS) -> Dict:
    """FLOPs, comm counts and peak memory of one micro-batch step, of the slowest rank (the
    peak: the larger of the first and the last rank's): ``{"base": ..., "per_layer": ...}``
    (the peak is linear in the layer count too, from two layers on: every layer keeps the
    same activations, and the peak falls at the same point of the step).
    Planned once per process for the same arguments: of the hardware only its
    ``multiprocessors`` enter them (TSP's head groups per call), so a planner that tries
    several GPUs of one kind, or sequence lengths again, reuses them."""
    key = json.dumps([values, mode, world_size, cp, fused_norm, multiprocessors], sort_keys=True, default=str)
    if key not in _COUNTS:
        _COUNTS[key] = _layer_counts(values, mode, world_size, cp, fused_norm, multiprocessors)
    return copy.deepcopy(_COUNTS[key])


def _layer_counts(values: Dict, mode: str, world_size: Optional[int], cp: int, fused_norm: bool,
                  multiprocessors: int) -> Dict:
    """Counts of the slowest rank; its peak is the larger of the first and the last rank's."""
    plans = memory.first_and_last_rank_plans(values, mode, world_size, cp, fused_norm, multiprocessors)
    fewer, more = ({"flops": p["flops_per_rank"], "attention_flops": p["attention_flops_per_rank"],
                    "memory_bytes": p["memory_bytes_per_rank"], "by_phase": p["by_phase"], "comm": p["comm"],
                    "launches": sum(without_optimizer(p["launches_by_op"]).values()),
                    "attention_kernel_calls": p["attention_kernel_calls"], "parallel": p["parallel"]}
                   for p in plans[memory.slowest_rank(plans)])
    for n, counts in enumerate((fewer, more)):
        counts["peak_gib"] = max(p[n]["peak_gib"] for p in plans.values())
    keys = ("flops", "attention_flops", "memory_bytes", "by_phase", "comm", "peak_gib", "launches",
            "attention_kernel_calls")
    low, high = memory.planned_layers(values)
    per_layer = _sub({}, _sub({k: more[k] for k in keys}, {k: fewer[k] for k in keys}), -1 / (high - low))
    base = _sub({k: fewer[k] for k in keys}, per_layer, low)
    stages = plans[memory.slowest_rank(plans)][0]["attention_stages"]
    return {"base": base, "per_layer": per_layer, "parallel": fewer["parallel"], "attention_stages": stages}


def totals_for(counts: Dict, layers: int) -> Dict:
    """The step's counts at ``layers`` layers, with the stages of its TSP attention."""
    return dict(_axpy(counts["base"], counts["per_layer"], layers), attention_stages=counts.get("attention_stages"))


def step_time(total: Dict, hw: Hardware, mode: str, scenario: str, world_size: int,
              phases=("forward", "backward"), overlap_grad_reduce: bool = True) -> Dict:
    """Seconds per micro-batch step of one rank, broken down (``scenario``: :data:`SCENARIOS`;
    ``overlap_grad_reduce``: the config's, whether the data-parallel reduce can hide).

    Overlap follows the schedule as far as the counts tell it: a transfer hides only behind
    compute of its own phase (the forward's traffic behind the forward, the backward's, its
    recomputation included, behind the backward), traffic that can only run beside attention
    only behind attention, and TransformerEngine's TP overlap hides ``te_tp_overlap_hidden``
    of the baselines' tensor-parallel traffic (the rest is exposed; its ring attention hides a
    CP exchange behind attention)."""
    peak = hw.peak_tflops * 1e12
    by_phase = total.get("by_phase") or {"step": {k: total.get(k, 0) for k in PHASE_COUNTS}}
    multi_node = world_size > hw.gpus_per_node
    comm: Dict[str, Dict[str, float]] = {}  # group -> phase -> seconds
    for group, group_phases in total["comm"].items():
        intra = group in INTRA_NODE_GROUPS or not multi_node
        bw = (hw.intra_node_gbs if intra else hw.inter_node_gbs) * 1e9
        latency = (hw.intra_node_latency_us if intra else hw.inter_node_latency_us) * 1e-6
        for phase, prims in group_phases.items():
            if phase not in phases:
                continue
            achieved = hw.primitive_gbs or {}
            seconds = sum(e["bytes_received"] / (achieved[p] * 1e9 if achieved.get(p) else bw) + e["calls"] * latency
                          for p, e in prims.items())
            if seconds > 0:
                key = phase if phase in by_phase else "step"
                comm.setdefault(group, {})[key] = comm.get(group, {}).get(key, 0.0) + seconds
    the_mode = get_mode(mode)
    # a pass of one stage has no stage before it to attend while its K/V travel, nor after it
    # to hide the reduce of dK/dV: that traffic is exposed
    alone = set(the_mode.behind_attention) if total.get("attention_stages") == 1 else set()
    full = set(overlapped(mode, "no_tp_overlap" if scenario == "overlap" else scenario, overlap_grad_reduce)) - alone
    te = set(the_mode.hides_with_te) if scenario == "overlap" else set()
    out = {"compute_s": 0.0, "host_s": 0.0, "memory_bound_s": 0.0, "step_s": 0.0}
    for phase, counts in by_phase.items():
        attention_s = counts["attention_flops"] / (peak * hw.attention_efficiency) \
            + counts.get("attention_calls", 0) * hw.attention_call_us * 1e-6
        memory_s = counts["memory_bytes"] / (hw.hbm_gbs * 1e9)
        device = (counts["flops"] - counts["attention_flops"]) / (peak * hw.matmul_efficiency) \
            + counts.get("gemm_calls", 0) * hw.matmul_call_us * 1e-6 + attention_s + memory_s
        host = counts.get("launches", 0) * hw.host_us_per_launch * 1e-6
        compute = max(device, host)
        hidden = exposed = behind = 0.0
        for group, seconds_by in comm.items():
            t = seconds_by.get(phase, 0.0)
            if group in full | te and group in the_mode.behind_attention:  # TSP's K/V, TE's ring attention
                behind += t
            elif group in full:
                hidden += t
            elif group in te:
                hidden += hw.te_tp_overlap_hidden * t
                exposed += (1 - hw.te_tp_overlap_hidden) * t
            else:
                exposed += t
        hidden += min(behind, attention_s)
        exposed += max(0.0, behind - attention_s)
        out["compute_s"] += compute
        out["host_s"] += host
        out["memory_bound_s"] += memory_s
        out["step_s"] += max(compute, hidden) + exposed
    out["comm_s"] = {g: sum(by.values()) for g, by in comm.items()}
    out["exposed_comm_s"] = out["step_s"] - out["compute_s"]
    return out


def predict(config_path: str, hw: Hardware, nodes: int = 1, modes: List[str] = (SUBJECT, REFERENCE),
            cp: int = DEFAULT_CP, seq_lengths: Optional[List[int]] = None, overrides: Optional[Dict] = None,
            fused_norm: bool = True) -> Dict:
    """Step time, tokens/s and MFU per mode at the config's sequence length on ``nodes``
    nodes, and (if ``seq_lengths``) the sweep that locates, for every mode, the sequence length
    from which it is at least as fast as TP+SP (:func:`crossover`)."""
    values = cfg.load_config(config_path)
    values.update(overrides or {})
    world = nodes * hw.gpus_per_node
    results: Dict = {"setup": run_record(config=config_path), "config": shown_path(config_path),
                     "hardware": hw.__dict__, "nodes": nodes, "fused_norm": fused_norm, "modes": {}}
    base_seq = cfg.resolve(values).seq_length
    check_layouts(values, modes, world, cp, "--nodes x gpus_per_node")  # before the first (slow) count
    for mode in modes:
        results["modes"][mode] = evaluate(values, mode, hw, world, cp, fused_norm=fused_norm, choose_by=CHOOSE_BY,
                                          limit_gib=hw.usable_gib)
    if seq_lengths:
        others = [m for m in modes if m != REFERENCE]
        sweep = {seq: {mode: evaluate(cfg.at_seq_length(values, seq), mode, hw, world, cp, brief=True,
                                      fused_norm=fused_norm, choose_by=CHOOSE_BY, limit_gib=hw.usable_gib)
                       for mode in others + [REFERENCE]}
                 for seq in seq_lengths}
        results["sweep"] = sweep
        results["crossover_seq_length"] = {mode: {key: crossover(sweep, mode, key) for key in SCENARIOS}
                                           for mode in others}
    results["seq_length"] = base_seq
    return results


def crossover(sweep: Dict, mode: str, scenario: str) -> Optional[int]:
    """The shortest swept length from which on ``mode``'s step is at most TP+SP's, at every
    longer length too (None: slower at the longest)."""
    found = None
    for seq in sorted(sweep, reverse=True):
        if sweep[seq][mode][scenario]["step_s"] > sweep[seq][REFERENCE][scenario]["step_s"]:
            break
        found = seq
    return found


def tsp_choices(values: Dict, mode: str, cp: int) -> List[Dict[str, int]]:
    """The settings of TSP's layers the model chooses among for ``mode``, where the config
    leaves them to ``auto`` (0): head groups per attention call, every divisor of D; MLP
    shards per call, the ring (1) or all gathered (D). Empty where nothing is left to choose."""
    the_mode = get_mode(mode)
    args = the_mode.args(values, cp)
    d = args.tsp_size
    if not the_mode.tsp_layers or d == 1 or (args.tsp_head_groups_per_call and args.tsp_mlp_shards_per_call):
        return []
    groups = [args.tsp_head_groups_per_call] if args.tsp_head_groups_per_call else \
        [g for g in range(1, d + 1) if d % g == 0]
    shards = [args.tsp_mlp_shards_per_call] if args.tsp_mlp_shards_per_call else [1, d]
    return [dict(tsp_head_groups_per_call=g, tsp_mlp_shards_per_call=m) for g in groups for m in shards]


def choice_name(setting: Dict[str, int]) -> str:
    return f"{setting['tsp_head_groups_per_call']} head groups, {setting['tsp_mlp_shards_per_call']} MLP shards a call"


def evaluate(values: Dict, mode: str, hw: Hardware, world: int, cp: int, brief: bool = False,
             fused_norm: bool = True, choose_by: Optional[str] = None, limit_gib: float = float("inf")) -> Dict:
    """Per scenario, step time and cluster tokens/s of ``mode`` on ``world`` GPUs, and rank 0's
    peak memory (``peak_gib``), from one planning at 2 and 3 layers. With ``choose_by`` (a
    scenario), TSP's head groups and MLP shards per call, where the config leaves them to
    ``auto``, are the model's choice (:func:`tsp_choices`) rather than the runtime's rule
    (:func:`~megatron_tsp.core.head_groups.head_groups_per_call`, which fills the GPU's SMs
    and knows nothing of launches or exposure): each is planned and the fastest in that
    scenario whose peak is at most ``limit_gib`` wins (the least memory if none fits);
    ``tsp_setting`` says which, ``by_tsp_setting`` what each would give."""
    choices = tsp_choices(values, mode, cp) if choose_by else []
    if not choices:
        return _evaluate(values, mode, hw, world, cp, brief, fused_norm)
    tried = [(c, _evaluate(dict(values, **c), mode, hw, world, cp, brief, fused_norm)) for c in choices]
    fitting = [t for t in tried if t[1]["peak_gib"] <= limit_gib] or [min(tried, key=lambda t: t[1]["peak_gib"])]
    setting, best = min(fitting, key=lambda t: t[1][choose_by]["step_s"])
    return dict(best, tsp_setting=setting,
                by_tsp_setting={choice_name(c): dict(peak_gib=r["peak_gib"], **{k: r[k]["step_s"] for k in SCENARIOS})
                                for c, r in tried})


def _evaluate(values: Dict, mode: str, hw: Hardware, world: int, cp: int, brief: bool, fused_norm: bool) -> Dict:
    args = get_mode(mode).args(values, cp)
    counts = layer_counts(values, mode, world, cp, fused_norm, hw.multiprocessors)
    total = totals_for(counts, args.num_layers)
    d = counts["parallel"]
    layout = cfg.sizes(args, world)
    replicas, ranks = layout.dp, layout.model_parallel
    tokens = args.micro_batch_size * args.seq_length
    model_flops = flops_formula.flops_per_sequence_from_args(args, padded_vocab(args)) * args.micro_batch_size
    out = {"parallel": d, "peak_gib": total["peak_gib"], "attention_stages": total["attention_stages"]}
    for key in SCENARIOS:
        t = step_time(total, hw, mode, key, world, overlap_grad_reduce=args.overlap_grad_reduce)
        t["tokens_per_s_cluster"] = replicas * tokens / t["step_s"]
        t["mfu"] = model_flops / (t["step_s"] * ranks * hw.peak_tflops * 1e12)
        out[key] = t
    if not brief:
        out["flops_per_rank"] = total["flops"]
        out["attention_flops_per_rank"] = total["attention_flops"]
        # kernel launches of the step and of one layer (memory.by_op_per_layer has them op by op)
        out["launches_per_rank"] = total["launches"]
        out["launches_per_layer"] = counts["per_layer"]["launches"]
        out["attention_kernel_calls_per_layer"] = counts["per_layer"]["attention_kernel_calls"]
        out["paper_accountings"] = _accountings(mode, hw, world, counts, args, layout, out["overlap"]["step_s"])
    return out


def _accountings(mode, hw, world, counts, args, layout, full_step_s) -> Dict:
    """Cluster tokens/s under the readings of 'tokens/s' a report might use."""
    tokens = args.micro_batch_size * args.seq_length
    per_layer = counts["per_layer"]
    # one layer's model FLOPs (no recompute) per rank, with the planner's attention share
    layer_flops = flops_formula.flops_per_sequence_from_args(args, 0) / args.num_layers * args.micro_batch_size / \
        layout.model_parallel  # the model's layers on average (windows and global ones)
    attn_share = per_layer["attention_flops"] / per_layer["flops"] if per_layer["flops"] else 0.0

    def layer_time(fraction, phases):
        flops = layer_flops * fraction
        total = {"flops": flops, "attention_flops": flops * attn_share, "comm": per_layer["comm"]}
        return step_time(total, hw, mode, "overlap", world, phases=phases)["step_s"]

    fwd_layer = layer_time(1.0 / 3.0, ("forward",))  # forward is a third of fwd+bwd
    replicas = layout.dp
    return {
        "training step, all layers": replicas * tokens / full_step_s,
        "forward, all layers": replicas * tokens / (args.num_layers * fwd_layer),
        "forward+backward, one layer": replicas * tokens / layer_time(1.0, ("forward", "backward")),
        "forward, one layer": replicas * tokens / fwd_layer,
    }


def table(result: Dict) -> str:
    hw = result["hardware"]["name"]
    lines = [f"{result['config']} on {result['nodes']} node(s) x {result['hardware']['gpus_per_node']} {hw}, "
             f"S={result['seq_length']} (one micro-batch step per rank)",
             "| mode | scenario | step s | compute s | exposed comm s | cluster tokens/s | MFU | vs TP+SP |",
             "|---|---|---|---|---|---|---|---|"]
    for mode, r in result["modes"].items():
        for key in SCENARIOS:
            t = r[key]
            base = result["modes"].get(REFERENCE, {}).get(key)
            vs = f"{t['tokens_per_s_cluster'] / base['tokens_per_s_cluster']:.2f}x" if base else "-"
            lines.append(f"| {mode} | {key} | {t['step_s']:.3f} | {t['compute_s']:.3f} | "
                         f"{t['exposed_comm_s']:.3f} | {t['tokens_per_s_cluster']:.3g} | {t['mfu']:.1%} | {vs} |")
    for mode, r in result["modes"].items():
        if r.get("tsp_setting"):
            lines.append(f"\n{mode}: {choice_name(r['tsp_setting'])}, the model's choice (step s in '{CHOOSE_BY}' "
                         f"and peak GiB of each: " + "; ".join(f"{name}: {t[CHOOSE_BY]:.3f} s, {t['peak_gib']:.1f} GiB"
                                                               for name, t in r["by_tsp_setting"].items()) + ")")
    for mode, by_scenario in result.get("crossover_seq_length", {}).items():
        lines.append(f"\n{mode} at least as fast as TP+SP from S = " + ", ".join(
            f"{v} ({k})" for k, v in by_scenario.items()) + f" (swept {list(result['sweep'])})")
    return "\n".join(lines)


def launch_prices(profile: Dict, host_bound: Dict, host_bound_launches: Dict[str, float]) -> Dict[str, float]:
    """The launch prices of a GPU (module docstring) from its ``gpu-check`` files: the fixed
    cost of a GEMM and of an attention kernel call from a profiled step of two modes with the
    same FLOPs (``profile``: the device time and calls of ``aten::mm``/``addmm`` and of the
    attention kernels, per mode: the extra time over the extra calls), and the host's cost per
    launch from a step both modes run host-bound (``host_bound``: each mode's compute time
    over its kernel launches, ``host_bound_launches``, counted on the code it ran), averaged."""
    def summed(mode: str, names) -> Tuple[float, float]:
        ops = [o for o in profile["modes"][mode]["profile"]["ops"]["top"] if o["name"] in names]
        return sum(o["ms"] for o in ops), sum(o["calls"] for o in ops)

    prices = {}
    for key, names in (("matmul_call_us", ("aten::mm", "aten::addmm")),
                       ("attention_call_us", tuple(o["name"] for o in profile["modes"][SUBJECT]["profile"]["ops"]["top"]
                                                   if o["name"].startswith(ATTENTION_KERNEL_OPS)))):
        (ms, calls), (ms_ref, calls_ref) = summed(SUBJECT, names), summed(REFERENCE, names)
        prices[key] = (ms - ms_ref) / (calls - calls_ref) * 1e3
    per_launch = [host_bound["modes"][m]["compute_s_median"] / host_bound_launches[m] for m in (SUBJECT, REFERENCE)]
    prices["host_us_per_launch"] = sum(per_launch) / len(per_launch) * 1e6
    return prices
