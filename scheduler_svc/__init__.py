"""The global scheduler service (`kvmesh scheduler`): admission, queues, routing, failover."""
