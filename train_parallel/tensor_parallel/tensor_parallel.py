"""Megatron-style tensor and sequence parallelism with DTensor, applied to the unmodified model.

* attention: wq, wk, wv column-parallel (each rank holds n_heads/tp query heads and
  n_kv_heads/tp key/value heads; q/k/v biases are split with their output columns), wo
  row-parallel (its bias replicated and added once, after the partial sums);
* per-head q/k norms (Qwen3): one head_dim weight serves every head, so it is replicated
  and each rank normalises its own heads (the weight's gradient is summed over ranks);
* the attention core (sliding windows, soft-capping, the attention scale) runs unchanged
  on whole sequences of the local heads;
* SwiGLU / GeGLU: w1, w3 column-parallel, w2 row-parallel;
* vocabulary-parallel embedding (rows) and output (columns), the output left
  sharded on the vocabulary for loss-parallel cross-entropy (gathered under
  pipeline parallelism);
* sequence parallelism: activations between blocks and the norms are sharded on
  the sequence, gathered before attention and the MLP, reduce-scattered after; post
  norms (Gemma 2) run on those sequence-sharded branch outputs. Gemma's embedding scale
  and the final logit soft-cap are elementwise, so they apply to sharded activations and
  vocabulary-sharded logits (under loss_parallel) as they are.

Mixture-of-experts blocks train with data and expert parallelism, not here
(``ParallelDims.validate_model`` refuses --tp / --pp for them).
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


def _has(module, path: str) -> bool:
    """Whether ``module`` holds a submodule at ``path`` (variants add q/k and post norms; the rest are None)."""
    for name in path.split("."):
        module = getattr(module, name, None)
        if module is None:
            return False
    return True


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
        plan = {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None, None),
                                            desired_input_layouts=(Replicate(), None, None, None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            # per-head q/k norms (Qwen3) act on this rank's heads (dim 2 of (batch, seq, heads, head_dim)):
            # the weight is replicated and its gradient summed over the ranks' heads
            "attention.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
            "attention.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
            # post norms (Gemma 2) on the sequence-sharded branch outputs, before the residual add
            "attention_post_norm": SequenceParallel(use_local_output=True),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
            "ffn_post_norm": SequenceParallel(use_local_output=True),
        }
        parallelize_module(block, tp_mesh, {k: v for k, v in plan.items() if _has(block, k)})
    if model.config.tie_embeddings and model.tok_embeddings is not None and model.output is not None:
        model.output.weight = model.tok_embeddings.weight  # both Shard(0) on the vocabulary


def loss_context(tp_enabled: bool):
    """Cross-entropy on vocabulary-sharded logits without gathering them."""
    return loss_parallel() if tp_enabled else contextlib.nullcontext()
