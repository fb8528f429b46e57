"""The sharded strategy (FSDP2): a model too large for one GPU, trained across every process."""
