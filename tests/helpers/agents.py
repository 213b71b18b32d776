"""Agents for the tests, named by import path as a user's are (env.<name>.agent): each plays one
episode through the openai client it is given."""

from __future__ import annotations

AGAIN = " again:"


def two_turns(client, example) -> float:
    """Asks, then asks again after the reply (the conversation kept whole): 1 when the second reply
    holds the answer, 0.1 otherwise."""
    messages = [{"role": "user", "content": example["prompt"]}]
    first = client.chat.completions.create(model="policy", messages=messages)
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": AGAIN}]
    second = client.chat.completions.create(model="policy", messages=messages)
    return 1.0 if example["answer"] in (second.choices[0].message.content or "") else 0.1


def rewrites(client, example) -> float:
    """Asks, then asks a second question without the first exchange (a rewritten history)."""
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": example["prompt"]}])
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": AGAIN + example["prompt"]}])
    return 0.5


def rewrites_on_odd(client, example) -> float:
    """two_turns where the example's answer is even, rewrites where it is odd (a run trains on both)."""
    return (rewrites if int(example["answer"]) % 2 else two_turns)(client, example)


def raises_on_odd(client, example) -> float:
    """Raises (after one request) when the example's answer is odd; about half the episodes fail."""
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": example["prompt"]}])
    if int(example["answer"]) % 2:
        raise RuntimeError("the agent lost its way")
    return 1.0


def says_nothing(client, example) -> str:
    return "not a number"
