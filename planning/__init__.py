"""Planning on top of the simulator: the scenario a command describes, sweeps over grids, and tuning."""
