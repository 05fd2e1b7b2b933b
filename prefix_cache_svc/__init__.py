"""The cluster-wide prefix-cache index (`kvmesh prefix-cache`); protocol and rules in docs/kv_events.md.

    radix_index  the in-memory index: block chains -> {worker: tiers}, longest-prefix walks
    core         pure rules: event batches, gaps, epochs, snapshots, consistency checks, Match
    store        Redis as the store of record (ownership keys, reload, purge)
    main         the process shell: registry discovery, ZMQ SUB, snapshots, gRPC Match, metrics

Its callers use services/prefix_client.py (PrefixClient: Match with a short deadline, fails open);
the scheduler weighs the answer against load in scheduler_svc/routing.py.
"""
