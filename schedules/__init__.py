"""The shared schedule vocabulary: the IR, its passes and analyses, and the method catalogue.

Imports nothing else of pipesim (and never torch), so every part can depend on it.
"""

from .analysis import (
    Versions,
    check_complete,
    find_deadlock,
    flushes,
    local_order_ok,
    peak_per_stage,
    resting_copies,
    steady_minibatches,
    validate,
    version_reads,
    warmup_minibatches,
    weight_versions,
)
from .catalogue import METHODS, build_schedule
from .ir import (
    ALL_TO_ALL_KINDS,
    BACKWARD_KINDS,
    COLLECTIVE_KINDS,
    COMPUTE_KINDS,
    PASS_COLLECTIVE_KINDS,
    RECV_KINDS,
    RING_KINDS,
    SEND_KINDS,
    SYNCHRONOUS,
    Action,
    Kind,
    Prediction,
    Read,
    Schedule,
    ScheduleError,
    StageGraph,
    WeightPolicy,
    evaluate_formula,
)
from .lowering import Channel, Lowered, check_transfer_order, lower, preflight
from .methods import Method, ScheduleParams, make_schedule
from .passes import (
    add_communication,
    add_context_parallel,
    add_data_parallel,
    add_expert_parallel,
    communication_table,
)
from .table import KIND_CODE, KINDS, NUM_COMPUTE_KINDS, ActionTable, kind_mask

__all__ = [
    "Action", "ActionTable", "ALL_TO_ALL_KINDS", "add_communication", "add_context_parallel", "add_data_parallel",
    "add_expert_parallel", "BACKWARD_KINDS", "build_schedule", "Channel",
    "check_complete", "check_transfer_order", "COLLECTIVE_KINDS", "communication_table", "COMPUTE_KINDS",
    "evaluate_formula", "find_deadlock", "flushes",
    "Kind", "KIND_CODE", "kind_mask", "KINDS", "local_order_ok", "lower", "Lowered", "make_schedule", "Method",
    "METHODS", "NUM_COMPUTE_KINDS", "PASS_COLLECTIVE_KINDS", "peak_per_stage", "Prediction", "preflight",
    "Read", "RECV_KINDS", "RING_KINDS",
    "Schedule", "ScheduleError", "ScheduleParams", "SEND_KINDS", "StageGraph", "steady_minibatches", "SYNCHRONOUS",
    "resting_copies", "validate", "version_reads", "Versions", "warmup_minibatches", "weight_versions", "WeightPolicy",
]
