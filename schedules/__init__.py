"""The shared schedule vocabulary: the IR, its passes and analyses, and the method catalogue.

Imports nothing else of pipesim (and never torch), so every part can depend on it.
"""

from .analysis import Versions, check_complete, find_deadlock, local_order_ok, validate, weight_versions
from .table import KIND_CODE, KINDS, NUM_COMPUTE_KINDS, ActionTable, kind_mask
from .ir import (
    BACKWARD_KINDS,
    COMPUTE_KINDS,
    RECV_KINDS,
    SEND_KINDS,
    SYNCHRONOUS,
    Action,
    Kind,
    Read,
    Schedule,
    ScheduleError,
    StageGraph,
    WeightPolicy,
    Prediction,
    evaluate_formula,
)
from .catalogue import METHODS, build_schedule
from .methods import Method, ScheduleParams, make_schedule, one_forward_one_backward
from .passes import add_communication, communication_table

__all__ = [
    "KIND_CODE", "KINDS", "kind_mask", "NUM_COMPUTE_KINDS", "ActionTable", "local_order_ok",
    "BACKWARD_KINDS", "COMPUTE_KINDS", "RECV_KINDS", "SEND_KINDS", "SYNCHRONOUS", "METHODS",
    "Action", "Kind", "Method", "Read", "Schedule", "ScheduleError", "ScheduleParams", "StageGraph",
    "Versions", "WeightPolicy", "Prediction", "evaluate_formula", "add_communication", "build_schedule", "check_complete", "find_deadlock",
    "communication_table", "make_schedule", "one_forward_one_backward", "validate", "weight_versions",
]
