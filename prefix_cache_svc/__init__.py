"""The cluster-wide prefix-cache index (`kvmesh prefix-cache`); protocol and rules in docs/kv_events.md.

    radix_index  the in-memory index: block chains -> {worker: tiers}, longest-prefix walks
    core         pure rules: event batches, gaps, epochs, snapshots, consistency checks, Match
    store        Redis as the store of record (ownership keys, reload, purge)
    main         the process shell: registry discovery, ZMQ SUB, snapshots, gRPC Match, metrics
    client       PrefixClient for the scheduler (short deadline, fails open)
    routing      pure scoring of workers by expected prefix hit against load
"""
