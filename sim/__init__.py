"""The discrete-event simulator: schedules + costs + cluster -> predicted trace. Never imports torch."""

from .cluster import Cluster, ClusterError, Link, load_cluster
from .costs import OPTIMIZER_STATE_FACTOR, CostError, Costs, StageCosts
from .engine import SimulationError, simulate

__all__ = ["OPTIMIZER_STATE_FACTOR", "Cluster", "ClusterError", "CostError", "Costs", "Link", "SimulationError",
           "StageCosts", "load_cluster", "simulate"]
