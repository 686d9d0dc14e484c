"""Collective times (ms) on one link: NCCL's ring and tree algorithms, priced as its tuner prices them.

A link is a per-step latency (`latency_ms`) and a per-direction bandwidth (`bytes_per_ms`) per rank. `nbytes`
is the whole buffer: the reduced tensor of an all-reduce, the full (gathered) tensor of a reduce-scatter or
all-gather, as nccl-tests sizes them. The bandwidth terms are nccl-tests' bus-bandwidth factors
(https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md): a ring all-reduce moves 2(n-1)/n of the
buffer through every rank's link, a reduce-scatter or all-gather (n-1)/n. A double binary tree all-reduce
(NCCL's tree, all-reduce only) sends the buffer up and down the trees, 2 buffers per rank in all, in
2·log2(n) latency steps instead of the ring's 2(n-1): NCCL's tuner (src/graph/tuning.cc) takes whichever is
faster, which is the tree for small buffers over many ranks, and for a few bytes (an amax, a loss) its LL
protocol, whose latency alone counts (`nccl_ll_all_reduce_ms`). Pure arithmetic: no torch, no simulator.
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
# Its LL protocol, which it picks for small buffers (8-byte lines of 4 data bytes and a flag: no fence a step, a
# fraction of the link), in the same tuner: base latency, then per step of a ring or hop of a tree on the node's
# link and on the network (baseLat, hwLat), a ring's in-node steps of an inter-node ring no shorter than the host's
# network post (getNetOverhead: 1 us on x86 Intel hosts, as DGX H100's Xeons); busBw x1/4 on a ring across nodes or
# in an all-reduce, a tree's x0.92/3.8, at most llMaxBws' rate for 1, 2, more nodes (Hopper alone, Intel hosts);
# a tree's bandwidth by size treeCorrectionFactor's LL row
LL_BASE_LATENCY_MS = {"ring": 0.0066, "tree": 0.0068}
LL_NODE_HOP_MS = {"nvlink": 0.0006, "xgmi": 0.0006, "pcie": 0.001}
LL_NETWORK_HOP_MS = {"ring": 0.0027, "tree": 0.005}
NET_OVERHEAD_MS = 0.001
LL_BANDWIDTH_FACTOR = {"ring": 1 / 4, "tree": 0.92 / 3.8}
LL_MAX_BYTES_PER_MS = (87.7e6, 39.0e6, 20.4e6)
LL_TREE_CORRECTION = (1., 1., 1., 1., .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1., 1., 1., 1.)

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
                       bytes_per_ms: float, tree_correction: bool = True, node_link: str = "nvlink") -> float:
    """An all-reduce over `ranks`, `per_node` of them on each of k nodes, as NCCL's tuner times it (Simple protocol)
    and picks the faster: a ring's base latency and 2(n-1) steps, 2k of them at the network's latency and the rest
    at the node link's, x`RING_PLATEAU` across nodes, then its bytes (`ring_all_reduce_ms`'s); a tree's
    2((n/k - 1) + log2 k) hops of `TREE_HOP_LATENCY_MS`, then its bytes (`tree_all_reduce_ms`'s) at its
    `TREE_CORRECTION` for the size (without `tree_correction`: at its full rate, a lower bound affine in the bytes
    for either algorithm, so their minimum is concave in them). Its latency grows with the ranks: the ring's in
    steps, the tree's in hops. A small buffer takes the LL protocol instead where it is faster
    (`nccl_ll_all_reduce_ms`, over a `node_link` node)."""
    _check(nbytes, ranks, bytes_per_ms)
    if ranks == 1:
        return 0.0
    nodes, steps = _nodes(ranks, per_node), 2 * (ranks - 1)
    crossing = min(2 * nodes, steps) if nodes > 1 else 0
    ring_latency_ms = RING_BASE_LATENCY_MS + (steps - crossing) * node_latency_ms + crossing * network_latency_ms
    ring = ring_latency_ms * (RING_PLATEAU if nodes > 1 else 1.0) + nbytes * steps / ranks / bytes_per_ms
    correction = _tree_correction(TREE_CORRECTION, nbytes) if tree_correction else 1.0
    tree = (2 * (min(per_node, ranks) - 1 + math.log2(nodes)) * TREE_HOP_LATENCY_MS
            + 2 * nbytes / (TREE_BANDWIDTH_FACTOR * correction * bytes_per_ms))
    return min(ring, tree, nccl_ll_all_reduce_ms(nbytes, ranks, per_node, bytes_per_ms, node_link, tree_correction))


def _tree_correction(row: tuple[float, ...], nbytes: float) -> float:
    """NCCL's correction of a tree's bandwidth for a buffer of nbytes: the row's entry at log2i(nBytes >> 6), x1
    past its end."""
    size_class = max((int(nbytes) >> 6).bit_length() - 1, 0)
    return row[size_class] if size_class < len(row) else 1.0


def nccl_ll_all_reduce_ms(nbytes: float, ranks: int, per_node: int, bytes_per_ms: float, node_link: str = "nvlink",
                          tree_correction: bool = True) -> float:
    """An all-reduce over `ranks`, `per_node` of them on each of k nodes, on NCCL's LL protocol as its tuner times it,
    the faster of ring and tree: the ring's base latency and 2(n-1) steps, 2k of them across nodes; the tree's
    2((n/k - 1) hops on the node's link + log2i(k) on the network); then the bytes at the protocol's share of the
    link (`LL_BANDWIDTH_FACTOR`, at most `LL_MAX_BYTES_PER_MS`). What a few bytes (an amax, a loss) cost: the tree's
    latency, which grows with log2 of the nodes."""
    _check(nbytes, ranks, bytes_per_ms)
    if ranks == 1:
        return 0.0
    nodes, steps, local = _nodes(ranks, per_node), 2 * (ranks - 1), min(per_node, ranks)
    crossing = min(2 * nodes, steps) if nodes > 1 else 0
    node_hop_ms = LL_NODE_HOP_MS[node_link]
    ring_step_ms = max(node_hop_ms, NET_OVERHEAD_MS) if nodes > 1 else node_hop_ms
    cap = LL_MAX_BYTES_PER_MS[min(nodes, len(LL_MAX_BYTES_PER_MS)) - 1]
    ring = (LL_BASE_LATENCY_MS["ring"] + (steps - crossing) * ring_step_ms + crossing * LL_NETWORK_HOP_MS["ring"]
            + nbytes * steps / ranks / min(LL_BANDWIDTH_FACTOR["ring"] * bytes_per_ms, cap))
    correction = _tree_correction(LL_TREE_CORRECTION, nbytes) if tree_correction else 1.0
    tree_hops_ms = (local - 1) * node_hop_ms + (nodes.bit_length() - 1) * LL_NETWORK_HOP_MS["tree"]
    tree = (LL_BASE_LATENCY_MS["tree"] + 2 * tree_hops_ms
            + 2 * nbytes / (correction * min(LL_BANDWIDTH_FACTOR["tree"] * bytes_per_ms, cap)))
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
