"""Tiny GPT models and batches shared by the tests (built the same way for every mode)."""

import torch
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_tsp import training

VOCAB = 128
SEQ = 32
MICRO_BATCH = 2
SEED = 1234


def tiny_config(**overrides) -> TransformerConfig:
    kwargs = dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        ffn_hidden_size=128,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def batches(n, seq=SEQ, micro_batch=MICRO_BATCH, vocab=VOCAB, seed=0):
    """``n`` deterministic micro-batches; the last quarter of each sequence is masked out."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, vocab, (micro_batch, seq + 1), generator=g)
        loss_mask = torch.ones(micro_batch, seq)
        loss_mask[:, -seq // 4 :] = 0.0
        out.append(
            {
                "tokens": tokens[:, :-1].contiguous(),
                "labels": tokens[:, 1:].contiguous(),
                "loss_mask": loss_mask,
                "position_ids": torch.arange(seq).unsqueeze(0).expand(micro_batch, -1).contiguous(),
                "attention_mask": None,
            }
        )
    return out


def train(config, layer_spec, steps=3, num_microbatches=1, position_embedding_type="rope",
          use_distributed_optimizer=True, batch_transform=None, lr=1e-3):
    """Train from ``SEED`` for ``steps`` Adam steps; return [(loss, grad_norm), ...]."""
    torch.manual_seed(SEED)
    model_parallel_cuda_manual_seed(SEED)
    model = training.build_model(
        config, layer_spec, VOCAB, SEQ, position_embedding_type=position_embedding_type,
        ddp_config=DistributedDataParallelConfig(use_distributed_optimizer=use_distributed_optimizer),
    )
    optimizer = training.build_optimizer(
        model,
        OptimizerConfig(optimizer="adam", lr=lr, clip_grad=1.0, weight_decay=0.01,
                        use_distributed_optimizer=use_distributed_optimizer),
    )
    history = []
    for _ in range(steps):
        result = training.train_step(
            model, optimizer, batches(num_microbatches), num_microbatches,
            SEQ, MICRO_BATCH, batch_transform=batch_transform,
        )
        history.append((result["loss"], result["grad_norm"]))
    return history


def assert_history_close(actual, expected, rtol=1e-5):
    assert len(actual) == len(expected)
    for step, ((loss, gn), (ref_loss, ref_gn)) in enumerate(zip(actual, expected)):
        assert abs(loss - ref_loss) <= rtol * abs(ref_loss), f"step {step}: loss {loss} vs {ref_loss}"
        assert abs(gn - ref_gn) <= rtol * abs(ref_gn), f"step {step}: grad norm {gn} vs {ref_gn}"
