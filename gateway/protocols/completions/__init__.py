"""Legacy completions (`POST /v1/completions`) in terms of chat completions.

The prompt goes in as one user message: the engines and the trainer know only the chat
form, and a chat-only upstream has nothing else. So the model sees the prompt through its
chat template, not as raw text to continue; `echo` and `suffix` cannot be honoured that
way and are refused with a 400. A list of prompts is answered prompt by prompt (one call
row each), choices numbered across them as OpenAI does; a stream takes one prompt.
"""
