"""LocalCloud: moto's HTTP server plus the glue, started and stopped as one object."""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple, NoReturn

import boto3
from aws_xray_sdk import global_sdk_config
from botocore.config import Config

from localcloud import aws_events, glue
from localcloud.account import ACCOUNT_ID, FAKE_CREDENTIALS, INTERNAL_HEADER
from localcloud.config import LocalCloudConfig
from localcloud.event_delivery import DeliveryFailure
from localcloud.parts import EventFault, RequestFault
from localcloud.waiting import DUMP_SIGNAL, sizes
from localcloud.lambda_runtime import close_environments

log = logging.getLogger(__name__)


class Payload(NamedTuple):
    """A payload's size, and what carried it."""

    size_bytes: int
    """As the service measures it against its limit."""
    what: str
    """Step Functions: "<state machine> <state> input|output"; DynamoDB: "<table> <pk>/<sk>";
    EventBridge: "<source> <detail type>"."""


PAYLOAD_KINDS = ("states", "dynamodb", "events")
"""The kinds `LocalCloud.largest_payloads` keeps."""


_glue_lock = threading.Lock()
_glue_applied = False


def apply_glue() -> None:
    """Apply every service's glue to moto, once per process: its patches are process-wide, and
    each serves the LocalCloud activated (glue.activate) while one runs."""
    global _glue_applied
    with _glue_lock:
        if _glue_applied:
            return
        from localcloud.glue import (awslambda, capacity_reservations, cloudwatch, dispatch, dynamodb, ec2, events,
                                     faults, iam, s3, sqs_lambda, stepfunctions, stepfunctions_map, vpc)

        for service in (awslambda, sqs_lambda, stepfunctions, stepfunctions_map, events, ec2, capacity_reservations,
                        vpc, dynamodb, iam, s3, cloudwatch, faults, dispatch):
            service.apply()
        _glue_applied = True


def _check_port_free(host: str, port: int) -> None:
    if port == 0:
        return
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise OSError(f"port {port} on {host} is not free ({exc.strerror}): "
                          f"pick another with port=..., or 0 for any free one") from exc


class LocalCloud:
    """See the package docstring for the whole surface."""

    def __init__(self, config: LocalCloudConfig | None = None, **overrides: Any):
        self.config = replace(config or LocalCloudConfig(), **overrides)
        self._server: Any = None
        self._executor: ThreadPoolExecutor | None = None
        self._owns_workdir = self.config.workdir is None
        self.workdir = Path(self.config.workdir or tempfile.mkdtemp(prefix="localcloud-"))
        self.delivery_failures: list[DeliveryFailure] = []
        self._saved_moto_settings: dict[str, Any] = {}
        self._timers: list[threading.Timer] = []
        self.request_faults: dict[str, RequestFault] = {}
        """Service -> how its requests fail, and until when (fail_requests)."""
        self.failed_requests: Counter[tuple[str, str]] = Counter()
        """(service, answer) -> requests answered with an injected error so far."""
        self.requests: Counter[tuple[str, str]] = Counter()
        """(service, action) -> API requests that reached the endpoint over HTTP (signed ones:
        the service is the SigV4 scope's, dynamodb, s3, states ...; glue/faults.py). The state
        machine's own service integrations (lambda:invoke, events:putEvents ...) are HTTP calls
        too, so they are counted here."""
        self.state_transitions: Counter[str] = Counter()
        """State machine name -> states entered by its executions (the *StateEntered events of
        their histories: what Step Functions bills Standard workflows for; a Task's retries
        are not counted here, AWS bills each as one more transition)."""
        self.sqs_redelivered: Counter[str] = Counter()
        """Queue name -> records a Lambda event source mapping handed to its function again (a
        batch had returned them, or they outlasted a visibility timeout): each a retry's wait."""
        self.lambda_invocations: Counter[str] = Counter()
        """Function name -> handler runs, however invoked: Invoke over HTTP (also counted in
        `requests`), asynchronous retries, and EventBridge targets, which do not come over HTTP."""
        self.largest_payloads: dict[str, Payload] = {}
        """Kind -> the largest payload of that kind so far (PAYLOAD_KINDS), beside the counters:
        "states", a state's input or output in an execution (Step Functions' limit: 256 KB);
        "dynamodb", an item as a put or an update left it (400 KB); "events", an entry put on an
        event bus, as EventBridge sizes it (256 KB). A kind nothing carried yet is absent; a
        bench clears the dict to measure one phase."""
        self._bookkeeping_lock = threading.Lock()
        """Guards the counters and the fault lists, which the server's threads share."""
        self._event_faults: list[EventFault] = []
        self._event_fault_of: dict[str, EventFault] = {}
        """Event id -> the fault it was given: every rule it matches delivers it the same way."""
        self._invocation_timeouts: list[list[Any]] = []
        """[function name part, invocations left] of time_out_invocations, oldest first."""
        self.capacity_limits: dict[tuple[str, str], int] = {}
        """(instance type, zone) -> instances of that type that may be alive there (set_capacity)."""
        self.vcpu_quota: int | None = None
        """The account's On-Demand vCPU quota in the region (set_vcpu_quota); None: none."""
        from localcloud.glue.s3_rates import PrefixRates

        self.s3_rates = PrefixRates(*self.config.s3_prefix_rates, window_s=self.scaled(1.0))
        """S3's per-prefix request rates, and the busiest prefixes so far (glue/s3_rates.py)."""
        from localcloud.fleet import LocalFleet

        self.fleet = LocalFleet(self)
        from localcloud.glue.routes import Routes

        self.routes = Routes(self.fleet.at_address, self.internal_client)
        """Where each instance's calls may go (glue/routes.py)."""

    # --- lifecycle -----------------------------------------------------------------------

    def start(self) -> LocalCloud:
        from moto.server import ThreadedMotoServer

        if self.running:
            raise RuntimeError(f"LocalCloud already running at {self.endpoint}")
        # moto's server thread dies silently on a taken port and start() then waits for ever.
        _check_port_free(self.config.host, self.config.port)
        apply_glue()
        glue.activate(self)
        # One line per request on stderr drowns everything else out.
        logging.getLogger("werkzeug").setLevel(logging.WARNING)
        # There is no X-Ray daemon here. Powertools' Tracer patches botocore process-wide, so
        # every AWS call of the server's own threads (no Lambda trace header) would warn that
        # its subsegment was discarded; with the SDK off the Tracer records nothing, quietly.
        global_sdk_config.set_sdk_enabled(False)
        # A process hosting a local cloud that seems stuck can be asked where its threads stand.
        faulthandler.register(DUMP_SIGNAL, all_threads=True)
        try:
            self._configure_moto()
            self.workdir.mkdir(parents=True, exist_ok=True)
            self._executor = ThreadPoolExecutor(self.config.delivery_workers,
                                                thread_name_prefix="localcloud")
            self._server = ThreadedMotoServer(ip_address=self.config.host,
                                              port=self.config.port, verbose=False)
            self._server.start()
            from localcloud.glue import cloudwatch, iam, vpc

            iam.admin_identity(self.account_id, self.region)
            vpc.prepare_default_vpc(self)
            cloudwatch.evaluate_every_minute(self)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Terminate the fleet's processes, stop the server, undo the process-wide settings."""
        for timer in self._timers:
            timer.cancel()
        self._timers.clear()
        self.fleet.shutdown()
        close_environments()
        if self._server is not None:
            self._server.stop()
            self._server = None
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
        self._restore_moto()
        from localcloud.glue import iam

        iam.enforce(False)
        global_sdk_config.set_sdk_enabled(True)  # its default (AWS_XRAY_SDK_ENABLED still wins)
        faulthandler.unregister(DUMP_SIGNAL)
        glue.deactivate(self)
        if self._owns_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> LocalCloud:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _configure_moto(self) -> None:
        from moto import settings
        from moto.core.config import default_user_config

        self._saved_moto_settings = {
            "execute_state_machine": default_user_config["stepfunctions"]["execute_state_machine"],
            "instance_type_validation": settings.EC2_ENABLE_INSTANCE_TYPE_VALIDATION,
        }
        default_user_config["stepfunctions"]["execute_state_machine"] = True
        settings.EC2_ENABLE_INSTANCE_TYPE_VALIDATION = True

    def _restore_moto(self) -> None:
        from moto import settings
        from moto.core.config import default_user_config

        if self._saved_moto_settings:
            default_user_config["stepfunctions"]["execute_state_machine"] = (
                self._saved_moto_settings["execute_state_machine"])
            settings.EC2_ENABLE_INSTANCE_TYPE_VALIDATION = (
                self._saved_moto_settings["instance_type_validation"])
            self._saved_moto_settings = {}

    # --- addresses -----------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._server is not None

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("LocalCloud is not started")
        return self._server.get_host_and_port()[1]

    @property
    def endpoint(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    @property
    def region(self) -> str:
        return self.config.region

    @property
    def account_id(self) -> str:
        return ACCOUNT_ID

    def env(self) -> dict[str, str]:
        """Environment that points an AWS SDK in another process (or a handler) here."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_REGION": self.region,
                "AWS_DEFAULT_REGION": self.region, **FAKE_CREDENTIALS}

    def client(self, service: str, **kwargs: Any) -> Any:
        """A boto3 client for this endpoint (no retries: a failure shows at once), in the cloud's
        region unless `region_name` names another."""
        kwargs.setdefault("config", Config(retries={"max_attempts": 1},
                                           connect_timeout=5, read_timeout=120))
        kwargs.setdefault("region_name", self.region)
        return boto3.client(service, endpoint_url=self.endpoint, aws_access_key_id="testing",
                            aws_secret_access_key="testing", aws_session_token="testing", **kwargs)

    def internal_client(self, service: str) -> Any:
        """A client for the local cloud's own plumbing, whose calls are no AWS API calls on AWS
        (the instance metadata service reads EC2's view of an instance; on EC2 the host serves
        it): never counted in `requests`, never failed by `fail_requests`."""
        client = self.client(service)
        client.meta.events.register("before-sign", _mark_internal)
        return client

    # --- time and background work --------------------------------------------------------

    def activity(self) -> tuple[Any, ...]:
        """A snapshot of what advances in this cloud: states entered by executions, the instances'
        states, what they wrote to their consoles. Not requests or Lambda invocations: agents'
        looks and schedules (the reaper's) make those while nothing advances."""
        with self._bookkeeping_lock:
            transitions = sum(self.state_transitions.values())
        instances = self.fleet.instances()
        return (transitions, tuple((instance.instance_id, instance.state) for instance in instances),
                sizes([instance.console_log for instance in instances]))

    def scaled(self, nominal_seconds: float) -> float:
        """Real seconds for a nominal duration (see LocalCloudConfig.time_scale)."""
        return nominal_seconds * self.config.time_scale

    def submit(self, description: str, work: Callable[[], Any]) -> Future | None:
        """Run `work` in the background; its failure is logged, never lost silently."""
        if self._executor is None:
            return None

        def run() -> Any:
            try:
                return work()
            except Exception:
                log.exception("background work failed: %s", description)
                raise

        try:
            return self._executor.submit(run)
        except RuntimeError:  # shutting down: the work no longer has anyone to serve
            return None

    def submit_later(self, description: str, nominal_delay_s: float,
                     work: Callable[[], Any]) -> threading.Timer:
        """Run `work` after a nominal delay (scaled), in the background."""
        timer = threading.Timer(self.scaled(nominal_delay_s),
                                lambda: self.submit(description, work))
        timer.daemon = True
        self._timers = [pending for pending in self._timers if pending.is_alive()] + [timer]
        timer.start()
        return timer

    def counters(self) -> tuple[Counter, Counter, Counter]:
        """Copies of (requests, state_transitions, lambda_invocations) as they stand, taken while
        no server thread counts."""
        with self._bookkeeping_lock:
            return Counter(self.requests), Counter(self.state_transitions), Counter(self.lambda_invocations)

    def count(self, counter: Counter, key: Hashable) -> None:
        """Add one to a counter of this cloud; the server's threads count at the same time."""
        with self._bookkeeping_lock:
            counter[key] += 1

    def note_payload(self, kind: str, size_bytes: int, what: str) -> None:
        """Keep the payload if it is the largest of its kind so far (largest_payloads)."""
        with self._bookkeeping_lock:
            largest = self.largest_payloads.get(kind)
            if largest is None or size_bytes > largest.size_bytes:
                self.largest_payloads[kind] = Payload(size_bytes, what)

    # --- Lambda invocation faults -------------------------------------------------------

    def time_out_invocations(self, function_name_part: str, count: int = 1) -> None:
        """The next `count` invocations of a function whose name contains the text run their
        handler (its side effects happen) and then report Sandbox.Timedout, as Lambda reports a
        function that ran past its timeout: Invoke answers FunctionError Unhandled with the
        timeout's error object; a Step Functions Task sees Lambda.Unknown (glue/stepfunctions.py)."""
        if not function_name_part:
            raise ValueError("function_name_part must not be empty")
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"count must be an integer >= 1, got {count!r}")
        with self._bookkeeping_lock:
            self._invocation_timeouts.append([function_name_part, count])

    def take_invocation_timeout(self, function_name: str) -> bool:
        """Whether this invocation of the function is to time out (time_out_invocations)."""
        with self._bookkeeping_lock:
            for pending in self._invocation_timeouts:
                if pending[0] in function_name:
                    pending[1] -= 1
                    if pending[1] == 0:
                        self._invocation_timeouts.remove(pending)
                    return True
        return False

    def forget_terminated_instances(self) -> list[str]:
        """EC2, an hour after each termination: terminated instances are no longer known (glue/ec2.py)."""
        from localcloud.glue.ec2 import forget_terminated

        return forget_terminated(self)

    # --- request faults ------------------------------------------------------------------

    def fail_requests(self, service: str, seconds: float, answer: str = "throttle") -> None:
        """Answer every API request to `service` (dynamodb, s3, events, lambda, logs, ec2, states)
        over HTTP for the next `seconds` real seconds with its throttling error (answer
        "throttle") or its internal error ("error"), as AWS does under load or in an outage
        (glue/faults.py)."""
        from localcloud.glue.faults import FAULT_ANSWERS, SERVICES

        if service not in SERVICES:
            raise ValueError(f"service must be one of {SERVICES}, got {service!r}")
        if answer not in FAULT_ANSWERS:
            raise ValueError(f"answer must be one of {list(FAULT_ANSWERS)}, got {answer!r}")
        if seconds < 0:
            raise ValueError(f"seconds must be >= 0, got {seconds}")
        self.request_faults[service] = RequestFault(answer, time.monotonic() + seconds)

    def throttle(self, service: str, seconds: float) -> None:
        """fail_requests(service, seconds, "throttle")."""
        self.fail_requests(service, seconds, "throttle")

    def stop_failing_requests(self, service: str | None = None) -> None:
        """End the request faults of a service now, or of every service."""
        if service is None:
            self.request_faults.clear()
        else:
            self.request_faults.pop(service, None)

    # --- capacity ------------------------------------------------------------------------

    def set_capacity(self, instance_type: str, availability_zone: str, instances: int | None) -> None:
        """Let at most `instances` of the type be alive (not terminated) in the zone at once;
        None lifts the cap. Launches beyond it get InsufficientInstanceCapacity (glue/ec2.py)."""
        if instances is not None and (isinstance(instances, bool) or not isinstance(instances, int)
                                      or instances < 0):
            raise ValueError(f"instances must be an integer >= 0 or None, got {instances!r}")
        if not availability_zone.startswith(self.region):
            raise ValueError(f"availability_zone must be a zone of {self.region}, got {availability_zone!r}")
        from moto.ec2.models.instance_types import INSTANCE_TYPES

        if instance_type not in INSTANCE_TYPES:
            raise ValueError(f"instance_type: unknown instance type {instance_type!r}")
        if instances is None:
            self.capacity_limits.pop((instance_type, availability_zone), None)
        else:
            self.capacity_limits[(instance_type, availability_zone)] = instances

    def create_capacity_block(self, instance_type: str, availability_zone: str, instances: int,
                              ends_in_s: float, placement_group: str | None = None) -> str:
        """A Capacity Block for ML that is active now and ends in `ends_in_s` (seconds, not
        scaled: its end is a date), as buying one leaves it; its reservation id
        (glue/capacity_reservations.py)."""
        from datetime import datetime, timedelta, timezone

        from localcloud.glue.capacity_reservations import CapacityReservation, add_reservation
        from localcloud.glue.ec2 import ec2_backend

        return add_reservation(ec2_backend(self), CapacityReservation(
            instance_type=instance_type, availability_zone=availability_zone, total=instances, region=self.region,
            account_id=self.account_id, capacity_block=True, match_criteria="targeted",
            end_date=datetime.now(timezone.utc) + timedelta(seconds=ends_in_s), placement_group=placement_group))

    def set_vcpu_quota(self, vcpus: int | None) -> None:
        """The account's On-Demand vCPU quota, as EC2 counts it: the vCPUs of its on-demand
        instances not yet terminated or stopped, those still shutting down included. A launch
        beyond it gets VcpuLimitExceeded (glue/ec2.py); None lifts it."""
        if vcpus is not None and (isinstance(vcpus, bool) or not isinstance(vcpus, int) or vcpus < 0):
            raise ValueError(f"vcpus must be an integer >= 0 or None, got {vcpus!r}")
        self.vcpu_quota = vcpus

    # --- events --------------------------------------------------------------------------

    def put_event(self, event: aws_events.AwsEvent) -> str:
        """Put an AWS-service event on the default bus, as the service itself would."""
        from moto.events.models import events_backends

        backend = events_backends[self.account_id][self.region]
        entries = backend.put_events([{
            "Source": event.source, "DetailType": event.detail_type,
            "Detail": json.dumps(event.detail), "Resources": list(event.resources),
            "Time": event.time,
        }])
        if "EventId" not in entries[0]:
            raise ValueError(f"event rejected: {entries[0]}")
        return entries[0]["EventId"]

    def duplicate_events(self, detail_types: list[str] | None = None, count: int = 1) -> None:
        """Deliver each of the next `count` matching events twice to every target of each rule
        it matches: EventBridge delivers at least once, so targets must be idempotent."""
        self._arm_event_fault("duplicate", 0.0, detail_types, count)

    def delay_events(self, delay_s: float, detail_types: list[str] | None = None, count: int = 1) -> None:
        """Deliver the next `count` matching events `delay_s` nominal seconds late (scaled like
        every nominal duration: EventBridge retries a delivery for up to a day)."""
        self._arm_event_fault("delay", delay_s, detail_types, count)

    def reorder_events(self, window_s: float, detail_types: list[str] | None = None, count: int = 2) -> None:
        """Hold the next `count` matching events from the first one on for `window_s` nominal
        seconds, then deliver them newest first: EventBridge does not keep events in order."""
        self._arm_event_fault("reorder", window_s, detail_types, count)

    def clear_event_faults(self) -> None:
        """Deliver events as they come again (faults armed and not yet spent are dropped)."""
        with self._bookkeeping_lock:
            self._event_faults.clear()

    def _arm_event_fault(self, kind: str, seconds: float, detail_types: list[str] | None, count: int) -> None:
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"count must be an integer >= 1, got {count!r}")
        if seconds < 0:
            raise ValueError(f"seconds must be >= 0, got {seconds}")
        if isinstance(detail_types, str):
            raise ValueError(f"detail_types must be a list of detail types, got {detail_types!r}")
        with self._bookkeeping_lock:
            self._event_faults.append(EventFault(
                kind, seconds, frozenset(detail_types) if detail_types is not None else None, count))

    def event_fault(self, event: dict[str, Any]) -> EventFault | None:
        """The fault that applies to this event on the bus, if any (the same for each rule)."""
        with self._bookkeeping_lock:
            if event.get("id") in self._event_fault_of:
                return self._event_fault_of[event["id"]]
            for fault in self._event_faults:
                if fault.detail_types is None or event.get("detail-type") in fault.detail_types:
                    fault.remaining -= 1
                    if fault.remaining == 0:
                        self._event_faults.remove(fault)
                    self._event_fault_of[event["id"]] = fault
                    return fault
        return None

    def inject_spot_interruption(self, instance_id: str, action: str = "terminate") -> str:
        """Send the two-minute Spot warning; the instance is interrupted when it runs out.

        The notice is also kept for the instance (`fleet.get(id).spot_action`), which is what
        its instance metadata's spot/instance-action document serves."""
        if action not in aws_events.SPOT_ACTIONS:
            raise ValueError(f"action must be one of {sorted(aws_events.SPOT_ACTIONS)}, "
                             f"got {action!r}")
        instance = self.fleet.get(instance_id)
        notice_s = self.config.spot_notice_seconds
        instance.spot_action = aws_events.spot_instance_action(action, notice_s)
        event_id = self.put_event(aws_events.spot_interruption_warning(
            self.region, self.account_id, instance_id, action))
        self.submit_later(f"spot interruption of {instance_id}", notice_s,
                          lambda: self.fleet.interrupt(instance_id, action))
        return event_id

    def inject_rebalance(self, instance_id: str) -> str:
        """Send an EC2 Instance Rebalance Recommendation; the instance's metadata shows it too."""
        self.fleet.get(instance_id).rebalance_notice = {"noticeTime": aws_events.iso_time(time.time())}
        return self.put_event(aws_events.rebalance_recommendation(
            self.region, self.account_id, instance_id))

    def inject_health_event(self, instance_ids: list[str],
                            event_type_code: str = "AWS_EC2_INSTANCE_RETIREMENT_SCHEDULED",
                            category: str = "scheduledChange",
                            description: str = "The instance is scheduled for retirement.") -> str:
        """Send an AWS Health Event (service EC2) naming these instances."""
        if not instance_ids:
            raise ValueError("instance_ids must name at least one instance")
        for instance_id in instance_ids:
            self.fleet.get(instance_id)
        return self.put_event(aws_events.health_event(
            self.region, self.account_id, instance_ids, event_type_code, category,
            description, event_id=uuid.uuid4().hex))

    def wait_until(self, predicate: Callable[[], bool], what: str, poll_s: float = 0.05) -> None:
        """Poll `predicate` until true, for one event that shows nothing on its way (a state, a
        process, a delivery): a TimeoutError names `what` it was waiting for once EVENT_WAIT_S
        passed. A wait for something that advances (a run) waits on its progress instead
        (localcloud.waiting)."""
        deadline = time.monotonic() + EVENT_WAIT_S
        while not predicate():
            if time.monotonic() > deadline:
                raise TimeoutError(f"no sign after {EVENT_WAIT_S:.0f} s of {what}")
            time.sleep(poll_s)


EVENT_WAIT_S = 120.0
"""How long `wait_until` waits for one event: an idle machine shows any of them within seconds, a
starved one within tens; one that has not come after this will not come."""


def _mark_internal(request: Any, **_: Any) -> None:
    request.headers[INTERNAL_HEADER] = "1"


def exit_after_local_cloud(code: int) -> NoReturn:
    """End a process that ran a local cloud, its output flushed, without finalizing the
    interpreter. A local cloud leaves daemon threads behind (Lambda environments, pollers,
    servers), and finalization tears modules down under them: once in a suite's runs, a C++
    extension's object finalized there aborted a harness whose run had ended and whose answer was
    written ("terminate called without an active exception", exit -6). Nothing of a local cloud's
    state needs an orderly interpreter exit: its files are closed and its children ended by then."""
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        stream.flush()
    os._exit(code)
