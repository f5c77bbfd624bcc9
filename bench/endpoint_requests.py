"""What counting requests costs at the local cloud's endpoint, per request.

    .venv/bin/python bench/endpoint_requests.py [--calls 20000]

Every signed request to the endpoint has its action worked out (`localcloud.api_requests`)
before moto sees it: from X-Amz-Target (JSON protocols), the form's Action (query protocols) or
method and path against botocore's request URIs (REST: S3, Lambda). Figures: microseconds per
call of each kind, the first REST call of a service apart (it loads botocore's model). Last
line: rest_action_us=<S3 PutObject, per call>.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

# Run as a script, this file's own folder comes first on sys.path and its name would shadow
# the package it measures.
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)

from localcloud.api_requests import request_action  # noqa: E402

CASES = {
    "json (DynamoDB PutItem)": ("dynamodb", "POST", "/", "", {"x-amz-target": "DynamoDB_20120810.PutItem"}, None),
    "query (EC2 DescribeInstances)": ("ec2", "POST", "/", "", {}, "Action=DescribeInstances&Version=2016-11-15"),
    "rest (Lambda Invoke)": ("lambda", "POST", "/2015-03-31/functions/f/invocations", "", {}, None),
    "rest (S3 PutObject)": ("s3", "PUT", "/bucket/runs/a/step-100/__0_0.distcp", "", {"content-length": "1"}, None),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=20000)
    calls = parser.parse_args().calls
    per_call = {}
    for name, case in CASES.items():
        started = time.perf_counter()
        first = request_action(*case)
        first_ms = (time.perf_counter() - started) * 1000
        started = time.perf_counter()
        for _ in range(calls):
            request_action(*case)
        per_call[name] = (time.perf_counter() - started) / calls * 1e6
        print(f"{name:32s} -> {first:20s} first call {first_ms:7.1f} ms, then {per_call[name]:6.1f} us/call")
    print(f"rest_action_us={per_call['rest (S3 PutObject)']:.1f}")


if __name__ == "__main__":
    main()
