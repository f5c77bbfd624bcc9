"""The instance metadata as the agent reads it (IMDSv2): who and where this instance is, and
whether EC2 gave it a Spot notice."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import botocore.session
from botocore.utils import IMDSFetcher

from node.node_log import say
from node.settings import AgentError
from trainfleet.core.events import instance_arn

METADATA_PATIENCE_S = 600.0
"""How long the agent keeps asking the metadata service for its identity at boot: right after
boot, or throttled, it may not answer at once (botocore's fetcher gives up after a few seconds)."""


@dataclass(frozen=True)
class Identity:
    """Who and where this instance is, from the instance metadata."""

    instance_id: str
    """meta-data/instance-id."""
    instance_type: str
    """meta-data/instance-type: what the preflight holds the node to."""
    private_ip: str
    """meta-data/local-ipv4: where node rank 0 hosts the rendezvous."""
    availability_zone: str
    """meta-data/placement/availability-zone."""
    region: str
    """meta-data/placement/region: where the agent's AWS clients go."""
    account_id: str
    """dynamic/instance-identity/document's accountId."""
    partition: str = "aws"
    """meta-data/services/partition."""

    @property
    def arn(self) -> str:
        """The instance's ARN: the sender named in every event it sends (the node role lets it
        put events with that source alone)."""
        return instance_arn(self.partition, self.region, self.account_id, self.instance_id)


class MetadataClient(IMDSFetcher):
    """IMDSv2 reads through botocore's fetcher (it honours AWS_EC2_METADATA_SERVICE_ENDPOINT)."""

    def __init__(self) -> None:
        endpoint = botocore.session.get_session().get_config_variable("ec2_metadata_service_endpoint")
        super().__init__(timeout=2, num_attempts=3,
                         config={"ec2_metadata_service_endpoint": endpoint} if endpoint else {})
        self._token: str | None = None

    def read(self, path: str) -> str | None:
        """The text at latest/<path>, or None where the service has nothing (404)."""
        for _ in range(2):  # a second time with a fresh token if the first one expired
            if self._token is None:
                self._token = self._fetch_metadata_token()
                if self._token is None:
                    raise AgentError(f"no IMDSv2 token from {self.get_base_url()}")
            try:
                response = self._get_request(f"latest/{path}", retry_func=lambda reply: reply.status_code >= 500,
                                             token=self._token)
            except self._RETRIES_EXCEEDED_ERROR_CLS:
                raise AgentError(f"instance metadata latest/{path}: no answer after retries") from None
            if response.status_code == 401:
                self._token = None
                continue
            if response.status_code == 404:
                return None
            if response.status_code != 200:
                raise AgentError(f"instance metadata latest/{path}: HTTP {response.status_code}")
            return response.text
        raise AgentError(f"instance metadata latest/{path}: token refused twice")

    def identity(self) -> Identity:
        def required(path: str) -> str:
            value = self.read(f"meta-data/{path}")
            if not value:
                raise AgentError(f"instance metadata has no meta-data/{path}")
            return value

        document = self.read("dynamic/instance-identity/document")
        if not document:
            raise AgentError("instance metadata has no dynamic/instance-identity/document")
        return Identity(instance_id=required("instance-id"), instance_type=required("instance-type"),
                        private_ip=required("local-ipv4"),
                        availability_zone=required("placement/availability-zone"),
                        region=required("placement/region"), account_id=json.loads(document)["accountId"],
                        partition=required("services/partition"))

    def spot_action(self) -> dict[str, Any] | None:
        """The Spot interruption notice, once EC2 has given one."""
        document = self.read("meta-data/spot/instance-action")
        return json.loads(document) if document else None

def boot_identity(metadata: MetadataClient, clock: Callable[[], float] = time.monotonic) -> Identity:
    """The instance's identity, asked again for METADATA_PATIENCE_S while the service fails."""
    give_up = clock() + METADATA_PATIENCE_S
    while True:
        try:
            return metadata.identity()
        except AgentError as error:
            if clock() > give_up:
                raise
            say("instance metadata unavailable at boot; asking again", error=str(error))
            time.sleep(2.0)


class SpotWatch:
    """A look for a Spot notice every `every` seconds, until one came."""

    def __init__(self, metadata: MetadataClient, every: float):
        self.metadata, self.every = metadata, every
        self.seen = False
        self.next_look = -math.inf
        self.failing = False

    def new_notice(self, now: float) -> bool:
        """Whether EC2 gave the Spot notice since the last look, when a look is due at `now`."""
        if self.seen or now < self.next_look:
            return False
        self.next_look = now + self.every
        self.seen = self.notice() is not None
        return self.seen

    def notice(self) -> dict[str, Any] | None:
        """The Spot notice, if the metadata service shows one; a service that does not answer
        (it throttles too) is asked again at the next look, never the end of the agent."""
        try:
            notice = self.metadata.spot_action()
        except AgentError as error:
            if not self.failing:
                say("instance metadata unavailable: looking for a Spot notice again at the next look",
                    error=str(error))
            self.failing = True
            return None
        self.failing = False
        return notice
