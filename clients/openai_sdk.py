"""Harpoon through the official openai SDK: a completion, a streamed completion, a chat and a chat held to a JSON
schema.

    python clients/openai_sdk.py [--base-url http://127.0.0.1:8000/v1] [--api-key KEY]
"""

from __future__ import annotations

import argparse
import os

from openai import OpenAI


def run(base_url: str, api_key: str) -> dict[str, str]:
    client = OpenAI(base_url=base_url, api_key=api_key)
    model = client.models.list().data[0].id

    completion = client.completions.create(model=model, prompt="The capital of France is", max_tokens=16,
                                           temperature=0)
    print(f"completion: {completion.choices[0].text!r}")

    streamed = []
    for chunk in client.completions.create(model=model, prompt="Once upon a time", max_tokens=24, stream=True):
        if chunk.choices:
            streamed.append(chunk.choices[0].text)
            print(chunk.choices[0].text, end="", flush=True)
    print()

    chat = client.chat.completions.create(model=model, max_tokens=48, temperature=0,
                                          messages=[{"role": "user", "content": "Name three colours."}])
    print(f"chat: {chat.choices[0].message.content!r}")

    schema = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
              "required": ["city", "country"]}
    structured = client.chat.completions.create(
        model=model, max_tokens=64, temperature=0,
        messages=[{"role": "user", "content": "What is the capital of France? Answer in JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "capital", "schema": schema}})
    print(f"json: {structured.choices[0].message.content}")
    return {"completion": completion.choices[0].text, "stream": "".join(streamed),
            "chat": chat.choices[0].message.content, "json": structured.choices[0].message.content}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default=os.environ.get("HARPOON_URL", "http://127.0.0.1:8000") + "/v1")
    parser.add_argument("--api-key", default=os.environ.get("HARPOON_API_KEY", "unused"))
    args = parser.parse_args()
    run(args.base_url, args.api_key)


if __name__ == "__main__":
    main()
