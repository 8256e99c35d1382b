"""Tensor parallelism inside one worker (`--tp-size N`): the model's every layer split over N ranks
(processes, one device each), SGLang's layout:

    q/k/v, gate/up      column-parallel: each rank computes its heads / its slice of the MLP
    o, down, experts    row-parallel: partial sums, one all-reduce each
    embedding, LM head  vocab-parallel: each rank holds 1/N of the rows; the embedding's lookups are
                        all-reduced, the logits all-gathered
    KV cache            each rank stores its KV heads (replicated when there are fewer than ranks)

Rank 0 is the worker: it runs the scheduler (batches, radix cache, sampling) and drives the others
(`followers.py`), which only run forwards on what it sends. `shard.py` says which slice of each
tensor a rank holds; `group.py` is the collectives (gloo on CPU, NCCL on CUDA)."""
