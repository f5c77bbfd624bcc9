"""Reserve the order's items in stock."""

from aws_lambda_powertools import Logger

from rules import reservation_id

logger = Logger()


def lambda_handler(event, context):
    reservation = reservation_id(event["order_id"], event["items"])
    logger.info("stock reserved", extra={"reservation": reservation})
    return {"reservation": reservation}
