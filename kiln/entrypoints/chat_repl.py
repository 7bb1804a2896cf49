"""``kiln chat``: an interactive conversation on the terminal (or through a pipe).

Each line read is a user turn; the answer streams as it is generated, and the
conversation so far goes through the chat template every turn. Ctrl-C stops the
current answer (what was said stays in the history) and not the REPL; ``/exit``,
``/quit`` or end of input leaves; ``/reset`` forgets the conversation. When the
history no longer fits the context, the oldest turns are dropped.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from kiln.engine.request import SamplingParams
from kiln.entrypoints.chat import render_chat
from kiln.entrypoints.runtime import Runtime

__all__ = ["ChatSession", "run_repl"]


class ChatSession:
    def __init__(self, rt: Runtime, params: SamplingParams, system: str | None = None, *,
                 chat_template: str | None = None) -> None:
        self.rt = rt
        self.params = params
        self.chat_template = chat_template
        self.system = [{"role": "system", "content": system}] if system else []
        self.turns: list[dict[str, Any]] = []

    def prompt_ids(self, text: str) -> list[int]:
        """The conversation with ``text`` as the next user turn, rendered; the
        oldest turns go first when it would not leave room for an answer."""
        turns = self.turns + [{"role": "user", "content": text}]
        limit = self.rt.config.max_model_len - min(self.params.max_tokens, self.rt.config.max_model_len // 2)
        while True:
            ids = render_chat(self.rt.tokenizer, self.system + turns, chat_template=self.chat_template)
            if len(ids) <= limit or len(turns) == 1:
                return ids
            turns = turns[2:]  # the oldest user turn and its answer

    def ask(self, text: str, out: TextIO) -> dict[str, Any]:
        """Stream the answer to ``text`` into ``out``; returns counts for the turn."""
        ids = self.prompt_ids(text)
        answer, tokens, reason, t0 = [], 0, "abort", time.perf_counter()
        stream = self.rt.stream(ids, self.params)
        try:
            for delta in stream:
                answer.append(delta.text)
                tokens += len(delta.token_ids)
                reason = delta.finish_reason or reason
                out.write(delta.text)
                out.flush()
        except KeyboardInterrupt:
            stream.close()  # aborts the request; its KV blocks are free at once
            out.write(" [stopped]")
        out.write("\n")
        self.turns += [{"role": "user", "content": text}, {"role": "assistant", "content": "".join(answer)}]
        return {"prompt_tokens": len(ids), "tokens": tokens, "finish": reason,
                "seconds": time.perf_counter() - t0}


def run_repl(session: ChatSession, stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout,
             verbose: bool = False) -> int:
    interactive = stdin.isatty()
    turn = 0
    while True:
        try:
            if interactive:
                stdout.write("> ")
                stdout.flush()
            line = stdin.readline()
        except KeyboardInterrupt:
            stdout.write("\n")
            continue
        if not line:
            return 0
        text = line.strip()
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            session.turns.clear()
            continue
        if not text:
            continue
        turn += 1
        stats = session.ask(text, stdout)
        if verbose:
            print(f"kiln: turn {turn}: prompt {stats['prompt_tokens']} tokens, {stats['tokens']} new tokens in "
                  f"{stats['seconds']:.2f}s, finish={stats['finish']}", file=sys.stderr)
