"""What a run reports: the wandb logger that never stops training, its record (config, provenance), progress
lines, predictions."""
