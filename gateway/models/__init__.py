"""The built-in models, so rlproxy runs with no model hub: the tiny network, its tokenizer and
chat template (`tiny`), its instruction tuning (`instruct`) and the defaults tuned for it
(`tuning`)."""
