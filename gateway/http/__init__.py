"""The HTTP edge, in front of every route: request ids and bearer keys (`middleware`), the
limits on one request (`limits`), CORS and the exposure warning (`security`), sessions in the
base URL (`session_url`) and the translation of errors into each protocol's shape (`errors`)."""
