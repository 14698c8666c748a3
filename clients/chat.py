"""A small interactive streaming chat in the terminal. The conversation is kept and sent each turn; Ctrl-C
cancels the answer being streamed (the server aborts it), a second Ctrl-C or Ctrl-D at the prompt quits.

    python clients/chat.py [--base-url http://127.0.0.1:8000/v1] [--system "You are ..."]
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator

from openai import OpenAI


class Chat:
    def __init__(self, client: OpenAI, model: str, system: str | None = None, max_tokens: int = 256,
                 temperature: float | None = None) -> None:
        self.client = client
        self.model = model
        self.max_tokens = max_tokens
        self.temperature = temperature  # None: the server's default (1, sampling)
        self.history: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []

    def ask(self, text: str) -> Iterator[str]:
        """Stream the answer to ``text``; the exchange joins the history once the stream ends or is cancelled."""
        self.history.append({"role": "user", "content": text})
        answer: list[str] = []
        extra = {} if self.temperature is None else {"temperature": self.temperature}
        stream = self.client.chat.completions.create(model=self.model, messages=self.history, stream=True,
                                                     max_tokens=self.max_tokens, **extra)
        try:
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    answer.append(chunk.choices[0].delta.content)
                    yield answer[-1]
        finally:
            stream.close()  # on Ctrl-C this closes the connection, and the server aborts the request
            self.history.append({"role": "assistant", "content": "".join(answer)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default=os.environ.get("HARPOON_URL", "http://127.0.0.1:8000") + "/v1")
    parser.add_argument("--api-key", default=os.environ.get("HARPOON_API_KEY", "unused"))
    parser.add_argument("--system", default=None)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=None, help="default: the server's (1, sampling)")
    args = parser.parse_args()
    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    chat = Chat(client, client.models.list().data[0].id, args.system, args.max_tokens, args.temperature)
    interactive = sys.stdin.isatty()
    while True:
        try:
            text = input("you> " if interactive else "")
        except (EOFError, KeyboardInterrupt):
            print()
            return
        if not text.strip():
            continue
        print("assistant> ", end="", flush=True)
        try:
            for piece in chat.ask(text):
                print(piece, end="", flush=True)
        except KeyboardInterrupt:
            print(" [cancelled]", end="")
        print()


if __name__ == "__main__":
    main()
