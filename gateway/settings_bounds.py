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
