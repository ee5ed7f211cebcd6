"""The `vllm` engine: a vLLM OpenAI server, managed or attached (`engine.VLLMEngine`).

`engine` is the chat hot path; `client` the HTTP pool to vLLM; `wire` what is sent and read
back (sampling in force, token ids, logprobs); `supervisor` health, restarts, sleep and wake;
`adapters` which LoRAs vLLM serves; `probes` the checks at start; `server` the process it
starts and `memory` the GPU memory it is given."""
