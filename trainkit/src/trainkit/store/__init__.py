"""The object store (S3 and compatible): a client for a bucket, and a run lock kept in it."""
