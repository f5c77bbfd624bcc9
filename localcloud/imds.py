"""Instance metadata (IMDSv2) for the instances of the local cloud.

On EC2 the node agent reads its identity, placement and interruption notices from
http://169.254.169.254. Here one HTTP server on 127.0.0.1 serves every local instance, each
under its own path prefix, and each instance process is pointed at its prefix through
AWS_EC2_METADATA_SERVICE_ENDPOINT, which botocore (and so boto3's IMDS fetchers) honours:

    AWS_EC2_METADATA_SERVICE_ENDPOINT=http://127.0.0.1:PORT/i-0123456789abcdef0

    PUT  /i-.../latest/api/token            X-aws-ec2-metadata-token-ttl-seconds: 1..21600
    GET  /i-.../latest/meta-data/instance-id      X-aws-ec2-metadata-token: <token>

With a LocalCloud, `serve_fleet(cloud)` starts the server over the fleet's instances and adds
the variable to every instance process it boots:

    imds = serve_fleet(cloud)
    ...
    imds.stop()

Behaviour follows EC2's instance metadata service:
- a token comes from PUT latest/api/token with a TTL header of 1 to 21600 seconds (400
  without a valid one, 403 when the PUT carries X-Forwarded-For, 405 for another method);
  it is valid for that instance only, until it expires;
- with HttpTokens=required a GET without a valid token gets 401; with `optional`, a GET
  without a token is answered (IMDSv1) but an invalid token still gets 401;
- HttpEndpoint=disabled answers 403;
- a folder path answers its entries one per line (sub-folders end in "/"); an unknown path 404;
- spot/instance-action and events/recommendations/rebalance are 404 until a notice exists,
  then the JSON documents EC2 serves; tags/instance exists only when the instance allows tags
  in metadata (InstanceMetadataTags=enabled);
- dynamic/instance-identity/document is the instance identity document (JSON);
  services/partition and services/domain are the commercial partition's;
- an instance launched with an instance profile has iam/info and
  iam/security-credentials/<role> (temporary credentials, renewed before they expire; under
  `serve_fleet` they are STS credentials of the role, which the local cloud authorizes against
  the role's policies once IAM is enforced).
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from botocore.exceptions import ClientError

from trainfleet.core.events import instance_arn

if TYPE_CHECKING:
    from localcloud.cloud import LocalCloud

__all__ = ["InstanceMetadata", "InstanceMetadataServer", "MetadataReply", "RoleCredentials", "metadata_reply",
           "serve_fleet", "ENDPOINT_VARIABLE", "MAX_TOKEN_TTL_S"]

ENDPOINT_VARIABLE = "AWS_EC2_METADATA_SERVICE_ENDPOINT"
"""The variable botocore reads the metadata endpoint from."""
MAX_TOKEN_TTL_S = 21600
"""The longest token lifetime EC2 grants (six hours)."""
TOKEN_HEADER = "X-aws-ec2-metadata-token"
TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"


@dataclass(frozen=True)
class InstanceMetadata:
    """What the metadata service knows about one instance."""

    instance_id: str
    """i-..., as EC2 gave it."""
    instance_type: str
    """p4d.24xlarge, ..."""
    image_id: str
    """The AMI it was launched from."""
    local_ipv4: str
    """Its private address (in the local cloud, its own loopback address)."""
    availability_zone: str
    """us-east-1a, ..."""
    region: str
    """The region the zone belongs to."""
    account_id: str
    """The account that owns the instance."""
    launch_time: datetime
    """When it was launched; the identity document's pendingTime."""
    architecture: str = "x86_64"
    """CPU architecture, as in the identity document."""
    tags: Mapping[str, str] = field(default_factory=dict)
    """The instance's tags."""
    tags_in_metadata: bool = False
    """InstanceMetadataTags=enabled: tags/instance is served."""
    tokens_required: bool = True
    """HttpTokens=required (IMDSv2 only); False serves token-less GETs too."""
    endpoint_enabled: bool = True
    """HttpEndpoint=enabled; False answers every request with 403."""
    spot_action: Mapping[str, str] | None = None
    """The spot/instance-action document ({"action": ..., "time": ...}) once a Spot
    interruption notice was given."""
    rebalance_notice: Mapping[str, str] | None = None
    """The events/recommendations/rebalance document ({"noticeTime": ...}) once a rebalance
    recommendation was given."""
    instance_profile_arn: str | None = None
    """The instance profile it was launched with; None serves no iam/ folder, as on EC2."""
    instance_profile_id: str = ""
    """That profile's id (AIPA...), for iam/info."""
    role_name: str | None = None
    """The profile's role, under which iam/security-credentials/ serves credentials."""


@dataclass(frozen=True)
class RoleCredentials:
    """Temporary credentials served for an instance's role."""

    access_key_id: str
    secret_access_key: str
    token: str
    issued: datetime
    expiration: datetime

    def document(self) -> dict[str, str]:
        """The iam/security-credentials/<role> JSON document."""
        return {"Code": "Success", "LastUpdated": _iso(self.issued), "Type": "AWS-HMAC",
                "AccessKeyId": self.access_key_id, "SecretAccessKey": self.secret_access_key,
                "Token": self.token, "Expiration": _iso(self.expiration)}


RecordProvider = Callable[[str], InstanceMetadata | None]
"""Given an instance id, its current metadata, or None for an instance that does not exist."""


@dataclass(frozen=True)
class MetadataReply:
    """One answer of the metadata service."""

    status: int
    """HTTP status."""
    body: str
    """Response text."""
    content_type: str = "text/plain"
    """Content-Type of the body."""


class _Document(str):
    """A leaf that is a JSON document (served as application/json)."""


def _iso(moment: datetime) -> str:
    return moment.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def metadata_tree(record: InstanceMetadata, credentials: RoleCredentials | None = None) -> dict[str, Any]:
    """Every path the service answers for `record`, as nested folders of text leaves;
    `credentials` are those of its role, if it has one."""
    hostname = f"ip-{record.local_ipv4.replace('.', '-')}.ec2.internal"
    meta_data: dict[str, Any] = {
        "ami-id": record.image_id,
        "hostname": hostname,
        "instance-id": record.instance_id,
        "instance-type": record.instance_type,
        "local-hostname": hostname,
        "local-ipv4": record.local_ipv4,
        "placement": {"availability-zone": record.availability_zone, "region": record.region},
        "services": {"domain": "amazonaws.com", "partition": "aws"},
    }
    if record.tags_in_metadata:
        meta_data["tags"] = {"instance": dict(record.tags)}
    if record.instance_profile_arn is not None:
        info = {"Code": "Success", "LastUpdated": _iso(record.launch_time),
                "InstanceProfileArn": record.instance_profile_arn, "InstanceProfileId": record.instance_profile_id}
        meta_data["iam"] = {"info": _Document(json.dumps(info, indent=2)), "security-credentials": {}}
        if record.role_name is not None and credentials is not None:
            meta_data["iam"]["security-credentials"][record.role_name] = _Document(
                json.dumps(credentials.document(), indent=2))
    if record.spot_action is not None:
        meta_data["spot"] = {"instance-action": _Document(json.dumps(dict(record.spot_action)))}
    if record.rebalance_notice is not None:
        meta_data["events"] = {"recommendations": {"rebalance": _Document(json.dumps(dict(record.rebalance_notice)))}}
    identity = {
        "accountId": record.account_id,
        "architecture": record.architecture,
        "availabilityZone": record.availability_zone,
        "billingProducts": None,
        "devpayProductCodes": None,
        "marketplaceProductCodes": None,
        "imageId": record.image_id,
        "instanceId": record.instance_id,
        "instanceType": record.instance_type,
        "kernelId": None,
        "pendingTime": _iso(record.launch_time),
        "privateIp": record.local_ipv4,
        "ramdiskId": None,
        "region": record.region,
        "version": "2017-09-30",
    }
    return {"meta-data": meta_data,
            "dynamic": {"instance-identity": {"document": _Document(json.dumps(identity, indent=2))}}}


def metadata_reply(record: InstanceMetadata, path: str, credentials: RoleCredentials | None = None) -> MetadataReply:
    """The answer to GET latest/<path> (path relative to latest/, e.g. "meta-data/instance-id")."""
    node: Any = metadata_tree(record, credentials)
    for part in [part for part in path.split("/") if part]:
        if not isinstance(node, dict) or part not in node:
            return MetadataReply(HTTPStatus.NOT_FOUND, "Not Found")
        node = node[part]
    if isinstance(node, dict):  # a folder lists its entries
        return MetadataReply(HTTPStatus.OK, "\n".join(
            f"{name}/" if isinstance(child, dict) else name for name, child in node.items()))
    return MetadataReply(HTTPStatus.OK, node, "application/json" if isinstance(node, _Document) else "text/plain")


class _Tokens:
    """Issued session tokens: each valid for one instance until its expiry."""

    def __init__(self, clock: Callable[[], float]):
        self._clock = clock
        self._expiry: dict[str, tuple[str, float]] = {}
        self._lock = threading.Lock()

    def issue(self, instance_id: str, ttl_s: int) -> str:
        token = secrets.token_urlsafe(40)
        now = self._clock()
        with self._lock:
            self._expiry = {t: held for t, held in self._expiry.items() if held[1] > now}
            self._expiry[token] = (instance_id, now + ttl_s)
        return token

    def valid(self, token: str, instance_id: str) -> bool:
        with self._lock:
            held = self._expiry.get(token)
        return held is not None and held[0] == instance_id and held[1] > self._clock()


CredentialIssuer = Callable[[InstanceMetadata, timedelta], RoleCredentials]
"""Issues credentials of an instance's role for a lifetime (EC2 assumes the role for it)."""


def random_credentials(record: InstanceMetadata, lifetime: timedelta) -> RoleCredentials:
    """Credentials of the right shape that no endpoint knows (for a metadata service alone)."""
    now = datetime.now(timezone.utc)
    return RoleCredentials(access_key_id="ASIA" + secrets.token_hex(8).upper(),
                           secret_access_key=secrets.token_urlsafe(30), token=secrets.token_urlsafe(60),
                           issued=now, expiration=now + lifetime)


class _RoleCredentialsCache:
    """One set of credentials per instance role, renewed an hour before it expires, as EC2
    rotates them."""

    LIFETIME = timedelta(hours=6)
    RENEW_BEFORE = timedelta(hours=1)

    def __init__(self, issue: CredentialIssuer) -> None:
        self._issue = issue
        self._held: dict[tuple[str, str], RoleCredentials] = {}
        self._lock = threading.Lock()

    def for_role(self, record: InstanceMetadata, role_name: str) -> RoleCredentials:
        now = datetime.now(timezone.utc)
        key = (record.instance_id, role_name)
        with self._lock:
            held = self._held.get(key)
            if held is None or held.expiration - now < self.RENEW_BEFORE:
                held = self._held[key] = self._issue(record, self.LIFETIME)
            return held


class InstanceMetadataServer:
    """One metadata service for every local instance, on 127.0.0.1."""

    def __init__(self, records: RecordProvider, port: int = 0, clock: Callable[[], float] = time.monotonic,
                 issue_credentials: CredentialIssuer = random_credentials):
        """`records` looks instances up by id; `port` 0 picks a free one; `clock` (seconds)
        times token expiry; `issue_credentials` gives the credentials of an instance's role."""
        self._records = records
        self._tokens = _Tokens(clock)
        self._credentials = _RoleCredentialsCache(issue_credentials)
        self._server = _Server(("127.0.0.1", port), _handler_for(self))
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    def endpoint_for(self, instance_id: str) -> str:
        """What AWS_EC2_METADATA_SERVICE_ENDPOINT is for that instance's processes."""
        return f"http://127.0.0.1:{self.port}/{instance_id}"

    def start(self) -> InstanceMetadataServer:
        self._thread = threading.Thread(target=self._server.serve_forever, name="instance-metadata",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(timeout=5)
            self._thread = None
        self._server.server_close()

    def __enter__(self) -> InstanceMetadataServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # --- requests (called from the handler threads) --------------------------------------

    def put(self, instance_id: str, path: str, headers: Mapping[str, str]) -> tuple[MetadataReply, dict[str, str]]:
        record = self._records(instance_id)
        if record is None:
            return MetadataReply(HTTPStatus.NOT_FOUND, f"no instance {instance_id}"), {}
        if not record.endpoint_enabled:
            return MetadataReply(HTTPStatus.FORBIDDEN, "Forbidden"), {}
        if path != "api/token":
            return MetadataReply(HTTPStatus.METHOD_NOT_ALLOWED, "Not Allowed"), {}
        if "X-Forwarded-For" in headers:  # a proxied request is refused a token
            return MetadataReply(HTTPStatus.FORBIDDEN, "Forbidden"), {}
        ttl = _token_ttl(headers.get(TTL_HEADER))
        if ttl is None:
            return MetadataReply(HTTPStatus.BAD_REQUEST, "Missing or Invalid Parameters"), {}
        return MetadataReply(HTTPStatus.OK, self._tokens.issue(instance_id, ttl)), {TTL_HEADER: str(ttl)}

    def get(self, instance_id: str, path: str, headers: Mapping[str, str]) -> MetadataReply:
        record = self._records(instance_id)
        if record is None:
            return MetadataReply(HTTPStatus.NOT_FOUND, f"no instance {instance_id}")
        if not record.endpoint_enabled:
            return MetadataReply(HTTPStatus.FORBIDDEN, "Forbidden")
        if path.rstrip("/") == "api/token":
            return MetadataReply(HTTPStatus.METHOD_NOT_ALLOWED, "Not Allowed")
        token = headers.get(TOKEN_HEADER)
        if token is None:
            authorized = not record.tokens_required  # IMDSv1, where the instance allows it
        else:
            authorized = self._tokens.valid(token, instance_id)
        if not authorized:
            return MetadataReply(HTTPStatus.UNAUTHORIZED, "Unauthorized")
        credentials = self._credentials.for_role(record, record.role_name) if record.role_name else None
        return metadata_reply(record, path, credentials)


class _Server(ThreadingHTTPServer):
    # Hundreds of instances boot at once and each asks for a token: the default backlog of 5
    # drops their connections, and a dropped SYN is retried only after a second.
    request_queue_size = 1024


def _token_ttl(raw: str | None) -> int | None:
    """The requested TTL if it is a whole number of seconds in 1..21600."""
    if raw is None or not raw.strip().isdigit():
        return None
    ttl = int(raw)
    return ttl if 1 <= ttl <= MAX_TOKEN_TTL_S else None


def _handler_for(service: InstanceMetadataServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "EC2ws"
        protocol_version = "HTTP/1.1"
        # Headers and body go out in two writes; with Nagle's algorithm on, a kept-alive client
        # waits for its delayed ACK before the body comes (about 40 ms a request).
        disable_nagle_algorithm = True

        def _route(self) -> tuple[str, str] | None:
            """(instance id, path under latest/) from /<instance-id>/latest/<path>."""
            instance_id, _, rest = self.path.split("?", 1)[0].lstrip("/").partition("/")
            prefix, _, path = rest.partition("/")
            return (instance_id, path) if instance_id and prefix == "latest" else None

        def do_PUT(self) -> None:  # noqa: N802 (the name http.server calls)
            self._drain_body()
            route = self._route()
            if route is None:
                self._send(MetadataReply(HTTPStatus.NOT_FOUND, "Not Found"))
                return
            reply, extra_headers = service.put(*route, self.headers)
            self._send(reply, extra_headers)

        def do_GET(self) -> None:  # noqa: N802
            route = self._route()
            self._send(service.get(*route, self.headers) if route else MetadataReply(HTTPStatus.NOT_FOUND,
                                                                                     "Not Found"))

        def _refuse(self) -> None:
            self._drain_body()
            self._send(MetadataReply(HTTPStatus.METHOD_NOT_ALLOWED, "Not Allowed"))

        do_POST = do_DELETE = do_PATCH = _refuse

        def _drain_body(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                self.rfile.read(length)

        def _send(self, reply: MetadataReply, extra_headers: Mapping[str, str] | None = None) -> None:
            body = reply.body.encode()
            self.send_response(reply.status)
            self.send_header("Content-Type", reply.content_type)
            self.send_header("Content-Length", str(len(body)))
            for name, value in (extra_headers or {}).items():
                self.send_header(name, value)
            try:
                self.end_headers()
                self.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the instance gave up waiting (its client timed out) and asks again later

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            """Quiet: instances poll spot/instance-action every few seconds."""

    return Handler


# --- the local fleet's instances ------------------------------------------------------------

def fleet_records(cloud: LocalCloud) -> RecordProvider:
    """Instance records from the local cloud: EC2's own description of each instance (type,
    image, zone, tags, metadata options, instance profile) plus the fleet's notices (Spot
    interruption, rebalance recommendation).

    Every instance polls its Spot notice (every 5 s; locally as much faster as time is scaled), so
    a record must be cheap: what cannot change in an instance's life (type, image, zone, address,
    launch time, profile) is described once, with DescribeInstances; what can (metadata options,
    tags) is read from EC2's model of the instance at each request, so a change shows at once, as
    on EC2."""
    from localcloud.glue.ec2 import ec2_backend

    ec2, iam = cloud.internal_client("ec2"), cloud.internal_client("iam")
    described: dict[str, tuple[dict[str, Any], Any]] = {}
    """Instance id -> its description and EC2's model of it (moto finds one by a scan of all)."""

    def describe(instance_id: str) -> tuple[dict[str, Any], Any] | None:
        if instance_id not in described:
            try:
                reservations = ec2.describe_instances(InstanceIds=[instance_id])["Reservations"]
            except ClientError as error:
                if error.response["Error"]["Code"] == "InvalidInstanceID.NotFound":
                    return None
                raise
            found = reservations[0]["Instances"][0]
            profile = found.get("IamInstanceProfile", {})
            described[instance_id] = (found | {"RoleName": _role_of(iam, profile["Arn"]) if profile else None},
                                      ec2_backend(cloud).get_instance(instance_id))
        return described[instance_id]

    def lookup(instance_id: str) -> InstanceMetadata | None:
        try:
            local = cloud.fleet.get(instance_id)
        except KeyError:
            return None
        if (known := describe(instance_id)) is None:
            return None
        found, model = known
        options = model.metadata_options
        tags_in_metadata = options.instance_metadata_tags == "enabled"
        profile = found.get("IamInstanceProfile", {})
        return InstanceMetadata(
            instance_id=instance_id,
            instance_type=found["InstanceType"],
            image_id=found["ImageId"],
            local_ipv4=found.get("PrivateIpAddress", local.private_ip),
            availability_zone=found["Placement"]["AvailabilityZone"],
            region=cloud.region,
            account_id=cloud.account_id,
            launch_time=found["LaunchTime"],
            architecture=found.get("Architecture", "x86_64"),
            tags=_tags_of(ec2, instance_id) if tags_in_metadata else {},
            tags_in_metadata=tags_in_metadata,
            tokens_required=options.http_tokens == "required",
            endpoint_enabled=options.http_endpoint == "enabled",
            spot_action=local.spot_action,
            rebalance_notice=local.rebalance_notice,
            instance_profile_arn=profile.get("Arn"),
            instance_profile_id=profile.get("Id", ""),
            role_name=found["RoleName"],
        )

    return lookup


def _tags_of(ec2: Any, instance_id: str) -> dict[str, str]:
    described = ec2.describe_tags(Filters=[{"Name": "resource-id", "Values": [instance_id]}])["Tags"]
    return {tag["Key"]: tag["Value"] for tag in described}


def _role_of(iam: Any, instance_profile_arn: str) -> str | None:
    profile_name = instance_profile_arn.rsplit("/", 1)[1]
    roles = iam.get_instance_profile(InstanceProfileName=profile_name)["InstanceProfile"]["Roles"]
    return roles[0]["RoleName"] if roles else None


def role_session_of(cloud: LocalCloud) -> CredentialIssuer:
    """Real STS credentials of the instance's role, which the local cloud accepts and
    authorizes against that role's policies, as EC2 gets them by assuming the role."""
    from localcloud.glue.iam import role_credentials

    def issue(record: InstanceMetadata, lifetime: timedelta) -> RoleCredentials:
        role_arn = f"arn:aws:iam::{record.account_id}:role/{record.role_name}"
        issued = role_credentials(record.account_id, cloud.region, role_arn, record.instance_id,
                                  instance_arn("aws", cloud.region, record.account_id, record.instance_id))
        expiration = datetime.strptime(issued["AWS_CREDENTIAL_EXPIRATION"], "%Y-%m-%dT%H:%M:%SZ")
        return RoleCredentials(issued["AWS_ACCESS_KEY_ID"], issued["AWS_SECRET_ACCESS_KEY"],
                               issued["AWS_SESSION_TOKEN"], datetime.now(timezone.utc),
                               expiration.replace(tzinfo=timezone.utc))

    return issue


def serve_fleet(cloud: LocalCloud) -> InstanceMetadataServer:
    """Start the metadata service over `cloud`'s fleet; every instance process booted from now
    on finds it through AWS_EC2_METADATA_SERVICE_ENDPOINT. Stop it with `.stop()`."""
    records, issue = fleet_records(cloud), role_session_of(cloud)
    server = InstanceMetadataServer(records, issue_credentials=issue).start()

    def instance_environment(instance: Any) -> dict[str, str]:
        environment = {ENDPOINT_VARIABLE: server.endpoint_for(instance.instance_id)}
        record = records(instance.instance_id)
        if record is not None and record.role_name is not None:
            # The CRT S3 client the trainer checkpoints with (s3torchconnector) reads instance
            # metadata at its fixed address only, not at this per-instance path: it gets the
            # same role's credentials in the environment, which every SDK reads first.
            credentials = issue(record, _RoleCredentialsCache.LIFETIME)
            environment |= {"AWS_ACCESS_KEY_ID": credentials.access_key_id,
                            "AWS_SECRET_ACCESS_KEY": credentials.secret_access_key,
                            "AWS_SESSION_TOKEN": credentials.token}
        return environment

    cloud.fleet.env_hooks.append(instance_environment)
    return server
