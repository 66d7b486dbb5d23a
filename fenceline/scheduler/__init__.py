"""Scheduler sweeps: one module per sweep, each single-runner across replicas."""
