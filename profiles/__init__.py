"""Calibration profiles as data: the schema, the partitioner and the piecewise link fit.

Pure Python with pydantic and numpy, never torch or simpy, so the simulator, the planners and the executor
read profiles without importing measurement code.
"""
