"""pipesim: predict, run and compare pipeline-parallel training schedules."""

__version__ = "0.1.0"
