"""The worker service: the process shell around one Engine (`kvmesh worker`)."""
