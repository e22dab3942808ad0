"""The synchronous engine: one sample-weighted average of the towers' gradients per step."""
