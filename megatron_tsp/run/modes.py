"""What a parallel mode is: the one place that defines ``tsp``, ``tp``, ``tp-sp``, ``tp-cp``
and the rest, and the roles comparisons give them.

A mode lays a config's model-parallel size D out over the parallel dimensions (the same
model, batch, sequence and recompute), chooses the transformer layers, the batch transform
and the layers' own communication overlap, and says which process groups' traffic it hides
behind compute (what the performance model needs). Training, the memory planner, the
benchmark, the GPU check, the performance model and the tests all go through :data:`MODES`:
adding a mode is one entry there. A comparison names modes only by their role:
:data:`SUBJECT`, its :data:`NO_OVERLAP` control and the :data:`REFERENCES` it is measured
against (:data:`REFERENCE` first).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple, Union

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

from megatron_tsp import versions
from megatron_tsp.core.baselines import get_gpt_block_baseline_spec
from megatron_tsp.core.sizes import DEFAULT_CP, ParallelSizes
from megatron_tsp.core.spec import get_gpt_block_tsp_spec, with_ring_mlp
from megatron_tsp.core.zigzag import ZigzagBatch
from megatron_tsp.env import transformer_engine_version
from megatron_tsp.errors import ConfigError
from megatron_tsp.run import config

PARALLEL_KEYS = ("tsp_size", "tensor_model_parallel_size", "context_parallel_size", "sequence_parallel", "ring_mlp",
                 "use_torch_fsdp2")


@dataclass(frozen=True)
class Mode:
    """``sizes(D, cp)``: the parallel config keys of the mode at model-parallel size D.
    ``hides``: groups whose traffic the mode's own layers overlap with compute;
    ``hides_with_te``: groups hidden only with TransformerEngine (TP by its ``--tp-comm-overlap``;
    CP by its ring attention: without it the baseline all-gathers K/V before attending, see
    ``core/baselines.py``); ``behind_attention``: groups that can hide behind attention only;
    ``inert_recompute``: megatron recompute modules that change nothing in this mode, and why.
    ``unlike``: what a comparison's table says the mode does differently from TSP.
    ``device_max_connections``: the ``CUDA_DEVICE_MAX_CONNECTIONS`` a training job of the mode
    runs with unless the user set one (None: CUDA's default, 8). megatron's tensor-parallel
    collectives want 1, so that each is queued ahead of the GEMM it overlaps (megatron warns
    otherwise); TSP's weight and K/V transfers run on their own streams beside the compute
    stream, which one hardware queue would serialise (scripts/slurm/env.sh gives ROCm 4). The
    ring-MLP modes keep 1: their attention is TP's, whose collectives sit on the data path."""

    name: str
    sizes: Callable[[int, int], Dict]
    tsp_layers: bool = False
    overlap_comm: bool = True
    hides: Tuple[str, ...] = ()
    hides_with_te: Tuple[str, ...] = ()
    behind_attention: Tuple[str, ...] = ()
    inert_recompute: Dict[str, str] = field(default_factory=dict)
    device_max_connections: Optional[str] = "1"
    unlike: str = ""

    def environment(self) -> Dict[str, str]:
        """What a rank of the mode gets where the user set nothing (``device_max_connections``)."""
        return {"CUDA_DEVICE_MAX_CONNECTIONS": self.device_max_connections} if self.device_max_connections else {}

    def values(self, values: Dict, cp: int = DEFAULT_CP) -> Dict:
        """The config ``values`` with the ranks of each pipeline stage (TSP x TP x CP) re-laid
        out as this mode."""
        d = ParallelSizes.of(values).within_a_stage
        v = {key: value for key, value in values.items() if key not in PARALLEL_KEYS}
        v.update(self.sizes(d, cp))
        return v

    def args(self, values: Dict, cp: int = DEFAULT_CP):
        """The resolved arguments of ``values`` laid out as this mode."""
        return config.resolve(self.values(values, cp))

    def spec(self, args, transformer_config, attention_backend: str = "auto",
             transformer_engine: Optional[bool] = None, fused_norm: bool = True):
        """What GPTModel takes as ``transformer_layer_spec``, as :meth:`layer_spec` says: the
        TSP block spec; megatron's TransformerEngine layer spec (it only imports with a GPU);
        or the baseline block spec, megatron's local layers with the attention op TSP uses and
        its norms (baselines.py), so that the modes run the same attention kernels;
        ``fused_norm``: see :func:`megatron_tsp.core.norm.implementation`."""
        kind = self.layer_spec(args, transformer_engine)
        if kind == "tsp":
            return get_gpt_block_tsp_spec(transformer_config, qk_layernorm=args.qk_layernorm,
                                          attention_backend=attention_backend, overlap_comm=self.overlap_comm,
                                          fused_norm=fused_norm, lookahead=args.tsp_lookahead,
                                          head_groups_per_call=head_groups_setting(args),
                                          mlp_shards_per_call=args.tsp_mlp_shards_per_call or "auto")
        if kind == "transformer_engine":
            spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=args.qk_layernorm)
            return with_ring_mlp(spec, fused_norm, self.overlap_comm) if args.ring_mlp else spec
        return get_gpt_block_baseline_spec(transformer_config, qk_layernorm=args.qk_layernorm,
                                           attention_backend=attention_backend, fused_norm=fused_norm,
                                           ring_mlp=args.ring_mlp, overlap_comm=self.overlap_comm)

    def layer_spec(self, args, transformer_engine: Optional[bool] = None) -> str:
        """Which layers :meth:`spec` builds, as results record it: ``tsp``;
        ``transformer_engine``, megatron's TE layer spec, where TE is installed and
        ``transformer_engine`` (default: ``--transformer-engine-spec``) asks for it or, unset,
        where the spec applies (Megatron-LM's default; :func:`config.te_spec_conflicts`); else
        ``local``, megatron's local layers with TSP's attention op and norms."""
        if self.tsp_layers:
            return "tsp"
        wanted = args.transformer_engine_spec if transformer_engine is None else transformer_engine
        if wanted is None:
            wanted = not config.te_spec_conflicts(args)
        return "transformer_engine" if wanted and transformer_engine_version() is not None else "local"

    def batch_transform(self, args) -> Optional[Callable]:
        """Zigzag order for TSP; megatron's context-parallel slice for CP; nothing otherwise."""
        if self.tsp_layers and args.tsp_size > 1:
            return ZigzagBatch(args.seq_length, args.tsp_size)
        if args.context_parallel_size > 1:
            return versions.context_parallel_slice
        return None

    def overlapped(self, transformer_engine: bool, overlap_grad_reduce: bool) -> Tuple[str, ...]:
        """The groups whose traffic hides behind compute (the data-parallel gradient reduce
        only with ``--overlap-grad-reduce``: megatron's default reduces after the backward pass)."""
        return self.hides + (self.hides_with_te if transformer_engine else ()) + \
            (("dp", "dp_cp", "edp") if overlap_grad_reduce else ())


def _tp_cp(d: int, cp: int) -> Dict:
    if d % cp:
        raise ConfigError(f"mode tp-cp: model-parallel size {d} is not divisible by --cp {cp}")
    return dict(tensor_model_parallel_size=d // cp, context_parallel_size=cp, sequence_parallel=d // cp > 1)


_TSP = dict(tsp_layers=True, hides=("tsp_weight", "tsp"), behind_attention=("tsp",), device_max_connections=None,
            inert_recompute={"core_attn": "TSP attention has no megatron core_attention; it keeps only its "
                                          "flash output and log-sum-exp already"})
MODES: Dict[str, Mode] = {m.name: m for m in (
    # TSP D: weights and tokens sharded on one axis
    Mode("tsp", lambda d, cp: dict(tsp_size=d), **_TSP),
    # TSP D with its communication not overlapped: what the overlap hides
    Mode("tsp-no-overlap", lambda d, cp: dict(tsp_size=d),
         **dict(_TSP, overlap_comm=False, hides=(), behind_attention=())),
    # TP D, TP D + sequence parallelism
    Mode("tp", lambda d, cp: dict(tensor_model_parallel_size=d), hides_with_te=("tp",)),
    Mode("tp-sp", lambda d, cp: dict(tensor_model_parallel_size=d, sequence_parallel=True),
         hides_with_te=("tp",)),
    # TP D/cp x CP cp (TP+SP when D/cp > 1)
    Mode("tp-cp", _tp_cp, hides_with_te=("tp", "cp"), behind_attention=("cp",),
         unlike="reduce-scatters dK/dV in the model's dtype, as TransformerEngine's all-gather context parallelism "
                "does (TSP sums them in fp32)"),
    # CP D with the weights, gradients and optimizer state fully sharded over the same D ranks
    # (torch FSDP2, Megatron-LM's --use-torch-fsdp2): 1/D of the weights and the tokens, as TSP
    Mode("cp-fsdp", lambda d, cp: dict(context_parallel_size=d, use_torch_fsdp2=True, use_distributed_optimizer=False,
                                       gradient_accumulation_fusion=False),
         hides=("dp_cp",), hides_with_te=("cp",), behind_attention=("cp",), device_max_connections=None,
         unlike="all-gathers each layer's whole weights (torch FSDP2) and reduce-scatters their gradients in the "
                "model's dtype; reduce-scatters dK/dV in the model's dtype (TSP sums both in fp32)"),
    # TP D + SP with TSP's ring MLP (--ring-mlp): the MLP moves weights, the attention is TP+SP's
    Mode("tp-sp-ring", lambda d, cp: dict(tensor_model_parallel_size=d, sequence_parallel=True, ring_mlp=True),
         hides=("tsp_weight",), hides_with_te=("tp",)),
    # TP D with the ring MLP: each rank's 1/D of the tokens through the ring, one all-gather out
    Mode("tp-ring", lambda d, cp: dict(tensor_model_parallel_size=d, ring_mlp=True), hides=("tsp_weight",),
         hides_with_te=("tp",)),
)}


SUBJECT, NO_OVERLAP = "tsp", "tsp-no-overlap"
REFERENCES = ("tp-sp", "tp-cp")  # TP+SP, and TP x CP for long sequences
REFERENCE = REFERENCES[0]


def ratio_key(reference: str) -> str:
    """The results key of a step time relative to ``reference`` (``vs_tp_sp``)."""
    return "vs_" + reference.replace("-", "_")


def head_groups_setting(args) -> Union[int, str]:
    """``--tsp-head-groups-per-call`` as TSP's attention takes it (``head_groups_per_call``):
    ``auto`` for 0, and where it is unread (tsp_size 1)."""
    return args.tsp_head_groups_per_call if args.tsp_size > 1 and args.tsp_head_groups_per_call else "auto"


def get_mode(name: str) -> Mode:
    if name not in MODES:
        raise ConfigError(f"unknown mode {name!r}; use one of {', '.join(MODES)}")
    return MODES[name]


def check_layouts(values: Dict, names, world_size: Optional[int], cp: int, source: str) -> None:
    """Every mode of ``names`` lays ``values`` out on ``world_size`` ranks (None: one replica):
    one ConfigError line otherwise, before any slow work starts. ``source`` names the flag the
    world size came from."""
    if ParallelSizes.of(values).within_a_stage == 1:
        raise ConfigError("the config sets no model-parallel size (tsp_size, tensor_model_parallel_size, "
                          "context_parallel_size), and the modes are layouts of one size D > 1: set tsp_size in "
                          "it, or use a config that does (configs/7b/128k-tsp8.yaml)")
    for name in names:
        config.sizes(get_mode(name).args(values, cp), world_size, source)


def runnable(values: Dict, names, cp: int) -> Tuple[List[str], List[str]]:
    """The modes of ``names`` the model of ``values`` can run, and a line for each it cannot
    (a ring MLP in a mixture-of-experts model, say): a comparison's default list of modes
    is not a request for each of them."""
    keep, skipped = [], []
    if ParallelSizes.of(values).within_a_stage == 1:  # no layout at all: check_layouts says so
        return list(names), skipped
    for name in names:
        mode = get_mode(name)
        try:
            mode.args(values, cp)
        except ConfigError as exc:
            skipped.append(f"mode {name} skipped: {exc}")
            continue
        keep.append(name)
    return keep, skipped


def of(args) -> Mode:
    """The mode a resolved config runs in (``megatron-tsp train``; a ring MLP beside context
    parallelism is tp-cp's layers with the ring)."""
    if args.tsp_size > 1:
        return MODES["tsp"]
    if args.context_parallel_size > 1:
        return MODES["cp-fsdp" if args.use_torch_fsdp2 and args.tensor_model_parallel_size == 1 else "tp-cp"]
    ring = "-ring" if args.ring_mlp else ""
    return MODES[("tp-sp" if args.sequence_parallel else "tp") + ring]
