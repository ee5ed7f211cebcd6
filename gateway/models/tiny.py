"""The built-in tiny model: what rlproxy serves on a machine with no model hub.

`ensure_tiny_model` builds, once, a Hugging Face model directory that loads with
`AutoModelForCausalLM.from_pretrained` / `AutoTokenizer.from_pretrained` like any other:

- a byte-level BPE tokenizer trained from `_CORPUS` (fixed text: English, digits, JSON,
  chat words), with Qwen2's pre-tokenizer and special tokens and a Qwen2.5-style chat
  template that supports tools;
- a randomly initialised `Qwen2ForCausalLM` (hidden 64, 2 layers) from a fixed seed, its
  weights drawn wider than Qwen2's usual std 0.02 (`_INIT_STD`) and its embeddings given a
  direction per character class (`_add_character_classes`): why, below.

Two built-in models share that recipe:

- `rlproxy/tiny-qwen2` (the default): the weights are random, so the text it writes is
  noise; what matters is that every path (chat template, token ids, logprobs, LoRA
  training, hot-swap) is the real one, and that a LoRA on its projections alone (what vLLM
  serves) can learn. Building takes about a second.
- `rlproxy/tiny-qwen2-instruct`: the same network (initialised wider, std 0.1), then
  instruction-tuned for about a minute (`gateway.models.instruct`) to answer with one of the
  items the user's last message lists: it reads its prompt, as a real instruct model does,
  which multi-turn tasks such as the tic-tac-toe demo need before RL can teach anything.

Builds are deterministic on one machine: same seed, same files.
"""

from __future__ import annotations

from pathlib import Path

from gateway.models.cache import build_once
from gateway.models.templates import hermes_template
from gateway.settings import BUILT_IN_MODELS, TINY_INSTRUCT_MODEL_ID, TINY_MODEL_ID  # noqa: F401 - re-exported

# Bump when the recipe changes so cached builds of an older recipe are not reused.
# 2: two query heads of 32 over one KV head (was four of 16 over two): vLLM's CPU attention
# refuses head_dim 16 ("Unsupported CPU attention configuration"), and the weight shapes stay
# the same. The cache names carry the layout too (`_LAYOUT`), so an old build is never served.
# 3: weights drawn with std 0.3 (was 0.02) and character-class directions, see _INIT_STD.
# Instruct 3: tuned on one thread (was two), see _BUILD_THREADS.
_RECIPE_VERSION = 3
_INSTRUCT_RECIPE_VERSION = 3
_HIDDEN_SIZE = 64
_ATTENTION_HEADS = 2
_KV_HEADS = 1
_LAYOUT = f"h{_HIDDEN_SIZE}q{_ATTENTION_HEADS}kv{_KV_HEADS}"
# The random model's init. The final RMSNorm holds the last hidden state at norm sqrt(64) = 8
# and the output head is the (tied) embedding matrix, so a token's logit is at most 8 x its
# embedding's norm, 8 x std x 8, whatever the layers below do. At Qwen2's std 0.02 that is
# 1.3: a LoRA on the projections can never make a token likely, and such a LoRA is all vLLM
# serves (no lm_head). Measured on SHOUT (`rlproxy demo`, local engine, LoRA on the
# projections only, lr 1e-2, seed 0 unless said; final val reward, steps): std 0.02 0.05 ->
# 0.05 in 60 (flat); 0.1 0.06 -> 0.40 in 60 (lr 3e-2: 0.43): one token can reach only
# p ~0.4; 0.2 collapsed onto "For" at 0.33 (lr 3e-2, seeds 0-2: 0.93, 0.99, 0.33); 0.5 0.03
# -> 0.41 in 60 (too peaked to explore); 0.3 learnt in 5 runs of 7 (seeds 0-4: 0.95-1.00 in
# 30-48 steps) and collapsed in 2 (seed 5 at 0.25; seed 0 through vLLM at 0.50).
_INIT_STD = 0.3
# Why it collapsed: random embeddings are nearly orthogonal, so the hidden state can point at
# one token, never at "the capitals", and the policy locks onto whichever partly capital
# token ("For", "Hi") got ahead first. A pretrained model's embeddings are not like that:
# tokens alike lie near each other. `_add_character_classes` gives the random model that
# much structure: with it (std 0.3 per class direction), seeds 0, 1, 2, 5 reached 1.00,
# 0.995, 1.00, 1.00 in 10-12 steps (16-18 s) and seeds 0-2 through vLLM 1.00 in 12-15 steps,
# from baselines of 0.07-0.10: its text is still noise.
_CLASS_STD = 0.3
# The instruct model's tuning. Measured (2 cores): with Qwen2's usual init (std 0.02) the
# share of probability on the last turn's items stayed at 0.24-0.31 (what knowing the item
# pool gives) after 600-1,000 steps; at std 0.1 it reached 0.79 in 1,500 single-turn steps,
# and 0.80-0.86 (on held-out chats) in 2,000 steps of chats of up to 5 turns.
_INSTRUCT_INIT_STD = 0.1
_INSTRUCT_STEPS = 2000
_INSTRUCT_BATCH = 16
_INSTRUCT_LEARNING_RATE = 3e-3
# Fixed so that a build is the same whatever the machine's core count (float sums depend
# on how the work is split). One thread: measured here (150 of the 2,000 steps), two threads
# took 6.1 s on an idle machine but 21.8 s beside one busy core (their OpenMP threads wait on
# each other), one thread 9.1 s and 9.2 s; a build on a busy day took ten minutes on two.
_BUILD_THREADS = 1
_VOCAB_SIZE = 768

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"

# Qwen2's pre-tokenizer regex (transformers' Qwen2Tokenizer rebuilds the pipeline with it on
# load, so the tokenizer must be trained with exactly this one to stay identical).
_PRETOKENIZE_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""  # noqa: E501 (Qwen2's pattern, verbatim)

_DEFAULT_SYSTEM = "You are a helpful assistant."

CHAT_TEMPLATE = hermes_template(_DEFAULT_SYSTEM)

# Training text for the BPE merges: chat scaffolding, tool-call JSON, everyday English, digits.
_CORPUS = """
<|im_start|>system
You are a helpful assistant.<|im_end|>
<|im_start|>user
What is the weather in Paris today?<|im_end|>
<|im_start|>assistant
The weather in Paris is sunny with a high of 21 degrees.<|im_end|>
# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{"type": "function", "function": {"name": "get_weather", "description": "Get the current weather for a city", "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The name of the city"}}, "required": ["city"]}}}
{"type": "function", "function": {"name": "search", "description": "Search the web for a query", "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}}, "required": ["query"]}}}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call>
<tool_call>
{"name": "get_weather", "arguments": {"city": "London"}}
</tool_call>
<tool_call>
{"name": "search", "arguments": {"query": "best pizza in New York", "limit": 3}}
</tool_call>
<tool_response>
{"temperature": 18, "condition": "cloudy", "humidity": 0.72}
</tool_response>
{"id": "call_1", "type": "function", "function": {"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}}
{"answer": 42, "ok": true, "items": [1, 2, 3], "error": null, "score": -0.5}
[{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi! How can I help you?"}]
0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 25 30 42 50 64 99 100 128 256 512 1000 1024 2024 2025
3.14 2.71 0.5 1.0 -1 +1 = < > <= >= == != ( ) [ ] { } : ; , . ! ? ' " / \\ | _ - * & % $ # @ ~ ^
Hello! How are you? I am fine, thank you. Can you help me with a question?
Sure, I can help. Please tell me more about what you need.
Yes. No. Maybe. Thanks! Good morning. Good night. Please wait. Let me think step by step.
The quick brown fox jumps over the lazy dog. A small model can still learn to answer well.
First, read the task. Then call a tool if you need data. Finally, give a short answer.
The answer is 7. The result is correct. That is wrong, try again. Well done!
What time is it? It is 10 o'clock. Where is the file? The file is in the folder.
Write a function that returns the sum of two numbers. Here is the code:
def add(a, b):
    return a + b
print(add(2, 3))
for i in range(10):
    if i % 2 == 0:
        print(i)
The user asked for a list of names: Alice, Bob, Carol, Dave, Eve.
We should check the math: 12 + 30 = 42 and 6 * 7 = 42 and 100 / 4 = 25.
Reward, score, judge, trajectory, group, session, policy, model, train, learn, step, agent, game.
I don't know. You're right. It's done. We'll see. They've gone. I'm here. She'd like that.
morning afternoon evening night day week month year today tomorrow yesterday
one two three four five six seven eight nine ten hundred thousand million first second last
red green blue yellow black white big small long short hot cold new old good bad high low
is are was were be been have has had do does did will would can could should may might must
the a an and or but if then else when while for with without from into onto over under about
what who which where why how this that these those there here all some any many much more most
user assistant system tool function name arguments content role message messages tools call
"""  # noqa: E501 (tool-call JSON lines as a template writes them)


def _build_tokenizer():
    """Byte-level BPE with Qwen2's pipeline, trained on `_CORPUS`; deterministic."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    specials = [PAD_TOKEN, IM_START, IM_END]
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB_SIZE,
        min_frequency=1,
        show_progress=False,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in specials],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    # The corpus without its special tokens: they are atoms, never learnt from.
    text = _CORPUS
    for token in specials:
        text = text.replace(token, "\n")
    backend.train_from_iterator([line + "\n" for line in text.split("\n")], trainer=trainer)
    # Like Qwen2.5: the tool-call tags are added tokens that are not "special", so
    # `decode(skip_special_tokens=True)` keeps them (the tool-call parser needs them).
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in (TOOL_CALL_START, TOOL_CALL_END)])

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        unk_token=None,
        bos_token=None,
        extra_special_tokens=[IM_START],
        clean_up_tokenization_spaces=False,
        model_max_length=2048,
        padding_side="left",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _build(directory: Path, seed: int, instruct: bool = False) -> None:
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tokenizer = _build_tokenizer()
    pad_id, eos_id = tokenizer.convert_tokens_to_ids([PAD_TOKEN, IM_END])
    config = Qwen2Config(
        vocab_size=len(tokenizer),  # exactly the tokenizer: every sampled id decodes
        hidden_size=_HIDDEN_SIZE,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=_ATTENTION_HEADS,  # head_dim 32: the smallest vLLM's CPU attention serves
        num_key_value_heads=_KV_HEADS,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        dtype="float32",
        initializer_range=_INSTRUCT_INIT_STD if instruct else _INIT_STD,
    )
    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG as it was
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(torch.float32).eval()
        if not instruct:
            _add_character_classes(model, tokenizer, _CLASS_STD)
        if instruct:
            from gateway.models.instruct import instruction_tune, log_progress

            threads = torch.get_num_threads()
            torch.set_num_threads(_BUILD_THREADS)
            try:
                instruction_tune(
                    model,
                    tokenizer,
                    steps=_INSTRUCT_STEPS,
                    batch_size=_INSTRUCT_BATCH,
                    learning_rate=_INSTRUCT_LEARNING_RATE,
                    seed=seed,
                    progress=log_progress(),
                )
            finally:
                torch.set_num_threads(threads)
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=None)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)


_CHARACTER_CLASSES = (str.isupper, str.islower, str.isdigit, str.isspace)  # and one for the rest


def _add_character_classes(model, tokenizer, std: float) -> None:
    """Give each token's (tied) embedding a share of one random direction per character class
    (capitals, small letters, digits, spaces, the rest), in proportion to the fraction of its
    characters in that class: "ABC" and "A" lie along the capitals' direction, "For" a third
    of the way. See `_CLASS_STD` for why."""
    import torch

    embeddings = model.get_input_embeddings().weight
    hidden = embeddings.shape[1]
    directions = torch.randn(len(_CHARACTER_CLASSES) + 1, hidden) * std
    fractions = torch.zeros(embeddings.shape[0], len(_CHARACTER_CLASSES) + 1)
    for token_id in range(embeddings.shape[0]):
        text = tokenizer.decode([token_id])
        if not text:
            continue
        for c, is_in in enumerate(_CHARACTER_CLASSES):
            fractions[token_id, c] = sum(map(is_in, text)) / len(text)
        fractions[token_id, -1] = 1 - fractions[token_id, :-1].sum()
    with torch.no_grad():
        embeddings += fractions @ directions


def ensure_tiny_model(cache_dir: Path, seed: int = 0, instruct: bool = False) -> Path:
    """Build the tiny model (the instruct one if `instruct`) under `cache_dir` unless it is
    there (`gateway.models.cache.build_once`); return its directory."""
    name = f"tiny-qwen2-instruct-r{_INSTRUCT_RECIPE_VERSION}" if instruct else f"tiny-qwen2-r{_RECIPE_VERSION}"
    name += f"-{_LAYOUT}"
    return build_once(Path(cache_dir) / f"{name}-seed{seed}", lambda tmp: _build(tmp, seed, instruct))
