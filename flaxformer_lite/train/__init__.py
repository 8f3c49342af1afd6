"""Training: the typed run configuration, the optimizer and schedules (the loop, checkpoints
and metrics build on them)."""
