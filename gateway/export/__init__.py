"""Taking what was learned out of rlproxy.

- `selection`: which recorded sessions an export covers (`--split`, `--rewarded`,
  `--min-reward`, `--since-step`, `--group`).
- `samples`: those sessions as the trainer's own samples (token ids, loss mask, behaviour
  logprobs, advantage), each tied to the call whose conversation it is.
- `openai_format`: a call's conversation in OpenAI's chat fine-tuning format.
- `records`: `rlproxy export --format rlproxy|openai|parquet`.
- `model`: `rlproxy export-model NAME@N`: the PEFT adapter, or the base with it merged.
- `card`: the model card (`README.md`) and reward curve written beside an exported model.
"""
