"""Charge the customer's card for the order's total."""

import os

from aws_lambda_powertools import Logger

logger = Logger()
CARD_LIMIT = int(os.environ["CARD_LIMIT"])


class PaymentDeclined(Exception):
    """The card refused the charge; the workflow catches it by this name."""


def lambda_handler(event, context):
    if event["total"] > CARD_LIMIT:
        raise PaymentDeclined(f"{event['total']} is over the card's limit of {CARD_LIMIT}")
    logger.info("card charged", extra={"total": event["total"]})
    return {"charge": f"C-{event['order_id']}-{event['total']}"}
