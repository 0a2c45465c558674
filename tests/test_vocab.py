"""TSP's vocabulary layouts (core/vocab.py): which one ``auto`` takes, and one-line refusals.
That both train as world=1 megatron-core is test_gpt's; their bytes, test_volumes'."""

import pytest
import torch

from megatron_tsp.core import vocab

H = 4096


@pytest.mark.parametrize("vocab_size,tokens,dtype,expected", [
    (32_000, 131_072, torch.bfloat16, "table"),  # the paper's 7B at 128K
    (128_256, 8_192, torch.bfloat16, "sequence"),  # a large vocabulary at a short sequence
    (256, 4_096, torch.float32, "table"),  # the CPU benchmark
    (512, 128, torch.float32, "sequence"),
])
def test_auto_takes_the_layout_that_moves_fewer_bytes(vocab_size, tokens, dtype, expected):
    assert vocab.choose("auto", vocab_size, H, tokens, 8, dtype) == expected
    table, sequence = (vocab.traffic(layout, vocab_size, H, tokens, 8, dtype) for layout in ("table", "sequence"))
    assert (table < sequence) == (expected == "table")


def test_a_chosen_layout_is_kept_and_one_rank_moves_nothing():
    assert vocab.choose("table", 128_256, H, 128, 8, torch.bfloat16) == "table"
    assert vocab.choose("sequence", 256, H, 1 << 20, 8, torch.bfloat16) == "sequence"
    assert vocab.choose("auto", 256, H, 1 << 20, 1, torch.bfloat16) == "sequence"
    assert vocab.traffic("table", 256, H, 1 << 20, 1, torch.bfloat16) == 0


def test_an_unknown_layout_is_one_line():
    with pytest.raises(ValueError, match="tsp_vocab must be one of auto, table, sequence"):
        vocab.choose("rows", 256, H, 1024, 2, torch.float32)


def _bare(cls, **attributes):
    """An instance of a megatron class that skipped its ``__init__`` (no process groups)."""
    module = object.__new__(cls)
    torch.nn.Module.__init__(module)
    for name, value in attributes.items():
        setattr(module, name, value)
    return module


def _last_stage(cls=None, **config):
    """The last pipeline stage of a 7B TSP8 GPTModel, as far as apply_vocab_layout reads it."""
    from types import SimpleNamespace

    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    return _bare(cls or GPTModel, config=SimpleNamespace(hidden_size=H, params_dtype=torch.bfloat16, **config),
                 vocab_size=32_768, pg_collection=SimpleNamespace(tp=SimpleNamespace(size=lambda: 8)),
                 pre_process=False, post_process=True, mtp_process=False, max_sequence_length=131_072,
                 position_embedding_type="rope", output_layer=_bare(ColumnParallelLinear, bias=None))


def test_what_needs_megatrons_layers_keeps_them_under_auto_and_is_one_line_under_table():
    from megatron.core.models.gpt import GPTModel

    assert vocab.table_blocker(_last_stage()) is None
    model = _last_stage(defer_embedding_wgrad_compute=True)
    assert vocab.apply_vocab_layout(model, "auto", tokens=131_072) == "sequence"
    with pytest.raises(ValueError, match="^--tsp-vocab table cannot be used with --defer-embedding-wgrad-compute"):
        vocab.apply_vocab_layout(model, "table")
    custom = _last_stage(type("MyGPT", (GPTModel,), {}))  # the layout replaces megatron's classes only
    assert vocab.apply_vocab_layout(custom, "auto", tokens=131_072) == "sequence"
    with pytest.raises(ValueError, match="cannot be used with MyGPT"):
        vocab.apply_vocab_layout(custom, "table")
    with pytest.raises(ValueError, match="auto needs tokens"):
        vocab.apply_vocab_layout(_last_stage(), "auto")
