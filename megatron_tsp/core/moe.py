"""megatron-core's MoE layer, its experts' gradients summed over every rank that routes to them."""

from megatron.core.transformer.moe.moe_layer import MoELayer


class SequenceShardedMoELayer(MoELayer):
    """megatron's MoE layer for experts held whole by every rank of a sequence-sharded group.

    With an expert tensor-parallel size below the tensor-parallel one (TSP folds its experts
    onto the TSP group with ETP 1), each rank routes only its own shard of the sequence to its
    experts, so an expert's gradient is a partial sum: it is reduced over the expert
    data-parallel group, as expert-parallel experts' are (``allreduce`` False). megatron-core
    0.19 marks them so whenever ETP differs from TP; 0.16 only when the expert-parallel size is
    above 1, and at size 1 reduced them over the data-parallel ranks alone, which left each rank
    the gradient of its own tokens."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        if config.expert_tensor_parallel_size != config.tensor_model_parallel_size:
            for param in self.experts.parameters():
                param.allreduce = False
