"""RULER: an LLM judge ranks a group's trajectories against each other. `scoring` is the pure
part (trajectories, prompt, answer checks) and the judging loop, `judges` how a judge is
reached (litellm or the gateway's own engine)."""
