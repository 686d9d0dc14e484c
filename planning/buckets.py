"""The distributed optimizer's gradient buckets: what of the first model chunk's reduce-scatter and all-gather is
exposed, as Megatron-core's DDP and NeMo's distributed Adam cut them.

Megatron-core's DistributedDataParallel (megatron/core/distributed/distributed_data_parallel.py, the same rule in
mid-2024's cf1d4d1 and 2026's d98e8a6) cuts a model chunk's parameters into buckets of
max(40,000,000, 1,000,000 x d) parameters where none is given, d the data-parallel ranks without the context-parallel
ones (`parallel_state.get_data_parallel_world_size()` then, the `dp_group` now) (NeMo's `ddp_bucket_size`,
unset in NVIDIA's dgxc recipes), but only on pipeline rank 0's first chunk: `disable_bucketing` for every chunk
after the first (NeMo's `setup_mcore_distributed_parallel`, Megatron's training.py) and `pp_rank > 0` each make
a chunk one bucket, which pipesim's per-stage REDUCE and GATHER rows already are. The buffer takes the parameters
in reverse order and closes a bucket once it holds at least the bucket size (param_and_grad_buffer.py); with
`overlap_grad_reduce` each bucket's reduce-scatter starts on the communication stream once its gradients are
ready in the backward, and with `overlap_param_gather` the next step's buckets are all-gathered one after another
(each dispatched when its predecessor is waited on, `finish_param_sync`), the forward of a layer waiting for its
own bucket. Pure arithmetic over the chunk's layers, a layer's parameters taken as one tensor.

NeMo's `distributed_fused_adam` (nemo/core/optim/distributed_adam.py over Apex's DistributedFusedAdam,
apex/contrib/optimizers/distributed_fused_adam.py at f9f19d5c, July 2024), the optimizer of every NVIDIA dgxc H100
recipe but Nemotron-4 15B's, groups instead (`nemo_groups`): NeMo's `MegatronGPTModel.configure_optimizers` gives it
one parameter group per virtual-pipeline chunk, or per transformer layer without one, the parameters left over
(the embedding, the output layer, norms whose gradients are reduced apart) in the model's first group; each
`init_params_bucket` call opens buckets of its own (`bucket_cap_mb` each, "Mark existings bucket as fully filled")
that all wait for the whole group's gradients and are reduce-scattered together, one `reduce_scatter_tensor` a
bucket under one `_coalescing_manager` (`_start_bucket_grad_sync`; the all-gathers alike, `_start_bucket_param_sync`),
which is one NCCL group launch. NCCL spreads a launch's collectives over its channels in proportion to their bytes
and runs them side by side (src/enqueue.cc `scheduleCollTasksToPlan`: `collInfo->nChannels = DIVUP(collInfo->workBytes
* tasks->usableChannels, totalCBDBytes)` at v2.21.5-1, `trafficPerChannel` at v2.22.3-1), so a group's buckets cost
one collective of the group's bytes, one ring latency, while its buckets are no more than the channels.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

# whose distributed optimizer cuts the collectives: Megatron-core's DDP buckets or NeMo's distributed Adam's groups
OPTIMIZER_BUCKETS = ("megatron", "nemo")
MIN_BUCKET_PARAMS = 40_000_000  # Megatron-core's default bucket_size floor (parameters)
BUCKET_PARAMS_PER_RANK = 1_000_000  # and its growth per data-parallel rank


def bucket_params(data_parallel: int) -> int:
    """Megatron-core's default bucket size in parameters for `data_parallel` (d) replicas."""
    return max(MIN_BUCKET_PARAMS, BUCKET_PARAMS_PER_RANK * data_parallel)


def nemo_groups(layers: int, chunked: bool) -> list[list[int]]:
    """NeMo's distributed Adam's parameter groups of a model stage's `layers`, in the backward's order (as `buckets`
    gives them): the whole chunk one group under a virtual pipeline (`chunked`), else a group a layer (the
    embedding's and the output layer's too, which NeMo adds to the first block's: a latency more each)."""
    order = list(reversed(range(layers)))
    return [order] if chunked else [[index] for index in order]


def buckets(layer_params: Sequence[int], size: int) -> list[list[int]]:
    """The layers' indices bucket by bucket in the backward's order: the layers taken last to first, a bucket
    closed once it holds at least `size` parameters, the rest (the first layers) in the last one."""
    out: list[list[int]] = [[]]
    held = 0
    for index in reversed(range(len(layer_params))):
        out[-1].append(index)
        held += layer_params[index]
        if held >= size and index:
            out.append([])
            held = 0
    return out


def exposed_reduce_ms(layer_bwd_ms: Sequence[float], bucketed: list[list[int]],
                      reduce_ms: Callable[[list[int]], float], persistent_products: bool = False) -> float:
    """How long the buckets' reduce-scatters add to the chunk's last backward: each starts once the backward has
    passed its bucket's layers (last to first) and the previous bucket's is done (one stream), and what runs past
    the backward's end is exposed. Where products run persistent CTAs (`Curve.persistent_products`, Hopper), a
    collective beside a product delays it by its whole time (planning/estimate.py `bulk_exposed_ms`): every
    bucket's, the sum."""
    if persistent_products:
        return sum(reduce_ms(bucket) for bucket in bucketed)
    ready_ms = done_ms = 0.0
    for bucket in bucketed:
        ready_ms += sum(layer_bwd_ms[i] for i in bucket)
        done_ms = max(done_ms, ready_ms) + reduce_ms(bucket)
    return max(done_ms - sum(layer_bwd_ms), 0.0)


def exposed_gather_ms(layer_fwd_ms: Sequence[float], bucketed: list[list[int]],
                      gather_ms: Callable[[list[int]], float], persistent_products: bool = False) -> float:
    """How long the chunk's first forward waits for its weights: the buckets all-gathered back to back in the
    forward's order (the reverse of `bucketed`), each layer's forward starting once its bucket's is done; with
    `persistent_products`, the sum of them (as `exposed_reduce_ms`)."""
    if persistent_products:
        return sum(gather_ms(bucket) for bucket in bucketed)
    gathered_ms, ready_at = 0.0, {}
    for bucket in reversed(bucketed):
        gathered_ms += gather_ms(bucket)
        ready_at.update(dict.fromkeys(bucket, gathered_ms))
    clock_ms = 0.0
    for index, ms in enumerate(layer_fwd_ms):
        clock_ms = max(clock_ms, ready_at[index]) + ms
    return clock_ms - sum(layer_fwd_ms)
