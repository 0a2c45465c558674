"""TSP GPT end to end on megatron-core: training equals the single-process run.

Stock GPTModel with the TSP layer spec, zigzag batches, megatron DDP + DistributedOptimizer,
gradient clipping, two micro-batches per step through get_forward_backward_func; loss and
grad norm at every step (4 Adam steps) within 1e-5 of the world=1 stock model from the same
seed.
"""

import pytest
from gpt_models import assert_history_close, run, setup

STEPS = 4  # a parameter whose gradient is not summed over the group diverges from step 2


@pytest.fixture(scope="module")
def single(ranks):
    return {model: ranks(1, run, "single", model, steps=STEPS)[0] for model in ("modern", "classic")}


@pytest.fixture(scope="module")
def single_untied(ranks):
    """The world=1 modern model whose output layer has its own weight."""
    return ranks(1, run, "single", "modern", steps=STEPS, tied=False)[0]


@pytest.fixture(scope="module")
def single_checkpoint(ranks, tmp_path_factory):
    """The world=1 model's initial weights: pipeline stages initialise their layers from
    different RNG states, so PP runs start from this checkpoint to match world=1."""
    path = str(tmp_path_factory.mktemp("single") / "init")
    ranks(1, run, "single", "modern", steps=0, save=path)
    return path


@pytest.mark.parametrize("model", ["modern", "classic"])
@pytest.mark.parametrize("tsp", [2, 4])
def test_tsp_trains_like_single_process(ranks, single, model, tsp):
    for history in ranks(tsp, run, "tsp", model, steps=STEPS, tsp=tsp):
        assert_history_close(history, single[model])
    assert single[model][-1][0] < single[model][0][0]


def prefetched_run(recompute):
    """Train as :func:`run`, recording each attention forward whose backward's first K/V
    re-gather the MLP after it posted (core/prefetch.py) and whether its backward took it."""
    from megatron_tsp.core import attention_schedule
    posted = []
    original = attention_schedule.post_backward_regathers

    def post(ctx, inflight):
        posted.append(ctx)
        return original(ctx, inflight)

    attention_schedule.post_backward_regathers = post
    try:
        history = run("tsp", "modern", steps=STEPS, tsp=2, recompute=recompute)
    finally:
        attention_schedule.post_backward_regathers = original
    return history, len(posted), sum(ctx.prefetched == [] for ctx in posted)


@pytest.mark.parametrize("recompute", [None, "full"])
def test_the_mlp_backward_posts_the_attention_backwards_kv(ranks, single, recompute):
    for history, posted, taken in ranks(2, prefetched_run, recompute):
        assert_history_close(history, single["modern"])
        assert posted == taken == 2 * 2 * STEPS  # layers x micro-batches x steps, each taken by its backward


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(tsp=2),  # TSP=2 x DP=2
        dict(tsp=2, pp=2, load=True, block_spec=True),  # per-stage block spec, TSP final norm
        dict(tsp=2, recompute="full", overlap_grad_reduce=True),  # TSP=2 x DP=2
        dict(tsp=2, pp=2, recompute="full", load=True),
        dict(tsp=4, recompute="selective"),
        dict(tsp=2, recompute="selective:mlp"),  # TSP=2 x DP=2
        dict(tsp=4, recompute="full", block_spec=True, lookahead=3),  # every shard in flight at once
        dict(tsp=4, recompute="full", model="classic"),  # GELU: the recomputed MLP keeps its activation
        dict(tsp=4, block_spec=True, per_call=4),  # every head group in one stage: the MLP gathers its shards
        dict(tsp=4, recompute="full", block_spec=True, per_call=2),  # two stages of two
        # the gathered MLP recomputed, keeping its activation and its last layer's gathered shards
        dict(tsp=4, recompute="full", model="classic", block_spec=True, mlp_shards=4),
    ],
    ids=["dp2", "pp2", "dp2-recompute-overlap", "pp2-recompute", "selective", "selective-mlp",
         "recompute-lookahead3", "recompute-gelu", "one-stage", "recompute-stages-of-two", "recompute-gathered-mlp"],
)
def test_tsp_with_dp_pp_and_recompute(ranks, single, single_checkpoint, kwargs):
    if kwargs.pop("load", False):
        kwargs["load"] = single_checkpoint
    model = kwargs.pop("model", "modern")
    for history in ranks(4, run, "tsp", model, steps=STEPS, **kwargs):
        assert_history_close(history, single[model])


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(tsp=2),
        dict(tsp=4, model="classic"),  # learned positions (their gradient summed over the group), LayerNorm, bias
        dict(tsp=2, pp=2, load=True),  # embedding and output layer on different stages, their tied weight
        dict(tsp=2, recompute="full", overlap_grad_reduce=True),  # TSP=2 x DP=2
        dict(tsp=2, tied=False),
        dict(tsp=4, documents=True),
    ],
    ids=["tsp2", "tsp4-classic", "tsp2-pp2", "dp2-recompute-overlap", "untied", "documents"],
)
def test_table_vocabulary_trains_like_single_process(ranks, single, single_untied, single_checkpoint, packed,
                                                     kwargs):
    """TSP's table layout (core/vocab.py: the gathered vocabulary table, each rank's own
    tokens' logits and cross entropy) trains as the world=1 stock model."""
    if kwargs.pop("load", False):
        kwargs["load"] = single_checkpoint
    model = kwargs.pop("model", "modern")
    expected = packed[model] if kwargs.get("documents") else single[model]
    if not kwargs.get("tied", True):
        expected = single_untied
    for history in ranks(4, run, "tsp", model, steps=STEPS, vocab="table", **kwargs):
        assert_history_close(history, expected)


def table_prefetch_run(tied):
    """Train as :func:`run` in the table layout, recording for each output-layer table gather
    the model posted ahead (core/vocab.py) the schedule that posted it, and whether the
    output layer took it."""
    import inspect

    from megatron_tsp.core import vocab
    posted_by, taken = [], []
    original_init, original_table = vocab.PrefetchedRows.__init__, vocab.PrefetchedRows.table

    def init(self, *args):
        posted_by.append([f.function for f in inspect.stack()
                          if f.function == "forward" and f.filename.endswith(("attention_schedule.py", "mlp.py"))])
        original_init(self, *args)

    def table(self, shard):
        full = original_table(self, shard)
        taken.append(full is not None)
        return full

    vocab.PrefetchedRows.__init__, vocab.PrefetchedRows.table = init, table
    try:
        history = run("tsp", "modern", steps=STEPS, tsp=2, vocab="table", tied=tied)
    finally:
        vocab.PrefetchedRows.__init__, vocab.PrefetchedRows.table = original_init, original_table
    return history, posted_by, taken


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_the_output_layers_table_travels_during_the_decoder(ranks, single, single_untied, tied):
    expected = single["modern"] if tied else single_untied
    for history, posted_by, taken in ranks(2, table_prefetch_run, tied):
        assert_history_close(history, expected)
        # micro-batches x steps: each posted inside a TSP module's forward (the last one's last stage), and taken
        assert len(posted_by) == 2 * STEPS and all(posted_by)
        assert taken == [True] * 2 * STEPS


@pytest.fixture(scope="module")
def sinks(ranks, tmp_path_factory):
    """A world=1 model with megatron's learnable softmax sinks: (its initial weights, its
    training). Each layout initialises its shard of the sinks, so every run loads the weights."""
    path = str(tmp_path_factory.mktemp("sinks") / "init")
    ranks(1, run, "single", "modern", steps=0, save=path, softmax_type="learnable")
    return path, ranks(1, run, "single", "modern", steps=STEPS, load=path, softmax_type="learnable")[0]


@pytest.mark.parametrize("softmax_type", ["learnable", "off-by-one"])
@pytest.mark.parametrize("mode,kwargs", [("tsp", dict(tsp=2)), ("tsp", dict(tsp=4)), ("tp-sp", dict(tp=2)),
                                         ("tp-cp", dict(cp=2))], ids=["tsp2", "tsp4", "tp2-sp", "cp2"])
def test_softmax_sinks_train_like_single_process(ranks, sinks, softmax_type, mode, kwargs):
    """megatron-core's softmax types (gpt-oss's attention sinks: TransformerEngine #2541 forces
    the a2a CP variant for them): TSP, and the baselines on the attention op TSP uses, train as
    the world=1 stock model (its local attention's softmax with the sink column)."""
    path, learnable = sinks
    expected = learnable if softmax_type == "learnable" else \
        ranks(1, run, "single", "modern", steps=STEPS, load=path, softmax_type=softmax_type)[0]
    size = kwargs.get("tsp", 1) * kwargs.get("tp", 1) * kwargs.get("cp", 1)
    for history in ranks(size, run, mode, "modern", steps=STEPS, load=path, softmax_type=softmax_type, **kwargs):
        assert_history_close(history, expected)


WINDOW = dict(window_size=(5, 0), window_attn_skip_freq=2)  # layer 1 sees 5 keys back, layer 2 every key


@pytest.fixture(scope="module")
def windowed(ranks):
    return ranks(1, run, "single", "modern", steps=STEPS, **WINDOW)[0]


@pytest.mark.parametrize("mode,kwargs", [("tsp", dict(tsp=2)), ("tsp", dict(tsp=4)), ("tp-sp", dict(tp=2)),
                                         ("tp-cp", dict(cp=2))], ids=["tsp2", "tsp4", "tp2-sp", "cp2"])
def test_sliding_windows_train_like_single_process(ranks, single, windowed, mode, kwargs):
    """megatron-core's window_size and window_attn_skip_freq (sliding-window attention with CP
    is slow or times out: Megatron-LM #2222): TSP and the baselines train as the world=1
    stock model, whose local attention masks the window, over chunks of 4 to 16 tokens."""
    assert windowed[0].loss != single["modern"][0].loss  # the window changes the model
    size = kwargs.get("tsp", 1) * kwargs.get("tp", 1) * kwargs.get("cp", 1)
    for history in ranks(size, run, mode, "modern", steps=STEPS, **kwargs, **WINDOW):
        assert_history_close(history, windowed)


@pytest.fixture(scope="module")
def packed(ranks):
    return {model: ranks(1, run, "single", model, steps=STEPS, documents=True)[0] for model in ("modern", "classic")}


@pytest.mark.parametrize("mode,kwargs", [("tsp", dict(tsp=2)), ("tsp", dict(tsp=4)), ("tsp", dict(tsp=2, pp=2)),
                                         ("tsp", dict(tsp=4, model="classic")), ("tp-sp", dict(tp=2)),
                                         ("tp-cp", dict(cp=2))],
                         ids=["tsp2", "tsp4", "tsp2-pp2", "tsp4-learned-positions", "tp2-sp", "cp2"])
def test_packed_documents_train_like_single_process(ranks, single, single_checkpoint, packed, mode, kwargs):
    """Megatron-LM's --reset-attention-mask --reset-position-ids --eod-mask-loss (packed
    documents with CP give wrong results or NaNs: TransformerEngine #1930, #2186): TSP and the
    baselines, which read the documents from the EOD tokens, train as the world=1 stock model
    fed the [b, 1, S, S] mask Megatron-LM's dataset builds; documents cross chunks and ranks."""
    model = kwargs.pop("model", "modern")  # classic: learned positions, restarting per document
    assert packed[model][0].loss != single[model][0].loss  # the documents change the model
    if kwargs.get("pp"):
        kwargs["load"] = single_checkpoint
    size = kwargs.get("tsp", 1) * kwargs.get("tp", 1) * kwargs.get("cp", 1) * kwargs.get("pp", 1)
    for history in ranks(size, run, mode, model, steps=STEPS, documents=True, **kwargs):
        assert_history_close(history, packed[model])


@pytest.fixture(scope="module")
def packed_window(ranks):
    """megatron-core's local attention drops the mask it is given for a window's: the world=1
    stock model gets both in its mask, and no window_size."""
    return ranks(1, run, "single", "modern", steps=STEPS, documents=True, mask_window=5)[0]


@pytest.mark.parametrize("mode,kwargs", [("tsp", dict(tsp=2)), ("tsp", dict(tsp=4)), ("tp-sp", dict(tp=2)),
                                         ("tp-cp", dict(cp=2))], ids=["tsp2", "tsp4", "tp2-sp", "cp2"])
def test_sliding_windows_within_packed_documents_train_like_single_process(ranks, packed, packed_window, mode,
                                                                           kwargs):
    """A window of 5 keys within each packed document, in every layer (bands that are not
    square where a document starts inside the window's reach)."""
    expected = packed_window
    assert expected[0].loss != packed["modern"][0].loss
    size = kwargs.get("tsp", 1) * kwargs.get("tp", 1) * kwargs.get("cp", 1)
    for history in ranks(size, run, mode, "modern", steps=STEPS, documents=True, window_size=(5, 0), **kwargs):
        assert_history_close(history, expected)


# megatron-core's MoE layers (router, all-to-all dispatcher, SequentialMLP experts) with a load-balancing loss;
# top-2 of 4 experts, and top-1 with a shared expert
MOE = {"top2": dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64, moe_aux_loss_coeff=0.01,
                    moe_token_dispatcher_type="alltoall"),
       "top1-shared": dict(num_moe_experts=4, moe_router_topk=1, moe_router_pre_softmax=True, moe_ffn_hidden_size=64,
                           moe_aux_loss_coeff=0.01,
                           moe_shared_expert_intermediate_size=32, moe_token_dispatcher_type="alltoall")}


@pytest.fixture(scope="module")
def experts(ranks, tmp_path_factory):
    """World=1 MoE models: {variant: (their initial weights, their training)}. Each expert-parallel
    layout initialises its own experts, so every run loads the weights."""
    out = {}
    for name, moe in MOE.items():
        path = str(tmp_path_factory.mktemp("moe") / name)
        ranks(1, run, "single", "modern", steps=0, save=path, ep=1, **moe)
        out[name] = path, ranks(1, run, "single", "modern", steps=STEPS, load=path, ep=1, **moe)[0]
    return out


@pytest.mark.parametrize("variant", list(MOE))
@pytest.mark.parametrize("mode,kwargs", [("tsp", dict(tsp=2, ep=2)), ("tsp", dict(tsp=2, ep=1)),
                                         ("tsp", dict(tsp=4, ep=4)), ("tsp", dict(tsp=4, ep=2)),
                                         ("tsp", dict(tsp=2, ep=2, world=4)),
                                         ("tsp", dict(tsp=2, ep=2, recompute="selective:moe")),
                                         ("tp-sp", dict(tp=2, ep=2)), ("tp-sp", dict(tp=2, ep=1)),
                                         ("tp-cp", dict(cp=2, ep=2))],
                         ids=["tsp2-ep2", "tsp2-ep1", "tsp4-ep4", "tsp4-ep2", "tsp2-ep2-dp2", "tsp2-ep2-recompute-moe",
                              "tp2-sp-ep2", "tp2-sp-ep1", "cp2-ep2"])
def test_moe_trains_like_single_process(ranks, experts, variant, mode, kwargs):
    """TSP attention with megatron-core's MoE layers, the experts folded onto the TSP group
    (each rank's 1/D of the tokens routed by all-to-all to experts held whole), trains as the
    world=1 stock MoE model: loss and grad norm (router and load-balancing loss included) at
    every step, at every expert-parallel size (EP 1: every rank holds every expert and sees its
    own tokens); the baselines fold theirs onto TP or CP ranks."""
    path, expected = experts[variant]
    size = kwargs.pop("world", kwargs.get("tsp", 1) * kwargs.get("tp", 1) * kwargs.get("cp", 1))
    for history in ranks(size, run, mode, "modern", steps=STEPS, load=path, block_spec=True, **kwargs,
                         **MOE[variant]):
        assert_history_close(history, expected)


def test_tsp_and_tp_sp_loss_curves_match(ranks):
    tsp = ranks(2, run, "tsp", "modern", steps=STEPS, tsp=2)[0]
    tp_sp = ranks(2, run, "tp-sp", "modern", steps=STEPS, tp=2)[0]
    assert_history_close(tsp, tp_sp)


def _build_errors():
    import megatron_tsp

    megatron_tsp.initialize_model_parallel(tsp_size=4)
    messages = []
    for overrides in (dict(sequence_parallel=False), dict(attention_dropout=0.1),
                      dict(ffn_hidden_size=130), dict(num_query_groups=2),
                      dict(num_moe_experts=4, expert_model_parallel_size=4, expert_tensor_parallel_size=1),
                      dict(num_moe_experts=4, expert_model_parallel_size=4, add_bias_linear=False)):
        try:
            setup("tsp", "classic", tsp=4, init=False, **overrides)
        except ValueError as exc:
            messages.append(str(exc))
        else:
            messages.append(None)
    return messages


def test_unsupported_models_fail_at_build(ranks):
    messages = ranks(4, _build_errors)[0]
    assert "set --sequence-parallel" in messages[0]
    assert "set --attention-dropout 0" in messages[1]
    assert "--ffn-hidden-size 130 is not divisible by --tsp-size 4" in messages[2]
    assert "--num-query-groups 2 is not divisible by --tsp-size 4" in messages[3]
    # MoE through the bare layer spec would have built dense layers; experts split within a rank
    assert "layer 1 is a mixture-of-experts layer" in messages[4] and "get_gpt_block_tsp_spec" in messages[4]
    assert "--expert-tensor-parallel-size must be 1 with --tsp-size 4 (got 4)" in messages[5]
