"""The 2048 example agent: `game` holds the rules, `agent` the model's side and the reward."""
