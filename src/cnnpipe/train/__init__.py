"""Training: the parts of a run (parts), the step (engine), the loop with checkpoints and resume
(trainer), the LR schedule, precision, the tuned and budgeted settings a run applies, DDP and torchrun,
and loading a trained model back."""
