"""Calibration: measure a real machine (compute, memory, links) into a Profile the simulator reads."""
