"""Demo task JSON (`rlproxy demo --base-model smollm2 --task json`): a format skill on top of
knowledge the model already has.

Each episode asks the plural of an English noun and wants the answer as the JSON object
`{"answer": "..."}` and nothing else. Why this question, measured on SmolLM2-135M-Instruct
(greedy, by hand): asked in plain words it names the plural of 12 nouns of 12 (irregular ones
included: children, mice, teeth), the opposite of 14 adjectives of 16, the capital of 28
countries of 40, the sum of two digits 6 times of 12; asked for JSON it returns valid JSON
with the right value for none of them (it wraps it in a code fence, adds a "description",
or answers in a sentence). Plurals are the knowledge it is surest of, so what RL has to
teach is the format, and the reward says whether the knowledge survived it.

The reward is strict, because a lenient one is gamed (capitals as JSON drifted into
trailing junk after the object when trailing text was tolerated, see the issue): 1 for a
reply that is exactly one JSON object whose only key is "answer" and whose value is the
plural; 0.25 for any other reply that is valid JSON; 0 for anything else, a code fence or a
truncated object included. The nouns are split once: `held_out` (the val set, never trained
on) and the rest, which `sample` draws from.
"""

from __future__ import annotations

import json
import random

NAME = "json"
DESCRIPTION = (
    'give the plural of a noun as the JSON object {"answer": ...}; reward 1 for exactly that with the '
    "right plural, 0.25 for other valid JSON, 0 otherwise"
)

OPTIONS = {"rollouts": 8, "max_tokens": 16, "steps": 40, "seconds": 900.0, "eval_groups": 8}
SETTINGS = {"default_max_tokens": 16, "max_tokens_per_row": 2048}

SYSTEM = "You are a helpful assistant. You reply with one JSON object and nothing else."
WRONG_VALUE = 0.25

# (singular, plural): regular, -es, -ies, -ves, irregular and unchanged plurals.
NOUNS = (
    ("cat", "cats"), ("dog", "dogs"), ("book", "books"), ("tree", "trees"), ("car", "cars"),
    ("house", "houses"), ("apple", "apples"), ("bird", "birds"), ("chair", "chairs"), ("table", "tables"),
    ("pen", "pens"), ("cup", "cups"), ("ball", "balls"), ("door", "doors"), ("window", "windows"),
    ("flower", "flowers"), ("river", "rivers"), ("mountain", "mountains"), ("road", "roads"),
    ("bridge", "bridges"), ("train", "trains"), ("plane", "planes"), ("boat", "boats"), ("ship", "ships"),
    ("horse", "horses"), ("cow", "cows"), ("pig", "pigs"), ("duck", "ducks"), ("frog", "frogs"),
    ("lion", "lions"), ("tiger", "tigers"), ("bear", "bears"), ("snake", "snakes"), ("rabbit", "rabbits"),
    ("girl", "girls"), ("boy", "boys"), ("friend", "friends"), ("teacher", "teachers"),
    ("student", "students"), ("doctor", "doctors"), ("farmer", "farmers"), ("king", "kings"),
    ("queen", "queens"), ("star", "stars"), ("planet", "planets"), ("cloud", "clouds"), ("lake", "lakes"),
    ("island", "islands"), ("forest", "forests"), ("garden", "gardens"), ("street", "streets"),
    ("school", "schools"), ("shop", "shops"), ("bank", "banks"), ("room", "rooms"), ("wall", "walls"),
    ("floor", "floors"), ("lamp", "lamps"), ("clock", "clocks"), ("phone", "phones"),
    ("computer", "computers"), ("shoe", "shoes"), ("shirt", "shirts"), ("hat", "hats"), ("coat", "coats"),
    ("ring", "rings"), ("key", "keys"), ("bag", "bags"), ("bottle", "bottles"), ("plate", "plates"),
    ("spoon", "spoons"), ("egg", "eggs"), ("cake", "cakes"), ("song", "songs"), ("game", "games"),
    ("idea", "ideas"), ("word", "words"), ("letter", "letters"), ("number", "numbers"), ("color", "colors"),
    ("box", "boxes"), ("fox", "foxes"), ("bus", "buses"), ("dish", "dishes"), ("watch", "watches"),
    ("church", "churches"), ("brush", "brushes"), ("glass", "glasses"), ("class", "classes"),
    ("kiss", "kisses"), ("match", "matches"), ("bench", "benches"), ("wish", "wishes"),
    ("beach", "beaches"), ("peach", "peaches"), ("lunch", "lunches"), ("dress", "dresses"),
    ("potato", "potatoes"), ("tomato", "tomatoes"), ("hero", "heroes"), ("witch", "witches"),
    ("city", "cities"), ("baby", "babies"), ("lady", "ladies"), ("party", "parties"), ("story", "stories"),
    ("country", "countries"), ("family", "families"), ("berry", "berries"), ("cherry", "cherries"),
    ("puppy", "puppies"), ("penny", "pennies"), ("body", "bodies"), ("fly", "flies"), ("library", "libraries"),
    ("army", "armies"), ("candy", "candies"), ("leaf", "leaves"), ("knife", "knives"), ("wife", "wives"),
    ("life", "lives"), ("wolf", "wolves"), ("half", "halves"), ("shelf", "shelves"), ("thief", "thieves"),
    ("calf", "calves"), ("loaf", "loaves"), ("child", "children"), ("mouse", "mice"), ("foot", "feet"),
    ("man", "men"), ("woman", "women"), ("tooth", "teeth"), ("goose", "geese"), ("person", "people"),
    ("ox", "oxen"), ("sheep", "sheep"), ("fish", "fish"), ("deer", "deer"), ("moose", "moose"),
    ("hand", "hands"), ("eye", "eyes"), ("ear", "ears"), ("nose", "noses"), ("finger", "fingers"),
    ("leg", "legs"), ("arm", "arms"), ("heart", "hearts"), ("farm", "farms"),
    ("town", "towns"), ("village", "villages"), ("castle", "castles"), ("tower", "towers"),
    ("picture", "pictures"), ("camera", "cameras"), ("pencil", "pencils"),
    ("desk", "desks"), ("bed", "beds"), ("sofa", "sofas"), ("blanket", "blankets"), ("pillow", "pillows"),
    ("kitchen", "kitchens"), ("oven", "ovens"), ("fork", "forks"), ("bowl", "bowls"), ("candle", "candles"),
    ("banana", "bananas"), ("orange", "oranges"), ("lemon", "lemons"), ("grape", "grapes"), ("onion", "onions"),
    ("carrot", "carrots"), ("cookie", "cookies"), ("sandwich", "sandwiches"), ("dollar", "dollars"),
    ("minute", "minutes"), ("hour", "hours"), ("day", "days"), ("week", "weeks"), ("month", "months"),
    ("year", "years"), ("monkey", "monkeys"), ("donkey", "donkeys"), ("toy", "toys"),
)  # fmt: skip


def _split() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(train, val): the distinct nouns shuffled once with a fixed seed, 64 held out."""
    nouns = sorted(set(NOUNS))
    random.Random("json-val").shuffle(nouns)
    return nouns[64:], nouns[:64]


TRAIN_NOUNS, VAL_NOUNS = _split()


def messages_for(noun: str) -> list[dict]:
    """The chat a rollout sends: a fixed system message and the question."""
    question = f'What is the plural of "{noun}"? Reply in JSON: {{"answer": "..."}}'
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def sample(rng: random.Random) -> tuple[str, str]:
    """The task of one group: a training noun and its plural."""
    return rng.choice(TRAIN_NOUNS)


def held_out(count: int) -> list[tuple[str, str]]:
    """The val set: `count` tasks cycling over the 64 held-out nouns (never trained on)."""
    return [VAL_NOUNS[i % len(VAL_NOUNS)] for i in range(count)]


async def episode(spec: tuple[str, str], chat) -> float:
    """One rollout: ask once, score the reply."""
    noun, plural = spec
    return reward(await chat(messages_for(noun)), plural)


def reward(reply: str | None, plural: str) -> float:
    """1 for exactly `{"answer": plural}` (case and surrounding whitespace aside), WRONG_VALUE
    for other valid JSON, 0 otherwise."""
    try:
        value = json.loads(reply or "")
    except ValueError:
        return 0.0
    right = isinstance(value, dict) and list(value) == ["answer"] and isinstance(value["answer"], str)
    return 1.0 if right and value["answer"].strip().lower() == plural else WRONG_VALUE
