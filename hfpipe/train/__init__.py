"""Training: optimiser and LR schedule, exact gradient handling, the step, and the run loop."""
