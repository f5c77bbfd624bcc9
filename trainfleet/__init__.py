"""trainfleet: serverless-managed pipeline-parallel training on an EC2 GPU fleet.

This package is the control plane's shared core (contracts, instance catalogue, lifecycle
decisions, adapters) and the `trainfleet` command. It never imports torch: the Lambda
functions ship it, and the trainer (package `trainer`) lives on the instances.
"""
