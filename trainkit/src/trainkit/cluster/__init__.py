"""Where the job runs: the platform's variables read and checked, and the ClusterEnvironment for Lightning."""
