"""How a LocalCloud runs: its settings, apart from the cloud so that the parts it hands them to
(the fleet, the glue) can name them without the cloud (localcloud/parts.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class LocalCloudConfig:
    """How a LocalCloud runs. Every field has a default that suits tests and the demo."""

    region: str = "us-east-1"
    """The one region served (clients of other regions work too, with separate state)."""
    host: str = "127.0.0.1"
    """Address the HTTP endpoint binds; loopback only, never a public interface."""
    port: int = 0
    """Port of the endpoint; 0 picks a free one."""
    time_scale: float = 1.0
    """Real seconds per nominal second for Wait states, Retry intervals, instance boot and the
    Spot notice period: 0.01 makes a 120 s notice last 1.2 s. Timeouts and heartbeats of
    tasks stay real: they bound real work."""
    workdir: Path | None = None
    """Where instances get their working folders; a temporary folder that
    is removed on stop when None."""
    boot_seconds: float = 2.0
    """Nominal seconds an instance stays `pending` before it is `running` and boots."""
    boot_spread_seconds: float = 0.0
    """Nominal seconds over which the boots of instances launched together spread: each waits
    boot_seconds plus a uniform draw up to this. EC2's instances of one launch reach `running`
    over tens of seconds, not in the same instant (hundreds of agents asking the one local
    metadata service at once overwhelm it)."""
    shutdown_grace_seconds: float = 5.0
    """Real seconds a terminated instance's processes get after SIGTERM before SIGKILL."""
    spot_notice_seconds: float = 120.0
    """Nominal seconds between an injected Spot interruption warning and the interruption
    (AWS gives two minutes)."""
    delivery_workers: int = 8
    """Threads that deliver EventBridge events to targets and run the fleet's transitions."""
    s3_prefix_rates: tuple[int, int] = (5500, 3500)
    """GET/HEAD and PUT/COPY/POST/DELETE requests S3 serves a second (of this cloud's time) per
    prefix, as it documents; it answers 503 SlowDown beyond (glue/s3_rates.py)."""

    def __post_init__(self) -> None:
        if self.time_scale <= 0:
            raise ValueError(f"time_scale must be > 0, got {self.time_scale}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be 0..65535, got {self.port}")
        for name in ("boot_seconds", "boot_spread_seconds", "shutdown_grace_seconds", "spot_notice_seconds"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.delivery_workers < 1:
            raise ValueError(f"delivery_workers must be >= 1, got {self.delivery_workers}")
        if min(self.s3_prefix_rates) < 1:
            raise ValueError(f"s3_prefix_rates must be >= 1 a second, got {self.s3_prefix_rates}")
        if self.host not in {"127.0.0.1", "localhost", "::1"}:
            raise ValueError(f"host must be a loopback address, got {self.host!r}")
