"""How a reservation is named (a module of the same name as validate_order's, with other code)."""


def reservation_id(order_id, items):
    return f"R-{order_id}-{sum(item['quantity'] for item in items)}"
