"""The airline tasks: what each customer says, and the writes that serve them within the policy.

A task's goal state is `data.json` with its `actions` replayed; a task with no actions is
a request the policy refuses, so its goal is the database untouched. `val` tasks are
held out: scored, never trained on.
"""

from __future__ import annotations

from examples.toolagent import Action, Task

EMMA = {"first_name": "Emma", "last_name": "Kim", "dob": "1990-04-12"}
NOAH = {"first_name": "Noah", "last_name": "Garcia", "dob": "1985-02-14"}

TRAIN = [
    Task(
        "cancel-airline-cancelled",
        "Hi, my user id is noah_garcia_1234. The airline cancelled the flight of my reservation MX7T3B, "
        "so please cancel the reservation and refund me.",
        (Action("cancel_reservation", {"reservation_id": "MX7T3B"}),),
    ),
    Task(
        "cancel-within-24h",
        "Hello, I'm ava_patel_5566. I booked reservation Q8WZ1D this morning but my plans changed; please cancel it.",
        (Action("cancel_reservation", {"reservation_id": "Q8WZ1D"}),),
    ),
    Task(
        "cancel-refused",
        "Hi, user id liam_chen_7788. I don't want to fly anymore: cancel my reservation T3VB8E and refund me, please.",
    ),
    Task(
        "change-date",
        "Hi, I'm emma_kim_9957. Please move my reservation ZFA04Y from the May 20 flight to the same "
        "flight on May 22, still economy. Use my credit card for any difference.",
        (
            Action(
                "update_reservation_flights",
                {
                    "reservation_id": "ZFA04Y",
                    "cabin": "economy",
                    "flights": [{"flight_number": "HAT001", "date": "2024-05-22"}],
                    "payment_method_id": "credit_card_7815",
                },
            ),
        ),
    ),
    Task(
        "change-basic-economy-refused",
        "Hi, I'm emma_kim_9957. On reservation K2PL9Q, move the outbound flight from May 18 to May 20, please.",
    ),
    Task(
        "add-bags",
        "Hello, liam_chen_7788 here. I'd like 2 checked bags on reservation U9KC2L; charge whatever it "
        "costs to my credit card.",
        (
            Action(
                "update_reservation_baggages",
                {
                    "reservation_id": "U9KC2L",
                    "total_baggages": 2,
                    "nonfree_baggages": 1,
                    "payment_method_id": "credit_card_3344",
                },
            ),
        ),
    ),
    Task(
        "book-one-way",
        "Hi, I'm emma_kim_9957. Book me a one-way economy flight from SFO to SEA on 2024-05-20, just me "
        "(Emma Kim, born 1990-04-12), no checked bags, no insurance, paid with my gift card.",
        (
            Action(
                "book_reservation",
                {
                    "user_id": "emma_kim_9957",
                    "origin": "SFO",
                    "destination": "SEA",
                    "flight_type": "one_way",
                    "cabin": "economy",
                    "flights": [{"flight_number": "HAT004", "date": "2024-05-20"}],
                    "passengers": [EMMA],
                    "payment_method_id": "gift_card_4421",
                    "total_baggages": 0,
                    "nonfree_baggages": 0,
                    "insurance": "no",
                },
            ),
        ),
    ),
    Task(
        "compensation-to-human",
        "Hi, I'm ava_patel_5566. My flight last month was five hours late and I want compensation.",
        (Action("transfer_to_human_agents", {"summary": "compensation for a delayed flight"}),),
        follow_ups=("Then please transfer me to a human agent.",),
    ),
]

VAL = [
    Task(
        "cancel-insured",
        "Hi, ava_patel_5566 here. I'm ill and can't travel: cancel reservation R5NH6C please; I took the "
        "travel insurance.",
        (Action("cancel_reservation", {"reservation_id": "R5NH6C"}),),
    ),
    Task(
        "book-with-insurance",
        "Hello, I'm noah_garcia_1234. Please book the HAT001 flight from JFK to LAX on 2024-05-22, one way, "
        "economy, for me (Noah Garcia, born 1985-02-14), with travel insurance and 1 checked bag, paid "
        "with my credit card.",
        (
            Action(
                "book_reservation",
                {
                    "user_id": "noah_garcia_1234",
                    "origin": "JFK",
                    "destination": "LAX",
                    "flight_type": "one_way",
                    "cabin": "economy",
                    "flights": [{"flight_number": "HAT001", "date": "2024-05-22"}],
                    "passengers": [NOAH],
                    "payment_method_id": "credit_card_2231",
                    "total_baggages": 1,
                    "nonfree_baggages": 0,
                    "insurance": "yes",
                },
            ),
        ),
    ),
    Task(
        "change-date-earlier",
        "Hi, I'm liam_chen_7788. Please move reservation U9KC2L one day earlier, to the same flight on "
        "May 25, economy; any difference on my credit card.",
        (
            Action(
                "update_reservation_flights",
                {
                    "reservation_id": "U9KC2L",
                    "cabin": "economy",
                    "flights": [{"flight_number": "HAT003", "date": "2024-05-25"}],
                    "payment_method_id": "credit_card_3344",
                },
            ),
        ),
    ),
    Task(
        "change-destination-refused",
        "Hi, I'm emma_kim_9957. On reservation ZFA04Y I'd like to fly to SFO instead of LAX, same day.",
    ),
]

TASKS = {"train": TRAIN, "val": VAL}
