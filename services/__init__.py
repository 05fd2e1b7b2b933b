"""What every kvmesh service shares: config, typed messages, transport, registry, metrics, CLI."""
