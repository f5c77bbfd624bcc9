"""The chaos protocol between `trainfleet chaos` and a running local cloud (localcloud.chaos_route).

A fault request is a JSON object {"fault", "run", "target", "seconds"} POSTed to CHAOS_PATH on
the local cloud's endpoint; the answer is a JSON object saying what was done (200), or
{"error": why not} (400).
"""

__all__ = ["CHAOS_PATH", "INSTANCE_FAULTS", "SERVICE_FAULTS"]

CHAOS_PATH = "/_localcloud/chaos"
"""The control route (moto's own control routes live under /moto-api/)."""
INSTANCE_FAULTS = ("kill", "freeze", "hang", "crash", "spot", "rebalance", "health")
"""Faults on one instance of a run: kill (it dies), freeze (all its processes stop), hang and
crash (one trainer rank stops / is killed), spot, rebalance, health (the EC2 notice or AWS
Health event for it)."""
SERVICE_FAULTS = ("throttle", "error")
"""Faults on a service (dynamodb, s3, events, lambda, ec2, states) for some seconds: every
request answers its throttling error / its internal error."""
