"""The core every side imports: Lambda, the node agent, the operator's commands, the local cloud.

    runspec, records, events, node_access, shapes   the contracts: every data shape that crosses
                         a boundary (pydantic v2), split by what it describes
    lifecycle            the decisions, pure functions over plain records
    catalogue            instance types' facts; memory_plan: what a layout needs per GPU
    pace                 the agents' and Recover's timing rules; settings: the functions' settings
    run_history          a run's history built from its records (the report and the live view)

It imports no boto3 and no torch, and nothing of the project above it: of the trainer, only its
torch-free rules (trainer/schedules.py).
"""
