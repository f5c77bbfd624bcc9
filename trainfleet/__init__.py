"""trainfleet: serverless-managed pipeline-parallel training on an EC2 GPU fleet.

The control plane, by audience (docs/ARCHITECTURE.md's Layout says what each may import):

    core/       the shapes and decisions every side shares: the contracts (runspec, records,
                events, node_access), lifecycle decisions, instance catalogue, memory plan, pace
    adapters/   the AWS calls: EC2 fleet, DynamoDB run store, S3 checkpoints, liveness, EMF metrics
    report/     the run report: the Report function and `trainfleet run report` draw it
    operator/   the operator's side: a stack's runs, the live view, the run and checkpoint commands
    cli.py      the `trainfleet` command

None of it imports torch (the Lambda functions ship core, adapters and report); the trainer
(package `trainer`) and what runs beside it (package `node`) live on the instances.
"""
