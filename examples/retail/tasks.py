"""The retail tasks: what each customer says, and the writes that serve them within the policy.

A task's goal state is `data.json` with its `actions` replayed; a task with no actions is
a request the policy refuses, so its goal is the database untouched. `val` tasks are
held out: scored, never trained on.
"""

from __future__ import annotations

from examples.toolagent import Action, Task

TRAIN = [
    Task(
        "cancel-by-mistake",
        "Hi! I'm Mia Li, my email is mia.li3668@example.com. Please cancel my order #W1001, I ordered it by mistake.",
        (Action("cancel_pending_order", {"order_id": "#W1001", "reason": "ordered by mistake"}),),
    ),
    Task(
        "return-to-gift-card",
        "Hello, I'm Mia Li, zip code 94110. I'd like to return the desk lamp from order #W1002 "
        "and get the refund on my gift card.",
        (
            Action(
                "return_delivered_order_items",
                {"order_id": "#W1002", "item_ids": ["4001"], "payment_method_id": "gift_card_1122"},
            ),
        ),
    ),
    Task(
        "exchange-size",
        "Hi, this is Omar Khan (omar.khan@example.com). The red T-shirt in order #W2001 is too big: "
        "I'd like to exchange it for the same shirt in red, size M. Use my PayPal for any difference.",
        (
            Action(
                "exchange_delivered_order_items",
                {
                    "order_id": "#W2001",
                    "item_ids": ["1003"],
                    "new_item_ids": ["1001"],
                    "payment_method_id": "paypal_7788",
                },
            ),
        ),
    ),
    Task(
        "new-address",
        "Hi, I'm Omar Khan, zip 10001. Please ship my pending order #W2002 to 77 Atlantic Ave, "
        "address line 2 'Apt 4', Brooklyn, NY 11201, USA instead.",
        (
            Action(
                "modify_pending_order_address",
                {
                    "order_id": "#W2002",
                    "address1": "77 Atlantic Ave",
                    "address2": "Apt 4",
                    "city": "Brooklyn",
                    "state": "NY",
                    "country": "USA",
                    "zip": "11201",
                },
            ),
        ),
    ),
    Task(
        "cancel-shipped-refused",
        "Hi, I'm Mia Li (mia.li3668@example.com). Please cancel order #W1003, I no longer need it.",
    ),
    Task(
        "pay-with-gift-card",
        "Hello, Yusuf Ali here, my email is yusuf.ali@example.com. For my pending order #W4001 I'd like "
        "to pay with my gift card instead of PayPal.",
        (Action("modify_pending_order_payment", {"order_id": "#W4001", "payment_method_id": "gift_card_7070"}),),
    ),
    Task(
        "exchange-headphones",
        "Hi, I'm Sofia Rossi, zip 60614. I want to exchange the in-ear headphones from order #W3001 for "
        "the white over-ear ones; charge the difference to my credit card.",
        (
            Action(
                "exchange_delivered_order_items",
                {
                    "order_id": "#W3001",
                    "item_ids": ["3003"],
                    "new_item_ids": ["3002"],
                    "payment_method_id": "credit_card_5566",
                },
            ),
        ),
    ),
    Task(
        "compensation-to-human",
        "Hi, I'm Sofia Rossi (srossi@example.com). My order #W3001 arrived two weeks late and I want "
        "compensation for the delay.",
        (Action("transfer_to_human_agents", {"summary": "compensation for a late delivery of #W3001"}),),
        follow_ups=("Then please transfer me to a human agent.",),
    ),
]

VAL = [
    Task(
        "cancel-no-longer-needed",
        "I'm Yusuf Ali, zip 73301. Cancel order #W4001 please, I no longer need it.",
        (Action("cancel_pending_order", {"order_id": "#W4001", "reason": "no longer needed"}),),
    ),
    Task(
        "return-to-original",
        "Hi, Mia Li, mia.li3668@example.com. I want to return the headphones from order #W1002, "
        "refunded to the original payment method.",
        (
            Action(
                "return_delivered_order_items",
                {"order_id": "#W1002", "item_ids": ["3001"], "payment_method_id": "credit_card_9951"},
            ),
        ),
    ),
    Task(
        "cancel-and-return",
        "Hi, Omar Khan here (omar.khan@example.com). Two things: cancel my order #W2002 since I no longer "
        "need it, and return the T-shirt from order #W2001 with the refund to my PayPal.",
        (
            Action("cancel_pending_order", {"order_id": "#W2002", "reason": "no longer needed"}),
            Action(
                "return_delivered_order_items",
                {"order_id": "#W2001", "item_ids": ["1003"], "payment_method_id": "paypal_7788"},
            ),
        ),
    ),
    Task(
        "exchange-unavailable-refused",
        "Hi, Sofia Rossi, zip 60614. I'd like to exchange the white mug in order #W3001 for the black 12oz one.",
    ),
]

TASKS = {"train": TRAIN, "val": VAL}
