"""`specq autoscale`: keep between min and max local workers, sized to the backlog.

- `config.py`: AutoscaleConfig, one frozen dataclass, validated;
- `policy.py`: the decision, pure (backlog, running workers, time -> wanted workers), unit-tested;
- `supervisor.py`: the worker processes (start on a device, SIGTERM, SIGKILL after a grace, reap);
- `loop.py`: reads the backlog from the database every interval, decides, applies, logs one line.

Kubernetes users get the same policy from KEDA (`deploy/k8s/`): scale on the backlog, to zero when idle.
"""
