"""Megatron-style tensor and sequence parallelism with DTensor, applied to the unmodified model.

* attention: wq, wk, wv column-parallel (each rank holds n_heads/tp query heads and
  n_kv_heads/tp key/value heads), wo row-parallel;
* SwiGLU: w1, w3 column-parallel, w2 row-parallel;
* vocabulary-parallel embedding (rows) and output (columns), the output left
  sharded on the vocabulary for loss-parallel cross-entropy (gathered under
  pipeline parallelism);
* sequence parallelism: activations between blocks and the norms are sharded on
  the sequence, gathered before attention and the MLP, reduce-scattered after.
"""

from __future__ import annotations

import contextlib

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)


def apply_tp(model, tp_mesh, loss_parallel: bool = True) -> None:
    """``loss_parallel=False`` gathers the logits (pipeline stages run backward outside the loss-parallel
    context, where vocabulary-sharded logits cannot meet a plain gradient)."""
    output = (ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False) if loss_parallel
              else ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()))
    plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": output,
    }
    # a pipeline stage may hold neither the embedding nor the head
    parallelize_module(model, tp_mesh, {k: v for k, v in plan.items() if getattr(model, k) is not None})
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None, None),
                                            desired_input_layouts=(Replicate(), None, None, None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        })
    if model.config.tie_embeddings and model.tok_embeddings is not None and model.output is not None:
        model.output.weight = model.tok_embeddings.weight  # both Shard(0) on the vocabulary


def loss_context(tp_enabled: bool):
    """Cross-entropy on vocabulary-sharded logits without gathering them."""
    return loss_parallel() if tp_enabled else contextlib.nullcontext()
