"""Adapters: the only place the control plane talks to AWS (boto3 clients are passed in).

    ec2_fleet     launch template with EFA, cluster placement group, CreateFleet, teardown
    run_store     DynamoDB run and node records, conditional state changes, task tokens
    checkpoints   the latest committed checkpoint in S3 (the trainer's commit protocol)
    liveness      the nodes' liveness records in S3, EC2 instance status checks
    metrics       CloudWatch metrics as embedded metric format (EMF) log lines
"""
