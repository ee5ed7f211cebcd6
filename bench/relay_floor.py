"""The least a Python relay on the gateway's stack costs: uvicorn (httptools, uvloop) and one ASGI
function that forwards the request's body to vLLM with the gateway's own HTTP client
(`gateway.engines.http1.HTTP1Pool`) and answers vLLM's bytes as they came. No validation, no
recording, no routing: what is left of rlproxy's CPU per call once its own work is taken out.
bench/vllm.py runs it with `--floor`, on the gateway's core, measured as the gateway is.

    python bench/relay_floor.py --port 8100 --upstream http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gateway.engines.http1 import HTTP1Pool  # noqa: E402


def relay_app(upstream: str):
    pool = HTTP1Pool(upstream, {"Content-Type": "application/json"})
    chat = pool.head("POST", "/v1/chat/completions")
    health = pool.head("GET", "/health")

    async def app(scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        if scope["method"] == "POST":
            answer = await pool.exchange(chat, b"".join(chunks), timeout=600)
        else:
            answer = await pool.exchange(health, None, timeout=30)
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(answer.body))]
        await send({"type": "http.response.start", "status": answer.status, "headers": headers})
        await send({"type": "http.response.body", "body": answer.body})

    return app


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, help="the vLLM's base URL")
    args = parser.parse_args()
    uvicorn.run(
        relay_app(args.upstream),
        host="127.0.0.1",
        port=args.port,
        log_level="warning",
        access_log=False,
        loop="uvloop",
        http="httptools",
    )


if __name__ == "__main__":
    main()
