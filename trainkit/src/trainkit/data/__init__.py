"""Data loading the kit adds to any DataModule: exact mid-epoch resume, and chunks to stream from."""
