"""The torch workload layer shared by calibration and the executor: models, optimizers with their weight
prediction and elastic averaging, and point-to-point transports. Never imports the simulator."""
