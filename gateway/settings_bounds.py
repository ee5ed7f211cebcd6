"""The ceilings of the numeric settings (`gateway.settings.Settings`), so that a very large finite
value is refused at start in one line, as inf is: `--max-body-mb 1e308`
crashed serve with an OverflowError (its bytes are an int), a wait past ~9e9 s crashes the wait
itself (time.sleep, Event.wait: OverflowError), a timedelta past ~1e14 s too. Past these, nothing changes.
"""

MAX_BODY_MB = 1024 * 1024
"""A tebibyte: a request body is read into memory whole."""
A_WEEK = 7 * 86400.0
"""The longest a call or a training rank is waited for: longer is never."""
A_YEAR = 365 * 86400.0
"""The longest a canary candidate waits for its verdict."""

# The training knobs (tried on the built-in model, three steps of four groups): past these a step's
# weights or loss overflow, its adapter is served broken and every later group is set aside as failed
# (NonFiniteStep), as if the data were at fault. Far above what any run uses (docs/training.md).
MAX_LEARNING_RATE = 1.0
"""AdamW moves each weight by about this much a step: 10 gave NaN by the third step, 1e9 by the second."""
MAX_WEIGHT_DECAY = 100.0
"""AdamW scales each weight by 1 - lr x decay a step (1e9 set every group aside; 100 trains)."""
MAX_BETA = 1000.0
"""The KL term's weight: 1e30 made every gradient infinite (1e6 still trains; runs use 0.001-0.2)."""
MAX_RATIO = 1e6
"""A clip range or cap of the probability ratio: past float32's 3.4e38 the clamp fails
("value cannot be converted to type float without overflow"); far below, nothing is clipped."""
MAX_LORA = 65536
"""A LoRA rank or alpha: no model is wider (alpha 1e9 gave NaN at the second step; 65536 trains)."""
