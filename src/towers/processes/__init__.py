"""Processes: local workers (``towers.spawn``), ``towers run``, and the torchrun environment."""
