"""Stock megatron-core GPT on CPU/gloo: world=1, TP=2, TP=2+SP and TP=4+SP train alike, and
so do TP=2 and TP=2+SP with TSP's ring MLP (--ring-mlp).

These are the baselines TSP is measured against; they also exercise every CPU shim on the
GPTModel + DDP + DistributedOptimizer + get_forward_backward_func path. TP x CP uses the
baseline spec (stock modules, memory-efficient core attention with all-gather CP).
"""

import pytest
from gpt_models import assert_history_close, run


@pytest.fixture(scope="module")
def reference(ranks):
    return ranks(1, run, "single", "classic")[0]


@pytest.mark.parametrize("mode,tp", [("tp", 2), ("tp-sp", 2), ("tp-sp", 4)])
def test_tensor_parallel_matches_single_process(ranks, reference, mode, tp):
    for history in ranks(tp, run, mode, "classic", tp=tp):
        assert_history_close(history, reference)
    assert reference[-1][0] < reference[0][0], "loss should fall over 3 Adam steps"


@pytest.fixture(scope="module")
def modern_reference(ranks):
    return ranks(1, run, "single", "modern")[0]


@pytest.mark.parametrize("tp,cp", [(1, 2), (2, 2)])
def test_tp_cp_baseline_with_flash_core_attention_matches(ranks, reference, tp, cp):
    for history in ranks(tp * cp, run, "tp-cp", "classic", tp=tp, cp=cp):
        assert_history_close(history, reference)


@pytest.mark.parametrize("tp,cp", [(1, 2), (1, 4), (2, 2)])
def test_tp_cp_baseline_matches_on_rope_gqa_swiglu(ranks, modern_reference, tp, cp):
    for history in ranks(tp * cp, run, "tp-cp", "modern", tp=tp, cp=cp):
        assert_history_close(history, modern_reference)


@pytest.fixture(scope="module")
def untied_references(ranks):
    return {model: ranks(1, run, "single", model, tied=False)[0] for model in ("classic", "modern")}


def _shard_fraction(cp):
    """This rank's share of the cp-fsdp model's parameters, and of all of them together."""
    import torch.distributed as dist
    from gpt_models import setup

    chunks, _, _ = setup("cp-fsdp", "modern", cp=cp)
    params = list(chunks[0].parameters())
    local = sum(p.to_local().numel() for p in params)
    return local / sum(p.numel() for p in params), dist.get_world_size()


@pytest.mark.parametrize("model,cp", [("modern", 2), ("classic", 4)])
def test_cp_with_fully_sharded_weights_matches_single_process(ranks, untied_references, model, cp):
    """cp-fsdp: context parallelism over D ranks, its weights, gradients and optimizer state
    sharded over the same ranks by megatron's torch FSDP2 wrapper (Megatron-LM's
    --use-torch-fsdp2; untied, as it requires): every step's loss and grad norm as world=1,
    each rank holding about 1/D of the parameters."""
    for history in ranks(cp, run, "cp-fsdp", model, cp=cp):
        assert_history_close(history, untied_references[model])
    for fraction, world in ranks(cp, _shard_fraction, cp):
        assert world == cp and abs(fraction - 1 / cp) < 0.05 / cp


@pytest.mark.parametrize("mode", ["tp-sp-ring", "tp-ring"])
@pytest.mark.parametrize("model", ["classic", "modern"])  # GeLU/MHA/LayerNorm/bias, SwiGLU/GQA/RMSNorm/RoPE
def test_ring_mlp_in_tensor_parallel_models_matches_single_process(ranks, reference, modern_reference, mode,
                                                                   model):
    """TSP's ring MLP inside a TP(+SP) model: the same training as the world=1 stock model."""
    for history in ranks(2, run, mode, model, tp=2):
        assert_history_close(history, reference if model == "classic" else modern_reference)


@pytest.mark.parametrize("kwargs", [dict(tp=2, pp=2, recompute="full"), dict(tp=2, cp=2, ring_mlp=True)],
                         ids=["tp2-pp2-recompute", "tp2-cp2"])
def test_ring_mlp_composes_with_pipeline_recompute_and_context_parallelism(ranks, modern_reference,
                                                                          pp_checkpoint, kwargs):
    mode = "tp-cp" if "cp" in kwargs else "tp-sp-ring"
    load = pp_checkpoint if "pp" in kwargs else None  # stages initialise from other RNG states
    for history in ranks(4, run, mode, "modern", load=load, **kwargs):
        assert_history_close(history, modern_reference)


@pytest.fixture(scope="module")
def pp_checkpoint(ranks, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("single") / "init")
    ranks(1, run, "single", "modern", steps=0, save=path)
    return path


def test_plain_optimizer_matches_distributed_optimizer(ranks, reference):
    (history,) = ranks(1, run, "single", "classic", use_distributed_optimizer=False)
    assert_history_close(history, reference)


def _layer_types_built(transformer_engine_spec):
    """On one rank, TE "installed" (its spec a stand-in that builds megatron's local layers and
    says so): which attention class `train`'s build puts in a TP baseline."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_tsp.device import CPU
    from megatron_tsp.run import build, config, modes

    te_spec = get_gpt_layer_local_spec()  # what megatron's TE spec would be: another core attention
    real = modes.transformer_engine_version, modes.get_gpt_layer_with_transformer_engine_spec
    modes.transformer_engine_version = lambda: "2.9.0"
    modes.get_gpt_layer_with_transformer_engine_spec = lambda **kw: te_spec
    try:  # a pooled worker: the next test finds it as it was
        values = dict(mock_data=True, vocab_size=256, num_layers=1, hidden_size=32, num_attention_heads=4,
                      seq_length=16, attention_dropout=0.0, transformer_engine_spec=transformer_engine_spec)
        args = config.resolve({k: v for k, v in values.items() if v is not None})
        build.initialize(args, CPU)
        _, model, _ = build.build(args, CPU)
        kind = modes.of(args).layer_spec(args)
    finally:
        modes.transformer_engine_version, modes.get_gpt_layer_with_transformer_engine_spec = real
    return kind, sorted({type(m).__name__ for m in model[0].modules() if "Attention" in type(m).__name__})


@pytest.mark.parametrize("te,kind,core", [(None, "transformer_engine", "DotProductAttention"),
                                          (True, "transformer_engine", "DotProductAttention"),
                                          (False, "local", "FlashDotProductAttention")])
def test_baselines_run_megatrons_te_spec_where_installed_unless_told_not_to(ranks, te, kind, core):
    """With TransformerEngine installed the baselines are built as Megatron-LM builds them, on
    megatron's TE layer spec, unless --no-transformer-engine-spec asks for TSP's attention op
    (the same kernels as TSP's); results record which (``layer_spec``)."""
    built, layers = ranks(1, _layer_types_built, te)[0]
    assert built == kind and core in layers


def test_te_spec_by_default_only_where_it_applies(monkeypatch):
    """Unset, ``transformer_engine_spec`` is TE's layers where TE is installed and the spec
    takes the settings; where it does not (a TSP layout, experts, packed documents), the local
    layers, with no error; without TE, always the local layers."""
    from megatron_tsp.run import config, modes

    base = dict(mock_data=True, vocab_size=256, attention_dropout=0.0, num_attention_heads=4)
    cases = [("tp-sp", {}, "transformer_engine"), ("tsp", {}, "tsp"),
             ("tp-sp", dict(num_experts=4), "local"), ("tp-sp", dict(reset_attention_mask=True), "local"),
             ("tp-sp", dict(transformer_engine_spec=False), "local")]
    monkeypatch.setattr(modes, "transformer_engine_version", lambda: "2.9.0")
    for mode, extra, kind in cases:
        args = modes.get_mode(mode).args(dict(base, **extra), 1)
        assert args.transformer_engine_spec is extra.get("transformer_engine_spec")  # decided at build
        assert modes.get_mode(mode).layer_spec(args) == kind, (mode, extra)
    monkeypatch.setattr(modes, "transformer_engine_version", lambda: None)
    assert modes.get_mode("tp-sp").layer_spec(config.resolve(base)) == "local"
    assert modes.get_mode("tp-sp").layer_spec(config.resolve(dict(base, transformer_engine_spec=True))) == "local"


def test_transformer_engine_spec_is_for_baselines():
    from megatron_tsp.run import config

    with pytest.raises(config.ConfigError, match="'transformer_engine_spec' .* applies to the baselines"):
        config.resolve(dict(mock_data=True, vocab_size=256, tsp_size=2, attention_dropout=0.0,
                            transformer_engine_spec=True))
