"""The `local` engine: transformers + peft in the gateway process (`engine.LocalEngine`).

`engine` is the asyncio face; `request` and `response` turn OpenAI bodies into jobs and
results back into OpenAI answers; `jobs` is what the face and the worker hand each other;
`worker` is the thread that owns the model (`model`) and runs the continuous batch (`batch`),
the sampling and its logprobs (`sampling`) and the text as it arrives (`text`)."""
