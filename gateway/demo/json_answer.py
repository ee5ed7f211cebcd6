"""Demo task JSON (`rlproxy demo --base-model smollm2 --task json`): a format skill on top of
knowledge the model already has.

Each episode asks the plural of an English noun, in a chat where the assistant has already
answered one question (the capital of France) as the JSON object `{"answer": "Paris"}`: the
reply wanted is `{"answer": "<plural>"}` and nothing else. Why this, measured on
SmolLM2-135M-Instruct:

- greedy and in plain words it names the plural of 12 nouns of 12 (children, mice, teeth
  included), the opposite of 14 adjectives of 16, the capital of 28 countries of 40, the sum
  of two digits 6 times of 12: plurals are what it is surest of;
- asked for JSON in the user's words or the system message alone, 0-1 replies of 64 sampled
  at temperature 1 held a JSON object: nothing for RL to start from. With an answered
  example of the *same* question in the chat, 53 of 64 did and 30 were exactly right (a
  baseline too high to show learning); with the capital example, 32 of 64 held a JSON
  object, 5 with the right plural and 4 exactly right: a baseline near 0.2 with signal in
  every group;
- sampled at temperature 1 its plurals are often wrong ("carrotines", "crops"): what RL
  sharpens is the format and the answer it gives greedily.

The reward is graded and strict at the top, because a lenient one is gamed (capitals as
JSON drifted into trailing junk after the object when trailing text was tolerated): 1 for a
reply that is exactly one JSON object whose only key is "answer" and whose value is the
plural; 0.5 for a reply that holds such an answer in a JSON object amid anything else
(prose, a code fence, other keys); 0.25 for a reply that holds any other JSON object; 0
otherwise. The nouns are split once: `held_out` (the val set, never trained on) and the
rest, which `sample` draws from.
"""

from __future__ import annotations

import json
import random

NAME = "json"
DESCRIPTION = (
    'give the plural of a noun as the JSON object {"answer": ...}; reward 1 for exactly that, 0.5 for the '
    "right plural in JSON amid other text, 0.25 for any other JSON object, 0 otherwise"
)

# The val set is played greedily: what is learned is the format on top of the plurals the model
# gives greedily, and sampled at temperature 1 a 135M model misspells plurals it knows ("kitchenettes"
# for kitchens) whatever it has learnt. Measured on the val set, untrained -> after 22 steps (seed 0):
# greedy 0.25 -> 0.88, at temperature 0.7 0.29 -> 0.82, at 1 0.20 -> 0.75. Training samples at 1.
# 840 s: the last round and the final evaluation end within 15 minutes.
OPTIONS = {"rollouts": 8, "max_tokens": 16, "steps": 40, "seconds": 840.0, "eval_groups": 8, "eval_temperature": 0.0}
# Rows of 256 tokens (four rollouts each): on a CPU one long packed row costs quadratic attention
# over tokens that never see each other (bench/README.md, smollm2.py: 2.38x the bare loop's CPU for
# one 1,888-token row, 1.53x for rows of 256).
SETTINGS = {"default_max_tokens": 16, "max_tokens_per_row": 256}

SYSTEM = "You reply with one JSON object and nothing else."
EXAMPLE = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": '{"answer": "Paris"}'},
]
RIGHT_AMID_OTHER_TEXT = 0.5
OTHER_JSON = 0.25

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
    question = f'What is the plural of "{noun}"?'
    return [{"role": "system", "content": SYSTEM}, *EXAMPLE, {"role": "user", "content": question}]


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
    """1 for exactly `{"answer": plural}` (case and surrounding whitespace aside), less for a JSON
    object amid other text (see the module's doc), 0 without one."""
    reply = reply or ""
    try:
        whole = json.loads(reply)
    except ValueError:
        whole = None
    if isinstance(whole, dict) and list(whole) == ["answer"] and _is(whole["answer"], plural):
        return 1.0
    objects = list(_json_objects(reply))
    if any(_is(value.get("answer"), plural) for value in objects):
        return RIGHT_AMID_OTHER_TEXT
    return OTHER_JSON if objects else 0.0


def _is(value, plural: str) -> bool:
    return isinstance(value, str) and value.strip().lower() == plural


def _json_objects(text: str):
    """Every JSON object that starts at a `{` of `text` and parses whole from there."""
    decoder = json.JSONDecoder()
    start = text.find("{")
    while start != -1:
        try:
            value, end = decoder.raw_decode(text, start)
        except ValueError:
            start = text.find("{", start + 1)
            continue
        if isinstance(value, dict):
            yield value
        start = text.find("{", end)
