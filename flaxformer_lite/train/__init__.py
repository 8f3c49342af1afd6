"""Training: optimizer and schedules (the loop, checkpoints and metrics build on them)."""
