"""A deployment package for the deploy test: echoes the event with the table it was given."""

import os


def handle(event, context):
    return {"table": os.environ["RUN_TABLE"], "event": event}
