"""Validate: complete the RunSpec with the stack's defaults, parse it, record the run. What its
author may leave out is filled in first (runspec.with_stack_defaults: the checkpoint location
in the stack's bucket, the stack's node network). A bad RunSpec fails here, before any allocation,
and so does a trainer section the trainer itself would refuse: its own checks
(trainer/config.py, torch-free) run here on the config the nodes would be given, a layout that
would run out of GPU memory (trainfleet/core/memory_plan.py), a shard set in S3 that is not there
or that the model or tokenizer does not fit (trainer/shards.py), a run to resume from that cannot
be (RunSpec.resume_from: not ended, no checkpoint, another model), and a subnet from which the
nodes could not reach the AWS services they call (trainfleet/core/network.py): on AWS such a fleet
is billed silent until its boot timeout."""

from dataclasses import asdict
from typing import Any

from aws_lambda_powertools.utilities.parser import event_parser
from aws_lambda_powertools.utilities.typing import LambdaContext
from pydantic import BaseModel, ValidationError

from functions.common import RunPayload, Timeouts, aws, logger, tracer, transient_errors_named
from functions.errors import InvalidRunSpec
from trainer import tokenizer
from trainer.config import ConfigError, JobConfig, config_from_sections
from trainer.shards import INDEX_NAME, ShardStore, index_problems
from trainer.tokenizer import TokenizerError
from trainfleet.adapters.checkpoints import latest_checkpoint
from trainfleet.adapters.network import NetworkNotFound, network_problems, node_network
from trainfleet.adapters.run_store import RunExists, RunNotFound
from trainfleet.core import memory_plan
from trainfleet.core.node_access import image_parameter_problem, node_access_problems
from trainfleet.core.records import RunRecord, RunRef
from trainfleet.core.runspec import TRAINER_FIELDS, RunSpec, TrainerConfig, with_stack_defaults
from trainfleet.core.shapes import validation_message


class ValidateInput(BaseModel):
    run_spec: Any
    """The execution input, exactly as the user gave it."""
    execution_arn: str


def parse_run_spec(raw: Any, bucket: str, stack_name: str) -> RunSpec:
    """The RunSpec, or InvalidRunSpec with one `field: problem` line per problem: what can be
    decided from the document alone (the shard set it names is read by check_shard_set)."""
    try:
        spec = RunSpec.model_validate(raw)
    except ValidationError as exc:
        raise InvalidRunSpec(validation_message(exc)) from exc
    # The nodes may only touch what their role grants in the stack's own bucket, and the
    # functions resolve the image from the parameters theirs grants.
    problems = [*node_access_problems(spec, bucket), image_parameter_problem(spec, stack_name)]
    if problems := [problem for problem in problems if problem]:
        raise InvalidRunSpec("\n".join(problems))
    config = check_trainer_config(spec)
    check_memory(spec, config)
    return resolved(spec, config)


def check_resume_from(spec: RunSpec) -> None:
    """InvalidRunSpec unless the run the RunSpec resumes is one of this stack's that has ended, kept
    its checkpoints where a resumed run's nodes may read them (RunSpec.resume_from_uri), committed
    one, and trained this very model (a checkpoint loads into the model it was saved from)."""
    if spec.resume_from is None:
        return
    name = spec.resume_from
    try:
        old = aws().store.run(name)
    except RunNotFound:
        raise InvalidRunSpec(f"resume_from: this stack has no run named {name!r}") from None
    if not old.state.is_final:
        raise InvalidRunSpec(f"resume_from: run {name!r} is {old.state.value}: a run resumes one that has ended "
                             f"(`trainfleet run stop {name}` ends it)")
    if old.spec.checkpoint.s3_uri != spec.resume_from_uri:
        raise InvalidRunSpec(f"resume_from: run {name!r} kept its checkpoints at {old.spec.checkpoint.s3_uri}; a "
                             f"resumed run's nodes may read only {spec.resume_from_uri}")
    theirs, ours = old.spec.trainer.model.model_dump(), spec.trainer.model.model_dump()
    if differing := sorted(key for key in theirs.keys() | ours.keys() if theirs.get(key) != ours.get(key)):
        raise InvalidRunSpec("resume_from: " + "; ".join(
            f"trainer.model.{key} is {ours.get(key)!r} here and was {theirs.get(key)!r} in run {name!r}"
            for key in differing) + ": a checkpoint loads only into the model it was saved from")
    if latest_checkpoint(aws().s3, spec.resume_from_uri) is None:
        raise InvalidRunSpec(f"resume_from: run {name!r} committed no checkpoint under {spec.resume_from_uri}: "
                             "nothing to resume from")


def check_network(spec: RunSpec) -> None:
    """InvalidRunSpec naming each subnet and the services its nodes could not reach from it."""
    try:
        problems = network_problems(aws().ec2, spec)
    except NetworkNotFound as error:
        raise InvalidRunSpec(str(error)) from error
    if problems:
        raise InvalidRunSpec("\n".join(problems))


def resolved(spec: RunSpec, config: JobConfig) -> RunSpec:
    """The RunSpec with its trainer section as the trainer will run it: every field the user left
    out filled with the trainer's default. The recorded run then holds the whole model, so a
    re-plan after a lost node can check the new layout's memory without the trainer's code."""
    sections = {name: values for name, values in asdict(config).items() if name in TRAINER_FIELDS}
    return spec.model_copy(update={"trainer": TrainerConfig.model_validate(sections)})


def check_trainer_config(spec: RunSpec) -> JobConfig:
    """InvalidRunSpec with the trainer's own message when it would refuse its config (a negative
    learning rate, no steps, heads that do not divide the width...): found here, not after the
    whole fleet has booted and passed preflight."""
    par = spec.trainer.parallel
    try:
        return config_from_sections(spec.trainer_mapping(par.pp, par.dp, resume_step=None), source="trainer")
    except ConfigError as exc:
        raise InvalidRunSpec(str(exc)) from exc


def check_memory(spec: RunSpec, config: JobConfig) -> None:
    """InvalidRunSpec with the fullest GPU's figures and the smallest fleet that fits, when the layout
    would run out of GPU memory. CPU types (local runs) are not checked: their ranks share the
    host's memory, which the catalogue does not describe."""
    facts = spec.facts
    if facts.accelerator == "none":
        logger.info("memory check skipped: no accelerator", instance_type=facts.name)
        return
    workload = memory_plan.Workload.from_sections(asdict(config), accelerator=facts.accelerator)
    problem = memory_plan.memory_problem(workload, facts.name, facts.ranks_per_node, facts.memory_per_rank_gib)
    if problem:
        raise InvalidRunSpec(f"trainer: {problem}")
    if spec.checkpoint.memory_interval_steps:
        problem = memory_plan.host_memory_problem(workload, facts.name, facts.ranks_per_node, facts.host_memory_gib)
        if problem:
            raise InvalidRunSpec(f"checkpoint: {problem}")


def check_shard_set(config: JobConfig) -> None:
    """InvalidRunSpec when the S3 shard set is not there (a typo'd location, no index), or a model
    smaller than its vocabulary or another tokenizer than its would train on it: each names both
    sides. Shards on the nodes' own disks are the trainer's to check, at its start."""
    data = config.data
    if not data.shards.startswith("s3://"):
        return
    index = ShardStore(data.shards).read_index()
    if index is None:
        if not data.corpus:
            raise InvalidRunSpec(f"trainer.data.shards: {data.shards} holds no {INDEX_NAME}: no shard set is there "
                                 "(write one with `trainfleet data prepare`)")
        return
    try:
        problems = index_problems(index, data.shards, config.model.vocab_size, data.tokenizer,
                                  tokenizer.sha256_of(data.tokenizer))
    except TokenizerError as error:
        raise InvalidRunSpec(f"trainer.data.tokenizer: {error}") from None
    if problems:
        raise InvalidRunSpec("trainer: " + "; ".join(problems))


@transient_errors_named
@logger.inject_lambda_context
@tracer.capture_lambda_handler
@event_parser(model=ValidateInput)
def handler(event: ValidateInput, context: LambdaContext) -> dict[str, Any]:
    settings = aws().settings
    try:
        document = with_stack_defaults(event.run_spec, settings.bucket, lambda instance_type: node_network(
            aws().ec2, list(settings.node_subnet_ids), list(settings.node_security_group_ids), instance_type))
    except NetworkNotFound as error:
        raise InvalidRunSpec(str(error)) from error
    spec = parse_run_spec(document, settings.bucket, settings.stack_name)
    check_shard_set(check_trainer_config(spec))
    check_resume_from(spec)
    check_network(spec)
    record = RunRecord(run_name=spec.run_name, spec=spec, execution_arn=event.execution_arn)
    try:
        aws().store.create_run(record)
    except RunExists:
        # A retried invocation of this same execution finds its own record; another
        # execution may not reuse the name (its S3 prefix and tags would mix with this one).
        if aws().store.run(spec.run_name).execution_arn != event.execution_arn:
            raise InvalidRunSpec(f"run_name: a run named {spec.run_name!r} exists already") from None
    logger.info("run recorded", run_name=spec.run_name, nodes=spec.node_count, spares=spec.spare_count)
    return RunPayload(run=RunRef(run_name=spec.run_name), timeouts=Timeouts.of(spec)).to_state()
