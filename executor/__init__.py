"""The executor: runs a schedule's lowered rows for real with torch, trains the model with the method's weight
semantics, and records a measured trace in the simulator's schema. Never imports the simulator; never knows a
method by name."""

from .backward import backward_input, backward_weight, full_backward
from .runners import Prelude, RunResult, run_in_process, run_multiprocess
from .runtime import DeviceLoop, DeviceResult
from .stages import (
    DivergedError,
    ExecutorError,
    RunSpec,
    StageModule,
    Stages,
    carried_bounds,
    cut,
    even_bounds,
    microbatch_data,
)
from .weights import StageWeights, Weights

__all__ = ["backward_input", "backward_weight", "carried_bounds", "cut", "DeviceLoop", "DeviceResult",
           "DivergedError", "even_bounds", "ExecutorError", "full_backward", "microbatch_data", "run_in_process",
           "Prelude", "run_multiprocess", "RunResult", "RunSpec", "StageModule", "Stages", "StageWeights", "Weights"]
