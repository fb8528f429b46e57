"""The researcher's data: LightningDataModules chosen in configs/data/*.yaml."""
