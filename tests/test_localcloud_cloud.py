"""LocalCloud itself: configuration checks, one cloud per process, the environment it hands out."""

import pytest

from localcloud import LocalCloud, LocalCloudConfig


@pytest.mark.parametrize("field, value", [("time_scale", 0), ("port", 70000), ("boot_seconds", -1),
                                          ("delivery_workers", 0), ("host", "0.0.0.0")])
def test_bad_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        LocalCloudConfig(**{field: value})


def test_one_cloud_per_process_and_a_taken_port_is_refused(local_cloud):
    with pytest.raises(RuntimeError, match="already running"):
        local_cloud.start()
    with pytest.raises(OSError, match=f"port {local_cloud.port} on 127.0.0.1 is not free"):
        LocalCloud(port=local_cloud.port).start()
    with pytest.raises(RuntimeError, match="already running in this process"):
        LocalCloud().start()


def test_env_points_an_sdk_at_the_endpoint(local_cloud):
    env = local_cloud.env()
    assert env["AWS_ENDPOINT_URL"] == local_cloud.endpoint.rstrip("/")
    assert env["AWS_REGION"] == env["AWS_DEFAULT_REGION"] == "us-east-1"
    assert local_cloud.client("sts").get_caller_identity()["Account"] == local_cloud.account_id
