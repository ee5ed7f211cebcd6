"""rlproxy gateway: an OpenAI-compatible service that records every call for RL training."""
