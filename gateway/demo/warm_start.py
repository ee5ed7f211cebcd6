"""`rlproxy demo --warm-start sft`: distil a scripted teacher into the model before GRPO.

The path a team with an agent on a hosted model takes, on the embedded default:

1. a teacher (the task's `teacher_reply`: for tic-tac-toe a fixed preference over the
   squares) answers as an OpenAI-compatible server in this process; a gateway in front of it
   (`--engine openai`, model name `teacher`) records `--teacher-games` games, each a session
   rewarded with its score, one in eight in the `val` split;
2. `rlproxy train --objective sft --model teacher --min-reward 0.5` distils the games that did
   not lose into the served model, `--warm-start-epochs` passes, as steps `NAME@1..N`;
3. the demo goes on as always: the gateway serves the newest step, the GRPO trainer resumes
   from it, and the val set is played before GRPO (the score after SFT) and at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

from gateway.demo import load_task
from gateway.demo.options import DemoOptions
from gateway.demo.processes import Trainer, client_key, free_socket, serve_gateway
from gateway.errors import ConfigError, RLProxyError
from gateway.settings import Settings

log = logging.getLogger("rlproxy.demo")

TEACHER = "teacher"
MIN_REWARD = 0.5  # a draw or a win: the games worth imitating
CONCURRENT_GAMES = 16


def teacher_app(task: ModuleType):
    """An OpenAI-compatible chat endpoint that answers with the task's teacher."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def completions(request: Request) -> JSONResponse:
        body = await request.json()
        reply = task.teacher_reply(body.get("messages") or [])
        return JSONResponse(
            {
                "id": f"chatcmpl-{uuid.uuid4().hex}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": body.get("model", TEACHER),
                "choices": [{"index": 0, "message": {"role": "assistant", "content": reply}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 0, "completion_tokens": 1, "total_tokens": 1},
            }
        )

    return Starlette(routes=[Route("/v1/chat/completions", completions, methods=["POST"])])


@contextlib.contextmanager
def serve_teacher(task: ModuleType) -> Iterator[str]:
    """The teacher under uvicorn in a thread of this process; yields its base URL (with /v1)."""
    import uvicorn

    sock = free_socket()
    server = uvicorn.Server(uvicorn.Config(teacher_app(task), log_config=None, access_log=False, lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="rlproxy-demo-teacher", daemon=True)
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise RLProxyError("the demo's teacher failed to start")
            time.sleep(0.02)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


async def record_teacher(url: str, task: ModuleType, games: int, seed: int, key: str = "demo") -> float:
    """Play `games` games against the gateway in front of the teacher, each a rewarded session;
    returns the teacher's mean score."""
    import random

    import httpx
    import openai

    rng = random.Random(seed)
    specs = [task.sample(rng) for _ in range(games)]
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=2)
    scores: list[float] = []
    async with httpx.AsyncClient(base_url=url, timeout=60, headers={"Authorization": f"Bearer {key}"}) as http:

        async def game(index: int) -> None:
            session = f"teacher-{index}"
            headers = {"X-Session-Id": session, "X-Split": "val" if index % 8 == 7 else "train"}

            async def chat(messages: list[dict]) -> str | None:
                response = await client.chat.completions.create(
                    model=TEACHER, messages=messages, extra_headers=headers, max_tokens=4
                )
                return response.choices[0].message.content

            _, score = await task.episode(specs[index], chat)
            scores.append(score)
            reply = await http.post(f"/v1/sessions/{session}/reward", json={"reward": score})
            reply.raise_for_status()

        for start in range(0, games, CONCURRENT_GAMES):
            await asyncio.gather(*(game(i) for i in range(start, min(games, start + CONCURRENT_GAMES))))
    await client.close()
    return sum(scores) / len(scores)


def warm_start(settings: Settings, options: DemoOptions, out: Path, threads: int) -> dict:
    """Record the teacher, then distil it (`rlproxy train --objective sft`, a child process,
    its log in OUT/sft.log); what it did, for the summary."""
    task = load_task(options.task)
    if not hasattr(task, "teacher_reply"):
        raise ConfigError(f"--warm-start sft needs a task with a teacher; '{task.NAME}' has none (tictactoe has)")
    started = time.monotonic()
    with serve_teacher(task) as teacher_url:
        recorder = settings.model_copy(
            update={"engine": "openai", "upstream_url": teacher_url, "model_name": TEACHER, "trainer": "off"}
        )
        with serve_gateway(recorder) as url:
            teacher_score = asyncio.run(
                record_teacher(url, task, options.teacher_games, settings.seed, client_key(recorder))
            )
    recorded = time.monotonic()
    print(
        f"  warm start: {options.teacher_games} teacher games recorded (score {teacher_score:.2f}) in "
        f"{recorded - started:.0f} s; distilling them (sft.log)",
        file=sys.stderr,
    )
    sft = Trainer(
        settings,
        out / "sft.log",
        threads,
        extra=["--objective", "sft", "--model", TEACHER, "--min-reward", str(MIN_REWARD)]
        + ["--epochs", str(options.warm_start_epochs), "--sft-sessions-per-step", "8"],
    )
    try:
        code = sft.wait()
    finally:  # Ctrl-C or SIGTERM while it distils: it stops before the demo ends (a no-op once it exited)
        # PR_SET_PDEATHSIG alone told it only when the demo was gone: it went on loading, training
        # and saving steps in the state dir after the demo returned and let go of --out.
        sft.stop()
    if code != 0:
        tail = (out / "sft.log").read_text(errors="replace")[-3000:]
        raise RLProxyError(f"the supervised warm start exited with code {code}:\n{tail}")
    return {
        "objective": "sft",
        "teacher_games": options.teacher_games,
        "teacher_score": round(teacher_score, 3),
        "epochs": options.warm_start_epochs,
        "record_seconds": round(recorded - started, 1),
        "sft_seconds": round(time.monotonic() - recorded, 1),
    }
