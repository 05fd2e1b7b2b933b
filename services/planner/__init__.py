"""`kvmesh planner`: scales the prefill and decode pools (Deployments or StatefulSets) from SLO signals.

    decide.py   the decision (pure): signals and replicas in, replicas out, with hysteresis
    signals.py  the signals, from Prometheus' HTTP API or the pods' /metrics pages
    kube.py     a Deployment's or StatefulSet's scale subresource, read and patched (the `kubernetes` client)
    main.py     the process: config, the loop, signals, its own /metrics
"""
