"""The retail store: a small JSON database (users, orders, products) and the tools an agent
may call on it, in the style of τ-bench's retail domain.

Each tool is a method with the same name as its OpenAI function schema in `TOOLS`. The
rules of `policy.md` that a tool can see are enforced here: the tool refuses with a
`PolicyError`, which the grader counts as a rule broken (acting before the customer is
authenticated, on another customer's order, on an order in the wrong status, exchanging for
another product). Writing without the customer's explicit "yes" is caught by `ToolEnv`.
"""

from __future__ import annotations

import json
from pathlib import Path

from examples.toolagent import PolicyError, ToolEnv, ToolError, write

DATA = json.loads((Path(__file__).parent / "data.json").read_text())
CANCEL_REASONS = ("no longer needed", "ordered by mistake")


def _fn(name: str, description: str, properties: dict, required: list[str] | None = None) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": properties,
                "required": list(properties) if required is None else required,
            },
        },
    }


_STR = {"type": "string"}
_IDS = {"type": "array", "items": {"type": "string"}}

TOOLS = [
    _fn("find_user_id_by_email", "Find a customer's user id by email (authenticates them).", {"email": _STR}),
    _fn(
        "find_user_id_by_name_zip",
        "Find a customer's user id by first name, last name and zip code (authenticates them).",
        {"first_name": _STR, "last_name": _STR, "zip": _STR},
    ),
    _fn("get_user_details", "The customer's profile: name, address, payment methods, order ids.", {"user_id": _STR}),
    _fn(
        "get_order_details",
        "An order: status, items (item id, product id, options, price), payments.",
        {"order_id": {"type": "string", "description": "such as '#W1001'"}},
    ),
    _fn(
        "get_product_details",
        "A product and all its variants (item ids, options, price, availability).",
        {"product_id": _STR},
    ),
    _fn(
        "cancel_pending_order",
        "Cancel a pending order; the payment is refunded to where it came from.",
        {"order_id": _STR, "reason": {"type": "string", "enum": list(CANCEL_REASONS)}},
    ),
    _fn(
        "modify_pending_order_address",
        "Change the shipping address of a pending order.",
        {
            "order_id": _STR,
            "address1": _STR,
            "address2": _STR,
            "city": _STR,
            "state": _STR,
            "country": _STR,
            "zip": _STR,
        },
    ),
    _fn(
        "modify_pending_order_payment",
        "Pay a pending order with another of the customer's payment methods; the old one is refunded.",
        {"order_id": _STR, "payment_method_id": _STR},
    ),
    _fn(
        "return_delivered_order_items",
        "Return items of a delivered order; the refund goes to the payment "
        "method given (the original one or a gift card).",
        {"order_id": _STR, "item_ids": _IDS, "payment_method_id": _STR},
    ),
    _fn(
        "exchange_delivered_order_items",
        "Exchange items of a delivered order for other variants of the same "
        "products (new_item_ids in the order of item_ids); the price difference is paid or refunded with the "
        "payment method given.",
        {"order_id": _STR, "item_ids": _IDS, "new_item_ids": _IDS, "payment_method_id": _STR},
    ),
    _fn(
        "transfer_to_human_agents",
        "Hand the customer over to a human agent, with a summary of their request.",
        {"summary": _STR},
    ),
]


class RetailEnv(ToolEnv):
    TOOLS = TOOLS

    def __init__(self, db: dict | None = None):
        super().__init__(DATA if db is None else db)

    # -- lookups the tools share

    def _order(self, order_id: str) -> dict:
        order = self.db["orders"].get(order_id)
        if order is None:
            raise ToolError(f"order '{order_id}' not found (order ids look like '#W1001')")
        self.require_user(order["user_id"])
        return order

    def _order_in(self, order_id: str, status: str, action: str) -> dict:
        order = self._order(order_id)
        if order["status"] != status:
            raise PolicyError(f"only a {status} order can be {action}; order {order_id} is {order['status']}")
        return order

    def _payment(self, user_id: str, payment_method_id: str) -> dict:
        method = self.db["users"][user_id]["payment_methods"].get(payment_method_id)
        if method is None:
            raise ToolError(f"payment method '{payment_method_id}' is not one of the customer's")
        return method

    def _move_money(self, user_id: str, payment_method_id: str, amount: float) -> None:
        """A gift card's balance follows its payments (+) and refunds (-); cards and PayPal hold none here."""
        method = self._payment(user_id, payment_method_id)
        if method["source"] == "gift_card":
            if amount > method["balance"] + 1e-9:
                raise PolicyError(
                    f"gift card {payment_method_id} holds {method['balance']:.2f}, not the {amount:.2f} needed"
                )
            method["balance"] = round(method["balance"] - amount, 2)

    # -- reading

    def find_user_id_by_email(self, email: str) -> str:
        for user_id, user in self.db["users"].items():
            if user["email"].lower() == email.strip().lower():
                self.user_id = user_id
                return user_id
        raise ToolError("no user with that email")

    def find_user_id_by_name_zip(self, first_name: str, last_name: str, zip: str) -> str:
        for user_id, user in self.db["users"].items():
            name = user["name"]
            if (name["first_name"].lower(), name["last_name"].lower(), user["address"]["zip"]) == (
                first_name.strip().lower(),
                last_name.strip().lower(),
                zip.strip(),
            ):
                self.user_id = user_id
                return user_id
        raise ToolError("no user with that name and zip code")

    def get_user_details(self, user_id: str) -> dict:
        if user_id not in self.db["users"]:
            raise ToolError(f"user '{user_id}' not found")
        self.require_user(user_id)
        return self.db["users"][user_id]

    def get_order_details(self, order_id: str) -> dict:
        return self._order(order_id)

    def get_product_details(self, product_id: str) -> dict:
        product = self.db["products"].get(product_id)
        if product is None:
            raise ToolError(f"product '{product_id}' not found")
        return {"product_id": product_id, **product}

    # -- writing

    @write
    def cancel_pending_order(self, order_id: str, reason: str) -> dict:
        order = self._order_in(order_id, "pending", "cancelled")
        if reason not in CANCEL_REASONS:
            raise PolicyError(f"the reason must be one of {list(CANCEL_REASONS)}")
        # Refund what each method still holds of the order: its payments less its refunds. A
        # payment change already refunded the old method; refunding every payment again paid
        # it twice (a gift card credited money it never paid).
        held: dict[str, float] = {}
        for entry in order["payment_history"]:
            sign = 1 if entry["transaction_type"] == "payment" else -1
            held[entry["payment_method_id"]] = held.get(entry["payment_method_id"], 0.0) + sign * entry["amount"]
        for method_id, amount in held.items():
            if round(amount, 2) > 0:
                self._move_money(order["user_id"], method_id, -round(amount, 2))
                order["payment_history"].append(
                    {"transaction_type": "refund", "amount": round(amount, 2), "payment_method_id": method_id}
                )
        order["status"] = "cancelled"
        order["cancel_reason"] = reason
        return order

    @write
    def modify_pending_order_address(
        self, order_id: str, address1: str, address2: str, city: str, state: str, country: str, zip: str
    ) -> dict:
        order = self._order_in(order_id, "pending", "modified")
        order["address"] = {
            "address1": address1,
            "address2": address2,
            "city": city,
            "state": state,
            "country": country,
            "zip": zip,
        }
        return order

    @write
    def modify_pending_order_payment(self, order_id: str, payment_method_id: str) -> dict:
        order = self._order_in(order_id, "pending", "modified")
        paid = [p for p in order["payment_history"] if p["transaction_type"] == "payment"][-1]
        if paid["payment_method_id"] == payment_method_id:
            raise PolicyError("the new payment method must differ from the current one")
        total = round(sum(item["price"] for item in order["items"]), 2)
        self._payment(order["user_id"], payment_method_id)
        self._move_money(order["user_id"], payment_method_id, total)
        self._move_money(order["user_id"], paid["payment_method_id"], -total)
        order["payment_history"] += [
            {"transaction_type": "payment", "amount": total, "payment_method_id": payment_method_id},
            {"transaction_type": "refund", "amount": total, "payment_method_id": paid["payment_method_id"]},
        ]
        return order

    def _items(self, order: dict, item_ids: list[str]) -> list[dict]:
        if not item_ids:
            raise ToolError("name at least one item id")
        by_id = {item["item_id"]: item for item in order["items"]}
        missing = [i for i in item_ids if i not in by_id]
        if missing or len(set(item_ids)) != len(item_ids):
            raise ToolError(f"item ids {missing or item_ids} are not (each once) in order {order['order_id']}")
        return [by_id[i] for i in item_ids]

    @write
    def return_delivered_order_items(self, order_id: str, item_ids: list[str], payment_method_id: str) -> dict:
        order = self._order_in(order_id, "delivered", "returned")
        self._items(order, item_ids)
        method = self._payment(order["user_id"], payment_method_id)
        original = order["payment_history"][0]["payment_method_id"]
        if payment_method_id != original and method["source"] != "gift_card":
            raise PolicyError("a refund goes to the original payment method or to a gift card")
        order["status"] = "return requested"
        order["return_items"] = sorted(item_ids)
        order["return_payment_method_id"] = payment_method_id
        return order

    @write
    def exchange_delivered_order_items(
        self, order_id: str, item_ids: list[str], new_item_ids: list[str], payment_method_id: str
    ) -> dict:
        order = self._order_in(order_id, "delivered", "exchanged")
        old = self._items(order, item_ids)
        if len(new_item_ids) != len(item_ids):
            raise ToolError("give one new item id for each item id")
        difference = 0.0
        for item, new_id in zip(old, new_item_ids, strict=False):
            variants = self.db["products"][item["product_id"]]["variants"]
            if new_id not in variants or new_id == item["item_id"]:
                raise PolicyError(
                    f"item {item['item_id']} can only be exchanged for another variant of the same "
                    f"product ({item['name']}), not for '{new_id}'"
                )
            if not variants[new_id]["available"]:
                raise PolicyError(f"item {new_id} is not available")
            difference += variants[new_id]["price"] - item["price"]
        difference = round(difference, 2)
        method = self._payment(order["user_id"], payment_method_id)
        # Money moves when the new items ship; a gift card must hold a difference to be paid now.
        if method["source"] == "gift_card" and difference > method["balance"] + 1e-9:
            raise PolicyError(
                f"gift card {payment_method_id} holds {method['balance']:.2f}, not the {difference:.2f} to be paid"
            )
        pairs = sorted(zip(item_ids, new_item_ids, strict=False))
        order["status"] = "exchange requested"
        order["exchange_items"] = [old_id for old_id, _ in pairs]
        order["exchange_new_items"] = [new_id for _, new_id in pairs]
        order["exchange_payment_method_id"] = payment_method_id
        order["exchange_price_difference"] = difference
        return order

    def transfer_to_human_agents(self, summary: str) -> str:
        self.db["transferred_to_human"] = True
        self.done = True
        return "Transfer successful"
