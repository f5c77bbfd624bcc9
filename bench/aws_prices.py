"""us-east-1 list prices (USD) of the services trainfleet calls, as AWS publishes them: what the
benches price a run and a preparation with."""

STEP_FUNCTIONS_PER_TRANSITION = 0.025 / 1000
"""Standard workflows: $0.025 per 1,000 state transitions."""
LAMBDA_PER_REQUEST = 0.20 / 1e6
LAMBDA_PER_GB_SECOND = 0.0000166667
"""x86, the first pricing tier."""
DYNAMODB_PER_READ_UNIT = 0.125 / 1e6
DYNAMODB_PER_WRITE_UNIT = 0.625 / 1e6
"""On-demand capacity, since AWS halved its prices in November 2024."""
EVENTBRIDGE_PER_EVENT = 1.00 / 1e6
"""Custom events put on a bus (a PutEvents entry up to 64 KB); AWS service events are free."""
S3_PER_WRITE_REQUEST = 0.005 / 1000
"""PUT, COPY, POST, LIST."""
S3_PER_READ_REQUEST = 0.0004 / 1000
"""GET and the rest."""
SQS_PER_REQUEST = 0.40 / 1e6
"""Standard queues, per request (up to 64 KB): EventBridge's sends of the agents' events and
Lambda's receives and deletes of them. Lambda keeps five pollers on a queue, the local cloud one,
so an idle queue's long polls here are a fifth of AWS's (5 x 4,320 a day, under a cent)."""
LOGS_PER_GB = 0.50
"""CloudWatch Logs ingestion (the functions' logs and the EMF metric lines in them)."""
METRIC_PER_MONTH = 0.30
"""A custom metric (each name and dimension set EMF creates), prorated by the hour."""
