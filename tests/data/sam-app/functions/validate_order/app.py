"""Check an order and price it; an order that cannot be taken raises InvalidOrder."""

from aws_lambda_powertools import Logger

from rules import priced

logger = Logger()


@logger.inject_lambda_context
def lambda_handler(event, context):
    order = priced(event)
    logger.info("order validated", extra={"order_id": order["order_id"], "total": order["total"]})
    return order
