"""The researcher's models: LightningModules chosen in configs/model/*.yaml."""
