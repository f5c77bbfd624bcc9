"""Hot spares at the start of an attempt: a READY spare takes a late worker's place.

AwaitNodes waits for the plan's workers to confirm for the attempt. When its late-worker
deadline passes (RecoveryPolicy.late_worker_seconds), swap_late_workers() pairs the workers that
have not confirmed with the spares that have, so the attempt starts without them:
    1. a worker still booting or in preflight (LAUNCHED, REGISTERED) becomes a spare: it is only
       slow, and will be a READY spare once it passes preflight;
    2. a worker that passed preflight before but has not confirmed this attempt went silent (its
       agent confirms at every look at the run): it is released, since a spare that never answers
       would only be promoted and waited for again;
    3. the silent ones are swapped first (they will not come), then those furthest from ready.
Spares count only once confirmed for the attempt themselves: a frozen spare cannot step in.
"""

from trainfleet.core.lifecycle.launch import confirmed
from trainfleet.core.records import LateWorkerSwap, NodeRecord, NodeRole, NodeState

# Swap order: silent first, then by how far from ready.
_LATENESS = {NodeState.READY: 0, NodeState.LAUNCHED: 1, NodeState.REGISTERED: 2}


def swap_late_workers(nodes: list[NodeRecord], attempt: int) -> LateWorkerSwap:
    """Which READY spares take the places of the workers not confirmed for `attempt`."""
    late = sorted((node for node in nodes if node.role is NodeRole.WORKER and node.state in _LATENESS
                   and not confirmed(node, attempt)),
                  key=lambda node: (_LATENESS[node.state], node.instance_id))
    spares = sorted(node.instance_id for node in nodes if node.role is NodeRole.SPARE and confirmed(node, attempt))
    swapped = late[:len(spares)]
    return LateWorkerSwap(
        promote_spare_ids=spares[:len(swapped)],
        demote_worker_ids=[node.instance_id for node in swapped if node.state is not NodeState.READY],
        release_instance_ids=[node.instance_id for node in swapped if node.state is NodeState.READY])
