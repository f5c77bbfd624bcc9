"""The embedded local cloud: the AWS side of trainfleet on one machine, no account, no Docker.

moto (pinned exactly) serves the AWS APIs over real HTTP on 127.0.0.1, so separate processes
(node agents, the trainer, the CLI) reach it through AWS_ENDPOINT_URL. The `glue` package
patches in what moto lacks, one module per service; `fleet` turns EC2 instances into local
processes.

    from localcloud import LocalCloud

    with LocalCloud(time_scale=0.01) as cloud:       # Wait/Retry/boot/Spot notice 100x faster
        sfn = cloud.client("stepfunctions")           # or boto3 with cloud.env() in a child
        cloud.fleet.boot = lambda instance: ["python", "-m", "node.agent"]
        ...
        cloud.fleet.kill(instance_id)                 # the instance goes `terminated`
        cloud.inject_spot_interruption(instance_id)  # warning now, interruption after notice

Public surface (everything else is internal):

LocalCloud(config=None, **overrides)      overrides are LocalCloudConfig fields
  .start() / .stop() / with-statement     one LocalCloud per process at a time
  .endpoint, .port, .region, .account_id
  .env()                                  AWS_ENDPOINT_URL, region and fake credentials
  .client(service)                        a boto3 client on the endpoint
  .fleet                                  LocalFleet (see localcloud.fleet):
      .boot = fn(LocalInstance) -> argv | None   what an instance runs once `running`
      .env_hooks.append(fn(LocalInstance) -> dict)  extra environment per instance
      .get(id) -> LocalInstance               private_ip, workdir, state, process,
                                              spot_action, rebalance_notice, console_log
      .kill(id) / .hang(id) / .resume(id)     SIGKILL / SIGSTOP / SIGCONT its process group
      .hang_process(id, role) -> pid          SIGSTOP one process: role "trainer" (a rank) or
      .crash_process(id, role) -> pid         "agent"; SIGKILL it (resume continues a hung one)
      .wait_for_state(id, state)
  .put_event(AwsEvent)                    emit an AWS-service event on the default bus
  .inject_spot_interruption(id, action)   Spot warning, then the interruption
  .inject_rebalance(id)                   EC2 Instance Rebalance Recommendation
  .inject_health_event(ids, code, ...)    AWS Health Event for EC2
  .set_capacity(type, zone, n | None)     at most n instances of the type alive in the zone
                                          (InsufficientInstanceCapacity beyond it)
  .create_capacity_block(type, zone, n, ends_in_s, group=None)  a Capacity Block (its cr- id);
                                          ODCRs come from CreateCapacityReservation
  .fail_requests(service, seconds, answer)  requests over HTTP to dynamodb, s3, events, lambda, logs,
                                          ec2 or states answer its throttling error
                                          ("throttle") or its 500 ("error") for a while
  .throttle(service, seconds)             fail_requests(service, seconds, "throttle")
  .stop_failing_requests(service=None)    end those faults now
  .failed_requests                        Counter (service, answer) -> requests refused so far
  .time_out_invocations(name_part, count=1)  the next invocations of a matching function
                                          run, then report Sandbox.Timedout
  .duplicate_events(detail_types, count)  deliver matching events twice (at least once)
  .delay_events(delay_s, detail_types, count)  deliver them late (nominal seconds)
  .reorder_events(window_s, detail_types, count)  hold them, then deliver newest first
  .requests                               Counter (service, action) -> API requests over HTTP
  .state_transitions                      Counter state machine name -> states entered
  .lambda_invocations                     Counter function name -> handler runs
  .counters()                             copies of those three, taken under the counting lock
  .largest_payloads                       dict kind -> Payload(size_bytes, what), the largest
                                          so far: "states" (a state's input or output),
                                          "dynamodb" (an item written), "events" (an event put)
  .delivery_failures                      EventBridge targets that could not be reached
  .scaled(seconds), .wait_until(...)      scaled time and a bounded poll for tests

POST /_localcloud/chaos on the endpoint (`trainfleet chaos FAULT RUN TARGET`) injects these
faults from another process (localcloud.chaos_route).
"""


def __getattr__(name: str):
    # Imported when first asked for, not with the package: `trainfleet` reaches the local cloud's
    # commands (localcloud.commands) without importing moto, which an operator's machine may lack.
    if name in __all__:
        from localcloud import cloud

        return getattr(cloud, name)
    raise AttributeError(f"module 'localcloud' has no attribute {name!r}")


__all__ = ["LocalCloud", "LocalCloudConfig"]
