"""The AWS CLI of a local instance's image: what the node user data runs of it, against the
local cloud, with the instance's own credentials (its instance profile's role, from the metadata
service) as the CLI on EC2 has them.

    aws s3 cp s3://BUCKET/KEY DIR/
    aws events put-events [--region R] --entries file://ENTRIES.json

A local instance finds `aws` on its PATH (localcloud/image_tools/aws runs this module). Errors
are printed as the CLI prints them, and the exit status is the CLI's: 1 for a failed s3
transfer, 255 for a failed call; a PutEvents entry the bus refused is in the answer printed, as
the CLI prints it, with status 0.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import boto3
from botocore.exceptions import BotoCoreError, ClientError

def s3_cp(source: str, into: str) -> int:
    """One object into a folder, as the CLI asks for an object below its part size: HEAD, GET."""
    bucket, _, key = source.removeprefix("s3://").partition("/")
    target = Path(into) / key.rsplit("/", 1)[-1] if into.endswith("/") or Path(into).is_dir() else Path(into)
    try:
        s3 = boto3.client("s3")
        s3.head_object(Bucket=bucket, Key=key)
        body = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
    except (BotoCoreError, ClientError) as error:
        print(f"fatal error: {error}", file=sys.stderr)
        return 1
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(body)
    print(f"download: s3://{bucket}/{key} to {target}")
    return 0


def put_events(entries: str, region: str | None) -> int:
    try:
        answer = boto3.client("events", region_name=region).put_events(
            Entries=json.loads(Path(entries.removeprefix("file://")).read_text()))
    except (BotoCoreError, ClientError) as error:
        print(f"\n{error}", file=sys.stderr)
        return 255
    print(json.dumps({key: value for key, value in answer.items() if key != "ResponseMetadata"}, indent=4))
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="aws")
    parser.add_argument("--region")
    services = parser.add_subparsers(dest="service", required=True)
    s3 = services.add_parser("s3").add_subparsers(dest="command", required=True).add_parser("cp")
    s3.add_argument("source")
    s3.add_argument("into")
    events = services.add_parser("events").add_subparsers(dest="command", required=True).add_parser("put-events")
    events.add_argument("--region")
    events.add_argument("--entries", required=True)
    args = parser.parse_args(argv)
    if args.service == "s3":
        return s3_cp(args.source, args.into)
    return put_events(args.entries, args.region)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
