"""The request-cost benchmark (``python -m benchmarks.request_cost``) measures real requests.

It runs against the session's SeaweedFS with a few requests and checks that every figure
is a positive CPU time and that the objects it read were really fetched through both
clients. It asserts nothing about speed.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `pytest` run as a script does not put the repo root there
    sys.path.insert(0, str(REPO))

from stores import S3_TEST_BUCKET  # noqa: E402

from benchmarks import request_cost  # noqa: E402
from dcpstore.testing.servers import S3Server  # noqa: E402


def test_request_cost_measures_both_clients(seaweedfs_s3: S3Server) -> None:
    before = dict(os.environ)
    figures = request_cost.measure(seaweedfs_s3, S3_TEST_BUCKET, requests=3, rounds=2)
    assert dict(os.environ) == before  # the server's credentials are not left behind
    keys = {
        "make_client_ms",
        "get_1B_dcpstore_ms",
        "get_1B_boto3_ms",
        "get_1MiB_dcpstore_ms",
        "get_1MiB_boto3_ms",
    }
    assert keys <= figures.keys()
    assert all(figures[key] > 0 for key in keys)
    listed = seaweedfs_s3.client().list_objects_v2(Bucket=S3_TEST_BUCKET, Prefix="request-cost/")
    sizes = sorted(obj["Size"] for obj in listed.get("Contents", []))
    assert sizes == [1, 1 << 20]
