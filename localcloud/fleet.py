"""The local fleet: each EC2 instance of the local cloud is a process group on this machine.

On EC2, an instance boots and its user data starts the node agent. Here, when an instance
reaches `running`, the fleet asks its `boot` callable what to run for it and starts that as
a new process group, in the instance's own working folder, with its own private address and
environment. By default a user-data shell script ("#!...") is what runs, as cloud-init
would run it; set `fleet.boot` to decide per instance (by launch template, tags, ...).

Each instance gets a loopback address of its own (127.77.x.y; Linux routes all of 127/8 to
the loopback interface) and moto records it as the instance's PrivateIpAddress, so peers
can reach a node at the address DescribeInstances reports. Its environment is this process's,
plus `LocalCloud.env()` (endpoint, region; not its credentials), plus LOCALCLOUD_INSTANCE_ID,
LOCALCLOUD_PRIVATE_IP and LOCALCLOUD_INSTANCE_TYPE, plus whatever `env_hooks` add (the
instance metadata server adds its endpoint there); instance_site/ on its PYTHONPATH is how a
network made slow (`slow_network`) reaches its torch.distributed transfers; image_tools/ first
on its PATH holds the tools its image brings (the AWS CLI), and TRAINFLEET_ROOT names a folder
of its own that the node user data uses as the filesystem root. Output goes to `console.log` in the
instance's folder, like EC2's console output. With a warm image (`use_warm_image`, for fleets of
hundreds: localcloud/warm_image.py), a boot command `python -m MODULE ...` is forked from the
image instead of started afresh; the instance's process is the same to everything below.

Lifecycle, as EC2 reports it with state-change events on the default bus:

    RunInstances/CreateFleet -> pending --boot_seconds--> running (process starts)
    TerminateInstances       -> shutting-down (SIGTERM, grace, SIGKILL) -> terminated
    StopInstances            -> stopping (process stopped the same way)  -> stopped
    StartInstances           -> pending --boot_seconds--> running (process starts again)
    process exits by itself  -> shutting-down -> terminated (instance-initiated shutdown)

A user-data script is not that process: the instance boots into CLOUD_INIT, which runs the script
and stays up after it, as an EC2 host does; `shutdown` (image_tools/, on the instance's PATH)
ends the instance from inside.

Fault injection: kill (SIGKILL the process group: the instance dies), hang (SIGSTOP of every
process of the instance, its process group and whatever left it: the
instance stays `running` but does nothing, as a wedged host does), resume (SIGCONT), and the
Spot interruption (`LocalCloud.inject_spot_interruption`) which ends in `interrupt`. One
process of a healthy instance can fail alone: hang_process (SIGSTOP: a rank stuck in a
collective or a wedged agent, the host still fine) and crash_process (SIGKILL: a rank killed
by the OOM killer or a segfault), by role: "trainer" is one rank (the lowest-pid process
running trainer.worker or trainer.train under the instance's torchrun), "agent" the node
agent alone (node.agent, not torchrun or the ranks it started).
A machine whose cores are shared with others (`cpu_share` of an instance below 1) starves the
instance: its processes run only that share of the time (SIGSTOP and SIGCONT in turn, as a CPU
quota throttles), all of them slower, none of them silent.
A network cut between two nodes is not provided: it needs packet filtering (root) on the
shared loopback interface.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import logging
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from localcloud import aws_events, in_place, warm_image
from localcloud.procfs import descendants, stat_fields
from localcloud.warm_image import ForkedProcess, WarmImage
from trainfleet.core.runspec import HOST_MEMORY_DIR

if TYPE_CHECKING:
    from localcloud.parts import FleetHost

log = logging.getLogger(__name__)

__all__ = ["LocalFleet", "LocalInstance", "BootCommand", "boot_user_data", "ROLE_MODULES",
           "python_module"]

HARNESS_CREDENTIALS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                       "AWS_SECURITY_TOKEN", "AWS_PROFILE")
"""Credential variables of the harness's environment that an instance's processes never see."""
LOOPBACK_POOL = ipaddress.ip_network("127.77.0.0/16")
"""Where instances' private addresses come from."""
IMAGE_TOOLS = Path(__file__).resolve().parent / "image_tools"
"""First on every instance's PATH: the tools its image brings (the AWS CLI: localcloud/aws_cli.py)."""
INSTANCE_SITE = Path(__file__).resolve().parent / "instance_site"
"""On every instance's PYTHONPATH: its sitecustomize makes `slow_network` felt."""


@dataclass
class LocalInstance:
    """One instance as the fleet sees it."""

    instance_id: str
    """The EC2 instance id moto gave it."""
    instance_type: str
    """p4d.24xlarge, ... as requested."""
    private_ip: str
    """Its loopback address, also its PrivateIpAddress in EC2."""
    workdir: Path
    """Its own folder: the process's working directory, user data, console.log."""
    user_data: str
    """Decoded user data (empty when none was given)."""
    launch_template_id: str | None
    """The launch template it came from, if any (tag aws:ec2launchtemplate:id)."""
    tags: dict[str, str]
    """Its tags at launch."""
    state: str = "pending"
    """Last state the fleet reported: pending, running, stopping, stopped, shutting-down,
    terminated."""
    spot_action: dict[str, str] | None = None
    """The spot/instance-action metadata document once an interruption was injected."""
    rebalance_notice: dict[str, str] | None = None
    """The events/recommendations/rebalance metadata document once a recommendation was
    injected: {"noticeTime": ...}."""
    process: subprocess.Popen | ForkedProcess | None = field(default=None, repr=False)
    """The running boot process group's leader, if any."""
    hung: bool = False
    """True while SIGSTOPped by `hang`."""
    _ending: bool = field(default=False, repr=False)
    """Set when the fleet itself ends the process, so its exit is not a crash."""

    @property
    def console_log(self) -> Path:
        return self.workdir / "console.log"

    @property
    def network_delay_file(self) -> Path:
        """Where LocalFleet.slow_network puts the instance's network delay (outside its folder,
        which is the instance's own disk)."""
        return self.workdir.with_name(f"{self.workdir.name}.network-delay")


def _strays(instance: LocalInstance, group: int | None) -> list[int]:
    """The instance's processes besides its process, those that left its process group too
    (torchrun starts its ranks in sessions of their own): the ones below its process, and those
    an ended parent left behind, found by working in the instance's folder (its disk). On EC2
    every one of them ends with the instance. `group`: its process's pid, which leads its group
    (None: not to be followed)."""
    folder = str(instance.workdir.resolve())
    found = set(descendants(group)) if group is not None else set()
    for cwd in Path("/proc").glob("[0-9]*/cwd"):
        try:
            where = os.readlink(cwd)
        except OSError:
            continue  # ended while listed, or not ours to read
        if where == folder or where.startswith(folder + os.sep):
            found.add(int(cwd.parent.name))
    found.discard(os.getpid())  # never the local cloud itself, whatever its folder
    return sorted(found - {group})


ROLE_MODULES = {"trainer": ("trainer.worker", "trainer.train"), "agent": ("node.agent",),
                "launcher": ("node.torchrun",)}
"""Process role -> the Python modules (`python -m MODULE`) a process of that role runs."""
_ROLE_MODULE_NAMES = [module for modules in ROLE_MODULES.values() for module in modules]
_OPTIONS_WITH_VALUE = {"-W", "-X", "-Q"}


def python_module(argv: Sequence[str]) -> str | None:
    """The module a Python command line runs (`python -u -m trainer.worker ...` ->
    trainer.worker); None for a script, `-c` code or anything else. Only the interpreter's own
    `-m` counts: torchrun's `-m trainer.worker` is an argument of torchrun's."""
    if not argv or not Path(argv[0]).name.startswith("python"):
        return None
    arguments = iter(argv[1:])
    for argument in arguments:
        if argument == "-m":
            return next(arguments, None)
        if argument in _OPTIONS_WITH_VALUE:
            next(arguments, None)
        elif not argument.startswith("-") or argument == "-c":
            return None
    return None


def _module(pid: int) -> str | None:
    """The module a process runs: its command line's, or, for a command run in place in a
    warm image's process (whose command line is the image's), the one its name says."""
    module = python_module(_argv(pid))
    if module != warm_image.__name__:
        return module
    try:
        name = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None
    return in_place.module_of(name, _ROLE_MODULE_NAMES)


def _argv(pid: int) -> list[str]:
    """A process's command line; empty once it ended (a zombie has none)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


BootCommand = Callable[[LocalInstance], Sequence[str] | None]
"""Given an instance that just reached `running`, the argv to start for it, or None."""


CLOUD_INIT = """"$1"
echo "cloud-init: the user data script exited with status $?; the instance stays up"
exec sleep infinity
"""
"""The instance's first process when it boots from its user data: it runs the script, as cloud-init
does once, and the host stays up after it whatever its status (on EC2 a failed user data script
leaves a running instance). The instance ends when it is terminated, or shut down from inside
(`shutdown`, image_tools/shutdown, which ends this process with the others)."""


def boot_user_data(instance: LocalInstance) -> Sequence[str] | None:
    """What cloud-init would run: a user-data script that starts with '#!'."""
    if not instance.user_data.startswith("#!"):
        return None
    script = instance.workdir / "user-data"
    script.write_text(instance.user_data)
    script.chmod(0o755)
    return ["/bin/sh", "-c", CLOUD_INIT, "cloud-init", str(script)]


def decode_user_data(raw: Any) -> str:
    """moto keeps user data base64-encoded (as the API carries it); text here."""
    if not raw:
        return ""
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    try:
        return base64.b64decode(text, validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        return text


STARVED_PERIOD_S = 0.2
"""A starved instance's processes run for their share of each such period, and are stopped for the rest."""
STARVED_LOOKUP_S = 1.0
"""How often a starved instance's processes are looked up again (/proc is read: a few ms)."""


class _Starvation(threading.Thread):
    """Lets an instance's processes, all of them (its group, and the ranks torchrun starts in
    sessions of their own), run only `share` of the time: SIGCONT, then SIGSTOP for the rest of
    each STARVED_PERIOD_S, as a CPU quota does (a container's, or noisy neighbours on shared
    cores). Ends, leaving them running, when the instance stops running or is frozen."""

    def __init__(self, instance: LocalInstance, process: subprocess.Popen | ForkedProcess, share: float):
        super().__init__(name=f"starve-{instance.instance_id}", daemon=True)
        self.instance, self.process, self.share = instance, process, share

    def run(self) -> None:
        pids: list[int] = []
        looked_up = -math.inf
        while self.instance.process is self.process and not self.instance._ending and not self.instance.hung:
            if time.monotonic() - looked_up > STARVED_LOOKUP_S:
                pids, looked_up = descendants(self.process.pid), time.monotonic()
            _signal_group(self.process.pid, signal.SIGCONT)
            _signal_pids(pids, signal.SIGCONT)
            time.sleep(self.share * STARVED_PERIOD_S)
            if self.instance.process is not self.process or self.instance._ending or self.instance.hung:
                break
            _signal_group(self.process.pid, signal.SIGSTOP)
            _signal_pids(pids, signal.SIGSTOP)
            time.sleep((1 - self.share) * STARVED_PERIOD_S)
        if not self.instance.hung:  # a freeze keeps its processes stopped
            _signal_group(self.process.pid, signal.SIGCONT)
            _signal_pids(pids, signal.SIGCONT)


class LocalFleet:
    def __init__(self, cloud: FleetHost):
        self.cloud = cloud
        self.boot: BootCommand = boot_user_data
        self.env_hooks: list[Callable[[LocalInstance], dict[str, str]]] = []
        self.image: WarmImage | None = None
        self.cpu_share: Callable[[LocalInstance], float] = lambda instance: 1.0
        """The share of CPU time an instance's processes get when it boots (below 1: starved,
        _Starvation): a machine whose cores its instances share with others."""
        self._instances: dict[str, LocalInstance] = {}
        self._by_address: dict[str, LocalInstance] = {}
        self._lock = threading.RLock()
        self._next_address = int(LOOPBACK_POOL.network_address) + 10

    # --- queries -------------------------------------------------------------------------

    def get(self, instance_id: str) -> LocalInstance:
        with self._lock:
            instance = self._instances.get(instance_id)
        if instance is None:
            raise KeyError(f"no instance {instance_id!r} in the local fleet "
                           f"(known: {sorted(self._instances)})")
        return instance

    def instances(self) -> list[LocalInstance]:
        with self._lock:
            return list(self._instances.values())

    def at_address(self, address: str) -> LocalInstance | None:
        """The instance whose private address this is (never given to another), or None."""
        with self._lock:
            return self._by_address.get(address)

    def use_warm_image(self, modules: list[str]) -> None:
        """Boot instances from now on from a warm image with `modules` imported."""
        self.image = WarmImage.start(modules, path=[str(INSTANCE_SITE)])

    def wait_for_state(self, instance_id: str, state: str) -> None:
        self.cloud.wait_until(lambda: self.get(instance_id).state == state, f"{instance_id} to be {state}")

    # --- fault injection -----------------------------------------------------------------

    def kill(self, instance_id: str) -> None:
        """SIGKILL the instance's processes, all of them, as a host that dies; the instance then
        terminates on its own."""
        instance = self.get(instance_id)
        strays = _strays(instance, instance.process.pid if instance.process is not None else None)
        self._signal(instance_id, signal.SIGKILL)
        _signal_pids(strays, signal.SIGKILL)

    def hang(self, instance_id: str) -> None:
        """SIGSTOP the instance's processes: alive, `running`, and doing nothing. All of them, like
        a frozen machine: also those that left its process group (torchrun starts its ranks in
        sessions of their own)."""
        self._signal(instance_id, signal.SIGSTOP)
        self._signal_descendants(instance_id, signal.SIGSTOP)
        self.get(instance_id).hung = True

    def hang_process(self, instance_id: str, role: str) -> int:
        """SIGSTOP one process of the instance (see ROLE_MODULES), the rest running on; its pid.
        `resume` continues it."""
        pid = self.process_of(instance_id, role)
        os.kill(pid, signal.SIGSTOP)
        return pid

    def crash_process(self, instance_id: str, role: str) -> int:
        """SIGKILL one process of the instance (see ROLE_MODULES), as a crash ends it; its pid."""
        pid = self.process_of(instance_id, role)
        os.kill(pid, signal.SIGKILL)
        return pid

    def slow_network(self, instance_id: str, delay_s: float) -> None:
        """From now on every torch.distributed transfer of the instance's processes waits
        `delay_s` (real seconds) before it starts (instance_site/sitecustomize.py): a node with
        a slow network, its agent's calls to the control plane as fast as before. 0 heals it."""
        if delay_s < 0:
            raise ValueError(f"delay_s must be >= 0, got {delay_s}")
        self.get(instance_id).network_delay_file.write_text(str(delay_s))

    def process_of(self, instance_id: str, role: str) -> int:
        """The pid of the instance's process of that role: the lowest of those running one of
        the role's modules."""
        if role not in ROLE_MODULES:
            raise ValueError(f"role must be one of {sorted(ROLE_MODULES)}, got {role!r}")
        instance = self.get(instance_id)
        process = instance.process
        if process is None or instance.state != "running":
            raise RuntimeError(f"instance {instance_id} ({instance.state}) has no running processes")
        found = sorted(pid for pid in (process.pid, *descendants(process.pid))
                       if _module(pid) in ROLE_MODULES[role])
        if not found:
            raise RuntimeError(f"instance {instance_id} has no {role} process (python -m "
                               f"{' or '.join(ROLE_MODULES[role])}) yet")
        return found[0]

    def resume(self, instance_id: str) -> None:
        """SIGCONT every process of the instance: what hang or hang_process stopped goes on."""
        self._signal_descendants(instance_id, signal.SIGCONT)
        self._signal(instance_id, signal.SIGCONT)
        self.get(instance_id).hung = False

    def _signal_descendants(self, instance_id: str, signum: signal.Signals) -> None:
        _signal_pids(descendants(self.get(instance_id).process.pid), signum)

    def _signal(self, instance_id: str, signum: signal.Signals) -> None:
        instance = self.get(instance_id)
        if instance.process is None or instance.state != "running":
            raise RuntimeError(f"instance {instance_id} ({instance.state}) has no running "
                               f"process to send {signum.name} to")
        try:
            os.killpg(instance.process.pid, signum)
        except ProcessLookupError as exc:
            raise RuntimeError(f"instance {instance_id}: its processes are already gone") from exc

    def interrupt(self, instance_id: str, action: str) -> None:
        """Carry out a Spot interruption: terminate, or stop (hibernate stops too)."""
        from localcloud.glue.ec2 import ec2_backend

        instance = self.get(instance_id)
        if instance.state not in {"pending", "running"}:
            return  # already gone, as a Spot instance can be before its notice runs out
        backend = ec2_backend(self.cloud)
        if action == "terminate":
            backend.terminate_instances([instance_id])
            _set_reason(backend, instance_id, "Server.SpotInstanceTermination",
                        "Server.SpotInstanceTermination: Spot instance termination")
        else:
            backend.stop_instances([instance_id])
            _set_reason(backend, instance_id, "Server.SpotInstanceShutdown",
                        "Server.SpotInstanceShutdown: Spot instance shutdown")

    # --- lifecycle, driven by the EC2 glue -----------------------------------------------

    def launched(self, moto_instance: Any) -> None:
        """A new instance exists in moto: give it an address and a folder, report pending."""
        from localcloud.glue.ec2 import set_private_ip

        with self._lock:
            private_ip = self._allocate_address()
        set_private_ip(self.cloud, moto_instance.id, private_ip)
        workdir = self.cloud.workdir / "instances" / moto_instance.id
        workdir.mkdir(parents=True, exist_ok=True)
        tags = {tag["key"]: tag["value"] for tag in moto_instance.get_tags()}
        instance = LocalInstance(
            instance_id=moto_instance.id, instance_type=moto_instance.instance_type,
            private_ip=private_ip, workdir=workdir,
            user_data=decode_user_data(moto_instance.user_data),
            launch_template_id=tags.get("aws:ec2launchtemplate:id"), tags=tags)
        with self._lock:
            self._instances[instance.instance_id] = instance
            self._by_address[private_ip] = instance
        self._report(instance, "pending")
        self._start_booting(instance)

    def started(self, instance_id: str) -> None:
        instance = self.get(instance_id)
        self._report(instance, "pending")
        self._start_booting(instance)

    def ending(self, instance_id: str, final_state: str) -> None:
        """Terminate (final_state 'terminated') or stop ('stopped') an instance."""
        instance = self.get(instance_id)
        passing = "shutting-down" if final_state == "terminated" else "stopping"
        with self._lock:  # not between a boot's check of `pending` and its process start
            instance._ending = True
            self._report(instance, passing)

        def finish() -> None:
            self._end_process(instance)
            # Its memory goes with it: the in-memory checkpoints its tmpfs held (runspec.HOST_MEMORY_DIR).
            shutil.rmtree(instance.workdir / "root" / HOST_MEMORY_DIR.lstrip("/"), ignore_errors=True)
            self._report(instance, final_state)

        self.cloud.submit(f"{passing} {instance_id}", finish)

    def shutdown(self) -> None:
        """End every process (the cloud is stopping); no events any more."""
        instances = self.instances()
        for instance in instances:  # all get SIGTERM first, so the grace periods overlap
            instance._ending = True
            if instance.process is not None:
                _signal_group(instance.process.pid, signal.SIGTERM)
        for instance in instances:
            self._end_process(instance)
        if self.image is not None:
            self.image.stop()

    # --- internals -----------------------------------------------------------------------

    def _allocate_address(self) -> str:
        address = ipaddress.ip_address(self._next_address)
        if address not in LOOPBACK_POOL or address == LOOPBACK_POOL.broadcast_address:
            raise RuntimeError(f"local fleet ran out of addresses in {LOOPBACK_POOL}")
        self._next_address += 1
        return str(address)

    def _report(self, instance: LocalInstance, state: str) -> None:
        """Record the state in moto and the fleet, then emit the state-change event."""
        from localcloud.glue.ec2 import set_moto_state

        set_moto_state(self.cloud, instance.instance_id, state)
        instance.state = state
        self.cloud.put_event(aws_events.instance_state_change(
            self.cloud.region, self.cloud.account_id, instance.instance_id, state))

    def _start_booting(self, instance: LocalInstance) -> None:
        def boot() -> None:
            from localcloud.glue.ec2 import after_fleet_creation

            after_fleet_creation()  # a fleet's instances boot once CreateFleet has answered
            with self._lock:
                if instance.state != "pending":  # terminated or stopped while pending
                    return
                self._report(instance, "running")
                instance._ending = False
                self._start_process(instance)

        config = self.cloud.config
        self.cloud.submit_later(f"boot {instance.instance_id}",
                                config.boot_seconds + random.uniform(0, config.boot_spread_seconds), boot)

    def _start_process(self, instance: LocalInstance) -> None:
        argv = self.boot(instance)
        if not argv:
            return
        env = dict(os.environ) | self.cloud.env() | {
            "LOCALCLOUD_INSTANCE_ID": instance.instance_id,
            "LOCALCLOUD_PRIVATE_IP": instance.private_ip,
            "LOCALCLOUD_INSTANCE_TYPE": instance.instance_type,
            "LOCALCLOUD_NETWORK_DELAY_FILE": str(instance.network_delay_file),
            # The image's tools first on the PATH (the AWS CLI), run by this interpreter; and the
            # instance's own filesystem root, for the node user data to write /etc and /opt under.
            "PATH": os.pathsep.join([str(IMAGE_TOOLS), os.environ.get("PATH", "")]),
            "LOCALCLOUD_PYTHON": sys.executable,
            "TRAINFLEET_ROOT": str(instance.workdir / "root"),
        }
        # An instance holds no credentials but its instance profile's (the metadata server's
        # hook adds them), as on EC2: never the harness's administrator keys.
        for name in HARNESS_CREDENTIALS:
            env.pop(name, None)
        env |= {"AWS_SHARED_CREDENTIALS_FILE": os.devnull, "AWS_CONFIG_FILE": os.devnull}
        for hook in self.env_hooks:
            env |= hook(instance)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(INSTANCE_SITE), env.get("PYTHONPATH")]))
        if self.image is not None and self.image.serves(list(argv)):
            instance.process = self.image.fork(list(argv), instance.workdir, env, instance.console_log)
        else:
            with open(instance.console_log, "ab") as console:
                instance.process = subprocess.Popen(
                    list(argv), cwd=instance.workdir, env=env, stdin=subprocess.DEVNULL,
                    stdout=console, stderr=subprocess.STDOUT, start_new_session=True)
        threading.Thread(target=self._watch, args=(instance, instance.process),
                         name=f"watch-{instance.instance_id}", daemon=True).start()
        share = self.cpu_share(instance)
        if share < 1:
            _Starvation(instance, instance.process, share).start()

    def _watch(self, instance: LocalInstance, process: subprocess.Popen | ForkedProcess) -> None:
        """A process that ends by itself takes its instance down, as a dead host does.

        A process of ours is observed without reaping (WNOWAIT): until `_end_process` reaps it,
        the leader's pid, which is also its group's id, cannot be reused by an unrelated process
        group, so signalling the group is always safe. A fork of the warm image is reaped by the
        image at once; its pid is signalled only until the image reports its exit, milliseconds
        later, far too soon for the kernel to hand the pid out again."""
        if isinstance(process, ForkedProcess):
            exit_status = process.wait()
        else:
            try:
                exit_status = os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOWAIT).si_status
            except ChildProcessError:
                return  # reaped by `_end_process` before this thread got to wait: the fleet ended it
        if instance._ending or instance.process is not process:
            return
        log.info("instance %s: process exited with %s; terminating it",
                 instance.instance_id, exit_status)
        from localcloud.glue.ec2 import ec2_backend

        backend = ec2_backend(self.cloud)
        backend.terminate_instances([instance.instance_id])
        _set_reason(backend, instance.instance_id, "Client.InstanceInitiatedShutdown",
                    f"Client.InstanceInitiatedShutdown: process exited with {exit_status}")

    def _end_process(self, instance: LocalInstance) -> None:
        """SIGTERM the whole process group, SIGKILL what is left after the grace period,
        then reap the leader (see `_watch`) and forget the process."""
        process = instance.process
        if process is None:
            return
        group = None if isinstance(process, ForkedProcess) and process.returncode is not None else process.pid
        strays = _strays(instance, group)  # see _watch: a reaped fork's pid is not ours to follow
        for signum in (signal.SIGCONT, signal.SIGTERM):  # a stopped process cannot act on SIGTERM
            if group is not None:
                _signal_group(group, signum)
            _signal_pids(strays, signum)
        deadline = time.monotonic() + self.cloud.config.shutdown_grace_seconds
        while ((group is not None and _group_alive(group)) or any(map(_alive, strays))) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        if group is not None:
            _signal_group(group, signal.SIGKILL)  # children that outlived their leader
        _signal_pids(strays, signal.SIGKILL)
        process.wait(timeout=10)
        instance.process = None
        instance.hung = False


def _signal_pids(pids: list[int], signum: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass  # ended meanwhile


def _alive(pid: int) -> bool:
    """Whether the process runs (or is stopped): neither gone nor a zombie."""
    fields = stat_fields(Path(f"/proc/{pid}/stat"))
    return fields is not None and fields[0] != "Z"


def _signal_group(pgid: int, signum: signal.Signals) -> None:
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        pass


def _group_alive(pgid: int) -> bool:
    """Whether the group still has a live (not zombie) member, its leader included."""
    return any(fields is not None and int(fields[2]) == pgid and fields[0] != "Z"
               for fields in map(stat_fields, Path("/proc").glob("[0-9]*/stat")))


def _set_reason(backend: Any, instance_id: str, code: str, message: str) -> None:
    from moto.ec2.models.instances import StateReason

    backend.get_instance(instance_id).state_reason = StateReason(message, code)
