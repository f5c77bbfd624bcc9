"""What each part of the local cloud needs from the cloud that assembles it.

cloud.py builds a LocalCloud from parts (the fleet, the routes, the glue's patches to moto, the
chaos route) and hands each the cloud, or a narrower object. A part names here only what it
uses, as a Protocol that LocalCloud satisfies by its shape, so no part imports the cloud: its
imports point one way (tests/test_import_direction.py) and it can be read, and tested, alone.

Also here, the records of injected faults that the cloud keeps and the glue reads.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from localcloud.aws_events import AwsEvent
    from localcloud.config import LocalCloudConfig
    from localcloud.event_delivery import DeliveryFailure
    from localcloud.glue.s3_rates import PrefixRates


@dataclass(frozen=True)
class RequestFault:
    """Requests to a service fail with `answer` until the monotonic time `until` (glue/faults.py)."""

    answer: str
    until: float


@dataclass
class EventFault:
    """How the next `remaining` events of some detail types are delivered (glue/events.py)."""

    kind: str
    """duplicate, delay or reorder."""
    seconds: float
    """Nominal seconds: the delay, or the window events are held for before going reversed."""
    detail_types: frozenset[str] | None
    """The detail types it applies to; None for all."""
    remaining: int
    """Events it still applies to."""
    held: list[tuple[Any, dict[str, Any]]] = field(default_factory=list, repr=False)
    """(rule, event) pairs a reorder fault holds, oldest first."""
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


# --- what several parts use -----------------------------------------------------------------

class Place(Protocol):
    """The account and region whose state is the cloud's: moto keeps each service's state per both."""

    @property
    def account_id(self) -> str: ...

    @property
    def region(self) -> str: ...


class Clock(Protocol):
    def scaled(self, nominal_seconds: float) -> float:
        """Real seconds for a nominal duration (LocalCloudConfig.time_scale)."""


class Workers(Protocol):
    """The cloud's worker threads, which outlive the request that hands them work."""

    def submit(self, description: str, work: Callable[[], Any]) -> Future | None: ...

    def submit_later(self, description: str, nominal_delay_s: float, work: Callable[[], Any]) -> threading.Timer: ...


class Counting(Protocol):
    """Adds to the cloud's counters (each part names those it counts in) while the server's threads do too."""

    def count(self, counter: Counter, key: Hashable) -> None: ...

    def note_payload(self, kind: str, size_bytes: int, what: str) -> None: ...


class Instance(Protocol):
    """One instance of the fleet, as the glue and the routes read it (LocalInstance)."""

    @property
    def instance_id(self) -> str: ...

    @property
    def hung(self) -> bool: ...

    @property
    def console_log(self) -> Path: ...


class Fleet(Protocol):
    """The fleet as the EC2 glue drives it (an instance's life follows moto's) and the chaos route
    strikes its instances (LocalFleet)."""

    def get(self, instance_id: str) -> Instance: ...

    def launched(self, moto_instance: Any) -> None: ...

    def started(self, instance_id: str) -> None: ...

    def ending(self, instance_id: str, final_state: str) -> None: ...

    def kill(self, instance_id: str) -> None: ...

    def hang(self, instance_id: str) -> None: ...

    def hang_process(self, instance_id: str, role: str) -> int: ...

    def crash_process(self, instance_id: str, role: str) -> int: ...


# --- each part's needs ----------------------------------------------------------------------

class FleetHost(Place, Workers, Protocol):
    """What the fleet (fleet.py) needs: where its instances' folders go, the settings of their
    boot and shutdown, the environment that points their SDKs at the cloud, and the bus their
    state changes go on."""

    workdir: Path

    @property
    def config(self) -> LocalCloudConfig: ...

    def env(self) -> dict[str, str]: ...

    def put_event(self, event: AwsEvent) -> str: ...

    def wait_until(self, predicate: Callable[[], bool], what: str) -> None: ...


class ChaosTarget(Place, Protocol):
    """What the chaos route (chaos_route.py) strikes: the fleet's instances, the services' requests,
    and the notices EC2 and AWS Health send."""

    @property
    def config(self) -> LocalCloudConfig: ...

    @property
    def fleet(self) -> Fleet: ...

    def fail_requests(self, service: str, seconds: float, answer: str) -> None: ...

    def inject_spot_interruption(self, instance_id: str) -> str: ...

    def inject_rebalance(self, instance_id: str) -> str: ...

    def inject_health_event(self, instance_ids: list[str]) -> str: ...


class Reachability(Protocol):
    def blocked(self, address: str | None, service: str) -> str | None:
        """Why the instance at `address` cannot reach `service`, or None (glue/routes.py)."""


class FrontDoorCloud(Counting, ChaosTarget, Protocol):
    """What the endpoint's front door (glue/faults.py) reads as it counts, fails or refuses a request,
    and serves the chaos route."""

    requests: Counter[tuple[str, str]]
    failed_requests: Counter[tuple[str, str]]
    request_faults: dict[str, RequestFault]

    @property
    def routes(self) -> Reachability: ...

    @property
    def s3_rates(self) -> PrefixRates: ...


class Ec2Cloud(Place, Clock, Protocol):
    """What the EC2 glue (glue/ec2.py) holds a launch to, and the fleet it hands instances to."""

    capacity_limits: dict[tuple[str, str], int]
    vcpu_quota: int | None

    @property
    def fleet(self) -> Fleet: ...


class EventsCloud(Counting, Workers, Protocol):
    """What EventBridge's delivery (glue/events.py) counts, records, and is faulted by."""

    requests: Counter[tuple[str, str]]
    delivery_failures: list[DeliveryFailure]

    def event_fault(self, event: dict[str, Any]) -> EventFault | None: ...


class LambdaCloud(Counting, Workers, Protocol):
    """What Lambda's invocations (glue/awslambda.py) count, run in, and are timed out by."""

    lambda_invocations: Counter[str]

    def env(self) -> dict[str, str]: ...

    def take_invocation_timeout(self, function_name: str) -> bool: ...


class QueueCloud(Counting, Clock, Protocol):
    """What an SQS event source mapping's poller (glue/sqs_lambda.py) counts and waits by."""

    requests: Counter[tuple[str, str]]
    sqs_redelivered: Counter[str]


class StatesCloud(Counting, Protocol):
    """What Step Functions' executions (glue/stepfunctions.py) count, call back and emit."""

    state_transitions: Counter[str]

    @property
    def config(self) -> LocalCloudConfig: ...

    @property
    def port(self) -> int: ...

    def put_event(self, event: AwsEvent) -> str: ...


class RunningCloud(FrontDoorCloud, Ec2Cloud, EventsCloud, LambdaCloud, QueueCloud, StatesCloud, Protocol):
    """The running cloud as moto's patches find it (glue.active_cloud): one process-wide registry
    serves every patch, so it holds what they need together; each patch's helpers name their own
    part's protocol above."""

    @property
    def endpoint(self) -> str: ...
