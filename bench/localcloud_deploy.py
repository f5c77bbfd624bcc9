"""How long `trainfleet local deploy` of template.yaml takes, and what one instance metadata
read costs.

    MOTO_IAM_LOAD_MANAGED_POLICIES=true .venv/bin/python bench/localcloud_deploy.py [--repeats 3]

Deploy: the project's template.yaml into one LocalCloud, `repeats` times under different stack
names (the first includes packaging the repository and the SAM translator's imports). The
split between packaging + transform and resource creation is printed too.
Metadata: a token PUT plus a GET through botocore's IMDS fetcher, against a plain GET with a
token already held, side by side in one run. Last line: deploy_s=<median>.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import urllib.request
import uuid
from datetime import datetime, timezone
from pathlib import Path

# Run as a script, this file's own folder comes first on sys.path and its name would shadow
# the package it measures.
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)

REPO = Path(__file__).resolve().parents[1]


def bench_deploy(cloud, repeats: int) -> list[float]:
    from localcloud.deploy import DeployRequest, deploy, load_template, transform_sam

    seconds = []
    for attempt in range(repeats):
        started = time.perf_counter()
        stack = deploy(DeployRequest(REPO / "template.yaml", cloud.endpoint, stack_name=f"bench-{uuid.uuid4().hex[:6]}"))
        seconds.append(time.perf_counter() - started)
        print(f"deploy {attempt + 1}: {seconds[-1]:.2f} s, {len(stack.resources)} resources")
    template = load_template(REPO / "template.yaml")
    for resource in template["Resources"].values():  # what packaging does, without the upload
        if "CodeUri" in resource.get("Properties", {}):
            resource["Properties"]["CodeUri"] = "s3://bench/code.zip"
        if "DefinitionUri" in resource.get("Properties", {}):
            resource["Properties"]["DefinitionUri"] = "s3://bench/definition.json"
        if "ContentUri" in resource.get("Properties", {}):
            resource["Properties"]["ContentUri"] = "s3://bench/layer.zip"
    started = time.perf_counter()
    transform_sam(template, {"AWS::AccountId": cloud.account_id}, cloud.region)
    print(f"SAM transform alone: {time.perf_counter() - started:.2f} s")
    return seconds


def bench_metadata(reads: int) -> None:
    from botocore.utils import IMDSFetcher

    from localcloud.imds import InstanceMetadata, InstanceMetadataServer

    record = InstanceMetadata("i-0bench0000000000", "p5.48xlarge", "ami-12c6146b", "127.77.0.10", "us-east-1a",
                              "us-east-1", "123456789012", datetime.now(timezone.utc))

    class Reader(IMDSFetcher):
        def read(self, path: str) -> str:
            return self._get_request(path, None, self._fetch_metadata_token()).text

    with InstanceMetadataServer({record.instance_id: record}.get) as server:
        endpoint = server.endpoint_for(record.instance_id)
        reader = Reader(timeout=2, num_attempts=1, config={"ec2_metadata_service_endpoint": endpoint})
        token = reader._fetch_metadata_token()
        plain = urllib.request.Request(f"{endpoint}/latest/meta-data/instance-id",
                                       headers={"X-aws-ec2-metadata-token": token})
        with_token, held = [], []
        for _ in range(reads):
            started = time.perf_counter()
            reader.read("latest/meta-data/instance-id")
            with_token.append(time.perf_counter() - started)
            started = time.perf_counter()
            with urllib.request.urlopen(plain, timeout=2) as response:
                response.read()
            held.append(time.perf_counter() - started)
    print(f"metadata read, new token each time (botocore): median {statistics.median(with_token) * 1000:.2f} ms")
    print(f"metadata read, token held (urllib):            median {statistics.median(held) * 1000:.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--reads", type=int, default=200)
    args = parser.parse_args()
    os.environ.setdefault("MOTO_IAM_LOAD_MANAGED_POLICIES", "true")  # SAM roles attach AWS managed policies
    from localcloud import LocalCloud

    with LocalCloud() as cloud:
        seconds = bench_deploy(cloud, args.repeats)
    bench_metadata(args.reads)
    print(f"deploy_s={statistics.median(seconds):.2f}")


if __name__ == "__main__":
    main()
