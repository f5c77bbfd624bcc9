"""Tell the customer the order is on its way. Runs on Python 3.12 (its syntax below)."""

import sys

type Line = dict[str, int | str]


def summary[T: Line](lines: list[T]) -> str:
    return ", ".join(f"{line['quantity']} x {line['sku']}" for line in lines)


def lambda_handler(event, context):
    message = f"Order {event['order_id']} is on its way: {summary(event['items'])}"
    print(message)
    return {"message": message, "python": f"{sys.version_info.major}.{sys.version_info.minor}"}
