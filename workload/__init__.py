"""The torch workload layer shared by calibration and the executor: models (models.py), optimizers with their
weight prediction and elastic averaging (optim.py), and point-to-point transports (transport.py). Never imports
the simulator."""
