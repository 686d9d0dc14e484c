"""Collective times (ms) on one link: NCCL's ring and tree algorithms, priced as its tuner prices them.

A link is a per-step latency (`latency_ms`) and a per-direction bandwidth (`bytes_per_ms`) per rank. `nbytes`
is the whole buffer: the reduced tensor of an all-reduce, the full (gathered) tensor of a reduce-scatter or
all-gather, as nccl-tests sizes them. The bandwidth terms are nccl-tests' bus-bandwidth factors
(https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md): a ring all-reduce moves 2(n-1)/n of the
buffer through every rank's link, a reduce-scatter or all-gather (n-1)/n. A double binary tree all-reduce
(NCCL's tree, all-reduce only) sends the buffer up and down the trees, 2 buffers per rank in all, in
2·log2(n) latency steps instead of the ring's 2(n-1): NCCL's tuner (src/graph/tuning.cc) takes whichever is
faster, which is the tree for small buffers over many ranks. Pure arithmetic: no torch, no simulator.
"""

from __future__ import annotations

import math

TREE_BANDWIDTH_FACTOR = 0.92  # NCCL's tuner (src/graph/tuning.cc) credits a tree 92 % of the link's bandwidth
# NCCL's tuner for its Simple protocol (src/graph/tuning.cc at b647562, baseLat, hwLat and ncclTopoGetAlgoTime):
RING_BASE_LATENCY_MS = 0.0084  # a ring collective's fixed latency
TREE_HOP_LATENCY_MS = 0.028  # a tree's latency per hop, on NVLink, PCIe and the network alike
RING_PLATEAU = 1.4  # a ring all-reduce across nodes: its latency x1.4 ("plateau effect of ring", sm80 and later)
# a tree's bandwidth by size (treeCorrectionFactor, Simple): x TREE_CORRECTION[i] for a buffer of 64·2^i to
# 64·2^(i+1) bytes (the first: below 128), x1 from 512 MiB
TREE_CORRECTION = (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9)

def _check(nbytes: float, ranks: int, bytes_per_ms: float) -> None:
    if nbytes < 0:
        raise ValueError(f"nbytes: {nbytes} is negative")
    if ranks < 1:
        raise ValueError(f"ranks: {ranks}; at least 1")
    if bytes_per_ms <= 0:
        raise ValueError(f"bytes_per_ms: {bytes_per_ms}; must be positive")


def ring_all_reduce_ms(nbytes: float, ranks: int, latency_ms: float, bytes_per_ms: float) -> float:
    """A ring all-reduce: a reduce-scatter then an all-gather, 2(n-1) steps of nbytes/n each."""
    _check(nbytes, ranks, bytes_per_ms)
    if ranks == 1:
        return 0.0
    steps = 2 * (ranks - 1)
    return steps * latency_ms + nbytes * steps / ranks / bytes_per_ms


def tree_all_reduce_ms(nbytes: float, ranks: int, latency_ms: float, bytes_per_ms: float) -> float:
    """A double binary tree all-reduce: reduce up, broadcast down, each rank sending twice the buffer
    (half on each tree, pipelined) at TREE_BANDWIDTH_FACTOR of the link, in 2·ceil(log2 n) latency steps."""
    _check(nbytes, ranks, bytes_per_ms)
    if ranks == 1:
        return 0.0
    return 2 * math.ceil(math.log2(ranks)) * latency_ms + 2 * nbytes / (TREE_BANDWIDTH_FACTOR * bytes_per_ms)


def all_reduce_ms(nbytes: float, ranks: int, latency_ms: float, bytes_per_ms: float) -> float:
    """An all-reduce as NCCL runs it: the faster of ring and tree."""
    return min(ring_all_reduce_ms(nbytes, ranks, latency_ms, bytes_per_ms),
               tree_all_reduce_ms(nbytes, ranks, latency_ms, bytes_per_ms))


def reduce_scatter_ms(nbytes: float, ranks: int, latency_ms: float, bytes_per_ms: float) -> float:
    """A ring reduce-scatter of an nbytes buffer (each rank keeps nbytes/n): n-1 steps of nbytes/n."""
    _check(nbytes, ranks, bytes_per_ms)
    if ranks == 1:
        return 0.0
    steps = ranks - 1
    return steps * latency_ms + nbytes * steps / ranks / bytes_per_ms


def all_gather_ms(nbytes: float, ranks: int, latency_ms: float, bytes_per_ms: float) -> float:
    """A ring all-gather into an nbytes buffer (each rank gives nbytes/n): the reduce-scatter's traffic reversed."""
    return reduce_scatter_ms(nbytes, ranks, latency_ms, bytes_per_ms)


def _nodes(ranks: int, per_node: int) -> int:
    """The nodes `ranks` occupy, `per_node` on each (the last may hold fewer)."""
    if per_node < 1:
        raise ValueError(f"per_node: {per_node}; at least 1")
    return math.ceil(ranks / per_node)


def nccl_all_reduce_ms(nbytes: float, ranks: int, per_node: int, node_latency_ms: float, network_latency_ms: float,
                       bytes_per_ms: float, tree_correction: bool = True) -> float:
    """An all-reduce over `ranks`, `per_node` of them on each of k nodes, as NCCL's tuner times it (Simple protocol)
    and picks the faster: a ring's base latency and 2(n-1) steps, 2k of them at the network's latency and the rest
    at the node link's, x`RING_PLATEAU` across nodes, then its bytes (`ring_all_reduce_ms`'s); a tree's
    2((n/k - 1) + log2 k) hops of `TREE_HOP_LATENCY_MS`, then its bytes (`tree_all_reduce_ms`'s) at its
    `TREE_CORRECTION` for the size (without `tree_correction`: at its full rate, a lower bound affine in the bytes
    for either algorithm, so their minimum is concave in them). Its latency grows with the ranks: the ring's in
    steps, the tree's in hops."""
    _check(nbytes, ranks, bytes_per_ms)
    if ranks == 1:
        return 0.0
    nodes, steps = _nodes(ranks, per_node), 2 * (ranks - 1)
    crossing = min(2 * nodes, steps) if nodes > 1 else 0
    ring_latency_ms = RING_BASE_LATENCY_MS + (steps - crossing) * node_latency_ms + crossing * network_latency_ms
    ring = ring_latency_ms * (RING_PLATEAU if nodes > 1 else 1.0) + nbytes * steps / ranks / bytes_per_ms
    size_class = max((int(nbytes) >> 6).bit_length() - 1, 0)  # NCCL's log2i(nBytes >> 6)
    correction = TREE_CORRECTION[size_class] if tree_correction and size_class < len(TREE_CORRECTION) else 1.0
    tree = (2 * (min(per_node, ranks) - 1 + math.log2(nodes)) * TREE_HOP_LATENCY_MS
            + 2 * nbytes / (TREE_BANDWIDTH_FACTOR * correction * bytes_per_ms))
    return min(ring, tree)


def nccl_reduce_scatter_ms(nbytes: float, ranks: int, per_node: int, node_latency_ms: float,
                           network_latency_ms: float, bytes_per_ms: float) -> float:
    """A ring reduce-scatter (or all-gather: the same traffic reversed) over `ranks`, `per_node` of them on each of k
    nodes, as NCCL's tuner times it: the base latency and n-1 steps, k-1 of them at the network's latency and the
    rest at the node link's, then `reduce_scatter_ms`'s bytes."""
    _check(nbytes, ranks, bytes_per_ms)
    if ranks == 1:
        return 0.0
    crossing, steps = _nodes(ranks, per_node) - 1, ranks - 1
    return (RING_BASE_LATENCY_MS + (steps - crossing) * node_latency_ms + crossing * network_latency_ms
            + nbytes * steps / ranks / bytes_per_ms)
