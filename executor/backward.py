"""Backward passes of one stage: full (B), and split into an input-gradient half (I) and a weight-gradient
half (W) that does not redo the input half's work.

Split without recomputation: I walks the graph from the stage's output to its input only, so autograd skips
every weight-gradient product; on the way it records, at each node of that path that also feeds weights (an
"anchor": a linear layer's matmul, a norm, a bias add), the gradient arriving at the node. W starts from those
anchors with the recorded gradients and asks only for the weights, so it runs just the weight-side products.
Two plain `autograd.grad` calls (one for the input, one for the weights, both from the output) would walk the
input chain twice.

Weight gradients are added into the mini-batch's gradient buffer during the pass, as autograd adds into `.grad`:
each is freed as soon as it is added. Taking them all first and adding them after held a whole stage's fresh
gradients at once; freed together, glibc handed that block back to the OS and faulted it in again at the next
backward (four times the page faults of torch's runtime, and 20 % slower steps on two CPU ranks).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge


def _grads(outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
           grad_outputs: Sequence[torch.Tensor | None], *, retain_graph: bool = False) -> list[torch.Tensor]:
    grads = torch.autograd.grad(outputs, inputs, grad_outputs, retain_graph=retain_graph, allow_unused=True)
    return [torch.zeros_like(i) if g is None else g for i, g in zip(inputs, grads)]


def _accumulate(tensors: Sequence[Any], grad_tensors: Sequence[torch.Tensor | None], leaves: Sequence[torch.Tensor],
                slots: Sequence[torch.Tensor | None], main: torch.dtype | None = None,
                mains: int = 0) -> list[torch.Tensor | None]:
    """Backward from `tensors` (tensors or gradient edges), adding each leaf's gradient in place into its slot
    (None: the gradient becomes the slot); the slots after it. The leaves' own `.grad` is left as it was. With
    `main`, the first `mains` leaves' slots hold their gradients in that dtype (mixed precision's float32 main
    gradients of 16-bit weights): each gradient is added in as autograd makes it and freed at once, as Megatron-LM's
    gradient hook does (`param.main_grad.add_(param.grad)`), not held until the pass ends."""
    kept = [leaf.grad for leaf in leaves]
    found = list(slots)
    widened = range(mains if main is not None else 0)
    handles = []

    def add_into(i: int) -> Callable[[torch.Tensor], None]:
        def add(leaf: torch.Tensor) -> None:
            grad, leaf.grad = leaf.grad, None
            found[i] = grad.to(main) if found[i] is None else found[i].add_(grad)
        return add
    try:
        for i, (leaf, slot) in enumerate(zip(leaves, slots)):
            leaf.grad = None if i in widened else slot
        handles = [leaves[i].register_post_accumulate_grad_hook(add_into(i)) for i in widened]
        torch.autograd.backward(list(tensors), list(grad_tensors), inputs=list(leaves))
        return [found[i] if i in widened else leaf.grad for i, leaf in enumerate(leaves)]
    finally:
        for handle in handles:
            handle.remove()
        for leaf, grad in zip(leaves, kept):
            leaf.grad = grad


def _wanted(inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [x for x in inputs if x.requires_grad]


def _aligned(inputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    found = iter(grads)
    return [next(found) if x.requires_grad else None for x in inputs]


def full_backward(outputs: Sequence[torch.Tensor], grad_outputs: Sequence[torch.Tensor | None],
                  inputs: Sequence[torch.Tensor], weights: Sequence[torch.Tensor],
                  into: list[torch.Tensor | None], main: torch.dtype | None = None) -> list[torch.Tensor | None]:
    """B: per input, its gradient (None for one that needs none); the gradients of `weights` are added into
    `into` (one slot per weight, None: nothing added yet; a weight the stage does not use adds nothing), in
    dtype `main` where given (None: the weights'). `outputs` are the stage's outputs (with `grad_outputs`) or the
    last stage's scalar loss ([None])."""
    wanted = _wanted(inputs)
    found = _accumulate(outputs, grad_outputs, [*weights, *wanted], [*into, *[None] * len(wanted)], main,
                        len(weights))
    into[:] = found[:len(weights)]
    dxs = [torch.zeros_like(x) if g is None else g for x, g in zip(wanted, found[len(weights):])]
    return _aligned(inputs, dxs)


@dataclass(eq=False)
class _Group:
    """Weights whose gradients start from the same anchors, and what I recorded arriving at each anchor."""

    anchors: list[Any]  # autograd Nodes
    weights: list[int]  # indices into the stage's weights
    arrived: list[tuple[torch.Tensor | None, ...] | None] = field(default_factory=list)


@dataclass
class PendingWeightGrad:
    """What I leaves for W: the anchor groups, or, when the stage has no input gradient to compute, the whole
    graph (`outputs`, `grad_outputs`) for W to walk."""

    groups: list[_Group]
    outputs: Sequence[torch.Tensor] = ()
    grad_outputs: Sequence[torch.Tensor | None] = ()

    def gradients(self) -> list[torch.Tensor]:
        """The gradients I recorded arriving at the anchors, which W starts from: held beside the graph until W."""
        return [grad for group in self.groups for arrived in group.arrived
                for grad in arrived or () if grad is not None]


def _node(t: torch.Tensor) -> Any:
    return get_gradient_edge(t).node


def _anchor_groups(roots: list[Any], x_nodes: list[Any], weight_nodes: list[Any]) -> list[_Group] | None:
    """Group the weights by the nodes of the output-to-input paths where their gradients branch off; None when
    some weight's gradient does not meet those paths (W then walks the whole graph)."""
    children: dict[Any, list[Any]] = {}
    parents: dict[Any, list[Any]] = {}
    stack, seen = list(set(roots)), set(roots)
    while stack:
        node = stack.pop()
        kids = [fn for fn, _ in node.next_functions if fn is not None]
        children[node] = kids
        for kid in kids:
            parents.setdefault(kid, []).append(node)
            if kid not in seen:
                seen.add(kid)
                stack.append(kid)
    reached = [node for node in x_nodes if node in seen]
    if not reached:
        return None
    on_path = set(reached)  # nodes the inputs' gradients flow through: the inputs' ancestors
    stack = list(reached)
    while stack:
        for parent in parents.get(stack.pop(), ()):
            if parent not in on_path:
                on_path.add(parent)
                stack.append(parent)
    group_of: dict[Any, _Group] = {}
    groups: list[_Group] = []
    for index, weight_node in enumerate(weight_nodes):
        if weight_node not in seen:
            continue  # unused weight: its gradient is zero
        anchors, stack, visited = set(), [weight_node], {weight_node}
        while stack:  # climb from the weight until the input path is met
            for parent in parents.get(stack.pop(), ()):
                if parent in on_path:
                    anchors.add(parent)
                elif parent not in visited:
                    visited.add(parent)
                    stack.append(parent)
        if not anchors:
            return None
        merged = {id(group_of[a]): group_of[a] for a in anchors if a in group_of}
        group = _Group(sorted(anchors, key=id), [index])
        for other in merged.values():
            group.anchors = list({*group.anchors, *other.anchors})
            group.weights += other.weights
            groups = [g for g in groups if g is not other]
        groups.append(group)
        for anchor in group.anchors:
            group_of[anchor] = group
    return groups


def backward_input(outputs: Sequence[torch.Tensor], grad_outputs: Sequence[torch.Tensor | None],
                   inputs: Sequence[torch.Tensor], weights: Sequence[torch.Tensor]
                   ) -> tuple[list[torch.Tensor | None], PendingWeightGrad]:
    """I: per input, its gradient (None for one that needs none), and what W needs to finish the weights'
    gradients without walking the input chain again."""
    wanted = _wanted(inputs)
    if not wanted:
        return [None] * len(inputs), PendingWeightGrad([], outputs, grad_outputs)
    roots = [o.grad_fn for o in outputs]
    groups = (_anchor_groups(roots, [_node(x) for x in wanted], [_node(w) for w in weights])
              if all(root is not None for root in roots) else None)
    if groups is None:
        dx = _grads(outputs, wanted, grad_outputs, retain_graph=True)
        return _aligned(inputs, dx), PendingWeightGrad([], outputs, grad_outputs)
    handles = []
    try:
        for group in groups:
            group.arrived = [None] * len(group.anchors)
            for i, anchor in enumerate(group.anchors):
                def record(grad_outputs: tuple[torch.Tensor | None, ...], group: _Group = group, i: int = i) -> None:
                    group.arrived[i] = tuple(grad_outputs)
                handles.append(anchor.register_prehook(record))
        dx = _grads(outputs, wanted, grad_outputs, retain_graph=True)
    finally:
        for handle in handles:
            handle.remove()
    return _aligned(inputs, dx), PendingWeightGrad(groups)


def backward_weight(pending: PendingWeightGrad, weights: Sequence[torch.Tensor],
                    into: list[torch.Tensor | None], main: torch.dtype | None = None) -> None:
    """W: the weights' gradients from what I left, added into `into` as `full_backward` adds them."""
    if pending.outputs:
        into[:] = _accumulate(pending.outputs, pending.grad_outputs, weights, into, main, len(weights))
    for group in pending.groups:
        edges, grads = [], []
        for anchor, arrived in zip(group.anchors, group.arrived):
            for nr, grad in enumerate(arrived or ()):
                if grad is not None:
                    edges.append(GradientEdge(anchor, nr))
                    grads.append(grad)
        handles = []
        if len(group.anchors) > 1:  # an anchor below another would get the upper one's gradient twice: pin it
            for anchor, arrived in zip(group.anchors, group.arrived):
                handles.append(anchor.register_prehook(lambda _, arrived=arrived: arrived))
        try:
            if edges:
                found = _accumulate(edges, grads, [weights[i] for i in group.weights], [into[i] for i in group.weights],
                                    main, len(group.weights))
                for i, grad in zip(group.weights, found):
                    into[i] = grad
        finally:
            for handle in handles:
                handle.remove()
    pending.groups, pending.outputs, pending.grad_outputs = [], (), ()
