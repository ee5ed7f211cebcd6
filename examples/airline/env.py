"""The airline: a small JSON database (flights by date, users with payment methods and
memberships, reservations with cabin, passengers, bags and payments) and the tools an
agent may call on it, in the style of τ-bench's airline domain.

Each tool is a method with the same name as its OpenAI function schema in `TOOLS`. The
fare rules of `policy.md` are enforced here: the tool refuses with a `PolicyError`, which
the grader counts as a rule broken (changing a basic economy reservation or its route,
cancelling outside the allowed cases, removing bags, acting for someone else). Writing
without the customer's explicit "yes" is caught by `ToolEnv`.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from pathlib import Path

from examples.toolagent import PolicyError, ToolEnv, ToolError, write

DATA = json.loads((Path(__file__).parent / "data.json").read_text())
NOW = datetime(2024, 5, 15, 15, 0, 0)  # the policy's "current time"
CABINS = ("basic_economy", "economy", "business")
FREE_BAGS = {
    "regular": {"basic_economy": 0, "economy": 1, "business": 2},
    "silver": {"basic_economy": 1, "economy": 2, "business": 3},
    "gold": {"basic_economy": 2, "economy": 3, "business": 3},
}
INSURANCE, BAG = 30, 50  # per passenger, per bag beyond the free allowance
DEPARTED = ("flying", "landed")


def _fn(name: str, description: str, properties: dict) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": list(properties)},
        },
    }


_STR = {"type": "string"}
_INT = {"type": "integer", "minimum": 0}
_FLIGHTS = {
    "type": "array",
    "description": "the flights in travel order",
    "items": {
        "type": "object",
        "properties": {"flight_number": _STR, "date": {"type": "string", "description": "YYYY-MM-DD"}},
        "required": ["flight_number", "date"],
    },
}
_PASSENGERS = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"first_name": _STR, "last_name": _STR, "dob": {"type": "string", "description": "YYYY-MM-DD"}},
        "required": ["first_name", "last_name", "dob"],
    },
}
_CABIN = {"type": "string", "enum": list(CABINS)}

TOOLS = [
    _fn("get_user_details", "The customer's profile: membership, payment methods, reservation ids.", {"user_id": _STR}),
    _fn(
        "get_reservation_details",
        "A reservation: route, cabin, flights and prices paid, passengers, bags, "
        "insurance, payments, when it was booked.",
        {"reservation_id": _STR},
    ),
    _fn(
        "search_direct_flight",
        "Direct flights from an airport to another on a date, with status and the price of each cabin.",
        {
            "origin": {"type": "string", "description": "IATA code such as 'JFK'"},
            "destination": _STR,
            "date": {"type": "string", "description": "YYYY-MM-DD"},
        },
    ),
    _fn(
        "book_reservation",
        "Book a reservation and charge it to one payment method.",
        {
            "user_id": _STR,
            "origin": _STR,
            "destination": _STR,
            "flight_type": {"type": "string", "enum": ["one_way", "round_trip"]},
            "cabin": _CABIN,
            "flights": _FLIGHTS,
            "passengers": _PASSENGERS,
            "payment_method_id": _STR,
            "total_baggages": _INT,
            "nonfree_baggages": _INT,
            "insurance": {"type": "string", "enum": ["yes", "no"]},
        },
    ),
    _fn(
        "update_reservation_flights",
        "Change a reservation's flights and/or cabin (all its flights, the ones "
        "kept included); the fare difference is charged or refunded to the payment method given.",
        {"reservation_id": _STR, "cabin": _CABIN, "flights": _FLIGHTS, "payment_method_id": _STR},
    ),
    _fn("cancel_reservation", "Cancel a whole reservation; everything paid is refunded.", {"reservation_id": _STR}),
    _fn(
        "update_reservation_baggages",
        "Set a reservation's checked bags (total, and how many are not free); "
        "the new non-free bags are charged to the payment method given.",
        {"reservation_id": _STR, "total_baggages": _INT, "nonfree_baggages": _INT, "payment_method_id": _STR},
    ),
    _fn(
        "transfer_to_human_agents",
        "Hand the customer over to a human agent, with a summary of their request.",
        {"summary": _STR},
    ),
]


class AirlineEnv(ToolEnv):
    TOOLS = TOOLS

    def __init__(self, db: dict | None = None):
        super().__init__(DATA if db is None else db)

    # -- lookups the tools share

    def _reservation(self, reservation_id: str, *, active: bool = False) -> dict:
        reservation = self.db["reservations"].get(reservation_id)
        if reservation is None:
            raise ToolError(f"reservation '{reservation_id}' not found")
        self.require_user(reservation["user_id"])
        if active and reservation["status"] != "active":
            raise ToolError(f"reservation {reservation_id} is {reservation['status']}")
        return reservation

    def _flight_on(self, flight_number: str, date: str) -> tuple[dict, dict]:
        flight = self.db["flights"].get(flight_number)
        if flight is None or date not in flight["dates"]:
            raise ToolError(f"there is no flight {flight_number} on {date}")
        return flight, flight["dates"][date]

    def _segments(self, flights: list[dict], cabin: str) -> list[dict]:
        """The reservation's flight entries for `flights`, each at today's price in `cabin`."""
        if cabin not in CABINS:
            raise ToolError(f"the cabin must be one of {list(CABINS)}")
        segments = []
        for leg in flights:
            if not isinstance(leg, dict):
                raise ToolError("each flight is an object with flight_number and date")
            flight, day = self._flight_on(leg.get("flight_number", ""), leg.get("date", ""))
            if day["status"] != "available":
                raise ToolError(f"flight {flight['flight_number']} on {leg['date']} is {day['status']}")
            segments.append(
                {
                    "flight_number": flight["flight_number"],
                    "date": leg["date"],
                    "origin": flight["origin"],
                    "destination": flight["destination"],
                    "price": day["prices"][cabin],
                }
            )
        return segments

    @staticmethod
    def _route(segments: list[dict]) -> tuple[str, str, str]:
        """(origin, destination, trip type) of direct flights: one flight, or there and back."""
        if len(segments) == 1:
            return segments[0]["origin"], segments[0]["destination"], "one_way"
        if len(segments) == 2 and (segments[0]["origin"], segments[0]["destination"]) == (
            segments[1]["destination"],
            segments[1]["origin"],
        ):
            return segments[0]["origin"], segments[0]["destination"], "round_trip"
        raise ToolError("a reservation is one direct flight, or two: there and back")

    def _charge(self, user_id: str, payment_method_id: str, amount: float) -> dict | None:
        """Charge (amount > 0) or refund (< 0) a payment method; the payment history entry, if any."""
        method = self.db["users"][user_id]["payment_methods"].get(payment_method_id)
        if method is None:
            raise ToolError(f"payment method '{payment_method_id}' is not one of the customer's")
        if method["source"] == "gift_card":
            if amount > method["balance"] + 1e-9:
                raise PolicyError(
                    f"gift card {payment_method_id} holds {method['balance']:.2f}, not the {amount:.2f} to be paid"
                )
            method["balance"] = round(method["balance"] - amount, 2)
        return {"payment_id": payment_method_id, "amount": float(amount)} if amount else None

    @staticmethod
    def _departed(reservation: dict, flights: dict) -> bool:
        return any(
            flights[s["flight_number"]]["dates"][s["date"]]["status"] in DEPARTED for s in reservation["flights"]
        )

    # -- reading

    def get_user_details(self, user_id: str) -> dict:
        user = self.db["users"].get(user_id)
        if user is None:
            raise ToolError(f"user '{user_id}' not found")
        self.user_id = user_id  # the policy's authentication: the customer's own id, looked up
        return user

    def get_reservation_details(self, reservation_id: str) -> dict:
        return self._reservation(reservation_id)

    def search_direct_flight(self, origin: str, destination: str, date: str) -> list[dict]:
        return [
            {
                "flight_number": f["flight_number"],
                "origin": f["origin"],
                "destination": f["destination"],
                "scheduled_departure_time": f["scheduled_departure_time"],
                "scheduled_arrival_time": f["scheduled_arrival_time"],
                "date": date,
                **f["dates"][date],
            }
            for f in self.db["flights"].values()
            if (f["origin"], f["destination"]) == (origin, destination) and date in f["dates"]
        ]

    # -- writing

    def _new_reservation_id(self) -> str:
        """Deterministic, so the grader's replay of a booking makes the same id."""
        n = 1
        while f"NEW{n:03d}" in self.db["reservations"]:
            n += 1
        return f"NEW{n:03d}"

    @write
    def book_reservation(
        self,
        user_id: str,
        origin: str,
        destination: str,
        flight_type: str,
        cabin: str,
        flights: list[dict],
        passengers: list[dict],
        payment_method_id: str,
        total_baggages: int,
        nonfree_baggages: int,
        insurance: str,
    ) -> dict:
        if user_id not in self.db["users"]:
            raise ToolError(f"user '{user_id}' not found")
        self.require_user(user_id)
        segments = self._segments(flights, cabin)
        if self._route(segments) != (origin, destination, flight_type):
            raise ToolError(f"the flights do not make a {flight_type} trip from {origin} to {destination}")
        if (
            not passengers
            or not all(isinstance(p, dict) for p in passengers)
            or not 0 <= nonfree_baggages <= total_baggages
            or insurance not in ("yes", "no")
        ):
            raise ToolError(
                "name at least one passenger; 0 <= nonfree_baggages <= total_baggages; insurance 'yes' or 'no'"
            )
        n = len(passengers)
        total = (
            sum(s["price"] for s in segments) * n
            + (INSURANCE * n if insurance == "yes" else 0)
            + BAG * nonfree_baggages
        )
        payment = self._charge(user_id, payment_method_id, total)
        reservation_id = self._new_reservation_id()
        reservation = {
            "reservation_id": reservation_id,
            "user_id": user_id,
            "origin": origin,
            "destination": destination,
            "flight_type": flight_type,
            "cabin": cabin,
            "flights": segments,
            "passengers": [{k: p.get(k) for k in ("first_name", "last_name", "dob")} for p in passengers],
            "payment_history": [payment],
            "created_at": NOW.isoformat(),
            "total_baggages": total_baggages,
            "nonfree_baggages": nonfree_baggages,
            "insurance": insurance,
            "status": "active",
        }
        self.db["reservations"][reservation_id] = reservation
        self.db["users"][user_id]["reservations"].append(reservation_id)
        return reservation

    @write
    def update_reservation_flights(
        self, reservation_id: str, cabin: str, flights: list[dict], payment_method_id: str
    ) -> dict:
        reservation = self._reservation(reservation_id, active=True)
        if reservation["cabin"] == "basic_economy":
            raise PolicyError("a basic economy reservation cannot be changed")
        if self._departed(reservation, self.db["flights"]):
            raise PolicyError("a flight of this reservation has already departed")
        kept = {(s["flight_number"], s["date"]): s["price"] for s in reservation["flights"]}
        segments = self._segments(flights, cabin)
        for segment in segments:  # an unchanged flight in an unchanged cabin keeps the price paid
            key = (segment["flight_number"], segment["date"])
            if cabin == reservation["cabin"] and key in kept:
                segment["price"] = kept[key]
        if self._route(segments) != (reservation["origin"], reservation["destination"], reservation["flight_type"]):
            raise PolicyError("the origin, destination and trip type of a reservation cannot change")
        difference = (sum(s["price"] for s in segments) - sum(kept.values())) * len(reservation["passengers"])
        payment = self._charge(reservation["user_id"], payment_method_id, difference)
        if payment:
            reservation["payment_history"].append(payment)
        reservation["cabin"], reservation["flights"] = cabin, segments
        return reservation

    @write
    def cancel_reservation(self, reservation_id: str) -> dict:
        reservation = self._reservation(reservation_id, active=True)
        flights = self.db["flights"]
        if self._departed(reservation, flights):
            raise PolicyError("a flight of this reservation has already departed")
        recent = NOW - datetime.fromisoformat(reservation["created_at"]) <= timedelta(hours=24)
        airline_cancelled = any(
            flights[s["flight_number"]]["dates"][s["date"]]["status"] == "cancelled" for s in reservation["flights"]
        )
        if not (recent or reservation["insurance"] == "yes" or airline_cancelled):
            raise PolicyError(
                "a reservation can be cancelled only within 24 hours of booking, with travel "
                "insurance, or when the airline cancelled one of its flights"
            )
        # Refund what the reservation holds of the customer's money, to the methods that paid,
        # in order. Reversing every entry charged back a fare difference once refunded to a gift
        # card: spent since, that refused an allowed cancellation as a rule broken, after
        # refunding the card payment (a retry refunded it again). The refund keeps the gift card's.
        owed = round(sum(paid["amount"] for paid in reservation["payment_history"]), 2)
        for paid in list(reservation["payment_history"]):
            back = round(min(paid["amount"], owed), 2)
            if back > 0:
                reservation["payment_history"].append(self._charge(reservation["user_id"], paid["payment_id"], -back))
                owed = round(owed - back, 2)
        reservation["status"] = "cancelled"
        return reservation

    @write
    def update_reservation_baggages(
        self, reservation_id: str, total_baggages: int, nonfree_baggages: int, payment_method_id: str
    ) -> dict:
        reservation = self._reservation(reservation_id, active=True)
        if total_baggages < reservation["total_baggages"] or nonfree_baggages < reservation["nonfree_baggages"]:
            raise PolicyError("checked bags can be added, not removed")
        if nonfree_baggages > total_baggages:
            raise ToolError("nonfree_baggages cannot exceed total_baggages")
        payment = self._charge(
            reservation["user_id"], payment_method_id, BAG * (nonfree_baggages - reservation["nonfree_baggages"])
        )
        if payment:
            reservation["payment_history"].append(payment)
        reservation["total_baggages"], reservation["nonfree_baggages"] = total_baggages, nonfree_baggages
        return reservation

    def transfer_to_human_agents(self, summary: str) -> str:
        self.db["transferred_to_human"] = True
        self.done = True
        return "Transfer successful"
