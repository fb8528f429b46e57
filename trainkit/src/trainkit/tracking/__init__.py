"""What a run reports: the wandb logger that never stops training, progress lines, predictions."""
